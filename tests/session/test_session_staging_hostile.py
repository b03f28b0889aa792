"""Staging sized past what the machine holds: the Session is refused with an XferError naming
``staging_bytes``, and the backend it was handed is left as it was (nothing registered).
Before, numpy's ValueError or MemoryError came out of ``Session()``."""

from __future__ import annotations

import numpy as np
import pytest

import xferkit as xk
from xferkit.session import Session


@pytest.mark.parametrize("nbytes", [2**45, 2**70], ids=["32-TiB", "2**70"])
def test_staging_larger_than_memory_is_an_xfer_error_naming_it(nbytes: int) -> None:
    buf = np.zeros((8, 16), np.uint8)
    manifest = xk.Manifest.build([xk.Region.from_array(buf, pool="p", name="a", layer=0)])
    with xk.open_backend("loopback") as backend:
        try:
            with pytest.raises(xk.XferError, match="staging_bytes"):
                Session(backend, manifest, staging_bytes=nbytes, staging_slice_bytes=1 << 20)
        finally:
            assert backend.manifest is None  # refused before anything was registered
