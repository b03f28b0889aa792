"""The public API with arguments of any type: it succeeds or raises an ``XferError``, nothing else.

Issue 9 found about thirty wrong-typed arguments surfacing as raw TypeError,
AttributeError, KeyError or ValueError from inside (``tp_size=2.0``,
``plan(m, "x")``, ``expand(None)``, ``write(peer, None)``, ``wait("5")``...).
Hypothesis draws values of every kind for every argument of every public call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xferkit as xk

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=16),
    st.lists(st.integers(-3, 3), max_size=4),
    st.tuples(st.integers(-3, 300), st.integers(-3, 300)),
    st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=3),
    st.builds(lambda n: np.arange(n), st.integers(0, 4)),
    st.builds(lambda: np.zeros((2, 2), dtype=np.float32)),
    st.builds(object),
    st.sampled_from([xk.Descriptors.empty(), 2.0, 0.5, "0", "loopback"]),
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


def _only_xfer_errors(call: Callable[[], Any]) -> None:
    """Run ``call``: success and ``XferError`` pass; any other exception fails the test."""
    with contextlib.suppress(xk.XferError):
        call()


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    """Real objects to pass where a wrong type is not being drawn."""
    src, dst = np.zeros((8, 16), np.uint8), np.zeros((8, 16), np.uint8)
    ms = xk.Manifest.build([xk.Region.from_array(src, pool="p", name="a", layer=0)])
    md = xk.Manifest.build([xk.Region.from_array(dst, pool="p", name="a", layer=0)])
    a, b = xk.open_backend("loopback"), xk.open_backend("loopback")
    a.register(ms)
    b.register(md)
    peer = a.connect(b.endpoint(), md)
    plan = xk.plan(ms, md)
    t = a.write(peer, plan.expand({"p": ([0], [1])}))
    t.wait(10)
    yield {"src": ms, "dst": md, "a": a, "b": b, "peer": peer, "plan": plan, "t": t}
    a.close()
    b.close()


REGION_FIELDS = {
    "pool": "p",
    "name": "a",
    "layer": 0,
    "part": 0,
    "addr": 0x1000,
    "nbytes": 64,
    "slot_shape": (16,),
    "itemsize": 4,
    "device": "cpu",
    "tp_axis": None,
    "tp_groups": None,
    "tp_global": None,
}


@SETTINGS
@given(field=st.sampled_from(sorted(REGION_FIELDS)), value=anything)
def test_region_fields(field: str, value: Any) -> None:
    _only_xfer_errors(lambda: xk.Manifest.build([xk.Region(**{**REGION_FIELDS, field: value})]))


@SETTINGS
@given(
    array=anything,
    field=st.sampled_from(
        ["pool", "name", "layer", "part", "tp_axis", "tp_groups", "tp_global", "device"]
    ),
    value=anything,
)
def test_from_array(array: Any, field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"pool": "p", "name": "a", "layer": 0, field: value}
    _only_xfer_errors(lambda: xk.Manifest.build([xk.Region.from_array(array, **kwargs)]))
    good = np.zeros((4, 8), np.uint8)
    _only_xfer_errors(lambda: xk.Manifest.build([xk.Region.from_array(good, **kwargs)]))


@SETTINGS
@given(regions=anything, rank=anything, size=anything)
def test_manifest_build_and_decode(regions: Any, rank: Any, size: Any) -> None:
    _only_xfer_errors(lambda: xk.Manifest.build(regions, tp_rank=rank, tp_size=size))
    _only_xfer_errors(lambda: xk.Manifest.build([], tp_rank=rank, tp_size=size))
    _only_xfer_errors(lambda: xk.Manifest.decode(regions))


@SETTINGS
@given(x=anything, y=anything)
def test_planning(world: dict[str, Any], x: Any, y: Any) -> None:
    _only_xfer_errors(lambda: xk.plan(world["src"], x))
    _only_xfer_errors(lambda: xk.plan(x, world["dst"]))
    _only_xfer_errors(lambda: xk.coverage(x, world["dst"]))
    _only_xfer_errors(lambda: xk.coverage([world["src"]], x))
    _only_xfer_errors(lambda: world["plan"].expand(x))
    _only_xfer_errors(lambda: world["plan"].expand({"p": x}))
    _only_xfer_errors(lambda: world["plan"].expand({"p": (x, y)}))
    if isinstance(x, str | int | float | bytes | None):  # hashable: usable as a pool name
        _only_xfer_errors(lambda: world["plan"].expand({x: ([0], [1])}))


@SETTINGS
@given(x=anything, y=anything, z=anything)
def test_backend_calls(world: dict[str, Any], x: Any, y: Any, z: Any) -> None:
    a, b, peer = world["a"], world["b"], world["peer"]
    d = world["plan"].expand({"p": ([0], [1])})
    _only_xfer_errors(lambda: a.register(x))
    _only_xfer_errors(lambda: a.connect(x, world["dst"]))
    _only_xfer_errors(lambda: a.connect(b.endpoint(), x))
    _only_xfer_errors(lambda: a.write(x, d))
    _only_xfer_errors(lambda: a.write(peer, x))
    _only_xfer_errors(lambda: a.write(peer, d, x).wait(10))
    _only_xfer_errors(lambda: a.write(peer, d, timeout=x).wait(10))
    _only_xfer_errors(lambda: a.write(peer, xk.Descriptors(x, y, z)).wait(10))
    _only_xfer_errors(lambda: b.notifications(timeout=x if not isinstance(x, int | float) else 0))
    _only_xfer_errors(lambda: world["t"].wait(x if not isinstance(x, int | float) else 0))
    _only_xfer_errors(lambda: a.disconnect(x))
    _only_xfer_errors(lambda: b.fence(x))


@SETTINGS
@given(name=anything, key=st.text(max_size=8), value=anything)
def test_open_backend(name: Any, key: str, value: Any) -> None:
    def attempt(n: Any, /, **options: Any) -> None:
        xk.open_backend(n, **options).close()

    _only_xfer_errors(lambda: attempt(name))
    _only_xfer_errors(lambda: attempt("loopback", **{key: value}))
    _only_xfer_errors(lambda: attempt("loopback", max_batch=value))
    _only_xfer_errors(lambda: attempt("loopback", name=value))  # an option named like the argument
