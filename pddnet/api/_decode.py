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

An endpoint is a composition; each responsibility has its own class:

* admission of P's offers (:class:`~pddnet.api._admit.Admission`);
* the requests in progress (:class:`~pddnet.api._requests.DecodeRequests`);
* blocks and grants (:class:`~pddnet.api._grants.BlockGrants`, MD's
  :class:`~pddnet.api._grants.CachedGrants`);
* serving one request, KV to close (:class:`~pddnet.api._serve.RelayServing`,
  :class:`~pddnet.api._serve.MainServing`), whose drivers reach the engine
  only through :class:`~pddnet.handoff.DecodeEngine`, send through a
  per-request :class:`~pddnet.api._link.DecoderLink`, and emit through the
  :class:`~pddnet.api._emit.SinkEmitter`;
* the tokens kept for the sink's re-sends (:class:`~pddnet.api._kept.KeptTokens`);
* (MD) the sinks' takeover reports (:class:`~pddnet.api._takeover.TakeoverReports`)
  and the cache's events to P (:class:`~pddnet.api._publish.DrcPublisher`).

The endpoint itself owns the control node and the data-path receiver, routes
the control messages to those parts, and watches the other decoder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import msgpack
import trio

from ..cache import CacheServer, DrcSnapshotRequest, RadixCache
from ..control import ControlNode, TcpTuning
from ..handoff import HandoffHub, HandoffParams, MainStats, RelayStats
from ..kv import KVPool
from ..transport import Receiver
from ..transport.local import local_available, open_local_receiver
from ..transport.wan import TlsConfig, WanLimits, WanReceiver
from ..wire import Message
from ._admit import Admission
from ._emit import SinkEmitter
from ._engine import DecodeEngine
from ._grants import BlockGrants, CachedGrants
from ._info import EndpointInfo
from ._kept import KeptTokens
from ._messages import (
    Abort,
    KvOffer,
    StatsReply,
    StatsRequest,
    StreamAck,
    StreamResend,
    StreamTakeover,
)
from ._publish import DrcPublisher
from ._requests import DecodeRequests
from ._serve import MainServing, RelayServing, Serving
from ._takeover import TakeoverReports

__all__ = ["DecodeStatistics", "MainEndpoint", "RelayEndpoint"]

log = logging.getLogger("pddnet.api")

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


class _DecodeEndpoint:
    role = ""
    serving: Serving  # each side builds its own, after the parts it takes

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
        self.watch_interval_s = watch_interval_s
        self._watched: set[str] = set()  # peers a _watch task pings (one each)
        self.engine_id = engine_id or name
        self.rank = rank
        self.node = ControlNode(name, secret=secret, bind=control_bind, tcp=control_tcp)
        self.wan_control_paths = wan_control_paths
        self.wan_tls = wan_tls
        self.wan_limits = wan_limits
        self.receiver: Receiver = receiver or self._default_receiver(data_host)
        self.grants = self._grants(lease_s)
        self.kept = KeptTokens(self.node)  # the tokens emitted, for the sink's re-sends
        self.hub = HandoffHub(self.node)
        self._reqs = DecodeRequests(name, self.grants, self.kept, self.hub)
        self.admission = Admission(
            self._reqs, self.grants, params or HandoffParams(), max_requests=max_requests
        )
        self.emitter = SinkEmitter(self.node, self.kept, self._reqs)
        self._nursery: trio.Nursery | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    def _default_receiver(self, data_host: str) -> Receiver:
        return self._wan_receiver(data_host)

    def _wan_receiver(self, data_host: str) -> WanReceiver:
        return WanReceiver(
            host=data_host, secret=self.node.key, tls=self.wan_tls, limits=self.wan_limits
        )

    def _grants(self, lease_s: float) -> BlockGrants:
        return BlockGrants(self.engine, self.pool, self.receiver, self.node, lease_s)

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.node)
            await stack.enter_async_context(self.receiver)  # type: ignore[arg-type]
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._stack = stack.pop_all()
        self.kept.attach(self._nursery)
        self.node.route(KvOffer, self._on_offer)
        self.node.route(Abort, self.serving.on_abort)
        self.node.route(StatsRequest, self._on_stats)
        self.node.route(StreamResend, self.kept.on_resend)
        self.node.route(StreamAck, self.kept.on_ack)
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
            self.receiver.address,
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
        watch = info.role in ("relay", "main") and info.role != self.role
        if watch and self.watch_interval_s and info.name not in self._watched:
            # once per peer: a reconnect (a restarted peer, the directory's
            # retry) keeps the task that already pings this name
            assert self._nursery is not None
            self._watched.add(info.name)
            self._nursery.start_soon(self._watch, info.name)

    async def _watch(self, peer: str) -> None:
        """Declare ``peer`` failed to this node's drivers when it stops answering pings."""
        while True:
            await self.hub.watch(peer, interval_s=self.watch_interval_s)

    @property
    def sink_timeout_s(self) -> float:
        """How long one send of a token to the sink may wait."""
        return self.kept.timeout_s

    @sink_timeout_s.setter
    def sink_timeout_s(self, value: float) -> None:
        self.kept.timeout_s = value

    @property
    def handoff_stats(self) -> deque[RelayStats | MainStats]:
        """The handoff machines' statistics of the latest requests that ended, oldest first."""
        return self._reqs.handoff_stats

    def statistics(self) -> DecodeStatistics:
        """A snapshot of this endpoint's counters."""
        return DecodeStatistics(
            offers=self.admission.offers,
            rejected=self.admission.rejected,
            active=len(self._reqs),
            finished=self._reqs.finished,
            failed=self._reqs.failed,
            tokens_emitted=self.emitter.emitted,
            tokens_resent=self.kept.resent,
            sink_failures=self.emitter.sink_failures,
            blocks_received=self.grants.received,
            blocks_cached_hit=self.grants.cached_hit,
            free_blocks=self.engine.free_blocks(),
        )

    def _on_stats(self, peer: str, msg: StatsRequest) -> StatsReply:
        return StatsReply(stats_payload(self.statistics(), list(self.handoff_stats)))

    async def _on_offer(self, peer: str, msg: KvOffer) -> Message:
        req, accept = self.admission.admit(peer, msg)
        assert self._nursery is not None
        self._nursery.start_soon(self.serving.serve, req)
        return accept


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
    serving: RelayServing

    def __init__(
        self,
        *args: Any,
        cut_off_wan: bool = True,
        local_options: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        self.local_options = {"cma": False, **(local_options or {})}  # read by _default_receiver
        super().__init__(*args, **kw)
        self.serving = RelayServing(
            self.node,
            self.engine,
            self.receiver,
            self.grants,
            self.kept,
            self._reqs,
            self.emitter,
            cut_off_wan=cut_off_wan,
        )

    @property
    def cut_off_wan(self) -> bool:
        """Whether P cancels MD's transfer when RLD finishes a request first."""
        return self.serving.cut_off_wan

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
    serving: MainServing

    def __init__(
        self,
        name: str,
        pool: KVPool,
        engine: DecodeEngine,
        *,
        cache: RadixCache | None = None,
        cache_lease_s: float = 60.0,
        keep_strange_traffic: bool = False,
        takeover_confirm_s: float = 0.5,
        **kw: Any,
    ) -> None:
        self.cache = RadixCache(pool.layout.block_size) if cache is None else cache
        self.drc = CacheServer(self.cache, lease_s=cache_lease_s)  # read by _grants
        super().__init__(name, pool, engine, **kw)
        self.publisher = DrcPublisher(self.node, self.drc)
        self.serving = MainServing(
            self.node,
            self.engine,
            self.receiver,
            self.grants,
            self.kept,
            self._reqs,
            self.emitter,
            keep_strange_traffic=keep_strange_traffic,
            publisher=self.publisher,
        )
        self.takeover = TakeoverReports(
            self.node, self._reqs, self.kept, self.hub, takeover_confirm_s
        )

    @property
    def keep_strange_traffic(self) -> bool:
        """Whether a transfer RLD made needless goes on to feed the cache."""
        return self.serving.keep_strange_traffic

    @property
    def takeover_confirm_s(self) -> float:
        """How long RLD may take to answer the ping that confirms a takeover report."""
        return self.takeover.confirm_s

    def _grants(self, lease_s: float) -> CachedGrants:
        return CachedGrants(self.engine, self.pool, self.receiver, self.node, lease_s, drc=self.drc)

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        assert self._nursery is not None
        self.takeover.attach(self._nursery)
        self.node.route(DrcSnapshotRequest, self.publisher.on_snapshot_request)
        self.node.route(StreamTakeover, self.takeover.on_takeover)
        return self

    def statistics(self) -> DecodeStatistics:
        """A snapshot of this endpoint's counters (with the takeover reports acted on)."""
        return dataclasses.replace(super().statistics(), takeover_reports=self.takeover.acted_on)


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
