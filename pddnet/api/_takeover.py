"""(MD) The sink's reports that RLD stopped answering mid-stream.

The sink sends ``StreamTakeover`` with the user's position and the tokens it
holds. MD answers at once with its stream status. If the report is new (MD
emitted nothing of the stream yet, its driver runs, and it did not act on a
report at this position already), MD pings RLD in the background; only if
RLD does not answer MD either does its driver get a ``takeover_only``
failure report (:meth:`~pddnet.handoff.HandoffHub.suspect_peer`), and the
handoff machine takes over only where that is exact. A sink cut off from RLD
alone thus never takes the request from a live RLD.
"""

from __future__ import annotations

import logging

import trio

from .._errors import PddnetError, PeerUnavailable, RemoteProtocolError, TransferTimeout
from ..control import ControlNode
from ..handoff import HandoffHub
from ..wire import decode_tokens
from ._kept import KeptTokens
from ._messages import StreamStatus, StreamTakeover
from ._record import RequestRecord
from ._requests import DecodeRequests
from ._stream import SourceState

__all__ = ["TakeoverReports"]

log = logging.getLogger("pddnet.api")


class TakeoverReports:
    """Checks the sinks' takeover reports, confirms them, and passes them to the drivers.

    Args:
        node: MD's control node (pings RLD).
        requests: the requests in progress.
        kept: the tokens MD emitted (its stream status).
        hub: reaches the request's driver.
        confirm_s: how long RLD may take to answer the confirming ping.
    """

    def __init__(
        self,
        node: ControlNode,
        requests: DecodeRequests,
        kept: KeptTokens,
        hub: HandoffHub,
        confirm_s: float,
    ) -> None:
        self.node = node
        self.requests = requests
        self.kept = kept
        self.hub = hub
        self.confirm_s = confirm_s
        self.acted_on = 0  # reports confirmed and passed to a driver
        self._suspecting: set[int] = set()  # requests whose report is being confirmed
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Run the confirmations in ``nursery`` (the endpoint's)."""
        self._nursery = nursery

    def on_takeover(self, peer: str, msg: StreamTakeover) -> StreamStatus:
        """The sink lost RLD mid-stream: confirm it and take over at the user's position.

        Answers at once with MD's stream status; the confirmation (a ping to
        RLD) and the takeover run in the background, and the handoff machine
        takes over only where that is exact (``PeerFailed.takeover_only``).

        Raises:
            RemoteProtocolError: the report is not from the request's sink, the
                request has no relay, or the position and tokens are malformed.
        """
        rid = msg.request_id
        req, kept = self.requests.get(rid), self.kept.get(rid)
        if req is None or kept is None:
            return StreamStatus(rid, int(SourceState.UNKNOWN), -1, -1)
        if peer != req.sink:
            raise RemoteProtocolError(
                f"takeover report from {peer}, not the sink", peer=peer, request_id=rid
            )
        if not req.relay:
            raise RemoteProtocolError("takeover report for a request without RLD", request_id=rid)
        if not 0 <= msg.position < req.max_tokens:
            raise RemoteProtocolError(
                f"takeover at {msg.position} outside 0..{req.max_tokens - 1}", request_id=rid
            )
        tokens = decode_tokens(msg.tokens, req.max_tokens)
        if tokens.size != msg.position:
            raise RemoteProtocolError(
                f"takeover at {msg.position} with {tokens.size} tokens", request_id=rid
            )
        if (
            kept.first < 0
            and req.driver is not None
            and req.reported_at != msg.position
            and rid not in self._suspecting
        ):
            self._suspecting.add(rid)
            assert self._nursery is not None
            self._nursery.start_soon(self._confirm, req, msg.position, tuple(tokens.tolist()))
        return kept.status(rid)

    async def _confirm(self, req: RequestRecord, position: int, tokens: tuple[int, ...]) -> None:
        try:
            try:
                await self.node.ping(req.relay, timeout=self.confirm_s)
            except (TransferTimeout, PeerUnavailable):
                pass  # unreachable from here too
            except PddnetError:
                return  # it answered (with an error), or we are closing
            else:
                log.info(
                    "%s: sink lost %s for %s, but it answers us: report ignored",
                    self.node.name,
                    req.relay,
                    req.rid,
                )
                return
            if self.requests.get(req.rid) is req and self.hub.suspect_peer(
                req.rid, position, tokens
            ):
                req.reported_at = position
                self.acted_on += 1
                log.info(
                    "%s: %s unreachable for %s: take over at user position %d if exact",
                    self.node.name,
                    req.relay,
                    req.rid,
                    position,
                )
        finally:
            self._suspecting.discard(req.rid)
