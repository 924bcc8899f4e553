"""The typed error hierarchy.

Every error pddnet raises derives from :class:`PddnetError` and carries the
context needed to act on it: the peer, the request or transfer id, and the
state the failing object was in. OS and library errors are translated once, at
the boundary, with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PddnetError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TransportError",
    "TransferTimeout",
    "TransferCancelled",
    "PeerUnavailable",
    "RemoteCallError",
    "RequestAborted",
    "LayoutMismatch",
    "AuthError",
    "ResourceLimitError",
    "MissingExtraError",
]


class PddnetError(Exception):
    """Root of every error pddnet raises.

    Args:
        message: what went wrong, for a human.
        peer: the remote peer involved, if any.
        request_id: the request involved, if any.
        transfer_id: the transfer involved, if any.
        state: the state of the object that raised, if it has one.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        request_id: str | int | None = None,
        transfer_id: int | None = None,
        state: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.peer = peer
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.state = state

    def context(self) -> dict[str, Any]:
        """The non-empty context fields, for logs and metrics."""
        ctx = {
            "peer": self.peer,
            "request_id": self.request_id,
            "transfer_id": self.transfer_id,
            "state": getattr(self.state, "name", self.state),
        }
        return {k: v for k, v in ctx.items() if v is not None}

    def __str__(self) -> str:
        ctx = self.context()
        if not ctx:
            return self.message
        extra = ", ".join(f"{k}={v}" for k, v in ctx.items())
        return f"{self.message} ({extra})"


class ProtocolError(PddnetError):
    """A protocol rule was broken, by us or by the peer."""


class LocalProtocolError(ProtocolError):
    """The local caller misused the API (an event the state does not allow, say)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed, unauthorised or out of bounds."""


class TransportError(PddnetError):
    """A connection or transfer failed below the protocol level."""


class TransferTimeout(TransportError):
    """A transfer or a call did not finish before its deadline."""


class TransferCancelled(TransportError):
    """A transfer was cancelled, locally or by the peer."""


class PeerUnavailable(TransportError):
    """The peer cannot be reached, or died."""


class RemoteCallError(PddnetError):
    """The peer handled a request and answered with an error.

    ``code`` is the name of the error class the peer raised.
    """

    def __init__(self, message: str, *, code: str, peer: str | None = None) -> None:
        super().__init__(message, peer=peer)
        self.code = code


class RequestAborted(PddnetError):
    """A node serving the request gave up on it; the message carries its reason."""


class LayoutMismatch(PddnetError):
    """Two KV layouts, or a layout and an array, do not agree."""


class AuthError(PddnetError):
    """Authentication failed: a bad MAC, a replay, a missing secret."""


class ResourceLimitError(PddnetError):
    """A configured bound (size, count, memory) would be exceeded."""


class MissingExtraError(PddnetError, ImportError):
    """An optional dependency is not installed; the message names the extra."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module} is not installed; install it with: pip install 'pddnet[{extra}]'"
        )
        self.module = module
        self.extra = extra
