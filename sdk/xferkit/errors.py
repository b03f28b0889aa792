"""The one error family users meet.

Every message names the object at fault (a region key, a pool, a peer) so that
a log line alone is enough to find it; a driver's own text is kept verbatim.
A programming mistake (an argument of the wrong type) is an ``ArgumentError``,
never a domain error, so code catching ``BoundsError`` for a descriptor out of
bounds does not also catch a ``write(peer, None)``::

    XferError
    |-- ArgumentError (also TypeError)  an argument of the wrong type
    |-- ManifestError                   a region or manifest breaking an invariant
    |-- PlanError                       manifests that cannot pair, a request a plan refuses
    |-- RegistrationError               a driver refused memory; nothing stays registered
    |-- BoundsError                     a descriptor outside registered / advertised memory
    |-- TransferError                   a posted write failed (the driver's own text)
    |-- ProtocolError                   a malformed or unexpected message from a peer
    |-- CapabilityError                 a request the backend declared it cannot serve
    `-- PluginError                     a plugin that cannot be found, loaded or trusted
        `-- OptionError                 a backend option unknown, ill-typed or out of range

``subject`` is the culprit in one form per kind: a region's key tuple, a
pool's name, a peer's name, a descriptor's index, a backend's name.
"""

from __future__ import annotations


class XferError(Exception):
    """Base of every error xferkit raises on purpose.

    ``subject`` is the object at fault (a region key, a pool name, a peer), when
    there is one, so callers can branch on it without parsing the message.
    ``followups`` holds errors that the first one caused: they are attached,
    never substituted for it.
    """

    def __init__(self, message: str, *, subject: object = None) -> None:
        super().__init__(message)
        self.subject = subject
        self.followups: list[BaseException] = []

    def attach(self, error: BaseException) -> None:
        """Record a later error caused by this one, without replacing it."""
        self.followups.append(error)

    def __str__(self) -> str:
        text = super().__str__()
        if not self.followups:
            return text
        later = "; ".join(f"{type(e).__name__}: {e}" for e in self.followups)
        return f"{text} (then {len(self.followups)} later error(s) it caused: {later})"


def keep_first(first: XferError | None, later: XferError) -> XferError:
    """The error to report: ``first`` if there is one, with ``later`` attached to it."""
    if first is None:
        return later
    first.attach(later)
    return first


class ArgumentError(XferError, TypeError):
    """An argument of the wrong type: a programming mistake, not a state of the world.

    A ``TypeError`` too (as msgspec's ``DecodeError`` is a ``ValueError``), so
    code that treats misuse the Python way catches it without knowing xferkit.
    """


class ManifestError(XferError):
    """A region or manifest that violates an invariant (duplicate key, overlap, ...)."""


class PlanError(XferError):
    """Two manifests that cannot be paired, or a request the plan cannot expand."""


class RegistrationError(XferError):
    """A driver refused to register memory; nothing stays registered."""


class BoundsError(XferError):
    """A descriptor outside the memory registered locally or advertised by the peer."""


class TransferError(XferError):
    """A posted transfer failed; carries the driver's own error text."""


class ProtocolError(XferError):
    """A malformed or unexpected message from a peer."""


class CapabilityError(XferError):
    """A request the backend declared it cannot serve, refused before anything is posted."""


class PluginError(XferError):
    """A backend plugin that cannot be found, loaded or trusted (name clash, contract version)."""


class OptionError(PluginError):
    """A backend option that is unknown, of the wrong type or out of range (every driver)."""
