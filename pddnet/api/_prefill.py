"""The prefill-side endpoint: :class:`PrefillEndpoint` (P).

After the engine prefilled a prompt into its KV blocks, one call,
:meth:`PrefillEndpoint.submit`, routes the request and ships its KV: every
block to RLD over the local path and, concurrently, only the blocks MD lacks
over the WAN. The source blocks stay leased until every transfer of the
request finished, or until the receivers stop renewing the lease; then the
engine is told it may reuse them (:class:`BlocksReleased`).

Layer by layer: ``submit(..., first_token=None, ready=False)`` right when the
engine schedules the prompt's last prefill chunk sends the offers and starts
the transfers before the forward pass; :meth:`PrefillEndpoint.mark_layer_ready`
sends each layer as the forward finishes it (a layer marked before a
decoder accepted is sent as soon as it does), and
:meth:`PrefillEndpoint.set_first_token`, once the engine sampled, sends the
first token to every decoder in a :class:`~pddnet.handoff.FirstToken`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import LocalProtocolError, PddnetError, RemoteProtocolError, ResourceLimitError
from ..cache import CacheMirror, DrcEvicted, DrcInserted, DrcSnapshot, block_hashes
from ..control import ControlNode, TcpTuning
from ..handoff import FirstToken
from ..handoff._messages import K_MAX_TOKEN_ID
from ..kv import KVPool, block_ranges
from ..route import (
    MainCandidate,
    RelayCandidate,
    Route,
    RouteDecision,
    RoutePolicy,
    Router,
    RouteRequest,
)
from ..transport import Grant, Sender, Transfer
from ..transport.local import open_local_sender
from ..transport.wan import WanSender
from ..wire import encode_tokens
from ._decode import K_CONTROL_TCP, stats_payload
from ._info import EndpointInfo
from ._lease import LeaseTable
from ._messages import (
    K_FIRST_TOKEN_FOLLOWS,
    Abort,
    CutOffWan,
    Emitted,
    KvAccept,
    KvOffer,
    LeaseRenew,
    StatsReply,
    StatsRequest,
)
from ._sink import TokenSink, TokenStream

if TYPE_CHECKING:  # pddnet.directory imports pddnet.api
    from ..directory import Directory, DirectoryEvent

__all__ = ["BlocksReleased", "PrefillEndpoint", "PrefillStatistics", "Submission"]

log = logging.getLogger("pddnet.api")

K_BANDWIDTH_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BlocksReleased:
    """P's engine may reuse these source blocks.

    ``error`` is None when every transfer finished; otherwise why the lease
    ended early (a failed transfer, an expired lease, an abort).
    """

    request_id: int
    block_ids: tuple[int, ...]
    error: PddnetError | None = None


@dataclass(frozen=True, slots=True)
class Submission:
    """What :meth:`PrefillEndpoint.submit` did with a request."""

    request_id: int
    decision: RouteDecision
    hit_blocks: int  # prompt blocks MD already held
    sent_blocks_wan: int
    sent_blocks_local: int
    relay: str  # the RLD serving it ("" on P->MD)
    main: str  # the MD serving it


@dataclass(frozen=True, slots=True)
class PrefillStatistics:
    requests: int
    routed_relay: int
    routed_main: int
    wan_bytes: int
    wan_bytes_saved: int
    local_bytes: int
    transfers_failed: int
    leases_expired: int
    held_blocks: int


@dataclass
class _Out:
    dest: str
    transfer: Transfer
    nbytes: int
    started: float
    ahead: int = 0  # bytes queued ahead of it at the WAN sender when it started
    keys: list[int] | None = None  # to MD: the prompt's chain keys (expected once landed)


@dataclass
class _Req:
    rid: int
    first_token: int | None
    follows: bool  # submitted without its first token (set_first_token sends it)
    outs: dict[str, _Out] = field(default_factory=dict)
    layers: set[int] = field(default_factory=set)  # marked ready (for transfers not yet started)
    told: set[str] = field(default_factory=set)  # decoders sent the FirstToken
    released: bool = False  # its blocks went back (kept while it awaits its token)
    aborted: bool = False
    stream: TokenStream | None = None  # this endpoint is its sink
    eager_s: float = 0.0  # the relay's planned length: its eager tokens at RLD's rate

    @property
    def awaits_token(self) -> bool:
        return self.follows and self.first_token is None and not self.aborted


class PrefillEndpoint:
    """P's side of pddnet.

    Args:
        name: node name.
        pool: the engine's KV pool (the transfers read from it; never copied).
        secret: control-plane secret (or ``$PDDNET_SECRET``).
        control_bind: where the control ROUTER binds.
        engine_id, rank: this worker's identity for rendezvous.
        router: routing policy and RLD admission control (a default one if None).
        lease_s: how long source blocks stay held without a renewal.
        wan_options: keyword arguments for each :class:`WanSender` to MD.
        local_options: keyword arguments for each local-path sender to RLD.
        timeout: deadline of each transfer, seconds.
        max_requests: requests whose source blocks pddnet holds, at most;
            ``submit`` raises :class:`~pddnet.ResourceLimitError` past it.
        control_tcp, wan_control_paths: as for :class:`RelayEndpoint`.
        model_id: the model's fingerprint, as the engine states it (a name
            and revision, or a digest of its config and weights); decoders
            must state the same one, or :meth:`connect_peer` refuses them.
        md_capacity: requests one MD decodes at once (its decode batch), for
            the router's load rule, when :meth:`set_main_load` has not stated
            that MD's own; 0: unknown, load is not weighed.

    P's node is also a token sink: open a request's stream with
    ``p.sink.open(request_id, ...)`` and submit it with ``sink=p.name``
    (:class:`TokenSink`).
    """

    role = "prefill"

    def __init__(
        self,
        name: str,
        pool: KVPool,
        *,
        secret: bytes | str | None = None,
        control_bind: str = "tcp://127.0.0.1:0",
        engine_id: str = "",
        rank: int = 0,
        router: Router | None = None,
        lease_s: float = 10.0,
        wan_options: dict[str, Any] | None = None,
        local_options: dict[str, Any] | None = None,
        timeout: float = 60.0,
        max_requests: int = 4096,
        control_tcp: TcpTuning | None = K_CONTROL_TCP,
        wan_control_paths: int = 2,
        model_id: str = "",
        md_capacity: int = 32,
    ) -> None:
        self.name = name
        self.pool = pool
        self.model_id = model_id
        self.engine_id = engine_id or name
        self.rank = rank
        self.router = router or Router(RoutePolicy())
        self.timeout = timeout
        self.max_requests = max_requests
        self.node = ControlNode(name, secret=secret, bind=control_bind, tcp=control_tcp)
        self.wan_control_paths = wan_control_paths
        self.leases = LeaseTable(lease_s)
        self.sink = TokenSink(self.node, route=False)
        self.mirrors: dict[str, CacheMirror] = {}  # MD name -> mirror of its cache
        self._wan_options = wan_options or {}
        self._local_options = local_options or {}
        self._resyncing: set[str] = set()  # MDs asked for a snapshot
        self._senders: dict[str, Sender] = {}
        self._sender_scopes: dict[str, trio.CancelScope] = {}
        self._roles: dict[str, str] = {}
        self._infos: dict[str, EndpointInfo] = {}  # decoder -> the handshake it was connected by
        self._reqs: dict[int, _Req] = {}
        self._events_in, self._events = trio.open_memory_channel[BlocksReleased](1 << 16)
        self._lease_changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._sender_nursery: Any = None
        self._stack: Any = None
        self._stats = dict.fromkeys(PrefillStatistics.__dataclass_fields__, 0)
        self.md_capacity = md_capacity
        self._md_open: dict[str, set[int]] = {}  # MD -> requests open there, as P sees
        self._md_load: dict[str, tuple[int, int]] = {}  # MD -> (active, capacity) stated

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> PrefillEndpoint:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.node)
            # Senders live in a nursery of their own, closed after the main
            # one and without cancellation, so their shutdown runs to the end.
            self._sender_nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(self._stop_senders)
            await stack.enter_async_context(self.sink)
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._stack = stack.pop_all()
        self.node.route(LeaseRenew, self._on_renew)
        self.node.route(Abort, self._on_abort)
        self.node.route(CutOffWan, self._on_cut_off)
        self.node.route(Emitted, self.sink.on_emitted)
        self.node.route(StatsRequest, self._on_stats)
        for cls in (DrcInserted, DrcEvicted, DrcSnapshot):
            self.node.route(cls, self._on_drc)
        self._nursery.start_soon(self._expire_loop)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        return bool(await self._stack.__aexit__(*exc))

    def _stop_senders(self) -> None:
        for scope in self._sender_scopes.values():
            scope.cancel()

    async def _run_sender(
        self, sender: Any, scope: trio.CancelScope, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with sender:
            task_status.started()
            with scope:  # cancelling it closes the sender cleanly
                await trio.sleep_forever()

    def info(self) -> EndpointInfo:
        return EndpointInfo(
            self.name,
            self.role,
            self.engine_id,
            self.rank,
            self.node.address,
            "",
            self.pool.layout,
            self.model_id,
        )

    async def connect_peer(self, info: EndpointInfo) -> None:
        """Connect to a decode endpoint: control plane, data path, and (for MD)
        a subscription to its radix-cache events.

        Raises:
            LayoutMismatch: if the peer's KV layout or model differs from ours
                (:meth:`EndpointInfo.check_peer`).
            LocalProtocolError: if the peer is not a decode endpoint.
        """
        if info.role not in ("relay", "main"):
            raise LocalProtocolError(f"{info.name} is a {info.role} endpoint, not a decoder")
        self.info().check_peer(info)
        paths = self.wan_control_paths if info.role == "main" else 1  # MD is across the WAN
        await self.node.connect(info.name, info.control, paths=paths)
        # TCP streams prove the shared secret before any chunk
        if info.role == "relay":  # UCX for a ucx: address, else TCP
            sender = open_local_sender(info.data, secret=self.node.key, **self._local_options)
        else:
            sender = WanSender(info.data, secret=self.node.key, **self._wan_options)
        scope = trio.CancelScope()
        await self._sender_nursery.start(self._run_sender, sender, scope)
        old = self._sender_scopes.pop(info.name, None)
        if old is not None:
            old.cancel()
        self._senders[info.name] = sender
        self._sender_scopes[info.name] = scope
        self._roles[info.name] = info.role
        self._infos[info.name] = info
        if info.role == "main":
            mirror = self.mirrors[info.name] = CacheMirror(
                self.pool.layout.block_size, bytes_per_token=self.pool.layout.kv_bytes_per_token
            )
            await self.node.request(info.name, mirror.snapshot_request(), timeout=10.0)

    def remove_peer(self, name: str) -> None:
        """Stop routing to decoder ``name`` (it left the directory, or died):
        its sender and our control connections to it close
        (:meth:`ControlNode.disconnect`), its mirror, load and link estimate
        go. Requests in flight to it end as the fault tables promise: their
        transfers to it are cancelled (:class:`BlocksReleased` with the
        error, the RLD slot given back) and their other decoders fail them
        on their own timers. Unknown names are ignored."""
        self.node.disconnect(name)  # a connection connect_peer made before it failed, too
        role = self._roles.pop(name, None)
        if role is None:
            return
        self._infos.pop(name, None)
        scope = self._sender_scopes.pop(name, None)
        if scope is not None:
            scope.cancel()
        self._senders.pop(name, None)
        self.mirrors.pop(name, None)
        self._md_load.pop(name, None)
        self._md_open.pop(name, None)
        self.router.forget(name)
        for req in self._reqs.values():
            out = req.outs.get(name)
            if out is not None:
                out.transfer.cancel()
                if role == "relay":
                    self.router.release(req.rid)

    async def apply_member(self, event: DirectoryEvent) -> None:
        """Follow the directory (:meth:`~pddnet.directory.Directory.watch`):
        a decoder that joins is connected (:meth:`connect_peer`), an MD's
        load update is passed to the router (:meth:`set_main_load`), and a
        decoder that left is removed (:meth:`remove_peer`). A decoder that
        comes back under its name with another handshake (a new process:
        new addresses), even before its old lease expired, is a new
        incarnation: the old one is removed first, so no connection, mirror,
        load, link estimate or transfer of it carries over. Other roles,
        and ourselves, are ignored.

        Raises:
            LayoutMismatch: a joining decoder's layout or model differs.
            PddnetError: it could not be connected (it stays unknown: what
                was connected is removed, and a later event of it, a load
                update say, tries again).

        Cancellation: a decoder being connected is removed again.
        """
        from ..directory import MemberLeft  # not at the top: it imports pddnet.api

        if isinstance(event, MemberLeft):
            self.remove_peer(event.name)
            return
        member = event.member
        if member.role not in ("relay", "main") or member.name == self.name:
            return
        known = self._infos.get(member.name)
        if known != member.info:
            if known is not None:
                self.remove_peer(member.name)
            try:
                await self.connect_peer(member.info)
            except BaseException:
                self.remove_peer(member.name)  # half connected: unknown, a later event retries
                raise
        if member.role == "main":
            self.set_main_load(member.name, member.load.active, member.load.capacity)

    async def follow(
        self, directory: Directory, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Apply every event of ``directory``'s watch (its members now, then
        each join, update and leave, :meth:`apply_member`) until cancelled.
        ``await nursery.start(p.follow, directory)`` returns once the watch
        is open: no later change is missed. A decoder that cannot be
        connected is logged and skipped.

        Raises:
            PeerUnavailable, TransferTimeout: the watch broke (open a new one).

        Cancellation: the watch closes; connected peers stay.
        """
        async with directory.watch() as events:
            task_status.started()
            async for event in events:
                try:
                    await self.apply_member(event)
                except PddnetError as exc:
                    log.warning("%s: directory event %s not applied: %s", self.name, event, exc)

    def statistics(self) -> PrefillStatistics:
        return PrefillStatistics(**{**self._stats, "held_blocks": self.leases.held_blocks()})

    # ------------------------------------------------------------- requests
    def _peers(self, role: str, name: str | None) -> tuple[str, ...]:
        """The connected peers of ``role`` the router may choose from: the one
        named, or all (none connected: empty)."""
        if name is not None:
            if self._roles.get(name) != role:
                raise LocalProtocolError(f"{name!r} is not a connected {role} endpoint")
            return (name,)
        return tuple(peer for peer, r in self._roles.items() if r == role)

    def _candidates(
        self, prompt: Any, nblocks: int, main: str | None
    ) -> tuple[tuple[MainCandidate, ...], list[int]]:
        """Each MD's delta (from the mirror of its cache: KV still in flight
        to it is not there yet) and the bytes queued ahead of it at its sender;
        the prompt's chain keys."""
        mains = self._peers("main", main)
        if not mains:
            raise LocalProtocolError("no main endpoint connected")
        keys = block_hashes(prompt, self.pool.layout.block_size).tolist()  # probed per MD
        now = trio.current_time()
        out = []
        for md in mains:
            mirror = self.mirrors[md]
            mirror.expire(now)
            delta = (nblocks - mirror.predict(keys)) * self.pool.layout.block_bytes
            sender = self._senders[md]
            ahead = sender.bytes_ahead(delta) if isinstance(sender, WanSender) else 0
            active, capacity = self._md_load.get(md, (0, self.md_capacity))
            active = max(active, len(self._md_open.get(md, ())))
            out.append(MainCandidate(md, delta, ahead, active, capacity))
        return tuple(out), keys

    def set_main_load(self, name: str, active: int, capacity: int) -> None:
        """State MD ``name``'s load as the cluster sees it (the directory's
        :class:`~pddnet.directory.Load`: every prefill instance's requests,
        and its decode batch). The router reads ``active`` or the requests
        this endpoint has open there, whichever is more, and ``capacity``
        instead of ``md_capacity``."""
        self._md_load[name] = (active, capacity)

    async def submit(
        self,
        request_id: int,
        prompt: Sequence[int],
        block_ids: Sequence[int],
        first_token: int | None,
        max_tokens: int,
        *,
        sink: str,
        route: Route | None = None,
        relay: str | None = None,
        main: str | None = None,
        ready: bool = True,
        deadline_s: float | None = None,
    ) -> Submission:
        """Route a prefilled request and start shipping its KV.

        Args:
            request_id: unique id of the request.
            prompt: its token ids.
            block_ids: the pool blocks holding the prompt's KV, in order.
            first_token: the token prefill produced (position 0 of the stream);
                None if the engine has not sampled yet: the offers and
                transfers start now, the decoders wait for
                :meth:`set_first_token` before they decode.
            max_tokens: output limit, ``first_token`` included.
            sink: node that receives the user's token stream.
            route: force a route; None lets the router decide.
            relay, main: pick peers by name (default: the router chooses among
                the connected ones: docs/cluster.md, "Routing across instances").
            ready: False to stream layer by layer (:meth:`mark_layer_ready`).
            deadline_s: the request's deadline in seconds: the decoders give up
                waiting for its KV or batches after it, with a typed error.

        Returns:
            The route taken and the blocks sent each way. Completion shows up
            as :class:`BlocksReleased` from :meth:`next_event`.

        Raises:
            LocalProtocolError: for a duplicate id, too few blocks or a
                ``first_token`` that is not a uint32 token id.
            ResourceLimitError: ``max_requests`` requests are in flight.
            RemoteCallError: if a decoder refused the request (no free blocks, ...).
            TransferTimeout: if a decoder did not answer.

        Cancellation: offers already accepted are aborted; no lease is left.
        """
        if request_id in self._reqs or request_id in self.leases:
            raise LocalProtocolError("duplicate request id", request_id=request_id)
        if len(self._reqs) >= self.max_requests:
            raise ResourceLimitError(
                f"{len(self._reqs)} requests in flight (max_requests={self.max_requests})",
                request_id=request_id,
            )
        if first_token is not None and not 0 <= first_token <= K_MAX_TOKEN_ID:
            raise LocalProtocolError(f"bad first_token {first_token}", request_id=request_id)
        prompt_arr = np.asarray(prompt, dtype=np.int64)
        nblocks = self.pool.layout.blocks_for_tokens(prompt_arr.size)
        if len(block_ids) < nblocks:
            raise LocalProtocolError(
                f"{len(block_ids)} blocks cannot hold a {prompt_arr.size}-token prompt",
                request_id=request_id,
            )
        mains, keys = self._candidates(prompt_arr, nblocks, main)
        relays = tuple(RelayCandidate(r) for r in self._peers("relay", relay))
        now = trio.current_time()
        decision = self.router.decide(
            RouteRequest(request_id, 0, max_tokens, mains=mains, relays=relays, route=route), now
        )
        main_peer = decision.main
        # From here on the router may hold an RLD slot for the request: every
        # failure below, even before an offer went out, must give it back.
        req = _Req(request_id, first_token, follows=first_token is None)
        accepts: dict[str, KvAccept] = {}
        try:
            if not decision.uses_wan:
                raise LocalProtocolError(
                    "the P->RLD-only route is not served by this endpoint", request_id=request_id
                )
            relay_peer = decision.relay
            offer = KvOffer(
                request_id,
                encode_tokens(prompt_arr),
                K_FIRST_TOKEN_FOLLOWS if first_token is None else int(first_token),
                int(max_tokens),
                relay_peer,
                main_peer,
                sink,
                float(deadline_s or 0.0),
            )
            dests = [main_peer] + ([relay_peer] if relay_peer else [])
            stream = self.sink.stream(request_id) if sink == self.name else None
            if stream is not None:  # our own sink can ask them for lost tokens
                stream.watch(*dests, relay=relay_peer, main=main_peer)
            self._reqs[request_id] = req
            req.stream = stream
            req.eager_s = decision.eager_tokens / self.router.policy.rld_decode_rate
            self._md_open.setdefault(main_peer, set()).add(request_id)
            self.leases.acquire(request_id, tuple(int(b) for b in block_ids), set(dests), now)
            self._lease_changed.set()
            views = self.pool.host_views()
            errors: list[PddnetError] = []

            async def offer_and_send(dest: str) -> None:
                try:
                    await _offer_and_send(dest)
                except PddnetError as exc:  # re-raised below, not as an exception group
                    errors.append(exc)

            async def _offer_and_send(dest: str) -> None:
                # Each destination starts as soon as it accepted: RLD's local
                # transfer never waits for MD's answer across the WAN.
                reply = await self.node.request(dest, offer, timeout=10.0)
                if not isinstance(reply, KvAccept) or reply.request_id != request_id:
                    raise RemoteProtocolError(
                        "bad answer to KvOffer", peer=dest, request_id=request_id
                    )
                if not 0 <= reply.skip_blocks <= nblocks:
                    raise RemoteProtocolError("bad skip_blocks", peer=dest, request_id=request_id)
                accepts[dest] = reply
                src = block_ranges(
                    self.pool.layout,
                    self.pool.num_blocks,
                    list(block_ids[reply.skip_blocks : nblocks]),
                )
                grant = Grant(
                    reply.transfer_id, reply.total, tuple(reply.layer_ends), reply.address
                )
                transfer = self._senders[dest].start(
                    grant,
                    views,
                    src,
                    priority=1 if dest == relay_peer else 0,
                    timeout=min(self.timeout, deadline_s or self.timeout),
                    ready=ready,
                )
                for layer in sorted(req.layers):  # marked while the offer was out
                    transfer.mark_layer_ready(layer)
                to_md = dest == main_peer
                req.outs[dest] = out = _Out(
                    dest,
                    transfer,
                    src.total,
                    trio.current_time(),
                    decision.bytes_ahead if to_md else 0,
                    keys if to_md else None,
                )
                assert self._nursery is not None
                self._nursery.start_soon(self._watch, req, out)
                if req.follows and req.first_token is not None:
                    await self._tell_first_token(req, dest)  # set while the offer was out
                if to_md and stream is not None:
                    self._nursery.start_soon(self._follow, request_id, stream, decision)

            async with trio.open_nursery() as nursery:
                for dest in dests:
                    nursery.start_soon(offer_and_send, dest)
            if errors:
                raise errors[0]
        except BaseException:
            for out in req.outs.values():
                out.transfer.cancel()
            for dest in accepts:
                await self._send_abort(dest, request_id, "offer abandoned")
            if decision.uses_rld:
                self.router.release(request_id)
            self._md_open.get(main_peer, set()).discard(request_id)
            self.leases.release(request_id)
            self._reqs.pop(request_id, None)
            raise
        skip = accepts[main_peer].skip_blocks
        self._stats["requests"] += 1
        self._stats["routed_relay" if relay_peer else "routed_main"] += 1
        self._stats["wan_bytes"] += req.outs[main_peer].nbytes
        self._stats["wan_bytes_saved"] += skip * self.pool.layout.block_bytes
        if relay_peer:
            self._stats["local_bytes"] += req.outs[relay_peer].nbytes
        return Submission(
            request_id,
            decision,
            skip,
            nblocks - skip,
            nblocks if relay_peer else 0,
            relay_peer,
            main_peer,
        )

    def mark_layer_ready(self, request_id: int, layer: int, dest: str | None = None) -> None:
        """Layer ``layer`` of the request's KV is final: send it (``ready=False``).

        May come while :meth:`submit` still waits for the decoders' answers:
        a transfer that starts later sends the layers marked before it.

        Args:
            dest: only to this decoder's transfer, if it started (default: to
                every destination, now or once it accepted).

        Raises:
            LocalProtocolError: unknown request, or no such layer.
        """
        req = self._reqs.get(request_id)
        if req is None:
            raise LocalProtocolError("unknown request", request_id=request_id)
        if not 0 <= layer < self.pool.layout.num_layers:
            raise LocalProtocolError(f"no layer {layer}", request_id=request_id)
        if dest is None:
            req.layers.add(layer)
        for out in req.outs.values():
            if dest is None or out.dest == dest:
                out.transfer.mark_layer_ready(layer)

    async def set_first_token(self, request_id: int, token: int) -> None:
        """The engine sampled the first token of a request submitted with
        ``first_token=None``: send it to each of its decoders (those that
        have not accepted yet get it right after they do, from :meth:`submit`).

        The :class:`~pddnet.handoff.FirstToken` goes one-way, as the handoff
        messages do: a decoder that already handed the request over (RLD, when
        MD's KV landed first and MD decodes from position 0) no longer knows
        it and drops it with a ``RemoteProtocolError`` of its own.

        Raises:
            LocalProtocolError: an unknown request, one submitted with its
                first token or given it already, or not a uint32 token id.
            TransferTimeout, PeerUnavailable: a decoder could not be sent to.

        Cancellation: the decoders not yet told may never get it; they fail
        the request after their ``kv_timeout_s``.
        """
        req = self._reqs.get(request_id)
        if req is None or not req.follows or req.first_token is not None:
            raise LocalProtocolError(
                "set_first_token needs a request submitted with first_token=None, once",
                request_id=request_id,
            )
        if not 0 <= token <= K_MAX_TOKEN_ID:
            raise LocalProtocolError(f"bad first token {token}", request_id=request_id)
        req.first_token = int(token)
        errors: list[PddnetError] = []

        async def tell(dest: str) -> None:
            try:
                await self._tell_first_token(req, dest)
            except PddnetError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for dest in list(req.outs):
                nursery.start_soon(tell, dest)
        self._forget_if_done(req)
        if errors:
            raise errors[0]

    async def abort(self, request_id: int, reason: str = "aborted by the engine") -> None:
        """Cancel the request's transfers, tell its decoders, free its blocks."""
        req = self._reqs.get(request_id)
        if req is None:
            return
        req.aborted = True  # no first token will follow
        self._ended(req.rid)
        for out in req.outs.values():
            out.transfer.cancel()
            await self._send_abort(out.dest, request_id, reason)
        self._forget_if_done(req)

    async def next_event(self) -> BlocksReleased:
        """Wait for the next :class:`BlocksReleased`."""
        return await self._events.receive()

    def poll_events(self) -> list[BlocksReleased]:
        """Every :class:`BlocksReleased` so far, without waiting."""
        out = []
        while True:
            try:
                out.append(self._events.receive_nowait())
            except trio.WouldBlock:
                return out

    # ------------------------------------------------------------- internals
    async def _watch(self, req: _Req, out: _Out) -> None:
        error: PddnetError | None = None
        try:
            await out.transfer.wait()
            mirror = self.mirrors.get(out.dest)
            if out.keys is not None and mirror is not None:
                # landed: MD caches these blocks when the request ends
                mirror.expect(out.keys, trio.current_time())
            if self._roles.get(out.dest) == "main" and out.nbytes >= K_BANDWIDTH_SAMPLE_BYTES:
                # Small transfers measure the RTT, not the bandwidth: only
                # large ones update the router's estimate of that MD's link,
                # which drained the bytes queued ahead of the transfer too.
                link = self.router.link_for(out.dest)
                elapsed = trio.current_time() - out.started - link.rtt_s
                if elapsed > 0:
                    sample = (out.nbytes + out.ahead) / elapsed
                    self.router.update_link(bandwidth_bytes_s=sample, weight=0.2, main=out.dest)
        except PddnetError as exc:
            error = exc
            self._stats["transfers_failed"] += 1
            log.info("%s: transfer of %s to %s failed: %s", self.name, req.rid, out.dest, exc)
        blocks = self.leases.finish(req.rid, out.dest)
        if blocks is not None:
            req.released = True
            self._forget_if_done(req)
            self._events_in.send_nowait(BlocksReleased(req.rid, blocks, error))
        if req.stream is None or error is not None:
            # Without the stream P sees nothing of the request after its KV
            # landed: MD's request counts until then, and RLD's slot until the
            # relay's planned end (its eager tokens at the policy's rate).
            if self._roles.get(out.dest) == "relay":
                if error is None:
                    await trio.sleep(req.eager_s)
                self.router.release(req.rid)
            else:
                self._md_open.get(out.dest, set()).discard(req.rid)

    async def _follow(self, rid: int, stream: TokenStream, decision: RouteDecision) -> None:
        """The request's end at its decoders, as its token stream shows it
        (this endpoint is the sink): RLD lets go at the handover (MD's first
        token here) or when the stream ends, and MD when the stream ends;
        a stream that fails ends it too."""
        try:
            async for token in stream:
                if token.source == decision.main:
                    self.router.release(rid)  # handed over: RLD let go
        except PddnetError:
            pass
        finally:
            self._ended(rid)

    def _ended(self, rid: int) -> None:
        """The request ended at its decoders (or will never reach them)."""
        self.router.release(rid)
        for open_ in self._md_open.values():
            open_.discard(rid)

    def _forget_if_done(self, req: _Req) -> None:
        # A request whose KV went out layer by layer may still owe its first token.
        if req.released and not req.awaits_token:
            self._reqs.pop(req.rid, None)

    async def _tell_first_token(self, req: _Req, dest: str) -> None:
        if dest in req.told or req.first_token is None:
            return
        req.told.add(dest)  # once per decoder, whichever of submit / set_first_token comes first
        await self.node.send(dest, FirstToken(req.rid, req.first_token), timeout=10.0)

    def _on_stats(self, peer: str, msg: StatsRequest) -> StatsReply:
        return StatsReply(stats_payload(self.statistics(), self.router.decisions()))

    def _on_renew(self, peer: str, msg: LeaseRenew) -> None:
        self.leases.renew(msg.request_id, trio.current_time())

    async def _on_abort(self, peer: str, msg: Abort) -> None:
        # a decoder gave up on the request: its stream (if we are the sink)
        # fails, and its transfers stop
        self.sink.on_abort(peer, msg)
        req = self._reqs.get(msg.request_id)
        if req is not None:
            for out in req.outs.values():
                out.transfer.cancel()

    def _on_cut_off(self, peer: str, msg: CutOffWan) -> None:
        # strange traffic: RLD finished first; stop feeding MD only
        req = self._reqs.get(msg.request_id)
        if req is not None:
            for out in req.outs.values():
                if self._roles.get(out.dest) == "main":
                    out.transfer.cancel()

    def _on_drc(self, peer: str, msg: Any) -> None:
        mirror = self.mirrors.get(peer)
        if mirror is None:
            return  # not a connected MD
        mirror.apply(msg)
        if mirror.needs_snapshot and peer not in self._resyncing and self._nursery is not None:
            # the mirror saw a gap or an MD restart: ask for the whole key set again
            self._resyncing.add(peer)
            self._nursery.start_soon(self._resync, peer, mirror)

    async def _resync(self, peer: str, mirror: CacheMirror) -> None:
        try:
            await self.node.request(peer, mirror.snapshot_request(), timeout=10.0)
        except PddnetError as exc:
            log.info("%s: cache snapshot from %s failed: %s", self.name, peer, exc)
        finally:
            self._resyncing.discard(peer)

    async def _send_abort(self, dest: str, request_id: int, reason: str) -> None:
        try:
            await self.node.send(dest, Abort(request_id, reason), timeout=2.0)
        except PddnetError as exc:
            log.info("%s: abort of %s to %s lost: %s", self.name, request_id, dest, exc)

    async def _expire_loop(self) -> None:
        while True:
            self._lease_changed = trio.Event()
            with trio.move_on_at(self.leases.next_expiry()):
                await self._lease_changed.wait()
            for lease in self.leases.expire(trio.current_time()):
                self._stats["leases_expired"] += 1
                req = self._reqs.pop(lease.request_id, None)
                self._ended(lease.request_id)
                if req is not None:
                    for out in req.outs.values():
                        out.transfer.cancel()
                err = PddnetError(
                    "lease expired: no renewal from the receivers", request_id=lease.request_id
                )
                self._events_in.send_nowait(BlocksReleased(lease.request_id, lease.blocks, err))
