"""An in-memory prefill -> decode handoff across different TP sizes, narrated.

The embedded default job: build a small hybrid model's buffers on every
prefill and decode rank, plan each decode rank's sources, execute the
descriptors with plain copies and check every byte against the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .planner import coverage
from .testing.models import gdn_hybrid
from .testing.reference import Reference, RegionSpec, WriteCounter, execute


def hybrid_specs(layers: int = 8) -> list[RegionSpec]:
    """The demo's model: a GDN hybrid with full attention on every 4th layer."""
    return gdn_hybrid(
        layers,
        attention_every=4,
        page=16,
        head_dim=32,
        conv_groups=(48, 48, 48),  # divisible by TP 1, 2, 3, 4, 6, 8, 12, 16
        state_heads=8,
        state_dim=16,
    )


def run(
    src_tp: int = 2, dst_tp: int = 4, layers: int = 8, out: Callable[[str], None] = print
) -> bool:
    specs = hybrid_specs(layers)
    ref = Reference(
        specs,
        src_tp=src_tp,
        dst_tp=dst_tp,
        src_slots={"kv": 64, "state": 8},
        dst_slots={"kv": 96, "state": 8},
    )
    rng = np.random.default_rng(1)
    pages = 12
    wanted = {
        "kv": (rng.choice(64, pages, replace=False), rng.choice(96, pages, replace=False)),
        "state": (np.array([3]), np.array([5])),
    }
    pools = {spec.pool for spec in specs}
    request = {pool: pair for pool, pair in wanted.items() if pool in pools}
    src_manifests = [r.manifest for r in ref.srcs]
    first = src_manifests[0]
    out(f"model: {layers} layers, {len(specs)} regions per rank before filtering")
    example = f" (e.g. {first.dropped[0].key}: {first.dropped[0].reason})" if first.dropped else ""
    out(
        f"prefill TP {src_tp} -> decode TP {dst_tp}; each prefill rank registers "
        f"{len(first)} regions, dropped {len(first.dropped)} empty{example}"
    )
    kv = f"{pages} KV pages (scattered)" if "kv" in request else "no KV (no attention layer)"
    out(f"request: {kv} and 1 state slot" if "state" in request else f"request: {kv}")
    ok = True
    for i, rank in enumerate(ref.dsts):
        t = time.perf_counter()
        cov = coverage(src_manifests, rank.manifest)
        plan_ms = (time.perf_counter() - t) * 1e3
        counter = WriteCounter([rank])
        parts = []
        for s in cov.sources:
            descs = cov.plans[s].expand(request)
            counter.record(descs)
            execute(descs)
            parts.append(f"from prefill rank {s}: {len(descs)} descriptors, {descs.total_bytes} B")
        try:
            ref.check(i, request)
            verdict = "byte-exact"
        except AssertionError as exc:
            ok, verdict = False, f"MISMATCH: {exc}"
        if counter.max > 1:
            ok, writes = False, f"a byte was written {counter.max} times"
        else:
            writes = "no byte written twice"
        needs = list(cov.sources)
        out(f"decode rank {i}: needs prefill ranks {needs} (planned in {plan_ms:.1f} ms)")
        for line in parts:
            out(f"    {line}")
        out(f"    result: {verdict}; {writes}")
    out("handoff " + ("verified" if ok else "FAILED"))
    return ok
