"""xferkit: move a request's KV cache and recurrent state between prefill and decode ranks."""

from .errors import (
    BoundsError,
    ManifestError,
    PlanError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)
from .manifest import Dropped, Manifest, Region, RegionKey, key_label
from .planner import Coverage, Descriptors, Pieces, Plan, coverage, plan

__version__ = "0.1.0"

__all__ = [
    "BoundsError",
    "Coverage",
    "Descriptors",
    "Dropped",
    "Manifest",
    "ManifestError",
    "Pieces",
    "Plan",
    "PlanError",
    "ProtocolError",
    "Region",
    "RegionKey",
    "RegistrationError",
    "TransferError",
    "XferError",
    "__version__",
    "coverage",
    "key_label",
    "plan",
]
