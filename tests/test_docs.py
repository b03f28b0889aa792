"""docs/architecture.md's module table is the true picture of the package."""

from __future__ import annotations

import re
from pathlib import Path

import xferkit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(xferkit.__file__).parent


def test_every_module_of_the_package_is_in_the_architecture_table() -> None:
    """Before: the table left out session/, closing.py, cli.py and demo.py."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("| module | idea |") :].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([\w/.]+)` \|", table, flags=re.M))
    modules = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    packages = {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert modules | packages <= listed, sorted((modules | packages) - listed)
    assert listed <= modules | packages, sorted(listed - modules - packages)  # none gone stale


def test_every_test_directory_is_described() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for d in sorted(p for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name[0] != "_"):
        assert f"`tests/{d.name}`" in doc, d.name


def test_the_data_flow_picture_names_real_modules_and_the_whole_package() -> None:
    """Before: the picture left out session/, closing.py, cli.py and bench/ (and a module it
    names can be renamed or deleted under it)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    start = doc.index("```\n") + 4
    picture = doc[start : doc.index("```\n", start)]
    named = set(re.findall(r"(?<![\w/])([\w/]+\.py|\w+/)(?=[,;:) ])", picture))
    missing = sorted(name for name in named if not (PACKAGE / name).exists())
    assert not missing, missing
    assert {"session/", "closing.py", "cli.py", "bench/", "planner/expand.py"} <= named, named
