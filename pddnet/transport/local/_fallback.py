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
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "ucxx is not installed: the local path falls back to TCP (pddnet.transport.wan). "
            "Install it with: pip install 'pddnet[ucx]'"
        )


def open_local_receiver(**kw: Any) -> Receiver:
    """A receiver for the local path: :class:`UcxReceiver`, or a TCP one without ucxx.

    Use it as an async context manager; ``kw`` go to the chosen class (``tls``
    and ``spin_us`` are dropped for TCP).
    """
    if local_available():
        from ._transport import UcxReceiver

        return UcxReceiver(**kw)
    _warn_once()
    from ..wan import WanReceiver

    kw.pop("tls", None)
    kw.pop("spin_us", None)
    return WanReceiver(**kw)


def open_local_sender(address: str, **kw: Any) -> Sender:
    """A sender to ``address``: UCX for a ``ucx:`` address, TCP otherwise."""
    if address.startswith("ucx:"):
        from ._transport import UcxSender

        return UcxSender(address, **kw)
    _warn_once()
    from ..wan import WanSender

    kw.pop("tls", None)
    kw.pop("spin_us", None)
    kw.pop("max_inflight", None)
    return WanSender(address, **kw)
