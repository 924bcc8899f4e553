"""The transport interface every pddnet data path implements.

A transfer moves the bytes of one source :class:`~pddnet.kv.ByteRanges` into
one destination :class:`~pddnet.kv.ByteRanges` that share a *logical* byte
space (see :class:`~pddnet.kv.TransferPlan`). The receiver owns the
destination memory, so it starts things:

1. the receiver registers the destination with :meth:`Receiver.grant` and gets
   a small serialisable :class:`Grant` (transfer id, total length, layer
   bounds, where to send);
2. the grant reaches the sender (over the control plane, or as a Python object
   in tests), which calls :meth:`Sender.start` with its source ranges;
3. both sides wait: :meth:`Transfer.wait` on the sender (every byte verified
   by the receiver) and :meth:`Receiver.wait_transfer` / ``wait_layer`` on the
   receiver.

The sender may write only inside its grant; a transport rejects anything else
with :class:`~pddnet.RemoteProtocolError` and never touches bytes outside it.
:func:`pddnet.transport.testing.check_transport` checks these rules for any
implementation, given a factory for a connected sender/receiver pair.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..kv import ByteRanges

__all__ = ["Grant", "Receiver", "Sender", "Transfer", "TransferState", "ProgressCallback"]

#: ``progress(transfer_id, verified_bytes, total_bytes)``; called from the event loop.
ProgressCallback = Callable[[int, int, int], None]


@dataclass(frozen=True, slots=True)
class Grant:
    """Permission to write logical ``[0, total)`` of one transfer at the receiver.

    Args:
        transfer_id: the receiver-chosen id, unique among its live grants.
        total: bytes granted.
        layer_ends: cumulative logical end offset of each layer (layer ``i`` is
            ``[layer_ends[i-1], layer_ends[i])``); empty if the transfer has no layers.
        address: the receiver's data-plane address (transport specific).
    """

    transfer_id: int
    total: int
    layer_ends: tuple[int, ...] = ()
    address: str = ""

    def layer_span(self, layer: int) -> tuple[int, int]:
        """Logical ``[start, end)`` of ``layer``."""
        start = self.layer_ends[layer - 1] if layer else 0
        return start, self.layer_ends[layer]


class TransferState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


def views_of(buffers: Sequence[Any]) -> list[memoryview]:
    """Flat writable-or-readonly byte views of buffer-protocol objects."""
    out = []
    for b in buffers:
        mv = b if isinstance(b, memoryview) else memoryview(b)
        out.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    return out


class Transfer(ABC):
    """The sender's handle on one running transfer."""

    transfer_id: int

    @property
    @abstractmethod
    def state(self) -> TransferState:
        """Where the transfer is."""

    @abstractmethod
    def mark_ready(self, lo: int, hi: int) -> None:
        """Declare logical ``[lo, hi)`` of the source ready to send (layer-wise streaming).

        Raises:
            LocalProtocolError: if the range is outside the grant.
        """

    @abstractmethod
    def mark_layer_ready(self, layer: int) -> None:
        """Declare one layer of the grant ready (see :meth:`mark_ready`)."""

    @abstractmethod
    async def wait(self) -> None:
        """Wait until the receiver verified every granted byte.

        Raises:
            TransferTimeout: past the deadline.
            TransferCancelled: if either side cancelled it.
            RemoteProtocolError: if the receiver rejected it.
            PeerUnavailable: if the peer went away.

        Cancelling the wait leaves the transfer running.
        """

    @abstractmethod
    def cancel(self) -> None:
        """Stop sending (within about one chunk time) and tell the receiver. Idempotent."""


class Sender(ABC):
    """The sending end of a transport, bound to one peer."""

    @abstractmethod
    def start(
        self,
        grant: Grant,
        views: Sequence[Any],
        ranges: ByteRanges,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ready: bool = True,
        progress: ProgressCallback | None = None,
    ) -> Transfer:
        """Start sending ``ranges`` of ``views`` into ``grant``.

        Args:
            grant: the receiver's grant; ``ranges.total`` must equal ``grant.total``.
            views: the source buffers, indexed by ``ranges.buffer``.
            ranges: source byte ranges in the grant's logical space.
            priority: higher runs first; ties go to the fewest remaining bytes.
            timeout: seconds until the transfer fails with TransferTimeout.
            ready: if False, nothing is sent until :meth:`Transfer.mark_ready`.
            progress: optional callback on every verified chunk.

        Raises:
            LocalProtocolError: if the ranges do not match the grant.
        """

    async def send(self, grant: Grant, views: Sequence[Any], ranges: ByteRanges, **kw: Any) -> None:
        """:meth:`start` then :meth:`Transfer.wait`; cancelling it cancels the transfer."""
        transfer = self.start(grant, views, ranges, **kw)
        try:
            await transfer.wait()
        except BaseException:
            transfer.cancel()
            raise

    @abstractmethod
    def statistics(self) -> Any:
        """A frozen snapshot of counters."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every connection; running transfers fail with TransferCancelled."""


class Receiver(ABC):
    """The receiving end of a transport."""

    address: str = ""  # where senders reach it (published in the handshake; set when it listens)

    @abstractmethod
    def grant(
        self,
        views: Sequence[Any],
        ranges: ByteRanges,
        *,
        num_layers: int | None = None,
        timeout: float | None = None,
    ) -> Grant:
        """Register destination ``ranges`` of ``views`` and return the grant to pass on.

        Args:
            views: writable destination buffers, indexed by ``ranges.buffer``.
            ranges: destination byte ranges (their logical space is the grant's).
            num_layers: report per-layer readiness for this many layers.
            timeout: seconds until the grant expires with TransferTimeout.
        """

    @abstractmethod
    async def wait_transfer(self, transfer_id: int) -> None:
        """Wait until every granted byte is verified.

        Raises:
            TransferTimeout, TransferCancelled, RemoteProtocolError: as the transfer ended.
            LocalProtocolError: for an id this receiver never granted.
        """

    @abstractmethod
    async def wait_layer(self, transfer_id: int, layer: int) -> None:
        """Wait until every byte of ``layer`` is verified (raises like :meth:`wait_transfer`)."""

    @abstractmethod
    def cancel(self, transfer_id: int) -> None:
        """Revoke the grant; the sender sees TransferCancelled. Idempotent."""

    @abstractmethod
    def statistics(self) -> Any:
        """A frozen snapshot of counters."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every connection; pending grants fail with TransferCancelled."""
