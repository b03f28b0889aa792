"""What every benchmark script shares: where results go and what is recorded beside them."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"


def default_out(name: str) -> str:
    return str(RESULTS / f"{name}.json")


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
