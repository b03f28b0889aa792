"""Engine-shaped adapters over ``Session``: each maps one engine's transfer interface onto
``offer`` / ``expect`` / ``write`` and the handles' states, imports nothing of the engine, and
is tested by driving it the way that engine's schedulers do (docs/engine.md): proof that the
Session's API fits the calls engines really make."""
