"""``python -m xferkit.testing.sim``: run many seeded schedules, or replay one.

Prints one line per violating schedule (its first violation, then the last calls of its
trace), and a final line ``N schedules, M violations, T simulated seconds``; exits 1 on any
violation. ``--seed S --trace`` replays one schedule call by call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import run
from .config import FAULTS, HARSH, Config
from .sweep import MIX, sweep

TAIL = 12
"""Trace lines printed after a violation."""


def _faults(text: str) -> frozenset[str]:
    faults = set(FAULTS)
    for word in filter(None, (w.strip() for w in text.split(","))):
        if word == "none":
            faults.clear()
        elif word.startswith("-"):
            faults.discard(word[1:])
        else:
            faults.add(word.removeprefix("+"))
    unknown = faults - FAULTS - HARSH
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown faults {sorted(unknown)}")
    return frozenset(faults)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xferkit.testing.sim", description=__doc__)
    ap.add_argument("--seeds", type=int, default=1000, help="schedules to run (from --first)")
    ap.add_argument("--first", type=int, default=0, help="the first seed")
    ap.add_argument("--seed", type=int, help="replay this one schedule")
    ap.add_argument("--trace", action="store_true", help="print every call into a core")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--prefill-pp", type=int, default=1, help="the prefill's pipeline stages")
    ap.add_argument("--instances", type=int, default=1, help="prefill instances (up to 3)")
    ap.add_argument("--decode-instances", type=int, default=1, help="decode instances (up to 3)")
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--decode-pp", type=int, default=1, help="each decode's pipeline stages")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--staging", choices=["never", "auto", "always"], default="auto")
    ap.add_argument("--written", action="store_true", help="a driver without notifications")
    ap.add_argument("--fencing", action="store_true", help="decode drivers fence lost sources")
    ap.add_argument(
        "--fence-cuts-all", action="store_true", help="with --fencing: a fence cuts every source"
    )
    ap.add_argument(
        "--ends-not-final", action="store_true",
        help="a cancelled write's bytes still land (ends_are_final=False: UCX over TCP)",
    )  # fmt: skip
    ap.add_argument("--packer", action="store_true", help="staged rounds pack on a worker")
    ap.add_argument(
        "--faults", type=_faults, default=FAULTS,
        help=f"comma list over the default set: '-crash', '+late', 'none'; "
             f"default {','.join(sorted(FAULTS))}; harsh: {','.join(sorted(HARSH))}",
    )  # fmt: skip
    ap.add_argument("--workers", type=int, default=1, help="processes for many seeds")
    ap.add_argument("--mix", action="store_true", help="the CI budget's configurations in turn")
    args = ap.parse_args(argv)
    config = Config(
        prefill_tp=args.prefill_tp, prefill_pp=args.prefill_pp, instances=args.instances,
        decode_tp=args.decode_tp, decode_pp=args.decode_pp, decode_instances=args.decode_instances,
        requests=args.requests, faults=args.faults, staging=args.staging,
        notifying=not args.written,
        fencing=args.fencing,
        fence_cuts_all=args.fence_cuts_all,
        ends_final=not args.ends_not_final,
        packer=args.packer,
    )  # fmt: skip
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    began = time.perf_counter()
    if args.seed is None and (args.workers > 1 or args.mix):
        got = sweep(args.first, args.seeds, MIX if args.mix else [config], args.workers)
        for line in got.violations:
            print(line)
        print(
            f"{got.schedules} schedules, {len(got.violations)} violations, "
            f"{got.simulated_s:.0f} simulated seconds ({time.perf_counter() - began:.1f} s)"
        )
        return 1 if got.violations else 0
    bad = simulated = 0.0
    for seed in seeds:
        result = run(seed, config, trace=args.trace)
        simulated += result.simulated_s
        if args.trace and result.trace is not None:
            print("\n".join(result.trace))
        if result.violations:
            bad += 1
            print(result.violations[0], flush=True)
            tail = result.trace or run(seed, config, trace=True).trace or []
            for line in tail[-TAIL:]:
                print(f"    {line}"[:200])
    print(
        f"{len(seeds)} schedules, {int(bad)} violations, {simulated:.0f} simulated seconds "
        f"({time.perf_counter() - began:.1f} s)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order: replays are exact
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "xferkit.testing.sim", *sys.argv[1:]])
    sys.exit(main())
