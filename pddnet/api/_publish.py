"""(MD) The decode-side radix cache's changes, published to the prefill nodes.

P subscribes with a ``DrcSnapshotRequest``: it gets the cache's contents as
events, in order, then every change as MD makes it (a request closing caches
its prompt; an eviction drops blocks). A subscriber that cannot be reached is
dropped (P asks for a new snapshot when its mirror needs one).
"""

from __future__ import annotations

from .._errors import PddnetError
from ..cache import CacheServer, DrcSnapshotRequest
from ..control import ControlNode
from ..wire import Message, Pong

__all__ = ["DrcPublisher"]


class DrcPublisher:
    """Sends MD's cache events to the nodes that subscribed.

    Args:
        node: MD's control node.
        drc: the cache server whose events go out.
    """

    def __init__(self, node: ControlNode, drc: CacheServer) -> None:
        self.node = node
        self.drc = drc
        self.subscribers: set[str] = set()

    async def on_snapshot_request(self, peer: str, msg: DrcSnapshotRequest) -> Message:
        """``peer`` subscribes: the snapshot goes as events, in order, then what is pending."""
        self.subscribers.add(peer)
        for part in self.drc.snapshot():
            await self.node.send(peer, part)
        await self.publish()
        return Pong()

    async def publish(self) -> None:
        """Send the cache's pending events to every subscriber."""
        for ev in self.drc.events():
            for peer in list(self.subscribers):
                try:
                    await self.node.send(peer, ev, timeout=2.0)
                except PddnetError:
                    self.subscribers.discard(peer)
