"""The main job: `xferkit demo` plans, executes and checks a handoff, for any sensible layout."""

from __future__ import annotations

import pytest

from xferkit.cli import main
from xferkit.demo import run


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "layers"), [(2, 4, 8), (4, 2, 8), (3, 2, 5), (1, 8, 4), (2, 2, 3)]
)
def test_demo_verifies_the_handoff(src_tp: int, dst_tp: int, layers: int) -> None:
    lines: list[str] = []
    assert run(src_tp, dst_tp, layers, out=lines.append)
    assert lines[-1] == "handoff verified"
    results = [line for line in lines if "result:" in line]
    assert len(results) == dst_tp
    assert all("byte-exact; no byte written twice" in line for line in results)


def test_cli_demo_exit_codes(capsys) -> None:
    assert main(["demo", "--layers", "3"]) == 0  # no attention layer: state only
    assert "handoff verified" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["demo", "--src-tp", "0"])
    assert info.value.code == 2
    assert "not a positive integer" in capsys.readouterr().err
