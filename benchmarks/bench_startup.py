"""Startup: what xferkit adds to bringing a driver up, against the driver alone.

Issue 19: NIXL agents took 5 to 16 s per rank to come up on this machine.
Each case runs in a fresh interpreter (so imports are cold in the process,
warm in the page cache, as a rank's restart is) and times its own phases:

* ``raw``: the driver's own API only (NIXL: ``nixl_agent`` with a UCX
  backend, imported from its compiled wheel ``nixl_cu12``; Mooncake:
  ``TransferEngine().initialize`` over tcp on 127.0.0.1);
* ``meta`` (NIXL only): the same through the ``nixl`` meta package, which
  imports torch to pick a wheel when it cannot read a CUDA version (a CPU build
  of torch installed, as here);
* ``xferkit``: ``import xferkit``, ``open_backend`` with the same settings,
  then a ``Session`` over one registered 1 MiB region (its sockets, its
  threads, its staging) and ``close``.

A warm-up child per case runs first, unmeasured (bytecode written, files in
the page cache). Cases alternate raw and xferkit per driver, ``--repeat`` times, one child at
a time and ``--ranks`` children started together (an engine brings up all its
ranks at once: six on this 2-core machine is the engine benchmark's TP 2 -> 4);
every child gets the same environment (UCX's module list decided once by the
parent). Prints each phase's median (and the slowest child's total) and
writes benchmarks/results/startup.json.
Run: ``python benchmarks/bench_startup.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from report import Column, header, line, parser, save

NIXL_META = """
from nixl._api import nixl_agent, nixl_agent_config
mark("import")
nixl_agent("raw-%d" % os.getpid(), nixl_agent_config(
    enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"]))
mark("open")
"""
"""NIXL through its meta package, which imports torch when it cannot read a CUDA version."""

RAW = {
    "nixl": """
from nixl_cu12._api import nixl_agent, nixl_agent_config
mark("import")
nixl_agent("raw-%d" % os.getpid(), nixl_agent_config(
    enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"]))
mark("open")
""",
    "mooncake": """
from mooncake.engine import TransferEngine
mark("import")
engine = TransferEngine()
rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
assert rc == 0, rc
mark("open")
""",
    "loopback": """
mark("import")
mark("open")
""",
}

KINDS = {"nixl": ("raw", "meta", "xferkit")}
"""Cases per driver: its compiled API alone, NIXL's meta package, and xferkit over it."""

OPTIONS = {"nixl": {}, "mooncake": {"protocol": "tcp", "hostname": "127.0.0.1"}, "loopback": {}}

XFERKIT = """
import numpy as np
import xferkit as xk
mark("import")
backend = xk.open_backend(NAME, **OPTIONS)
mark("open")
buf = np.zeros((16, 65536), np.uint8)
manifest = xk.Manifest.build([xk.Region.from_array(buf, pool="kv", name="k", layer=0)])
session = xk.Session(backend, manifest, bind="tcp://127.0.0.1:0")
mark("session")
session.close()
mark("close")
"""

PRELUDE = """
import os, sys, time, json
T0 = time.perf_counter()
_last = [T0]
OUT = {}
def mark(name):
    now = time.perf_counter()
    OUT[name] = now - _last[0]
    _last[0] = now
"""

EPILOGUE = """
OUT["total"] = time.perf_counter() - T0
print("STARTUP " + json.dumps(OUT), flush=True)
os._exit(0)
"""


def run(name: str, kind: str, env: dict[str, str], ranks: int) -> list[dict[str, float]]:
    """``ranks`` children of one case started together (an engine starts its ranks at once)."""
    body = {"raw": RAW[name], "meta": NIXL_META}.get(kind, XFERKIT)
    code = f"{PRELUDE}\nNAME = {name!r}\nOPTIONS = {OPTIONS[name]!r}\n{body}\n{EPILOGUE}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(ranks)
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        found = [t for t in stdout.splitlines() if t.startswith("STARTUP ")]
        if not found:
            raise RuntimeError(f"{name} {kind}: exit {proc.returncode}: {stderr[-2000:]}")
        outs.append(json.loads(found[-1][len("STARTUP ") :]))
    return outs


def child_env() -> dict[str, str]:
    """One environment for every child: UCX's modules decided as the NIXL driver would."""
    from xferkit.driver import rdma_devices
    from xferkit_nixl.ucx_env import ucx_modules_default

    env = dict(os.environ)
    # A deployed rank imports compiled bytecode (pip writes it at install); without it every
    # child compiles xferkit from source (this sandbox sets the variable), 3x its import.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    modules, _ = ucx_modules_default(rdma_devices())
    if modules is not None:
        env.setdefault("UCX_MODULES", modules)
    env.setdefault("UCX_LOG_FILE", "stderr")
    return env


def main() -> None:
    args = parser("startup", __doc__)
    args.add_argument("--repeat", type=int, default=5)
    args.add_argument("--drivers", default="loopback,mooncake,nixl")
    args.add_argument("--ranks", default="1,6", help="children started together, per case")
    opts = args.parse_args()
    env = child_env()
    cases = [(n, k) for n in opts.drivers.split(",") for k in KINDS.get(n, ("raw", "xferkit"))]
    for name, kind in cases:  # warm-up: bytecode written, page cache filled
        run(name, kind, env, 1)
    samples: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    for _ in range(opts.repeat):
        for ranks in (int(n) for n in opts.ranks.split(",")):
            for name, kind in cases:
                samples.setdefault((ranks, name, kind), []).extend(run(name, kind, env, ranks))
    rows: list[dict[str, Any]] = []
    for (ranks, name, kind), runs in samples.items():
        phases = {p: statistics.median(r.get(p, 0.0) for r in runs) for p in runs[0]}
        worst = max(r["total"] for r in runs)
        rows.append(
            {
                "ranks": ranks,
                "driver": name,
                "case": kind,
                "runs": len(runs),
                **phases,
                "worst": worst,
            }
        )
    columns = [
        Column("ranks", "ranks", width=6),
        Column("driver", "driver", width=10),
        Column("case", "case", width=9),
        Column("import s", "import", ".3f"),
        Column("open s", "open", ".3f"),
        Column("session s", lambda r: r.get("session", 0.0), ".3f"),
        Column("close s", lambda r: r.get("close", 0.0), ".3f"),
        Column("total s", "total", ".3f"),
        Column("worst s", "worst", ".3f"),
    ]
    print(header(columns))
    for row in rows:
        print(line(row, columns))
    save(opts.out, rows, repeat=opts.repeat)


if __name__ == "__main__":
    main()
