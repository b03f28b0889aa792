"""docs/architecture.md's module table is the true picture of the package."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

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


PLUGINS = ROOT / "docs" / "plugins.md"


def _block(doc: str, first_line: str) -> str:
    """The fenced python block of ``doc`` whose first line is ``first_line``."""
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    found = [b for b in blocks if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"{first_line!r}: {len(found)} blocks"
    return found[0]


def test_the_kit_table_in_plugins_md_is_the_generated_one() -> None:
    """Before: the page listed 8 of the kit's 23 tests, by hand."""
    from xferkit.testing.conformance import obligations, table

    doc = PLUGINS.read_text()
    start = doc.index("| test | what your driver must do |")
    assert doc[start:].split("\n\n", 1)[0] == table()
    listed = re.findall(r"^\| `(test_\w+)` \|", doc, flags=re.M)
    assert listed == [name for name, _ in obligations()]  # every test, once, nothing else


def test_every_kit_obligation_is_named_in_the_prose_too() -> None:
    """Each kit test is named where an author reads (the obligations list or the sections)."""
    from xferkit.testing.conformance import obligations

    doc = PLUGINS.read_text()
    prose = doc[: doc.index("| test | what your driver must do |")]
    missing = [
        name
        for name, _ in obligations()
        if f"`{name}`" not in prose and not name.startswith("test_cross_process_")
    ]
    assert missing == [] and "`test_cross_process_*`" in prose, missing


def test_the_sample_driver_needs_only_xferkit_driver_and_opens() -> None:
    """The page's sample imports from ``xferkit.driver`` alone, and its class is a driver the
    core accepts (capabilities, options, notifications all consistent)."""
    import ast
    import types

    import xferkit.driver

    doc = PLUGINS.read_text()
    for first in ("# my_driver/driver.py", "# my_driver/__init__.py"):
        tree = ast.parse(_block(doc, first))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xferkit"):
                assert node.module == "xferkit.driver", (first, node.module)
                names = {a.name for a in node.names}
                assert names <= set(xferkit.driver.__all__), names - set(xferkit.driver.__all__)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("xferkit") for a in node.names), first

    class _Engine:  # stands in for the sample's fictional `engine` module
        def open(self, device: str) -> _Engine:
            self.device = device
            return self

        def url(self) -> str:
            return f"engine://{self.device}"

        def close(self) -> None:
            self.device = "closed"

    module = types.ModuleType("plugins_md_sample")  # msgspec resolves hints in the module
    module.engine = _Engine()  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        _run_sample(module, _block(doc, "# my_driver/driver.py"))
    finally:
        del sys.modules[module.__name__]


def _run_sample(module: object, source: str) -> None:
    import xferkit.driver
    from xferkit.options import parse

    # As its own module would: without this file's `from __future__ import annotations`.
    exec(compile(source, "plugins.md", "exec", dont_inherit=True), vars(module))
    namespace = vars(module)
    cls: Any = namespace["MyDriver"]
    assert isinstance(cls, type) and issubclass(cls, xferkit.driver.Driver)
    assert cls.Options is not None
    factory: Any = namespace["MyDriver"]  # not narrowed to Driver: it takes its Options
    driver = factory(parse("mydriver", cls.Options, {"device": "eth0", "max_batch": 3}))
    backend = xferkit.Backend(driver)  # refuses inconsistent capabilities
    assert backend.capabilities.max_batch == 3 and backend.capabilities.notifications
    assert driver.address == "engine://eth0"
    assert isinstance(namespace["Blob"], type)
    backend.close()
    assert driver.engine.device == "closed"
