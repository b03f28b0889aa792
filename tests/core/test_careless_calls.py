"""Public calls given what a careless caller passes (0-d and ragged arrays, numpy values where
Python ones go, keys of the wrong shape, addresses out of range) raise an ``XferError``
naming what was wrong, never numpy's or Python's own error. Found by fuzzing the public API
with such values; each case raised something else before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import xferkit as xk

M = xk.Manifest.build(
    [xk.Region.from_array(np.zeros((4, 8), np.uint8), pool="p", name="a", layer=0, tp_axis=0)]
)
R = M.regions[0]
P = xk.plan(M, M)
DEEP = "[" * 100_000  # JSON nested past the interpreter's recursion limit

CASES: dict[str, Callable[[], object]] = {
    "backends(array)": lambda: xk.backends(np.array([1, 2])),  # type: ignore[arg-type]
    "open_backend(faults=np.int64)": lambda: xk.open_backend("loopback", faults=np.int64(1)),
    "open_backend(faults=array)": lambda: xk.open_backend("loopback", faults=np.array([1, 2])),
    "open_backend(faults=range)": lambda: xk.open_backend("loopback", faults=range(3)),
    "Manifest.build(0-d array)": lambda: xk.Manifest.build(np.array(1)),  # type: ignore[arg-type]
    "from_array(tp_groups=0-d array)": lambda: xk.Region.from_array(
        np.zeros((4, 8), np.uint8), pool="p", name="a", layer=0, tp_axis=0,
        tp_groups=np.array(8),  # type: ignore[arg-type]
    ),
    "Manifest(dropped=None)": lambda: xk.Manifest((), 0, 1, None),  # type: ignore[arg-type]
    "Manifest(dropped=[tuple])": lambda: xk.Manifest((), 0, 1, [("p", "a", 0, 0)]),  # type: ignore[arg-type]
    "index(3-tuple)": lambda: M.index(("p", "a", 0)),  # type: ignore[arg-type]
    "index(None)": lambda: M.index(None),  # type: ignore[arg-type]
    "region(list)": lambda: M.region(["p", "a", 0, 0]),  # type: ignore[arg-type]
    "key_label(3-tuple)": lambda: xk.key_label(("p", "a", 0)),  # type: ignore[arg-type]
    "key_label(None)": lambda: xk.key_label(None),  # type: ignore[arg-type]
    "locate([-1])": lambda: M.locate([-1]),  # type: ignore[arg-type]
    "locate(None)": lambda: M.locate(None),  # type: ignore[arg-type]
    "locate(5)": lambda: M.locate(5),  # type: ignore[arg-type]
    "locate(nbytes=str)": lambda: M.locate(np.array([1], np.uint64), "x"),  # type: ignore[arg-type]
    "first_outside([2**64])": lambda: M.first_outside([2**64]),  # type: ignore[arg-type]
    "nearest(-1)": lambda: M.nearest(-1),
    "nearest(None)": lambda: M.nearest(None),  # type: ignore[arg-type]
    "nearest(list)": lambda: M.nearest([1, 2]),  # type: ignore[arg-type]
    "axis_layout(str)": lambda: R.axis_layout("2"),  # type: ignore[arg-type]
    "axis_layout(None)": lambda: R.axis_layout(None),  # type: ignore[arg-type]
    "axis_layout(0)": lambda: R.axis_layout(0),
    "axis_layout(float)": lambda: R.axis_layout(2.5),  # type: ignore[arg-type]
    "Plan.layers(list)": lambda: P.layers(["p"]),  # type: ignore[arg-type]
    "Plan.page_pairs(None)": lambda: P.page_pairs(None),  # type: ignore[arg-type]
    "Descriptors(lists)": lambda: xk.Descriptors([1], [2], [3]),  # type: ignore[arg-type]
    "Descriptors(None)": lambda: xk.Descriptors(None, None, None),  # type: ignore[arg-type]
    "Descriptors.concat(ints)": lambda: xk.Descriptors.concat([1, 2]),  # type: ignore[list-item]
    "Descriptors.concat(int)": lambda: xk.Descriptors.concat(5),  # type: ignore[arg-type]
    "load_config(env=int)": lambda: xk.load_config({}, env=5),  # type: ignore[arg-type]
    "load_config(env=bytes)": lambda: xk.load_config({}, env=b"XFERKIT"),  # type: ignore[arg-type]
    "load_config(env value int)": lambda: xk.load_config({}, env={"XFERKIT_BACKEND_OPTIONS": 5}),  # type: ignore[dict-item]
    "load_config(env value None)": lambda: xk.load_config({}, env={"XFERKIT_TRUSTED_KEYS": None}),  # type: ignore[dict-item]
    "load_config(deep JSON)": lambda: xk.load_config({}, env={"XFERKIT_BACKEND_OPTIONS": DEEP}),
    "summarize(0-d array)": lambda: xk.group.summarize(np.array(1)),  # type: ignore[arg-type]
}  # fmt: skip


def test_an_unhashable_key_is_in_no_manifest() -> None:
    assert ["p", "a", 0, 0] not in M  # before: TypeError (unhashable)
    assert ("p", "a", 0, 0) in M


@pytest.mark.parametrize("call", sorted(CASES))
def test_a_careless_call_is_an_xfer_error(call: str) -> None:
    with pytest.raises(xk.XferError):
        CASES[call]()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a, peer, one, t: a.write(peer, one, timeout=2**1024), "float"),
        (lambda a, peer, one, t: t.wait(2**1024), "float"),
        (lambda a, peer, one, t: t.abort("test", timeout=2**1024), "float"),
        (lambda a, peer, one, t: t.abort("test", wait=np.array([1, 2])), "wait"),
    ],
    ids=["write timeout", "wait", "abort timeout", "abort wait"],
)
def test_a_careless_transfer_call_is_refused_and_the_write_still_ends(
    call: Callable, match: str
) -> None:
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    with xk.open_backend("loopback") as a, xk.open_backend("loopback") as b:
        a.register(xk.Manifest.build([xk.Region.from_array(src, pool="p", name="s", layer=0)]))
        mb = xk.Manifest.build([xk.Region.from_array(dst, pool="p", name="d", layer=0)])
        b.register(mb)
        peer = a.connect(b.endpoint(), mb)
        addrs = (src.ctypes.data, dst.ctypes.data, 64)
        one = xk.Descriptors(*(np.array([x], np.uint64) for x in addrs))
        t = a.write(peer, one)
        with pytest.raises(xk.XferError, match=match):
            call(a, peer, one, t)
        t.wait(10)
        np.testing.assert_array_equal(dst, src)


def test_a_config_file_nested_too_deep_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text(DEEP)
    with pytest.raises(xk.XferError, match=r"deep\.json"):
        xk.load_config(str(path))  # before: RecursionError
