"""``xferkit bench``, ``xferkit bench raw`` and ``xferkit bench calibrate``: the command line."""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
from functools import partial
from typing import Any

import numpy as np

from .errors import FAILED, USAGE, BenchError, exit_codes_help
from .models import PRESETS

SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _pair(text: str) -> tuple[int, int]:
    """``4:8`` -> (4, 8); ``4`` -> (4, 4)."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or N:M") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or N:M of positive integers")
    return values[0], values[1]


def _pairs(text: str) -> list[tuple[int, int]]:
    return [_pair(t) for t in text.split(",")]


def _layouts(text: str) -> tuple[str, str]:
    parts = text.lower().split(":")
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not set(parts) <= {"nhd", "hnd"}:
        raise argparse.ArgumentTypeError(f"{text!r} is not nhd, hnd or PREFILL:DECODE of them")
    return parts[0], parts[1]


def _tokens(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    low, high = _positive(lo), _positive(hi) if sep else 0
    if sep and high < low:
        raise argparse.ArgumentTypeError(f"{text!r}: the range ends below its start")
    return (low, high) if sep else (0, low)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in SIZE_SUFFIX and not t[-1:].isdigit() else ""
    try:
        value = int(t[: len(t) - len(unit)]) * SIZE_SUFFIX[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (4096, 64K, 16M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def _sizes(text: str) -> list[int]:
    return [_size(t) for t in text.split(",")]


def _staging(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in ("auto", "always", "never")]
    if bad:
        raise argparse.ArgumentTypeError(f"staging {bad[0]!r} is not auto, always or never")
    return values


def _option(text: str) -> tuple[str, Any]:
    """``key=value``: value read as an int, float, true/false, or else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    value: Any = raw
    for kind in (int, float):
        try:
            value = kind(raw)
            break
        except ValueError:
            pass
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key, value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress, no table (for scripts)")
    p.add_argument("--debug", action="store_true", help="tracebacks and the ranks' logs")
    p.add_argument(
        "-o", "--driver-option", dest="options", type=_option, action="append", default=[],
        metavar="KEY=VALUE", help="an option for open_backend (repeatable), e.g. protocol=tcp",
    )  # fmt: skip


def add_parser(sub: Any) -> None:
    presets = "\n".join(f"  {p.name:<10}{p.about}" for p in PRESETS.values())
    bench = sub.add_parser(
        "bench",
        help="a model-shaped handoff through real Sessions in real processes, every byte checked",
        description=(
            "Prefill and decode ranks run as separate processes, each with its own Session and "
            "backend, handing over requests shaped like a real model; decode ranks check every "
            "byte. Prints GB/s, requests/s and p50/p99 latency per case beside the ceiling "
            "measured in the same run. Cases: every combination of --driver, --tp and --staging."
        ),
        epilog=f"presets:\n{presets}\n\n{exit_codes_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    bench.add_argument("--layers", type=_positive, help="layers (default: the preset's)")
    bench.add_argument("--tp", type=_pairs, help="PREFILL:DECODE TP sizes, comma-separated cases")
    bench.add_argument("--pp", type=_pair, default=(1, 1), help="PREFILL:DECODE pipeline stages")
    bench.add_argument(
        "--tokens", type=_tokens, help="tokens per request, or LO-HI: each drawn at random"
    )
    bench.add_argument("--page", type=_pair, help="PREFILL:DECODE tokens per KV page")
    bench.add_argument(
        "--layout", type=_layouts, default=("nhd", "nhd"), help="nhd, hnd or nhd:hnd"
    )
    bench.add_argument("--requests", type=_positive, default=20, help="measured requests per case")
    bench.add_argument("--concurrency", type=_positive, default=2, help="requests in flight")
    bench.add_argument("--chunks", type=_positive, default=1, help="prefill writes per request")
    bench.add_argument("--driver", default="loopback", help="driver(s), comma-separated cases")
    bench.add_argument("--staging", type=_staging, default=["auto"], help="auto|always|never[,...]")
    bench.add_argument("--keys", action="store_true", help="CurveZMQ on every Session")
    bench.add_argument("--no-verify", action="store_true", help="skip the byte checks (huge runs)")
    bench.add_argument("--plot", metavar="FILE.png", help="throughput against ceiling, latency CDF")
    bench.add_argument("--seed", type=int, default=0)
    _common(bench)
    modes = bench.add_subparsers(dest="mode", metavar="{raw,calibrate}")
    raw = modes.add_parser(
        "raw",
        help="raw driver throughput over descriptor size x batch size (nixlbench's columns)",
        description=(
            "Two backends of one driver in this process; each row times writes of BATCH "
            "descriptors of BLOCK bytes: B/W in GB/s (10^9 bytes), latency per batch, the post "
            "call and the completion after it (avg and p99, microseconds)."
        ),
        epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    raw.add_argument("--driver", default="loopback")
    raw.add_argument("--blocks", type=_sizes, default=_sizes("4K,16K,64K,256K,1M,4M,16M,64M"))
    raw.add_argument("--batches", type=_sizes, default=[1, 16, 64])
    raw.add_argument("--max-bytes", type=_size, default=256 << 20, help="skip larger batches")
    raw.add_argument("--check", action="store_true", help="verify the bytes of each row")
    _common(raw)
    cal = modes.add_parser(
        "calibrate",
        help="measure the descriptor_bytes and copy_cost a driver should declare",
        epilog=exit_codes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cal.add_argument("calibrate_driver", metavar="DRIVER")
    _common(cal)


def main(args: argparse.Namespace) -> int:
    try:
        if args.mode == "raw":
            return _raw(args)
        if args.mode == "calibrate":
            return _calibrate(args)
        return _bench(args)
    except BenchError as exc:
        print(f"xferkit bench: {exc}", file=sys.stderr)
        if args.debug and exc.detail:
            print(exc.detail, file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("xferkit bench: interrupted; every rank process was stopped", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(
            f"xferkit bench: {type(exc).__name__}: {exc} (--debug for the traceback)",
            file=sys.stderr,
        )
        return FAILED


def _consoles(args: argparse.Namespace) -> tuple[Any, Any]:
    from .report import need

    console = need("rich.console", "cli").Console
    # Piped (make demo, CI logs): wide enough that the table keeps one line per case.
    wide = None if sys.stdout.isatty() else 200
    err = console(stderr=True, quiet=args.quiet, width=wide)
    out = err if args.json == "-" else console(quiet=args.quiet, width=wide)
    return out, err


def _meta() -> dict[str, Any]:
    from .. import __version__

    return {
        "xferkit": __version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": list(os.getloadavg()),
    }


def _bench(args: argparse.Namespace) -> int:
    from .handoff import Case, Workload, run_case
    from .models import shaped
    from .raw import ceiling, open_checked
    from .record import STAGES, STATES
    from .report import bench_table, need, plot, split_table, write_json

    out, err = _consoles(args)
    if args.plot:
        need("matplotlib", "plot")
    preset = PRESETS[args.preset]
    layers = args.layers or preset.layers
    pages = args.page or (preset.page, preset.page)
    min_tokens, tokens = args.tokens or (0, preset.tokens)
    try:
        specs = shaped(preset, layers, pages, args.layout)
    except ValueError as exc:
        raise BenchError(USAGE, str(exc)) from None
    options = dict(args.options)
    drivers = [d for d in args.driver.split(",") if d]
    tps = args.tp or _pairs(preset.tp)
    for d in drivers:  # fail fast, in one line, before any rank starts
        open_checked(d, options, cross_process=True).close()
    cases = [
        Case(d, tp, args.pp, st, options)
        for d, tp, st in itertools.product(drivers, tps, args.staging)
    ]
    work = Workload(
        specs, tokens, pages, args.requests, args.concurrency, args.chunks,
        verify=not args.no_verify, keys=args.keys, debug=args.debug, min_tokens=min_tokens,
    )  # fmt: skip
    err.print(
        f"[bold]{preset.name}[/]: {preset.about}; {layers} layers, "
        f"{f'{min_tokens}-' if min_tokens else ''}{tokens} tokens a request, "
        f"pages {pages[0]}:{pages[1]} tokens, layout {args.layout[0]}:{args.layout[1]}; "
        f"{args.requests} requests a case, {args.concurrency} in flight, {args.chunks} chunk(s)"
    )
    progress_mod = need("rich.progress", "cli")
    results = []
    ceilings: dict[tuple[str, int], dict[str, float]] = {}
    with progress_mod.Progress(
        progress_mod.TextColumn("{task.description}"),
        progress_mod.BarColumn(),
        progress_mod.MofNCompleteColumn(),
        progress_mod.TimeElapsedColumn(),
        console=err,
        disable=args.quiet,
    ) as progress:
        for case in cases:
            task = progress.add_task(case.label, total=args.requests)
            result = run_case(case, work, partial(progress.advance, task), seed=args.seed)
            nbytes = int(np.median([r.bytes for r in result.measured]))  # as the table's
            key = (case.driver, nbytes)
            if key not in ceilings:
                progress.update(task, description=f"{case.label} (ceiling)")
                ceilings[key] = ceiling(case.driver, options, max(nbytes, 1))
            result.ceiling = ceilings[key]
            progress.update(task, description=case.label)
            results.append(result.to_json())
    for r in results:
        readers = "; ".join(f"{d} <- {', '.join(s)}" for d, s in r["readers"].items())
        err.print(f"{r['label']}: {readers}")
        if r["dropped"]:
            err.print(f"  dropped ({len(r['dropped'])} empty regions): {r['dropped'][0]}, ...")
    title = f"xferkit bench --preset {preset.name} ({layers} layers, {tokens} tokens)"
    out.print(bench_table(results, title))
    out.print(
        "GB/s: bytes of all measured requests over their span (first expect or offer to the "
        "last DONE); ratio: GB/s over the driver's own 1-descriptor GB/s for a request's bytes; "
        "CPU s/GB: what every rank process spent over the measured requests, per GB moved"
    )
    out.print(split_table(results, "where a request's time went (p50 ms per stage)"))
    out.print(
        "plan, pack, post: the busiest prefill rank's work; wire: first post to last write "
        "done; notify: to the last notification; unpack: the busiest decode rank's; control: "
        "what no stage covers (messages, queues, loops). Stages overlap as chunks pipeline."
    )
    data = {
        "command": "bench",
        "model": {
            "preset": preset.name, "layers": layers, "tokens": tokens,
            "min_tokens": min_tokens, "pages": list(pages),
            "layout": list(args.layout), "requests": args.requests,
            "concurrency": args.concurrency, "chunks": args.chunks, "keys": args.keys,
            "verify": not args.no_verify, "pp": list(args.pp),
        },
        "stages": list(STAGES),
        "states": list(STATES),
        "cases": results,
        "meta": _meta(),
    }  # fmt: skip
    if args.plot:
        plot(args.plot, results)
        err.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, data, err)
    return 0


def _raw(args: argparse.Namespace) -> int:
    from .raw import sweep
    from .report import need, raw_table, write_json

    out, err = _consoles(args)
    progress_mod = need("rich.progress", "cli")
    total = sum(1 for b in args.blocks for n in args.batches if b * n <= args.max_bytes)
    if not total:
        raise BenchError(USAGE, f"no block x batch fits --max-bytes {args.max_bytes}")
    with progress_mod.Progress(console=err, disable=args.quiet) as progress:
        task = progress.add_task(f"{args.driver} raw", total=total)
        rows = sweep(
            args.driver, dict(args.options), args.blocks, args.batches,
            max_bytes=args.max_bytes, check=args.check, tick=lambda: progress.advance(task),
        )  # fmt: skip
    out.print(raw_table(rows, f"xferkit bench raw --driver {args.driver} (GB = 10^9 bytes)"))
    if args.json:
        write_json(
            args.json,
            {"command": "bench raw", "driver": args.driver, "rows": rows, "meta": _meta()},
            err,
        )
    if args.check and not all(r["checked"] for r in rows):
        bad = next(r for r in rows if not r["checked"])
        raise BenchError(1, f"block {bad['block_bytes']} x batch {bad['batch']}: bytes differ")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from .raw import calibrate
    from .report import write_json

    out, err = _consoles(args)
    with err.status(f"calibrating {args.calibrate_driver}"):
        c = calibrate(args.calibrate_driver, dict(args.options))
    Table = __import__("rich.table", fromlist=["Table"]).Table
    t = Table(title=f"xferkit bench calibrate {args.calibrate_driver}", title_justify="left")
    for name in (
        "us/descriptor",
        "GB/s (64 MiB)",
        "copier GB/s",
        "descriptor_bytes",
        "copy_cost",
        "declared now",
    ):
        t.add_column(name, justify="right")
    d = c["declared"]
    t.add_row(
        f"{c['us_per_descriptor']:.3f}", f"{c['large_gbps']:.2f}", f"{c['copier_gbps']:.2f}",
        f"{c['descriptor_bytes']}", f"{c['copy_cost']:.3f}",
        f"{d['descriptor_bytes']} / {d['copy_cost']:.3f}",
    )  # fmt: skip
    out.print(t)
    out.print(
        f"declare: Capabilities(..., descriptor_bytes={c['descriptor_bytes']}, "
        f"copy_cost={c['copy_cost']})"
    )
    if args.json:
        write_json(args.json, {"command": "bench calibrate", **c, "meta": _meta()}, err)
    if not c["landed"]:
        raise BenchError(1, f"driver {args.calibrate_driver!r}: the calibration's bytes differ")
    return 0
