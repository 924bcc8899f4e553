"""The drivers' :class:`~pddnet.handoff.Link` on a decoder, one per request.

A link sends the request's handoff messages to the other decoder over the
control node, and does what the handoff machine asks around the P->MD WAN
transfer. The two sides differ only there:

* RLD (:class:`RelayLink`) has P cancel the transfer at its source
  (``CutOffWan``), unless the endpoint lets it run (``cut_off_wan=False``).
* MD (:class:`MainLink`) revokes its grant, or, with
  ``keep_strange_traffic``, lets the transfer of a request RLD finished go on
  to feed the cache and keeps the blocks it lands in.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from .._errors import PddnetError
from ..control import ControlNode
from ..handoff import AbortReason
from ..transport import Receiver
from ..wire import Message
from ._grants import BlockGrants
from ._messages import CutOffWan
from ._record import RequestRecord

__all__ = ["K_LINK_TIMEOUT_S", "DecoderLink", "MainLink", "RelayLink", "notify"]

log = logging.getLogger("pddnet.api")

K_LINK_TIMEOUT_S = 2.0  # one control send may wait this long on the peer's queue


async def notify(node: ControlNode, peer: str, msg: Message) -> None:
    """Send a one-way ``msg`` to ``peer``; an unreachable peer is logged, not raised."""
    try:
        await node.send(peer, msg, timeout=K_LINK_TIMEOUT_S)
    except PddnetError as exc:
        log.info("%s: %s unreachable: %s", node.name, peer, exc)


class DecoderLink(ABC):
    """A request's link to the other decoder (``peer``; empty on P->MD).

    Args:
        node: the decoder's control node.
        peer: the other decoder's node name.
        req: the request (a link serves this one only).
        grants: frees the request's blocks.
    """

    def __init__(
        self, node: ControlNode, peer: str, req: RequestRecord, grants: BlockGrants
    ) -> None:
        self.node = node
        self.peer = peer
        self.req = req
        self.grants = grants

    async def send(self, message: Message) -> None:
        """Send a handoff message to the other decoder.

        Raises:
            PeerUnavailable, TransferTimeout: as :meth:`ControlNode.send`.
        """
        await self.node.send(self.peer, message, timeout=K_LINK_TIMEOUT_S)

    @abstractmethod
    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        """Stop the request's P->MD WAN transfer."""

    async def free_blocks(self, request_id: int) -> None:
        """Free the request's blocks (idempotent)."""
        self.grants.free(self.req)


class RelayLink(DecoderLink):
    """RLD's link to MD: the WAN transfer runs P -> MD, so P cancels it.

    Takes the arguments of :class:`DecoderLink`, plus:

    Args:
        cut_off_wan: have P cancel the transfer when the machine asks; if
            False, it runs to its end.
    """

    def __init__(
        self,
        node: ControlNode,
        peer: str,
        req: RequestRecord,
        grants: BlockGrants,
        *,
        cut_off_wan: bool,
    ) -> None:
        super().__init__(node, peer, req, grants)
        self.cut_off_wan = cut_off_wan

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        """Ask P to cancel the transfer (``CutOffWan``), if ``cut_off_wan``."""
        if self.cut_off_wan:
            await notify(self.node, self.req.p, CutOffWan(request_id, reason.name))


class MainLink(DecoderLink):
    """MD's link to RLD: MD receives the WAN transfer, so it revokes the grant.

    Takes the arguments of :class:`DecoderLink`, plus:

    Args:
        receiver: MD's WAN receiver (holds the grant).
        keep_strange_traffic: a transfer cancelled because RLD finished the
            request (or fell back) goes on instead; its blocks are kept to
            be cached when the request closes.
    """

    def __init__(
        self,
        node: ControlNode,
        peer: str,
        req: RequestRecord,
        grants: BlockGrants,
        *,
        receiver: Receiver,
        keep_strange_traffic: bool,
    ) -> None:
        super().__init__(node, peer, req, grants)
        self.receiver = receiver
        self.keep_strange_traffic = keep_strange_traffic

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        """Revoke the grant, or keep the transfer going (``req.keep``) for the cache."""
        if self.keep_strange_traffic and reason in (AbortReason.RLD_FINISHED, AbortReason.FALLBACK):
            self.req.keep = True
            return
        self.receiver.cancel(self.req.transfer_id)

    async def free_blocks(self, request_id: int) -> None:
        """Free the request's blocks, unless a kept transfer still lands in them."""
        if not self.req.keep:
            self.grants.free(self.req)
