"""xferkit: move a request's KV cache and recurrent state between prefill and decode ranks."""

from .backend import (
    CONTRACT_VERSION,
    Backend,
    Capabilities,
    Endpoint,
    Notification,
    Peer,
    Posted,
    Status,
    Transfer,
)
from .errors import (
    BoundsError,
    CapabilityError,
    ManifestError,
    PlanError,
    PluginError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)
from .manifest import Dropped, Manifest, Region, RegionKey, key_label
from .planner import Coverage, Descriptors, Pieces, Plan, coverage, plan
from .plugins import BackendInfo, BackendSpec, backends, hookimpl, hookspec, open_backend
from .worker import BatchWorker, QueuedBatch

__version__ = "0.1.0"

__all__ = [
    "CONTRACT_VERSION",
    "Backend",
    "BackendInfo",
    "BackendSpec",
    "BatchWorker",
    "BoundsError",
    "Capabilities",
    "CapabilityError",
    "Coverage",
    "Descriptors",
    "Dropped",
    "Endpoint",
    "Manifest",
    "ManifestError",
    "Notification",
    "Peer",
    "Pieces",
    "Plan",
    "PlanError",
    "PluginError",
    "Posted",
    "ProtocolError",
    "QueuedBatch",
    "Region",
    "RegionKey",
    "RegistrationError",
    "Status",
    "Transfer",
    "TransferError",
    "XferError",
    "__version__",
    "backends",
    "coverage",
    "hookimpl",
    "hookspec",
    "key_label",
    "open_backend",
    "plan",
]
