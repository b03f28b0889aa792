"""The installed kit's assertions show what differed, as the author's own tests' do (issue 20).

pytest rewrites assertions only in test modules and in modules registered for
it; the kit (``xferkit.testing``) is an installed package, so xferkit's pytest
plugin registers it. Run in a fresh pytest process, as a plugin author's would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

AUTHOR_TEST = """
from xferkit.testing.conformance import held


class Unregistered:
    manifest = None


def test_kit_helper_fails():
    held(Unregistered())
"""


def test_a_failing_kit_assertion_shows_the_values(tmp_path: Path) -> None:
    (tmp_path / "test_author.py").write_text(AUTHOR_TEST)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_author.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    # Rewritten: pytest explains the comparison; unrewritten, a bare AssertionError.
    assert "assert None is not None" in run.stdout, run.stdout
    assert "where None = " in run.stdout and ".manifest" in run.stdout, run.stdout
