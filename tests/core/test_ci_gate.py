"""The CI gate in the repository's conftest.py: with CI=true a skip fails unless allowed.

Each check runs pytest in a subprocess on a small temporary project that uses
a copy of the repository's root conftest.py, with CI set or unset explicitly (the
outer run may itself be in CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

CONFTEST = Path(__file__).parents[2] / "conftest.py"  # tests/core/ -> the repository root

CASES = """
import pytest


def test_missing_driver():
    pytest.skip("mooncake is not installed")


@pytest.mark.skipif(True, reason="libibverbs.so.1 missing")
def test_skipif_mark():
    pass


@pytest.fixture
def driver():
    pytest.skip("nixl is not installed")


def test_skip_in_fixture(driver):
    pass


@pytest.mark.allow_skip("the driver declares no cross-process support")
def test_allowed():
    pytest.skip("no cross-process")


@pytest.mark.allow_skip
def test_allowed_without_reason():
    pytest.skip("no cross-process")


@pytest.mark.xfail(reason="known bug", strict=True)
def test_expected_failure():
    assert False


def test_passes():
    pass
"""

MODULE_SKIP = """
import pytest

pytest.importorskip("mooncake_transfer_engine_surely_absent")


def test_never_collected():
    pass
"""


def _run(tmp_path: Path, name: str, source: str, ci: bool) -> tuple[int, str, dict[str, str]]:
    """Run pytest on one test file; (exit code, output, outcome per test name)."""
    project = tmp_path / f"{name}-{'ci' if ci else 'local'}"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "conftest.py").write_text(CONFTEST.read_text())
    (project / f"test_{name}.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "CI"}
    if ci:
        env["CI"] = "true"
    report = project / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", "-q"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        outcome = kinds[0] if kinds else "passed"
        skipped = case.find("skipped")
        if skipped is not None and "xfail" in (skipped.get("type") or ""):
            outcome = "xfail"
        outcomes[case.get("name") or case.get("classname") or "?"] = outcome
    return run.returncode, run.stdout + run.stderr, outcomes


def test_outside_ci_skips_stay_skips(tmp_path):
    code, out, outcomes = _run(tmp_path, "cases", CASES, ci=False)
    assert code == 0, out
    assert outcomes == {
        "test_missing_driver": "skipped",
        "test_skipif_mark": "skipped",
        "test_skip_in_fixture": "skipped",
        "test_allowed": "skipped",
        "test_allowed_without_reason": "skipped",
        "test_expected_failure": "xfail",
        "test_passes": "passed",
    }


def test_in_ci_a_skip_fails(tmp_path):
    code, out, outcomes = _run(tmp_path, "cases", CASES, ci=True)
    assert code == 1, out
    assert outcomes == {
        "test_missing_driver": "failure",
        "test_skipif_mark": "error",  # refused at setup, so pytest reports an error
        "test_skip_in_fixture": "error",
        "test_allowed": "skipped",
        "test_allowed_without_reason": "failure",
        "test_expected_failure": "xfail",
        "test_passes": "passed",
    }
    assert "mooncake is not installed" in out and "libibverbs.so.1 missing" in out
    assert "allow_skip" in out


@pytest.mark.parametrize("ci", [False, True])
def test_module_level_importorskip(tmp_path, ci):
    code, out, _ = _run(tmp_path, "module", MODULE_SKIP, ci=ci)
    if ci:  # a collection error: the run stops, nothing passes silently
        assert code == pytest.ExitCode.INTERRUPTED, out
        assert "1 error" in out and "mooncake_transfer_engine_surely_absent" in out, out
    else:
        assert code == pytest.ExitCode.NO_TESTS_COLLECTED and "1 skipped" in out, out
