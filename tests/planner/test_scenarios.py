"""Named scenarios from real models, byte-exact against the reference model.

(1) a short-conv hybrid whose ``temporal`` state is degenerate (shape [0, 0, 0]);
(2) a gated-delta-net (GDN) hybrid: conv state [q | k | v] in shard groups,
    temporal state sharded on heads, full-attention KV layers with fewer KV
    heads than decode ranks;
(3) GQA KV with 8 KV heads, NHD and HND pages, 4 -> 8 and 16 -> 8, with
    descriptor counts derived by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from xferkit import coverage
from xferkit.testing import Reference, RegionSpec, handoff

# -- (1) short-conv hybrid --------------------------------------------------

LAYERS = 42
CONV_STREAMS = 6
CONV_CHANNELS, CONV_WINDOW = 12, 3  # 12 channels: divisible by TP 2, 3 and 4


def short_conv_specs() -> list[RegionSpec]:
    specs = []
    for layer in range(LAYERS):
        for part in range(CONV_STREAMS):
            specs.append(
                RegionSpec(
                    pool="state",
                    name="conv",
                    layer=layer,
                    part=part,
                    shape=(CONV_CHANNELS, CONV_WINDOW),
                    itemsize=2,
                    tp_axis=0,
                )
            )
        # The degenerate temporal state an engine allocates for a conv-only layer.
        specs.append(
            RegionSpec(
                pool="state", name="temporal", layer=layer, shape=(0, 0, 0), itemsize=2, tp_axis=0
            )
        )
    return specs


def test_short_conv_hybrid_manifests_drop_exactly_the_degenerate_entries() -> None:
    specs = short_conv_specs()
    assert len(specs) == 294
    ref = Reference(specs, src_tp=2, dst_tp=2, src_slots={"state": 3}, dst_slots={"state": 3})
    temporal = {s.key for s in specs if s.name == "temporal"}
    for rank in (*ref.srcs, *ref.dsts):
        m = rank.manifest
        assert len(m.dropped) == 42
        assert m.dropped_keys == temporal
        assert all("0 bytes" in d.reason for d in m.dropped)
        # The registration views: 252 entries, aligned with the regions, no empty one.
        assert len(m) == 252
        for view in (m.addrs, m.nbytes, m.slot_nbytes, m.tp_dims, m.slots):
            assert view.shape == (252,)
        assert len(m.keys) == 252 and not temporal & set(m.keys)
        for i, key in enumerate(m.keys):
            array = rank.arrays[key]
            assert int(m.addrs[i]) == array.ctypes.data
            assert int(m.nbytes[i]) == array.nbytes > 0
            assert int(m.slot_nbytes[i]) == array[0].nbytes
            assert int(m.tp_dims[i]) == CONV_CHANNELS // 2


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "expected"),
    [
        # Equal TP: the local slots are identical, one whole-slot piece per region; the
        # request's two slot runs ([1, 2] -> [4, 5] and [0] -> [0]) give 2 descriptors
        # per region: 2 * 252.
        (2, 2, {0: {0: 504}, 1: {1: 504}}),
        # 2 -> 3: source ranks hold channels [0, 6) and [6, 12), destination ranks
        # [0, 4), [4, 8), [8, 12). Channels are the outer axis, so each (src, dst) pair
        # moves one contiguous piece per slot; it is never a whole source slot, so
        # consecutive slots do not join: 3 slots * 252 regions per pair.
        (2, 3, {0: {0: 756}, 1: {0: 756, 1: 756}, 2: {1: 756}}),
        # 4 -> 2 (gather): each destination rank takes two sources' whole slots as two
        # halves of its own; each half-slot piece stands alone: 3 * 252 per pair.
        (4, 2, {0: {0: 756, 1: 756}, 1: {2: 756, 3: 756}}),
    ],
)
def test_short_conv_hybrid_transfer(src_tp: int, dst_tp: int, expected: dict) -> None:
    ref = Reference(
        short_conv_specs(),
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_slots={"state": 4},
        dst_slots={"state": 6},
        seed=1,
    )
    request = {"state": (np.array([2, 0, 1]), np.array([5, 0, 4]))}
    assert handoff(ref, request) == expected


# -- (2) GDN hybrid ---------------------------------------------------------

GDN_LAYERS = 8
FULL_ATTENTION = (3, 7)  # one full-attention layer in four
K_HEADS, V_HEADS, HEAD_K, HEAD_V, KERNEL = 4, 8, 4, 4, 4
KEY_DIM, VALUE_DIM = K_HEADS * HEAD_K, V_HEADS * HEAD_V
KV_HEADS, HEAD_DIM, PAGE = 2, 8, 4  # 2 KV heads: at decode TP 4 each head lives on 2 ranks


def gdn_specs(conv_layout: str) -> list[RegionSpec]:
    """conv_layout "DK": conv state [conv_dim, kernel-1]; "KD": [kernel-1, conv_dim]."""
    conv_dim = 2 * KEY_DIM + VALUE_DIM
    shape, axis = (
        ((conv_dim, KERNEL - 1), 0) if conv_layout == "DK" else ((KERNEL - 1, conv_dim), 1)
    )
    specs = []
    for layer in range(GDN_LAYERS):
        if layer in FULL_ATTENTION:
            for name in ("k", "v"):
                specs.append(
                    RegionSpec(
                        pool="kv",
                        name=name,
                        layer=layer,
                        shape=(PAGE, KV_HEADS, HEAD_DIM),
                        itemsize=2,
                        tp_axis=1,
                    )
                )
        else:
            specs.append(
                RegionSpec(
                    pool="state",
                    name="conv",
                    layer=layer,
                    shape=shape,
                    itemsize=2,
                    tp_axis=axis,
                    tp_groups=(KEY_DIM, KEY_DIM, VALUE_DIM),  # [q | k | v]
                )
            )
            specs.append(
                RegionSpec(
                    pool="state",
                    name="temporal",
                    layer=layer,
                    shape=(V_HEADS, HEAD_K, HEAD_V),
                    itemsize=4,
                    tp_axis=0,
                )
            )
    return specs


@pytest.mark.parametrize("conv_layout", ["DK", "KD"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_gdn_hybrid(conv_layout: str, src_tp: int, dst_tp: int) -> None:
    ref = Reference(
        gdn_specs(conv_layout),
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_slots={"state": 3, "kv": 8},
        dst_slots={"state": 5, "kv": 10},
        seed=2,
    )
    request = {
        "state": (np.array([1]), np.array([4])),
        "kv": (np.array([5, 6, 7, 0]), np.array([2, 3, 4, 9])),
    }
    srcs = [r.manifest for r in ref.srcs]
    for d, rank in enumerate(ref.dsts):
        cov = coverage(srcs, rank.manifest)
        if src_tp < dst_tp:
            # Scatter: every group of source rank d // 2 contains destination rank d's
            # share of it, and KV head d // 2 lives on source rank d // 2 only.
            assert cov.sources == (d // 2,)
        else:
            # Gather: each group's share is split over source ranks 2d and 2d + 1; the
            # KV head d is held by both, and exactly one of them writes it.
            assert cov.sources == (2 * d, 2 * d + 1)
            for layer in FULL_ATTENTION:
                writers = [
                    i for i, p in cov.plans.items() if p.pieces(("kv", "k", layer, 0)).src.size
                ]
                assert len(writers) == 1
    handoff(ref, request)


# -- (3) GQA KV -------------------------------------------------------------

GQA_HEADS, GQA_DIM, GQA_PAGE, GQA_LAYERS = 8, 8, 4, 4
GQA_REGIONS = 2 * GQA_LAYERS  # K and V per layer


def gqa_specs(layout: str) -> list[RegionSpec]:
    shape, axis = (
        ((GQA_PAGE, GQA_HEADS, GQA_DIM), 1)
        if layout == "NHD"
        else ((GQA_HEADS, GQA_PAGE, GQA_DIM), 0)
    )
    return [
        RegionSpec(pool="kv", name=name, layer=layer, shape=shape, itemsize=2, tp_axis=axis)
        for layer in range(GQA_LAYERS)
        for name in ("k", "v")
    ]


CONTIGUOUS = (np.arange(2, 8), np.arange(8, 14))  # 6 pages, consecutive on both sides
TWO_RUNS = (np.array([2, 3, 4, 5, 6]), np.array([8, 9, 10, 12, 13]))  # dst breaks after 10


@pytest.mark.parametrize(
    ("layout", "src_tp", "request_", "per_source"),
    [
        # 4 -> 8, HND: a source slot is [2 heads, page, D], a destination slot [1, page, D].
        # Destination rank d takes head d % 2 of source rank d // 2: one contiguous block
        # of page * D elements, the whole destination slot but half the source slot, so
        # consecutive pages never join: 1 descriptor per (region, page) = 8 * 6 = 48.
        ("HND", 4, CONTIGUOUS, GQA_REGIONS * 6),
        # 4 -> 8, NHD: a source slot is [page, 2 heads, D]; each token row gives one piece
        # of D elements, strided by 2 * D in the source: 8 regions * 6 pages * 4 tokens.
        ("NHD", 4, CONTIGUOUS, GQA_REGIONS * 6 * GQA_PAGE),
        # 16 -> 8: source rank r holds head r // 2 (each head twice); destination rank d
        # holds head d. Both local slots are [.., 1 head, ..]: a whole-slot copy, so 6
        # consecutive pages are one descriptor per region, from exactly one source.
        ("HND", 16, CONTIGUOUS, GQA_REGIONS),
        ("NHD", 16, CONTIGUOUS, GQA_REGIONS),
        # Same with the destination pages in two runs: 2 descriptors per region.
        ("HND", 16, TWO_RUNS, GQA_REGIONS * 2),
        ("NHD", 16, TWO_RUNS, GQA_REGIONS * 2),
        # 8 -> 8 (equal TP): whole slots, one run: 1 descriptor per region.
        ("NHD", 8, CONTIGUOUS, GQA_REGIONS),
        # 4 -> 8 with two runs: pieces never join anyway, so still one per (region, page)
        # for HND (8 * 5) and one per token row for NHD (8 * 5 * 4).
        ("HND", 4, TWO_RUNS, GQA_REGIONS * 5),
        ("NHD", 4, TWO_RUNS, GQA_REGIONS * 5 * GQA_PAGE),
    ],
)
def test_gqa_kv_to_decode_tp_8(layout: str, src_tp: int, request_: tuple, per_source: int) -> None:
    ref = Reference(
        gqa_specs(layout),
        src_tp=src_tp,
        dst_tp=8,
        src_slots={"kv": 16},
        dst_slots={"kv": 16},
        seed=3,
    )
    counts = handoff(ref, {"kv": request_})
    for d in range(8):
        (source,) = counts[d]  # exactly one source rank feeds each destination rank
        if src_tp == 4:
            assert source == d // 2
        elif src_tp == 16:
            assert source in (2 * d, 2 * d + 1)  # either replica of head d
        else:
            assert source == d
        assert counts[d][source] == per_source


@pytest.mark.parametrize(
    ("layout", "per_source"),
    [
        # 8 -> 4 (gather): destination rank d holds heads 2d, 2d + 1, one from each of
        # source ranks 2d and 2d + 1. HND: each source's whole slot is half a destination
        # slot, one descriptor per (region, page): 8 * 6. NHD: one per token row: 8 * 6 * 4.
        ("HND", GQA_REGIONS * 6),
        ("NHD", GQA_REGIONS * 6 * GQA_PAGE),
    ],
)
def test_gqa_kv_gather_8_to_4(layout: str, per_source: int) -> None:
    ref = Reference(
        gqa_specs(layout), src_tp=8, dst_tp=4, src_slots={"kv": 16}, dst_slots={"kv": 16}, seed=4
    )
    counts = handoff(ref, {"kv": CONTIGUOUS})
    assert counts == {d: {2 * d: per_source, 2 * d + 1: per_source} for d in range(4)}


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(4, 8), (8, 8), (8, 4), (3, 2)])
def test_replicated_region_source_is_pinned(src_tp: int, dst_tp: int) -> None:
    """The documented rule: destination rank d reads a replicated region from source d % T_src."""
    spec = RegionSpec(pool="kv", name="mla", layer=0, shape=(4, 8))
    ref = Reference([spec], src_tp=src_tp, dst_tp=dst_tp, src_slots={"kv": 2}, dst_slots={"kv": 2})
    for d, rank in enumerate(ref.dsts):
        cov = coverage([r.manifest for r in ref.srcs], rank.manifest)
        assert cov.sources == (d % src_tp,)


def test_gqa_replica_source_is_pinned() -> None:
    """8 KV heads on TP 16: head h lives on ranks 2h and 2h+1; decode rank d (TP 8, head d)
    reads from holder d % 2 of those, i.e. rank 2d + d % 2."""
    spec = RegionSpec(pool="kv", name="k", layer=0, shape=(4, 8, 2), tp_axis=1)
    ref = Reference([spec], src_tp=16, dst_tp=8, src_slots={"kv": 2}, dst_slots={"kv": 2})
    for d, rank in enumerate(ref.dsts):
        cov = coverage([r.manifest for r in ref.srcs], rank.manifest)
        assert cov.sources == (2 * d + d % 2,)
