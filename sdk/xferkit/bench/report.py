"""Tables (rich), JSON and plots (matplotlib, Agg) of bench results.

rich and matplotlib are optional extras (``xferkit[cli]``, ``xferkit[plot]``):
``need`` turns a missing one into one line naming the extra to install.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import USAGE, BenchError
from .raw import RAW_COLUMNS


def need(module: str, extra: str) -> Any:
    """Import ``module`` or raise BenchError(USAGE) naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise BenchError(
            USAGE, f"{module} is not installed: pip install 'xferkit[{extra}]'"
        ) from None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _share(staged: int, direct: int) -> str:
    """The chunks that went staged, as a share of all (a dash where none could)."""
    total = staged + direct
    return f"{staged / total:.0%}" if total else "-"


def bench_table(cases: list[dict[str, Any]], title: str) -> Any:
    """One row per case: the comparable columns, and the ceiling measured in the same run."""
    Table = need("rich.table", "cli").Table
    t = Table(title=title, title_justify="left")
    for name in (
        "case", "bytes/req", "descs/req", "GB/s", "req/s", "p50 ms", "p99 ms",
        "staged", "wait p99 ms", "memcpy GB/s", "1-desc GB/s", "ratio", "CPU s/GB", "check",
    ):  # fmt: skip
        t.add_column(name, justify="left" if name == "case" else "right")
    for c in cases:
        ceiling = c["ceiling"]
        check = {True: "checked", None: "unchecked", False: "FAILED"}[c["verified"]]
        t.add_row(
            c["label"],
            _mib(c["bytes_per_request"]),
            f"{c['descriptors_per_request']:,}",
            f"{c['gbps']:.2f}",
            f"{c['requests_per_s']:.1f}",
            f"{c['p50_ms']:.2f}",
            f"{c['p99_ms']:.2f}",
            _share(c["staged_chunks"], c["direct_chunks"]),
            f"{c['staging_wait_p99_ms']:.1f}",
            f"{ceiling.get('memcpy_gbps', 0):.2f}",
            f"{ceiling.get('driver_gbps', 0):.2f}",
            "" if c["ratio"] is None else f"{c['ratio']:.2f}",
            "" if not c.get("cpu_s_per_gb") else f"{c['cpu_s_per_gb']['all']:.2f}",
            check,
        )
    return t


def split_table(cases: list[dict[str, Any]], title: str) -> Any:
    """Where each case's latency went: the median of every request's split, per stage."""
    Table = need("rich.table", "cli").Table
    t = Table(title=title, title_justify="left")
    stages = list(cases[0]["split_p50_ms"]) if cases else []
    for name in ("case", *stages, "p50 ms"):
        t.add_column(name, justify="left" if name == "case" else "right")
    for c in cases:
        split = [f"{c['split_p50_ms'][s]:.2f}" for s in stages]
        t.add_row(c["label"], *split, f"{c['p50_ms']:.2f}")
    return t


def raw_table(rows: list[dict[str, Any]], title: str) -> Any:
    Table = need("rich.table", "cli").Table
    t = Table(title=title, title_justify="left")
    for name in RAW_COLUMNS:
        t.add_column(name, justify="right")
    checked = any(r["checked"] is not None for r in rows)
    if checked:
        t.add_column("Check", justify="right")
    for r in rows:
        cells = [
            f"{r['block_bytes']}",
            f"{r['batch']}",
            f"{r['gbps']:.6f}",
            f"{r['avg_lat_us']:.3f}",
            f"{r['avg_post_us']:.3f}",
            f"{r['p99_post_us']:.3f}",
            f"{r['avg_tx_us']:.3f}",
            f"{r['p99_tx_us']:.3f}",
        ]
        if checked:
            cells.append("ok" if r["checked"] else "FAILED")
        t.add_row(*cells)
    return t


def write_json(path: str, data: dict[str, Any], console: Any) -> None:
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")
        console.print(f"wrote {path}")


def plot(path: str, cases: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Throughput per case against its ceilings, and each case's latency CDF, in one PNG.

    The series drawn are recorded in the PNG's ``Description`` text chunk (JSON) and returned,
    so a script can tell what the figure holds without reading pixels."""
    mpl = need("matplotlib", "plot")
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [c["label"] for c in cases]
    x = np.arange(len(cases))
    bars.bar(x, [c["gbps"] for c in cases], label="bench GB/s", color="tab:blue")
    for key, color, label in (
        ("driver_gbps", "tab:red", "driver, 1 descriptor"),
        ("memcpy_gbps", "tab:gray", "memcpy, 1 core"),
    ):
        values = [c["ceiling"][key] for c in cases]
        bars.scatter(x, values, marker="_", s=600, color=color, label=label, zorder=3)
    bars.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
    bars.set_ylabel("GB/s (10^9 B/s)")
    bars.set_title("throughput per case against its ceiling")
    bars.legend(fontsize=8)
    for c in cases:
        lat = np.sort([r["latency_s"] * 1e3 for r in c["records"] if not r["warmup"]])
        cdf.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=c["label"])
    cdf.set_xlabel("request latency, ms (first expect to the last decode rank's DONE)")
    cdf.set_xscale("log")  # cases differ by orders of magnitude
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("latency CDF")
    cdf.legend(fontsize=8)
    fig.tight_layout()
    series = {"throughput": ["bench GB/s", "driver, 1 descriptor", "memcpy, 1 core"], "cdf": labels}
    fig.savefig(path, dpi=110, metadata={"Description": json.dumps(series)})
    plt.close(fig)
    return series
