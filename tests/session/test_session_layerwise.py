"""Layer-wise writes: a prefill rank writes each chunk's pages layer by layer, as its forward
pass finishes them (``Send.write(..., layers=...)``), and the decode rank receives exactly
what the whole chunk would have given it.

A GDN hybrid of four layers (recurrent state on 0 and 2, KV pages on 1 and 3), TP 2 -> 4,
through Sessions on the loopback, direct and staged, with pages alike and with two prefill
pages per decode page (NHD -> HND): every byte of every decode slot is checked against the
reference model.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

import xferkit as xk
from xferkit.session import RequestError, Session, State
from xferkit.testing import Reference, RegionSpec, gdn_hybrid

SLOTS = {"kv": 16, "state": 4}
CHUNKS = [[0, 1], [2, 3], [4, 5]]  # prefill KV slots per chunk; the state goes with the last
DST = {"kv": [9, 2, 7, 12, 5, 0], "state": [3]}


def _views(spec: RegionSpec) -> RegionSpec:
    if spec.pool != "kv":
        return spec
    return msgspec.structs.replace(
        spec, axes=(xk.PAGE_AXIS, "head", "dim"), dst_order=(1, 0, 2), dst_pages=2
    )


def _cluster(views: bool, staging: str) -> tuple[Reference, list[Session], list[Session]]:
    specs = [_views(s) if views else s for s in gdn_hybrid(4)]
    ref = Reference(specs, src_tp=2, dst_tp=4, src_slots=SLOTS, dst_slots=SLOTS, seed=5)
    pres = [Session(xk.open_backend("loopback"), r.manifest, staging=staging) for r in ref.srcs]
    decs = [Session(xk.open_backend("loopback"), d.manifest, staging=staging) for d in ref.dsts]
    return ref, pres, decs


def _dst(views: bool) -> dict[str, list[int]]:
    return {"kv": DST["kv"][:3], "state": DST["state"]} if views else DST


@pytest.mark.parametrize(
    "groups",
    [[[0], [1], [2], [3]], [[3, 1], [0, 2]], [[0, 1, 2, 3]]],
    ids=["each-layer", "kv-then-state", "all-at-once"],
)
@pytest.mark.parametrize("views", [False, True], ids=["alike", "views"])
@pytest.mark.parametrize("staging", ["never", "always"])
def test_chunks_written_layer_by_layer_land_as_whole_chunks(
    groups: list[list[int]], views: bool, staging: str
) -> None:
    """Every decode byte as the reference model says, and each prefill rank moved exactly the
    bytes a request of whole chunks moves (a layer-wise write that sent every layer each
    time would land the same bytes, several times over)."""
    ref, pres, decs = _cluster(views, staging)
    try:
        dst = _dst(views)
        moved = {}
        for rid, by in (("lw", groups), ("whole", None)):  # the same slots, one after the other
            recvs = [d.expect(rid, [p.address for p in pres], dst) for d in decs]
            for p in pres:
                send = p.offer(rid)
                for i, kv in enumerate(CHUNKS):
                    slots = {"kv": kv, **({"state": [1]} if i == len(CHUNKS) - 1 else {})}
                    for j, layers in enumerate(by or [None]):
                        last = i == len(CHUNKS) - 1 and j == len(by or [None]) - 1
                        send.write(slots, last=last, layers=layers)
                assert send.wait(20) is State.DONE
                moved[rid, p.address] = send.routes.direct_bytes + send.routes.staged_bytes
            for h in recvs:
                assert h.wait(20) is State.DONE, h.error
            every = [s for c in CHUNKS for s in c]
            for i in range(len(decs)):
                ref.check(i, {"kv": (every, dst["kv"]), "state": ([1], dst["state"])})
        for p in pres:
            assert moved["lw", p.address] == moved["whole", p.address] > 0
    finally:
        for s in (*pres, *decs):
            s.close()


def _fails(writes: Sequence[tuple[dict[str, list[int]], bool, Sequence[int]]], text: str) -> None:
    """One prefill rank, one decode rank; the writes end the request at plan, naming why."""
    ref = Reference(gdn_hybrid(4), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest)
    dec = Session(xk.open_backend("loopback"), ref.dsts[0].manifest)
    try:
        recv = dec.expect("bad", [pre.address], {"kv": [4, 5], "state": [2]})
        send = pre.offer("bad")
        for slots, last, layers in writes:
            send.write(slots, last=last, layers=layers)
        for h in (recv, send):
            with pytest.raises(RequestError, match=text) as info:
                h.wait(10)
            assert info.value.stage == "plan"
    finally:
        pre.close()
        dec.close()


def test_the_last_write_with_layers_missing_fails_naming_them() -> None:
    _fails([({"kv": [0, 1], "state": [0]}, True, [0, 1])], r"leaves layers \[3\] of pool 'kv'")


def test_a_chunk_before_the_previous_chunk_has_every_layer_fails() -> None:
    writes = [({"kv": [0]}, False, [1]), ({"kv": [1]}, False, [1])]
    _fails(writes, r"layers \[3\] of the layer-wise chunk before it are unwritten")


def test_a_layer_written_twice_for_the_same_slots_fails() -> None:
    writes = [({"kv": [0]}, False, [1]), ({"kv": [0]}, False, [1, 3])]
    _fails(writes, r"layers \[1\] of pool 'kv' written twice")


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([], "names no layer"),
        ([7], r"layers \[7\] are not in this rank's manifest"),
        ("13", "iterable of layer ids"),
        ([1.0], "layer ids are ints"),
        (5, "iterable of layer ids"),
    ],
)
def test_wrong_layers_are_refused_naming_them(layers: object, message: str) -> None:
    ref = Reference(gdn_hybrid(4), src_tp=1, dst_tp=1, src_slots=SLOTS, dst_slots=SLOTS)
    pre = Session(xk.open_backend("loopback"), ref.srcs[0].manifest)
    try:
        send = pre.offer("w")
        with pytest.raises(xk.ArgumentError, match=message):
            send.write({"kv": [0]}, layers=layers)  # type: ignore[arg-type]
        send.write({"kv": [0]}, layers=range(4))  # refused calls changed nothing
    finally:
        pre.close()


@pytest.mark.parametrize("staging", ["never", "always"])
def test_layer_by_layer_with_a_prefix_held_drops_the_same_slots_for_every_layer(
    staging: str,
) -> None:
    """The decode holds the first three KV pages (``expect(skip=)``): the first chunk is all
    prefix and the second half, and each of their layers must drop the same source slots
    (before, only the first layer's write would have)."""
    ref, pres, decs = _cluster(False, staging)
    try:
        dst = {"kv": [9, 2, 7], "state": [3]}
        recvs = [d.expect("pre", [p.address for p in pres], dst, skip={"kv": 3}) for d in decs]
        for p in pres:
            send = p.offer("pre")
            for i, kv in enumerate(CHUNKS):
                slots = {"kv": kv, **({"state": [1]} if i == len(CHUNKS) - 1 else {})}
                for layer in range(4):
                    send.write(slots, last=i == len(CHUNKS) - 1 and layer == 3, layers=[layer])
        for h in recvs:
            assert h.wait(20) is State.DONE, h.error
        for i in range(len(decs)):
            ref.check(i, {"kv": ([3, 4, 5], dst["kv"]), "state": ([1], dst["state"])})
    finally:
        for s in (*pres, *decs):
            s.close()
