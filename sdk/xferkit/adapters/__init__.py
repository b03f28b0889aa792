"""Engine-shaped adapters over ``Session``: each maps one engine's transfer interface onto
``offer`` / ``expect`` / ``write`` and the handles' states, importing nothing of the engine,
so that the Session's API is proven against the calls engines really make (issue 19)."""
