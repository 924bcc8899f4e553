"""Pick UCX when ucxx imports, else the TCP transport, warning once."""

from __future__ import annotations

import logging
from typing import Any

from ..._optional import available
from .._base import Receiver, Sender

__all__ = ["local_available", "open_local_receiver", "open_local_sender"]

log = logging.getLogger("pddnet.transport.local")
_warned = False


def local_available() -> bool:
    """Whether the UCX path can be used (ucxx imports)."""
    return available("ucxx._lib.libucxx")


def _warn_once() -> None:
    # only open_local_receiver calls it, when ucxx does not import
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "ucxx is not installed (ucxx._lib.libucxx does not import): the local path "
            "falls back to TCP (pddnet.transport.wan). "
            "Install it with: pip install 'pddnet[ucx]'"
        )


# UCX-only options, dropped for the TCP fallback
_UCX_ONLY = (
    "tls",
    "spin_us",
    "max_inflight",
    "busy_poll_us",
    "busy_poll_max_bytes",
    "drain_timeout",
    "session_workers",
    "cma",
    "error_handling",
)


def _tcp_options(kw: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in kw.items() if k not in _UCX_ONLY}
    out.pop("auth_timeout", None)  # the TCP handshake has its own (pddnet.transport._auth)
    return out


def open_local_receiver(**kw: Any) -> Receiver:
    """A receiver for the local path: :class:`UcxReceiver`, or a TCP one without ucxx.

    Use it as an async context manager; ``kw`` go to the chosen class (the
    UCX-only ``tls``, ``spin_us``, ``busy_poll_*``, ``drain_timeout``, ``session_workers``
    and ``cma`` are dropped for TCP).
    Pass ``secret=`` to authenticate senders: both transports run the same
    challenge-response (:class:`pddnet.wire.AuthHandshake`) before any data.
    """
    if local_available():
        from ._receiver import UcxReceiver

        return UcxReceiver(**kw)
    _warn_once()
    from ..wan import WanReceiver

    return WanReceiver(**_tcp_options(kw))


def open_local_sender(address: str, **kw: Any) -> Sender:
    """A sender to ``address``: UCX for a ``ucx:`` address, TCP otherwise.

    The receiver chose the transport when it published its address, and said
    why if it fell back; a TCP address is not a sign that ucxx is missing here,
    so the sender logs nothing. ``secret=`` must match the receiver's (see
    :func:`open_local_receiver`).
    """
    if address.startswith("ucx:"):
        from ._sender import UcxSender

        return UcxSender(address, **kw)
    from ..wan import WanSender

    return WanSender(address, **_tcp_options(kw))
