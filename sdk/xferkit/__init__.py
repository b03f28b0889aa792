"""xferkit: move a request's KV cache and recurrent state between prefill and decode ranks.

These are the names an engine uses. Driver authors find theirs in
``xferkit.driver``; tests and tools in ``xferkit.testing``.
"""

from importlib.metadata import PackageNotFoundError, version

from . import group, pools
from .backend import Backend, Peer
from .descriptors import Descriptors
from .driver import Notification, Status
from .errors import (
    ArgumentError,
    BoundsError,
    CapabilityError,
    ManifestError,
    OptionError,
    PlanError,
    PluginError,
    ProtocolError,
    RegistrationError,
    TransferError,
    XferError,
)
from .manifest import PAGE_AXIS, Dropped, Manifest, Region, RegionKey, key_label
from .planner import Coverage, Plan, coverage, plan
from .plugins import BackendInfo, backends, open_backend
from .session import (
    PairEvent,
    Receive,
    RequestError,
    Routes,
    Send,
    Session,
    SessionConfig,
    SessionKeys,
    Span,
    State,
    load_config,
)
from .transfer import Transfer

try:
    __version__ = version("xferkit")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "PAGE_AXIS",
    "ArgumentError",
    "Backend",
    "BackendInfo",
    "BoundsError",
    "CapabilityError",
    "Coverage",
    "Descriptors",
    "Dropped",
    "Manifest",
    "ManifestError",
    "Notification",
    "OptionError",
    "PairEvent",
    "Peer",
    "Plan",
    "PlanError",
    "PluginError",
    "ProtocolError",
    "Receive",
    "Region",
    "RegionKey",
    "RegistrationError",
    "RequestError",
    "Routes",
    "Send",
    "Session",
    "SessionConfig",
    "SessionKeys",
    "Span",
    "State",
    "Status",
    "Transfer",
    "TransferError",
    "XferError",
    "__version__",
    "backends",
    "coverage",
    "group",
    "key_label",
    "load_config",
    "open_backend",
    "plan",
    "pools",
]
