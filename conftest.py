"""In CI a test that cannot run fails: every skip becomes a failure there.

With the environment variable ``CI`` set to ``true``, a test that ends
skipped (``pytest.skip``, ``skipif``, ``importorskip``, in the test, a fixture
or at module level) is reported as failed, so that a driver or dependency
missing on the CI machine cannot pass unnoticed. A skip that is legitimate
whatever is installed (a capability the driver does not claim, say) carries
``@pytest.mark.allow_skip("why")``. Expected failures (xfail) are untouched.
"""

from __future__ import annotations

import os

import pytest

ALLOW = "allow_skip"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{ALLOW}(reason): this test may end skipped in CI (CI=true); the reason says why "
        "the skip is legitimate rather than a missing driver or dependency",
    )


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2])
    return str(longrepr)


def _refusal(node: pytest.Item | pytest.Collector, longrepr: object) -> str | None:
    """Why this skip fails in CI, or None when it may stand."""
    marker = node.get_closest_marker(ALLOW)
    if marker is not None:
        reason = marker.args[0] if marker.args else marker.kwargs.get("reason")
        if isinstance(reason, str) and reason.strip():
            return None
        return (
            f"@pytest.mark.{ALLOW} on {node.nodeid} gives no reason; "
            f"skipped in CI: {_skip_reason(longrepr)}"
        )
    return (
        f"skipped in CI (CI=true), where a test that cannot run fails: "
        f"{_skip_reason(longrepr)}. Install what is missing, or mark the test "
        f'@pytest.mark.{ALLOW}("why") if the skip is legitimate.'
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        refusal = _refusal(item, report.longrepr)
        if refusal is not None:
            report.outcome = "failed"
            report.longrepr = refusal
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if _in_ci() and report.outcome == "skipped":  # a module-level skip or importorskip
        refusal = _refusal(collector, report.longrepr)
        if refusal is not None:
            report.outcome = "failed"
            report.longrepr = refusal
    return report
