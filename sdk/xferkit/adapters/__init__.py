"""Engine-shaped adapters over ``xferkit.Session``: each maps one engine's transfer-layer
interface onto Session calls, imports nothing of that engine, and is tested by driving it
the way that engine's schedulers do (docs/engine.md)."""
