"""Carry handoff messages over the control plane (:class:`pddnet.control.ControlNode`).

A :class:`HandoffHub` routes the handoff messages arriving at a node (RLD's
and MD's four, and P's ``FirstToken``) to the driver of their request, and
gives each driver a :class:`ControlLink` that sends to the peer node. One hub
serves every request on the node.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from .._errors import PeerUnavailable, TransferTimeout
from ..wire import Message
from ._driver import HandoffDriver
from ._events import AbortReason
from ._messages import (
    FirstToken,
    HandoffAbort,
    HandoffAck,
    KvReady,
    TokenBatch,
    check_first_token,
    request_id_of,
)

if TYPE_CHECKING:
    from ..control import ControlNode

__all__ = ["ControlLink", "HandoffHub"]

log = logging.getLogger("pddnet.handoff")

K_MAX_EARLY = 64  # messages held per request before its driver exists


class ControlLink:
    """A driver's :class:`~pddnet.handoff.Link` over a control node.

    Args:
        node: the local control node.
        peer: the peer node's name.
        timeout: how long one send may wait on a full peer queue.
        on_cancel_transfer: called to cancel the request's WAN transfer.
        on_free_blocks: called to free the request's blocks (MD).
    """

    def __init__(
        self,
        node: ControlNode,
        peer: str,
        *,
        timeout: float = 1.0,
        on_cancel_transfer: Callable[[int, AbortReason], Awaitable[None]] | None = None,
        on_free_blocks: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.node = node
        self.peer = peer
        self.timeout = timeout
        self._on_cancel = on_cancel_transfer
        self._on_free = on_free_blocks

    async def send(self, message: Message) -> None:
        """Send one handoff message to the peer (a one-way control event).

        Raises:
            PeerUnavailable, TransferTimeout: as :meth:`ControlNode.send`.
        """
        await self.node.send(self.peer, message, timeout=self.timeout)

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        """Run the cancel-transfer hook, if any."""
        if self._on_cancel is not None:
            await self._on_cancel(request_id, reason)

    async def free_blocks(self, request_id: int) -> None:
        """Run the free-blocks hook, if any."""
        if self._on_free is not None:
            await self._on_free(request_id)


class HandoffHub:
    """Routes incoming handoff messages on ``node`` to request drivers.

    Args:
        node: a running control node; the hub registers its routes on it.
    """

    def __init__(self, node: ControlNode) -> None:
        self.node = node
        self._drivers: dict[int, HandoffDriver] = {}
        self._early: dict[int, list[Message]] = {}
        self.unrouted = 0
        for cls in (TokenBatch, HandoffAck, KvReady, HandoffAbort, FirstToken):
            node.route(cls, self._on_message)

    def expect(self, request_id: int) -> None:
        """Hold messages for ``request_id`` until its driver is attached (the
        peer may speak first: MD's ``KvReady`` can beat RLD's own KV landing)."""
        self._early.setdefault(request_id, [])

    def attach(self, driver: HandoffDriver) -> None:
        """Deliver messages for ``driver.request_id`` to ``driver``, held ones first."""
        self._drivers[driver.request_id] = driver
        for msg in self._early.pop(driver.request_id, []):
            driver.deliver(msg)

    def detach(self, request_id: int) -> None:
        """Stop delivering messages for ``request_id`` (late ones are dropped)."""
        self._drivers.pop(request_id, None)
        self._early.pop(request_id, None)

    async def watch(
        self,
        peer: str,
        *,
        interval_s: float = 0.5,
        misses: int = 3,
        user_position: Callable[[int], int | None] | None = None,
    ) -> None:
        """A failure detector: ping ``peer`` every ``interval_s``; after
        ``misses`` pings in a row go unanswered, tell every attached driver
        that the peer failed, and return.

        Args:
            peer: the peer node to watch.
            interval_s: ping period, and each ping's timeout.
            misses: consecutive failed pings that declare the peer dead.
            user_position: maps a request id to the length of its user stream,
                if the caller knows it (the stream's sink does); it lets the
                survivor continue where that is safe.

        Cancellation: stops watching; nothing is reported.
        """
        missed = 0
        while missed < misses:
            t0 = trio.current_time()
            try:
                await self.node.ping(peer, timeout=interval_s)
                missed = 0
            except (TransferTimeout, PeerUnavailable):
                missed += 1
            await trio.sleep_until(t0 + interval_s)
        log.warning("%s: peer %s missed %d pings: declared failed", self.node.name, peer, misses)
        for rid, driver in list(self._drivers.items()):
            driver.peer_failed(user_position(rid) if user_position is not None else None)

    def suspect_peer(
        self, request_id: int, user_position: int, user_tokens: tuple[int, ...] | None = None
    ) -> bool:
        """Report the peer of ``request_id`` as failed *for that request only*,
        as a suspicion: its driver gets a ``takeover_only`` :class:`PeerFailed`
        (MD takes over at ``user_position`` if that is safe, and otherwise
        ignores it). The caller must have authenticated the reporter (the
        stream's sink) and confirmed the peer is unreachable.

        Returns:
            False if no driver serves ``request_id`` here.
        """
        driver = self._drivers.get(request_id)
        if driver is None:
            return False
        driver.peer_failed(user_position, user_tokens, takeover_only=True)
        return True

    def _on_message(self, peer: str, msg: Message) -> None:
        rid = request_id_of(msg)
        driver = self._drivers.get(rid) if rid is not None else None
        if isinstance(msg, FirstToken):  # a bad one: the sender's RemoteCallError, if it asked
            check_first_token(msg, known=driver is not None or rid in self._early, peer=peer)
        if driver is None and rid in self._early and len(self._early[rid]) < K_MAX_EARLY:
            self._early[rid].append(msg)
            return
        if driver is None:
            self.unrouted += 1
            log.debug("%s: no driver for request %s (%s)", self.node.name, rid, type(msg).__name__)
            return
        driver.deliver(msg)
