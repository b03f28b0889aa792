"""An engine's cache pools, as it allocates them, turned into Regions in one call per pool.

Engines hold their caches in a few recurring shapes: paged K and V per attention
layer, an MLA latent per layer, recurrent state stacked over layers
(``[layers, slots, ...]``, some fields lists of per-stream tensors), and small
per-request aux rows. Each builder here walks one such description and names
its regions ``(pool, name, layer, part)``, the key the planner pairs by, so two
engines describing the same model the same way pair region for region.

What the builders do not do, on purpose: guess sharding (the caller declares
it: a KV layout names the heads axis, a ``Shard`` names a state field's axis
and groups) and filter empty buffers. They return every region, empty ones
included; ``Manifest.build`` is the one empty filter and records what it
drops in ``Manifest.dropped``. Tensors are duck-typed (numpy arrays, torch
tensors): nothing here imports torch.
"""

from .fields import Shard, aux_rows, state_pool
from .paged import KV_LAYOUTS, Layout, kv_pages, mla_pages

__all__ = ["KV_LAYOUTS", "Layout", "Shard", "aux_rows", "kv_pages", "mla_pages", "state_pool"]
