"""Serving on a decoder: one admitted request, from its KV landing to its close.

Per request, in order: its KV lands (renewing P's lease meanwhile) -> the
handoff driver runs, reaching the engine only through
:class:`~pddnet.handoff.DecodeEngine`, its tokens going out through the
:class:`~pddnet.api._emit.SinkEmitter` and its messages through the
request's :class:`~pddnet.api._link.DecoderLink` -> the request closes
(:class:`~pddnet.api._requests.DecodeRequests`). The side that answers for
the stream tells the sink with an ``Abort`` when it ended without its last
token, so no request is lost.

RLD (:class:`RelayServing`) starts its driver once the local KV landed and
answers for the stream unless it handed the request to MD. MD
(:class:`MainServing`) starts its driver at once (RLD's batches may come
before the WAN KV), tells it when the KV lands, and answers for the stream
on P->MD, and on P->RLD->MD once it took over.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import trio

from .._errors import PddnetError, TransferCancelled
from ..control import ControlNode
from ..handoff import DecodeEngine, Done, MainDriver, RelayDriver, RelayState, TokenOut
from ..transport import Receiver
from ._grants import BlockGrants
from ._kept import KeptTokens
from ._link import K_LINK_TIMEOUT_S, MainLink, RelayLink, notify
from ._messages import Abort
from ._publish import DrcPublisher
from ._record import RequestRecord
from ._requests import DecodeRequests
from ._stream import SourceState

__all__ = ["MainServing", "RelayServing", "Serving"]

log = logging.getLogger("pddnet.api")


@dataclass(eq=False)
class Serving(ABC):
    """What RLD's and MD's serving share.

    Args:
        node: the decoder's control node.
        engine: the decoder's engine (the drivers run requests on it).
        receiver: the data-path receiver (an abort before the driver revokes the grant).
        grants: waits for a request's KV; frees its blocks.
        kept: the tokens kept for the sinks' re-sends.
        requests: the requests in progress.
        out: where the drivers' tokens go.
    """

    node: ControlNode
    engine: DecodeEngine
    receiver: Receiver
    grants: BlockGrants
    kept: KeptTokens
    requests: DecodeRequests
    out: TokenOut

    @abstractmethod
    async def serve(self, req: RequestRecord) -> None:
        """Receive the request's KV and drive its handoff to the end."""

    async def on_abort(self, peer: str, msg: Abort) -> None:
        """P (or the sink) gave the request up: cancel its driver, or its
        transfer if the driver has not started."""
        req = self.requests.get(msg.request_id)
        if req is None:
            return
        if req.driver is not None:
            req.driver.cancel()
        else:
            self.receiver.cancel(req.transfer_id)

    async def finish(self, req: RequestRecord, error: PddnetError | None) -> None:
        """Close the request (``error`` set if it failed)."""
        self.requests.close(req, error)

    async def tell_sink_abort(self, req: RequestRecord, reason: str) -> None:
        """The stream ends here without its last token: say so to the sink."""
        self.kept.end(req.rid, SourceState.FAILED, reason)
        try:
            await self.node.send(req.sink, Abort(req.rid, reason), timeout=K_LINK_TIMEOUT_S)
        except PddnetError as exc:
            log.warning(
                "%s: could not tell %s that %s failed: %s", self.node.name, req.sink, req.rid, exc
            )


@dataclass(eq=False, kw_only=True)
class RelayServing(Serving):
    """RLD: decode once the local KV landed, then hand over to MD.

    Takes the arguments of :class:`Serving`, plus:

    Args:
        cut_off_wan: have P cancel the WAN transfer when RLD finishes first
            (:class:`~pddnet.api._link.RelayLink`).
    """

    cut_off_wan: bool

    async def serve(self, req: RequestRecord) -> None:
        try:
            await self.grants.wait(req)
        except PddnetError as exc:
            if req.main:
                await notify(self.node, req.main, Abort(req.rid, f"relay lost the KV: {exc}"))
            await self.tell_sink_abort(req, f"relay KV transfer failed: {exc}")
            await self.finish(req, exc)
            return
        link = RelayLink(self.node, req.main, req, self.grants, cut_off_wan=self.cut_off_wan)
        driver = self.requests.attach(
            req, RelayDriver(self.engine, link, self.out, req.handoff_request(), req.params)
        )
        result = await driver.run()
        await self.finish(req, result.error)
        # RLD answers for the stream unless it handed the request to MD.
        if not req.delivered_final and result.state is not RelayState.RELEASED:
            await self.tell_sink_abort(req, _why(result))


@dataclass(eq=False, kw_only=True)
class MainServing(Serving):
    """MD: drive from the start, the KV landing as one of the driver's events.

    Takes the arguments of :class:`Serving`, plus:

    Args:
        keep_strange_traffic: let the transfer of a request RLD finished go
            on to feed the cache (:class:`~pddnet.api._link.MainLink`).
        publisher: tells P of the cache's changes when a request closes.
    """

    keep_strange_traffic: bool
    publisher: DrcPublisher

    async def serve(self, req: RequestRecord) -> None:
        link = MainLink(
            self.node,
            req.relay,
            req,
            self.grants,
            receiver=self.receiver,
            keep_strange_traffic=self.keep_strange_traffic,
        )
        driver = self.requests.attach(
            req,
            MainDriver(
                self.engine,
                link,
                self.out,
                req.handoff_request(),
                req.params,
                relayed=bool(req.relay),
            ),
        )
        async with trio.open_nursery() as nursery:

            async def land() -> None:
                try:
                    await self.grants.wait(req)
                except TransferCancelled:
                    return  # we cancelled it (strange traffic) or P did; the driver knows
                except PddnetError as exc:
                    log.info("%s: KV for %s failed: %s", self.node.name, req.rid, exc)
                    driver.cancel()
                    return
                driver.kv_landed()

            nursery.start_soon(land)
            result = await driver.run()
            if not req.keep:
                nursery.cancel_scope.cancel()
            # else: the transfer still runs to feed the cache; land() ends with it
        await self.finish(req, result.error)
        # MD answers for the stream on P->MD, and on P->RLD->MD once it took over.
        took_over = driver.machine.position is not None
        if not req.delivered_final and (not req.relay or took_over):
            await self.tell_sink_abort(req, _why(result))

    async def finish(self, req: RequestRecord, error: PddnetError | None) -> None:
        """Close the request, then publish what that changed in the cache."""
        await super().finish(req, error)
        await self.publisher.publish()


def _why(result: Done) -> str:
    """A human reason for a request that ended without its last token."""
    if result.error is not None:
        return f"{type(result.error).__name__}: {result.error}"
    return f"ended in {result.state.name} without finishing"
