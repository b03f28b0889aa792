"""scripts/gpu_check.py on a machine without a GPU: a clear message and exit status 2.

On a CUDA machine the same script runs its checks (docs/performance.md says
what it measured); here it must say why it checks nothing, not raise.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "scripts" / "gpu_check.py"


def _module() -> object:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_cuda_device_it_says_so_and_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.fail("this machine has a GPU: run scripts/gpu_check.py itself")
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert run.stderr.startswith("gpu_check: no CUDA device to check: torch 2.")
    assert run.stdout == ""


def test_it_imports_without_running_and_main_returns_the_status() -> None:
    module = _module()
    assert module.NO_DEVICE == 2 and module.MISMATCH == 1  # type: ignore[attr-defined]
    assert module.main(["--device", "cuda:7"]) == 2  # type: ignore[attr-defined]
    problem = module.cuda_problem("cuda:0")  # type: ignore[attr-defined]
    assert problem is not None and "sees none" in problem


def test_a_dry_run_on_host_memory_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    """The script's own code (copier cases, registration, a staged TP 1 -> 2 request) on the
    host, through loopback: what a GPU run does, bar the device."""
    module = _module()
    status = module.main(["--device", "cpu", "--backends", "loopback", "--mib", "1"])  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert sum(" ok " in line for line in lines if line.startswith("copier ")) == 24, out
    assert any(line.startswith("register loopback") and " ok " in line for line in lines), out
    staged = next(line for line in lines if line.startswith("staged loopback"))
    assert " ok " in staged and "2 chunks staged, 0 direct" in staged, out
    assert lines[-1] == "gpu_check: 0 failed"
