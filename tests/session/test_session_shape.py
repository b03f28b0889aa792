"""The Session's shape, as issue 17 asks for it: a pure core, no import circle, small modules.

Read from the source (``ast``), so a change that makes the core reach for a socket, a
thread, the clock or the backend, or that ties two modules into a circle, fails here
rather than in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import xferkit.session

SESSION = Path(xferkit.session.__file__).parent
CORE = {
    "actions", "core", "incoming", "layerwise", "outgoing", "pairs", "prefix", "protocol",
    "recvs", "rounds", "roster", "sends", "sources", "staged", "states", "timeline",
    "unpacking", "wire",
}  # fmt: skip
FORBIDDEN = {"zmq", "threading", "time", "socket", "concurrent", "xferkit.backend"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules of the package it imports, absolute names it imports), TYPE_CHECKING too."""
    local: set[str] = set()
    absolute: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            absolute |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                local.add(node.module.split(".")[0])
            elif node.level == 1:
                local |= {a.name for a in node.names}
            elif node.level == 2 and node.module:
                absolute.add(f"xferkit.{node.module}")
            elif node.module:
                absolute.add(node.module)
    return local, absolute


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in SESSION.glob("*.py")}


def test_the_protocol_core_imports_no_io() -> None:
    mods = _modules()
    assert set(mods) >= CORE, CORE - set(mods)
    for name in sorted(CORE):
        _, absolute = _imports(mods[name])
        bad = {a for a in absolute if a in FORBIDDEN or a.split(".")[0] in FORBIDDEN}
        assert not bad, (name, bad)


def test_no_import_circle_inside_the_session_package() -> None:
    mods = _modules()
    graph = {m: {d for d in _imports(p)[0] if d in mods} for m, p in mods.items()}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path, m))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, (*path, m))
        done.add(m)

    for m in sorted(graph):
        visit(m, ())


def test_no_module_of_the_session_is_over_400_lines() -> None:
    long = {p.name: n for p in SESSION.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
