"""The decode-side endpoints: :class:`RelayEndpoint` (RLD) and :class:`MainEndpoint` (MD).

Both receive a request's prompt KV into blocks they grant, run the handoff
machine's trio driver for it, and stream the user's tokens to the request's
sink. They differ in what they receive and how they end:

* RLD receives every prompt block over the local path, starts decoding as
  soon as they land, and hands over to MD by token ids.
* MD consults its decode-side radix cache (DRC): it pins the prefix it holds
  and grants only the missing blocks, which cross the WAN. When they land it
  has its engine continue prompt + RLD's eager tokens (one extend pass) and
  takes over, or, on the P->MD route, decodes from the first token itself.
  Finished prompts are cached.

Per request, in order: ``KvOffer`` from P -> blocks allocated and granted ->
``KvAccept`` to P -> the transfer lands (lease renewals go to P meanwhile) ->
the driver runs -> the blocks are freed (or cached, on MD). Every failure
ends the request with an ``Abort`` to the sink, so no request is lost.

Each responsibility has its own class; the endpoint wires them: the blocks
and grants (:class:`~pddnet.api._grants.BlockGrants`, MD's
:class:`~pddnet.api._grants.CachedGrants`), the tokens kept for the sink's
re-sends (:class:`~pddnet.api._kept.KeptTokens`), the per-request record
(:class:`~pddnet.api._record.RequestRecord`), and the handoff drivers, which
reach the engine only through :class:`~pddnet.handoff.DecodeEngine`. The
endpoint itself is the drivers' ``TokenOut`` (emits to the sink) and the
hooks behind their ``Link`` (cancel a transfer, free blocks).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import msgpack
import trio

from .._errors import (
    PddnetError,
    PeerUnavailable,
    RemoteProtocolError,
    ResourceLimitError,
    TransferCancelled,
    TransferTimeout,
)
from ..cache import CacheServer, DrcSnapshotRequest, RadixCache
from ..control import ControlNode, TcpTuning
from ..handoff import (
    AbortReason,
    ControlLink,
    Done,
    HandoffHub,
    HandoffParams,
    MainDriver,
    MainStats,
    RelayDriver,
    RelayState,
    RelayStats,
)
from ..kv import KVPool
from ..transport import Receiver
from ..transport.local import local_available, open_local_receiver
from ..transport.wan import TlsConfig, WanLimits, WanReceiver
from ..wire import Message, Pong, decode_tokens
from ._engine import DecodeEngine
from ._grants import BlockGrants, CachedGrants
from ._info import EndpointInfo
from ._kept import KeptTokens
from ._messages import (
    Abort,
    CutOffWan,
    Emitted,
    KvAccept,
    KvOffer,
    StatsReply,
    StatsRequest,
    StreamAck,
    StreamResend,
    StreamStatus,
    StreamTakeover,
)
from ._record import RequestRecord
from ._stream import SourceState

__all__ = ["DecodeStatistics", "MainEndpoint", "RelayEndpoint"]

log = logging.getLogger("pddnet.api")
_D = TypeVar("_D", RelayDriver, MainDriver)

K_MAX_PROMPT = 1 << 20
# Control connections fail over fast: a lost single-packet message costs ~2 RTT
# + 5 ms instead of 2 RTT + 200 ms (TCP_RTO_MIN_US / TCP_DELACK_MAX_US).
K_CONTROL_TCP = TcpTuning.wan()


@dataclass(frozen=True, slots=True)
class DecodeStatistics:
    """A snapshot of a decode endpoint's counters."""

    offers: int
    rejected: int
    active: int
    finished: int
    failed: int
    tokens_emitted: int
    tokens_resent: int
    sink_failures: int
    blocks_received: int
    blocks_cached_hit: int
    free_blocks: int
    takeover_reports: int = 0  # (MD) sink reports of a lost RLD acted on (RLD unreachable here too)


class _DecodeEndpoint(ABC):
    role = ""

    def __init__(
        self,
        name: str,
        pool: KVPool,
        engine: DecodeEngine,
        *,
        secret: bytes | str | None = None,
        control_bind: str = "tcp://127.0.0.1:0",
        data_host: str = "127.0.0.1",
        engine_id: str = "",
        rank: int = 0,
        params: HandoffParams | None = None,
        lease_s: float = 10.0,
        receiver: Receiver | None = None,
        watch_interval_s: float = 2.0,
        max_requests: int = 4096,
        wan_tls: TlsConfig | None = None,
        wan_limits: WanLimits | None = None,
        control_tcp: TcpTuning | None = K_CONTROL_TCP,
        wan_control_paths: int = 2,
        model_id: str = "",
    ) -> None:
        self.name = name
        self.pool = pool
        self.model_id = model_id
        self.engine = engine
        self.params = params or HandoffParams()
        self.lease_s = lease_s
        self.watch_interval_s = watch_interval_s
        self.max_requests = max_requests
        self.handoff_stats: collections.deque[RelayStats | MainStats] = collections.deque(
            maxlen=4096
        )
        self.engine_id = engine_id or name
        self.rank = rank
        self.node = ControlNode(name, secret=secret, bind=control_bind, tcp=control_tcp)
        self.wan_control_paths = wan_control_paths
        self.wan_tls = wan_tls
        self.wan_limits = wan_limits
        self.receiver: Receiver = receiver or self._default_receiver(data_host)
        self.grants = BlockGrants(engine, pool, self.receiver, self.node, lease_s)
        self._reqs: dict[int, RequestRecord] = {}
        self.kept = KeptTokens(self.node)  # the tokens emitted, for the sink's re-sends
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._stats = dict.fromkeys(DecodeStatistics.__dataclass_fields__, 0)

    def _default_receiver(self, data_host: str) -> Receiver:
        return self._wan_receiver(data_host)

    def _wan_receiver(self, data_host: str) -> WanReceiver:
        return WanReceiver(
            host=data_host, secret=self.node.key, tls=self.wan_tls, limits=self.wan_limits
        )

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.node)
            await stack.enter_async_context(self.receiver)  # type: ignore[arg-type]
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._stack = stack.pop_all()
        self.kept.attach(self._nursery)
        self.node.route(KvOffer, self._on_offer)
        self.node.route(Abort, self._on_abort)
        self.node.route(StatsRequest, self._on_stats)
        self.node.route(StreamResend, self.kept.on_resend)
        self.node.route(StreamAck, self.kept.on_ack)
        self.hub = HandoffHub(self.node)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._nursery is not None and self._stack is not None
        self._nursery.cancel_scope.cancel()
        return bool(await self._stack.__aexit__(*exc))

    def info(self) -> EndpointInfo:
        """This endpoint's handshake (publish its :meth:`EndpointInfo.blob`)."""
        return EndpointInfo(
            self.name,
            self.role,
            self.engine_id,
            self.rank,
            self.node.address,
            getattr(self.receiver, "address", ""),
            self.pool.layout,
            self.model_id,
        )

    async def connect_peer(self, info: EndpointInfo) -> None:
        """Open the control connection to a peer endpoint (P, or the other decoder).

        Raises:
            LayoutMismatch: if the peer's KV layout or model differs from ours
                (:meth:`EndpointInfo.check_peer`).
        """
        self.info().check_peer(info)
        # RLD<->MD and MD<->P cross the WAN: a second connection takes the
        # single-packet tail losses (docs/handoff-bench.md)
        wan = (info.role == "main") != (self.role == "main")
        await self.node.connect(info.name, info.control, paths=self.wan_control_paths if wan else 1)
        if info.role in ("relay", "main") and info.role != self.role and self.watch_interval_s:
            assert self._nursery is not None
            self._nursery.start_soon(self._watch, info.name)

    @property
    def sink_timeout_s(self) -> float:
        """How long one send of a token to the sink may wait."""
        return self.kept.timeout_s

    @sink_timeout_s.setter
    def sink_timeout_s(self, value: float) -> None:
        self.kept.timeout_s = value

    def statistics(self) -> DecodeStatistics:
        return DecodeStatistics(
            **{
                **self._stats,
                "active": len(self._reqs),
                "free_blocks": self.engine.free_blocks(),
                "tokens_resent": self.kept.resent,
                "blocks_received": self.grants.received,
                "blocks_cached_hit": self.grants.cached_hit,
            }
        )

    def _on_stats(self, peer: str, msg: StatsRequest) -> StatsReply:
        return StatsReply(stats_payload(self.statistics(), list(self.handoff_stats)))

    # --------------------------------------------------------------- offers
    async def _on_offer(self, peer: str, msg: KvOffer) -> Message:
        self._stats["offers"] += 1
        if msg.request_id in self._reqs:
            raise RemoteProtocolError("duplicate request id", peer=peer, request_id=msg.request_id)
        if len(self._reqs) >= self.max_requests:
            self._stats["rejected"] += 1
            raise ResourceLimitError(
                f"{len(self._reqs)} requests in progress (max_requests={self.max_requests})",
                peer=peer,
                request_id=msg.request_id,
            )
        if not 0 < msg.max_tokens <= K_MAX_PROMPT:
            raise RemoteProtocolError("bad max_tokens", peer=peer, request_id=msg.request_id)
        prompt = decode_tokens(msg.prompt, K_MAX_PROMPT)
        if prompt.size == 0:
            raise RemoteProtocolError("empty prompt", peer=peer, request_id=msg.request_id)
        req = RequestRecord(
            msg.request_id,
            prompt,
            msg.first_token,
            msg.max_tokens,
            peer,
            msg.relay,
            msg.main,
            msg.sink,
            self._params_for(msg.deadline_s),
        )
        try:
            grant, skip = self.grants.reserve(req)
        except PddnetError:
            self._stats["rejected"] += 1
            raise
        self._reqs[req.rid] = req
        self.kept.open(req.rid, req.sink)
        self.hub.expect(req.rid)
        assert self._nursery is not None
        self._nursery.start_soon(self._serve, req)
        return KvAccept(
            req.rid,
            grant.transfer_id,
            grant.total,
            list(grant.layer_ends),
            grant.address,
            skip,
            self.lease_s,
        )

    def _params_for(self, deadline_s: float) -> HandoffParams:
        """The endpoint's handoff parameters, with waits capped by the request's deadline."""
        if not deadline_s > 0:
            return self.params
        return dataclasses.replace(
            self.params,
            kv_timeout_s=min(self.params.kv_timeout_s, deadline_s),
            idle_timeout_s=min(self.params.idle_timeout_s, deadline_s / 2),
        )

    # -------------------------------------------------------------- serving
    @abstractmethod
    async def _serve(self, req: RequestRecord) -> None:
        """Receive the request's KV and drive its handoff to the end."""

    async def _finish(self, req: RequestRecord, error: PddnetError | None) -> None:
        if req.driver is not None:
            self.handoff_stats.append(req.driver.machine.statistics(trio.current_time()))
        self._reqs.pop(req.rid, None)
        self.kept.end(req.rid, SourceState.DONE)
        self.hub.detach(req.rid)
        self.grants.free(req)
        if error is None:
            self._stats["finished"] += 1
        else:
            self._stats["failed"] += 1
            log.info("%s: request %s failed: %s", self.name, req.rid, error)

    async def _tell_sink_abort(self, req: RequestRecord, reason: str) -> None:
        self.kept.end(req.rid, SourceState.FAILED, reason)
        try:
            await self.node.send(req.sink, Abort(req.rid, reason), timeout=2.0)
        except PddnetError as exc:
            log.warning(
                "%s: could not tell %s that %s failed: %s", self.name, req.sink, req.rid, exc
            )

    async def _on_abort(self, peer: str, msg: Abort) -> None:
        req = self._reqs.get(msg.request_id)
        if req is None:
            return
        if req.driver is not None:
            req.driver.cancel()
        else:
            self.receiver.cancel(req.transfer_id)

    def _start_driver(self, req: RequestRecord, driver: _D) -> _D:
        req.driver = driver
        self.hub.attach(driver)
        return driver

    def _link(self, peer: str) -> ControlLink:
        return ControlLink(
            self.node,
            peer,
            timeout=2.0,
            on_cancel_transfer=self.cancel_transfer,
            on_free_blocks=self.free_blocks,
        )

    async def _watch(self, peer: str) -> None:
        """Declare ``peer`` failed to this node's drivers when it stops answering pings."""
        while True:
            await self.hub.watch(peer, interval_s=self.watch_interval_s)

    # ---------------------------------------------------- driver interfaces
    # (the handoff driver's TokenOut and Link hooks, per request)
    async def emit(self, request_id: int, position: int, token: int, final: bool) -> None:
        req = self._reqs[request_id]
        msg = Emitted(request_id, position, token, self.name, final)
        self.kept.record(request_id, position, token, final)  # first: a re-send can deliver it
        try:
            await self.node.send(req.sink, msg, timeout=self.kept.timeout_s)
        except PddnetError as exc:
            # Nobody can read the stream any more: stop the request (its blocks
            # are freed by the driver's normal exit) instead of dying here.
            self._stats["sink_failures"] += 1
            log.warning("%s: sink %s unreachable for %s: %s", self.name, req.sink, request_id, exc)
            if req.driver is not None:
                req.driver.cancel()
            return
        req.emitted += 1
        req.delivered_final = req.delivered_final or msg.finished
        self._stats["tokens_emitted"] += 1

    async def free_blocks(self, request_id: int) -> None:
        req = self._reqs.get(request_id)
        if req is not None:
            self.grants.free(req)

    @abstractmethod
    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        """Stop the request's WAN transfer (the link's hook for the driver)."""


class RelayEndpoint(_DecodeEndpoint):
    """RLD: decodes eager tokens as soon as the local KV lands, then hands over.

    Args:
        name: node name.
        pool: the engine's KV pool (blocks are granted from it).
        engine: the decode hooks.
        secret: control-plane secret (or ``$PDDNET_SECRET``).
        control_bind: where the control ROUTER binds.
        data_host: address the data-plane receiver listens on.
        params: handoff tuning.
        lease_s: lease renewal period is a third of this.
        watch_interval_s: ping the other decoder this often; three missed
            pings declare it failed to every running handoff (0: don't watch).
        max_requests: requests in progress (pending handoffs) at most; a
            further ``KvOffer`` is refused with :class:`~pddnet.ResourceLimitError`
            (P's ``submit`` raises it as :class:`~pddnet.RemoteCallError`).
        wan_tls: TLS for the WAN data streams (:class:`~pddnet.transport.wan.TlsConfig`;
            P passes its side as ``wan_options={"tls": ...}``).
        wan_limits: the WAN receiver's bounds (:class:`~pddnet.transport.wan.WanLimits`).
        control_tcp: TCP options of every control connection (default: 5 ms
            minimum RTO and delayed ACK; None: the system's).
        wan_control_paths: control connections to a peer across the WAN; each
            frame goes on every one, so one lost packet costs nothing.
        model_id: the model's fingerprint, as the engine states it; every
            peer must state the same one (:meth:`EndpointInfo.check_peer`).
        receiver: the data-path receiver (default: RLD takes the local path,
            UCX where ucxx is installed, else TCP; MD takes the WAN path).
        cut_off_wan: (RLD) when RLD finishes a request before MD's KV landed,
            have P cancel the WAN transfer (the strange-traffic cut-off).
        local_options: (RLD) keyword arguments for the UCX receiver, e.g.
            ``{"busy_poll_us": 100}`` for the low-latency mode (docs/local.md).
            ``cma`` defaults to False here: with it, a prefill process killed
            mid-transfer on the same host makes UCX abort RLD (docs/local.md,
            *`cma` kills the receiver*); ``{"cma": True}`` takes it back.
    """

    role = "relay"

    def __init__(
        self,
        *args: Any,
        cut_off_wan: bool = True,
        local_options: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        self.local_options = {"cma": False, **(local_options or {})}  # read by _default_receiver
        super().__init__(*args, **kw)
        self.cut_off_wan = cut_off_wan

    def _default_receiver(self, data_host: str) -> Receiver:
        """The local path: UCX where ucxx imports (RDMA/shared memory/tcp), else
        TCP with a warning that says so (senders follow the published address)."""
        if local_available():  # senders prove the control plane's secret first
            return open_local_receiver(secret=self.node.key, **self.local_options)
        log.warning(
            "relay %s: ucxx is not installed (ucxx._lib.libucxx does not import), so the"
            " local path (P->RLD) takes TCP on %s; install pddnet[ucx] for UCX",
            self.name,
            data_host,
        )
        return self._wan_receiver(data_host)

    async def _serve(self, req: RequestRecord) -> None:
        try:
            await self.grants.wait(req)
        except PddnetError as exc:
            if req.main:
                await self._notify(req.main, Abort(req.rid, f"relay lost the KV: {exc}"))
            await self._tell_sink_abort(req, f"relay KV transfer failed: {exc}")
            await self._finish(req, exc)
            return
        driver = self._start_driver(
            req,
            RelayDriver(self.engine, self._link(req.main), self, req.handoff_request(), req.params),
        )
        result = await driver.run()
        await self._finish(req, result.error)
        # RLD answers for the stream unless it handed the request to MD.
        if not req.delivered_final and result.state is not RelayState.RELEASED:
            await self._tell_sink_abort(req, _why(result))

    async def _notify(self, peer: str, msg: Message) -> None:
        try:
            await self.node.send(peer, msg, timeout=2.0)
        except PddnetError as exc:
            log.info("%s: %s unreachable: %s", self.name, peer, exc)

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        # The WAN transfer runs P -> MD; P cancels it at the source.
        req = self._reqs.get(request_id)
        if req is not None and self.cut_off_wan:
            await self._notify(req.p, CutOffWan(request_id, reason.name))


class MainEndpoint(_DecodeEndpoint):
    """MD: receives only the blocks its radix cache lacks, recomputes, takes over.

    Takes the arguments of :class:`RelayEndpoint`, plus:

    Args:
        cache: MD's decode-side radix cache over ``pool`` (one is made if None).
        cache_lease_s: how long a pinned prefix waits for its transfer.
        keep_strange_traffic: when RLD finishes a request before its KV landed
            here (strange traffic), let the transfer finish and cache the
            prompt instead of cancelling it. Right for multi-turn sessions,
            whose next turn starts with this prompt; pair it with
            ``RelayEndpoint(cut_off_wan=False)``.
        takeover_confirm_s: when the request's sink reports that RLD stopped
            answering (``StreamTakeover``), MD pings RLD with this timeout and
            acts on the report only if RLD does not answer.
    """

    role = "main"

    def __init__(
        self,
        *args: Any,
        cache: RadixCache | None = None,
        cache_lease_s: float = 60.0,
        keep_strange_traffic: bool = False,
        takeover_confirm_s: float = 0.5,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.keep_strange_traffic = keep_strange_traffic
        self.takeover_confirm_s = takeover_confirm_s
        self._suspecting: set[int] = set()  # requests whose takeover report is being confirmed
        self.cache = cache or RadixCache(self.pool.layout.block_size)
        self.drc = CacheServer(self.cache, lease_s=cache_lease_s)
        self.grants = CachedGrants(
            self.engine, self.pool, self.receiver, self.node, self.lease_s, drc=self.drc
        )
        self._subscribers: set[str] = set()

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.node.route(DrcSnapshotRequest, self._on_snapshot_request)
        self.node.route(StreamTakeover, self._on_takeover)
        return self

    def _on_takeover(self, peer: str, msg: StreamTakeover) -> StreamStatus:
        """The sink lost RLD mid-stream: confirm it and take over at the user's position.

        Answers at once with MD's stream status; the confirmation (a ping to
        RLD) and the takeover run in the background, and the handoff machine
        takes over only where that is exact (``PeerFailed.takeover_only``).

        Raises:
            RemoteProtocolError: the report is not from the request's sink, the
                request has no relay, or the position and tokens are malformed.
        """
        rid = msg.request_id
        req, kept = self._reqs.get(rid), self.kept.get(rid)
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
            self._nursery.start_soon(
                self._confirm_takeover, req, msg.position, tuple(tokens.tolist())
            )
        return kept.status(rid)

    async def _confirm_takeover(
        self, req: RequestRecord, position: int, tokens: tuple[int, ...]
    ) -> None:
        try:
            try:
                await self.node.ping(req.relay, timeout=self.takeover_confirm_s)
            except (TransferTimeout, PeerUnavailable):
                pass  # unreachable from here too
            except PddnetError:
                return  # it answered (with an error), or we are closing
            else:
                log.info(
                    "%s: sink lost %s for %s, but it answers us: report ignored",
                    self.name,
                    req.relay,
                    req.rid,
                )
                return
            if self._reqs.get(req.rid) is req and self.hub.suspect_peer(req.rid, position, tokens):
                req.reported_at = position
                self._stats["takeover_reports"] += 1
                log.info(
                    "%s: %s unreachable for %s: take over at user position %d if exact",
                    self.name,
                    req.relay,
                    req.rid,
                    position,
                )
        finally:
            self._suspecting.discard(req.rid)

    async def _on_snapshot_request(self, peer: str, msg: DrcSnapshotRequest) -> Message:
        """P subscribes to cache events; the snapshot goes as events, in order."""
        self._subscribers.add(peer)
        for part in self.drc.snapshot():
            await self.node.send(peer, part)
        await self._publish()
        return Pong()

    async def _publish(self) -> None:
        for ev in self.drc.events():
            for peer in list(self._subscribers):
                try:
                    await self.node.send(peer, ev, timeout=2.0)
                except PddnetError:
                    self._subscribers.discard(peer)

    async def _finish(self, req: RequestRecord, error: PddnetError | None) -> None:
        await super()._finish(req, error)
        await self._publish()

    async def _serve(self, req: RequestRecord) -> None:
        driver = self._start_driver(
            req,
            MainDriver(
                self.engine,
                self._link(req.relay),
                self,
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
                    log.info("%s: KV for %s failed: %s", self.name, req.rid, exc)
                    driver.cancel()
                    return
                driver.kv_landed()

            nursery.start_soon(land)
            result = await driver.run()
            if not req.keep:
                nursery.cancel_scope.cancel()
            # else: the transfer still runs to feed the cache; land() ends with it
        await self._finish(req, result.error)
        # MD answers for the stream on P->MD, and on P->RLD->MD once it took over.
        took_over = driver.machine.position is not None
        if not req.delivered_final and (not req.relay or took_over):
            await self._tell_sink_abort(req, _why(result))

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        req = self._reqs.get(request_id)
        if req is None:
            return
        if self.keep_strange_traffic and reason in (AbortReason.RLD_FINISHED, AbortReason.FALLBACK):
            req.keep = True
            return
        self.receiver.cancel(req.transfer_id)

    async def free_blocks(self, request_id: int) -> None:
        req = self._reqs.get(request_id)
        if req is not None and not req.keep:
            self.grants.free(req)


def _why(result: Done) -> str:
    """A human reason for a request that ended without its last token."""
    if result.error is not None:
        return f"{type(result.error).__name__}: {result.error}"
    return f"ended in {result.state.name} without finishing"


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    return obj


def stats_payload(statistics: Any, requests: Sequence[Any] = ()) -> bytes:
    """msgpack of ``{"statistics": ..., "requests": [...]}`` (enums by name)."""
    return bytes(
        msgpack.packb({"statistics": _plain(statistics), "requests": [_plain(r) for r in requests]})
    )


def new_request_id() -> int:
    """A random 63-bit request id."""
    return secrets.randbits(63) or 1
