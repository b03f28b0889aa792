"""What every benchmark script shares: its command line, its timings, its tables, its results.

- ``parser(name)``: the script's ``argparse`` parser, ``--out`` already on it
  (benchmarks/results/<name>.json); ``script``: the whole usual ``main`` (options, run,
  table, save);
- ``timed(fn, repeat)``: the seconds of each call (``.median``, ``.best``);
- ``table(rows, columns)``: a header and one line a row (``header``, ``line``: as they come);
- ``save(out, rows, **meta)``: the rows and the run's circumstances as JSON;
- ``shuffled_blocks`` / ``check_shuffled``: a buffer moved in blocks landing in a random
  order, as a paged KV cache asks, and the proof that every block landed;
- ``kv_manifest``: a Llama-70B-shaped KV layer set over real memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import xferkit as xk

RESULTS = Path(__file__).parent / "results"

HEADS, HEAD_DIM, PAGE, BF16 = 8, 128, 64, 2
"""A Llama-70B-shaped KV layer set: 8 KV heads of 128, bf16, pages of 64 tokens."""


# -- the command line and the results ----------------------------------------------------


def default_out(name: str) -> str:
    return str(RESULTS / f"{name}.json")


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The script's parser (its docstring as description), with ``--out`` for ``name``."""
    out = argparse.ArgumentParser(description=doc)
    out.add_argument("--out", default=default_out(name), help="where the JSON results go")
    return out


def script(
    name: str,
    doc: str | None,
    run: Callable[..., list[dict[str, Any]]],
    columns: Sequence[Column],
    options: dict[str, tuple[Any, str | None]],
    **meta: Any,
) -> None:
    """The usual ``main``: ``options`` (name: (default, help)) on the command line,
    ``run(*their values)``, its rows as a table, saved with the values and ``meta``."""
    args = parser(name, doc)
    for key, (default, text) in options.items():
        flag = "--" + key.replace("_", "-")
        args.add_argument(flag, type=type(default), default=default, help=text)
    a = args.parse_args()
    values = {key: getattr(a, key) for key in options}
    rows = run(*values.values())
    table(rows, columns)
    save(a.out, rows, **values, **meta)


def save(out: str, rows: list[dict[str, Any]], **meta: Any) -> Path:
    """Write rows and the run's circumstances as JSON; say where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        **meta,
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return path


# -- timings -----------------------------------------------------------------------------


class Times(list[float]):
    """Seconds per call. The machine is shared: the median is the typical call, the best
    what the code can do."""

    @property
    def median(self) -> float:
        return statistics.median(self)

    @property
    def best(self) -> float:
        return min(self)


def timed(
    fn: Callable[[], Any],
    repeat: int = 1,
    *,
    warm: bool = False,
    then: Callable[[Any], object] | None = None,
) -> Times:
    """The seconds each of ``repeat`` calls of ``fn`` takes; ``warm``: one untimed call
    first (pages faulted in, caches filled); ``then`` gets each call's result, untimed
    (to release it)."""
    if warm:
        result = fn()
        if then is not None:
            then(result)
    out = Times()
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t)
        if then is not None:
            then(result)
    return out


# -- tables ------------------------------------------------------------------------------


class Column(NamedTuple):
    """One column of a printed table: ``value`` is a row key or a function of the row."""

    head: str
    value: str | Callable[[dict[str, Any]], Any]
    spec: str = ""  # the value's format spec: ",", ".2f", ".1%"
    width: int = 10
    left: bool = False

    def cell(self, text: str) -> str:
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"

    def show(self, row: dict[str, Any]) -> str:
        value = row[self.value] if isinstance(self.value, str) else self.value(row)
        return self.cell(format(value, self.spec))


def header(columns: Sequence[Column]) -> str:
    return "".join(c.cell(c.head) for c in columns)


def line(row: dict[str, Any], columns: Sequence[Column]) -> str:
    return "".join(c.show(row) for c in columns)


def table(rows: Iterable[dict[str, Any]], columns: Sequence[Column]) -> None:
    """Print a header and one line per row (``header`` and ``line``: rows as they come)."""
    print(header(columns))
    for row in rows:
        print(line(row, columns))


def kib(key: str) -> Callable[[dict[str, Any]], str]:
    """A byte count as ``64Ki``: descriptor sizes in table cells."""
    return lambda row: f"{row[key] >> 10}Ki"


# -- workloads ---------------------------------------------------------------------------


def shuffled_blocks(
    src: int, dst: int, total: int, size: int, rng: np.random.Generator
) -> xk.Descriptors:
    """``total`` bytes at ``src`` in blocks of ``size``, block i landing at block ``order[i]``
    of ``dst`` for a random permutation ``order``: as a paged KV cache would ask."""
    n = total // size
    order = rng.permutation(n).astype(np.uint64)
    offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    return xk.Descriptors(
        np.uint64(src) + offs,
        np.uint64(dst) + order * np.uint64(size),
        np.full(n, size, dtype=np.uint64),
    )


def check_shuffled(
    d: xk.Descriptors, src: np.ndarray, landed: np.ndarray, dst: int, size: int
) -> None:
    """The moved bytes are right: ``landed`` (the destination's bytes, read back where they are
    elsewhere; its first byte is address ``dst`` of ``d``) holds block i of ``src`` at the
    block ``d`` sent it to."""
    order = ((d.dst - np.uint64(dst)) // np.uint64(size)).astype(np.int64)
    assert np.array_equal(landed.reshape(-1, size)[order], src.reshape(-1, size))


def kv_manifest(
    layout: str, tp: int, rank: int, layers: int, pages: int, seed: int, page: int = PAGE
) -> tuple[xk.Manifest, list[np.ndarray]]:
    """One rank's k and v pages of ``page`` tokens, NHD or HND (axes named, so either side may
    use either), random bytes (the tests check correctness)."""
    heads = HEADS // tp
    shape, axis = ((page, heads, HEAD_DIM), 1) if layout == "NHD" else ((heads, page, HEAD_DIM), 0)
    axes = ("token", "head", "dim") if layout == "NHD" else ("head", "token", "dim")
    rng = np.random.default_rng(seed)
    arrays, regions = [], []
    for layer in range(layers):
        for name in "kv":
            a = rng.integers(0, 256, (pages, *shape[:-1], HEAD_DIM * BF16), dtype=np.uint8)
            arrays.append(a)
            regions.append(
                xk.Region(
                    pool="kv",
                    name=name,
                    layer=layer,
                    addr=a.ctypes.data,
                    nbytes=a.nbytes,
                    slot_shape=shape,
                    itemsize=BF16,
                    tp_axis=axis,
                    axes=axes,
                )
            )
    return xk.Manifest.build(regions, tp_rank=rank, tp_size=tp), arrays
