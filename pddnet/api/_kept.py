"""What a decoder keeps of each stream it emitted, for the sink's re-sends.

A decoder (RLD or MD) records every token it sends to a request's sink. The
sink asks for the tokens it lacks (``StreamResend``) and learns which
positions this decoder holds from the answer (``StreamStatus``); the tokens
themselves follow from a task of their own. A stream is kept until the sink
acknowledges it (``StreamAck``), or at most :data:`K_RETAIN_S` seconds and
:data:`K_MAX_RETAINED` streams after it ended.
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass, field

import trio

from .._errors import PddnetError, RemoteProtocolError
from ..control import ControlNode
from ._messages import Emitted, StreamAck, StreamResend, StreamStatus
from ._stream import SourceState

__all__ = ["K_MAX_RETAINED", "K_RETAIN_S", "KeptStream", "KeptTokens"]

log = logging.getLogger("pddnet.api")

K_RETAIN_S = 30.0
K_MAX_RETAINED = 16384


@dataclass
class KeptStream:
    """The tokens this decoder emitted for one request."""

    sink: str
    first: int = -1
    final: int = -1  # the stream's last position, if we emitted it
    tokens: array.array[int] = field(default_factory=lambda: array.array("q"))
    state: SourceState = SourceState.ACTIVE
    detail: str = ""
    ended_at: float = 0.0

    @property
    def last(self) -> int:
        return self.first + len(self.tokens) - 1 if self.tokens else -1

    def status(self, request_id: int) -> StreamStatus:
        return StreamStatus(request_id, int(self.state), self.first, self.last, self.detail)


class KeptTokens:
    """Every stream one decoder keeps, and its answers to the sinks.

    Args:
        node: the decoder's control node (re-sends go through it).
        timeout_s: how long one re-send may wait on a sink.
    """

    def __init__(self, node: ControlNode, timeout_s: float = 2.0) -> None:
        self.node = node
        self.timeout_s = timeout_s
        self.resent = 0  # tokens sent again
        self.resending: set[int] = set()  # requests whose tokens a task is re-sending
        self._streams: dict[int, KeptStream] = {}
        self._ended: dict[int, None] = {}  # ended streams' ids, oldest first
        self._nursery: trio.Nursery | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def attach(self, nursery: trio.Nursery) -> None:
        """Run re-sends in ``nursery`` (the endpoint's)."""
        self._nursery = nursery

    def get(self, request_id: int) -> KeptStream | None:
        return self._streams.get(request_id)

    def open(self, request_id: int, sink: str) -> None:
        """A new stream to ``sink`` starts here."""
        self._streams[request_id] = KeptStream(sink)
        self._ended.pop(request_id, None)

    def record(self, request_id: int, position: int, token: int, final: bool) -> None:
        """Keep a token before it is sent (a re-send can deliver one whose send failed)."""
        kept = self._streams.get(request_id)
        if kept is None:
            return
        if kept.first < 0:
            kept.first = position
        if position == kept.first + len(kept.tokens):
            kept.tokens.append(token)
            kept.final = position if final else kept.final
        else:
            log.warning("request %s emitted out of order at %s", request_id, position)

    def end(self, request_id: int, state: SourceState, detail: str = "") -> None:
        """The request ended here: keep its tokens a while for the sink's re-sends
        (at most :data:`K_RETAIN_S` seconds, and the :data:`K_MAX_RETAINED` latest)."""
        kept = self._streams.get(request_id)
        if kept is None or kept.state is not SourceState.ACTIVE:
            return
        kept.state, kept.detail = state, detail
        kept.ended_at = now = trio.current_time()
        self._ended[request_id] = None
        while self._ended:
            oldest = next(iter(self._ended))
            if (
                len(self._ended) <= K_MAX_RETAINED
                and self._streams[oldest].ended_at > now - K_RETAIN_S
            ):
                break
            del self._ended[oldest], self._streams[oldest]

    def on_resend(self, peer: str, msg: StreamResend) -> StreamStatus:
        """The sink asks for the tokens it lacks from ``msg.start`` on.

        The answer leaves at once; the tokens follow from a task of their own
        (at most one per request), so a sink that reads slowly delays only
        itself, never the node's other control traffic (handlers run one at a
        time). The assembler needs no order between the two: the status says
        which positions this decoder holds, and the tokens are checked by
        position when they land.

        Raises:
            RemoteProtocolError: the request is kept for another sink.
        """
        rid = msg.request_id
        kept = self._streams.get(rid)
        if kept is None:
            return StreamStatus(rid, int(SourceState.UNKNOWN), -1, -1)
        if peer != kept.sink:
            raise RemoteProtocolError(
                f"re-send asked by {peer}, not the sink", peer=peer, request_id=rid
            )
        start = max(msg.start, kept.first)
        if start <= kept.last and rid not in self.resending:
            assert self._nursery is not None
            self.resending.add(rid)
            self._nursery.start_soon(self._resend, peer, rid, kept, start)
        return kept.status(rid)

    async def _resend(self, peer: str, rid: int, kept: KeptStream, start: int) -> None:
        """Send ``kept``'s tokens from ``start`` on again; the whole re-send gets
        one bounded wait (a sink that stops reading is dropped, not waited on)."""
        try:
            with trio.move_on_after(self.timeout_s):
                for pos in range(start, kept.last + 1):
                    tok = kept.tokens[pos - kept.first]
                    again = Emitted(rid, pos, tok, self.node.name, pos == kept.final)
                    await self.node.send(peer, again, timeout=self.timeout_s)
                    self.resent += 1
        except PddnetError as exc:  # the next round asks again, or the stream fails
            log.info("%s: re-send of %s to %s stopped: %s", self.node.name, rid, peer, exc)
        finally:
            self.resending.discard(rid)

    def on_ack(self, peer: str, msg: StreamAck) -> None:
        """The sink holds the whole stream: forget it."""
        kept = self._streams.get(msg.request_id)
        if kept is not None and kept.state is not SourceState.ACTIVE and peer == kept.sink:
            del self._streams[msg.request_id], self._ended[msg.request_id]
