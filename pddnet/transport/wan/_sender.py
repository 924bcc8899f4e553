"""The WAN sender: N persistent TCP streams to one receiver, driven from trio.

Each stream runs two tasks: a send loop that waits until its socket is
writable (below ``TCP_NOTSENT_LOWAT``), *then* pulls the next chunk from the
shared :class:`~._scheduler.Scheduler` (so the choice is made as late as
possible and priority works), and an ack loop that reads link frames. A
stream that fails hands its unacknowledged chunks back to the scheduler and
reconnects with exponential backoff. A sampling task reads ``TCP_INFO`` from
every stream and applies the pacer's decisions. A timer task enforces
deadlines and reports a peer that stays unreachable as ``PeerUnavailable``.

Each connection is, in order: TCP connect, TLS handshake (if a
:class:`TlsConfig` is given), the challenge-response under the shared secret
(if one is given; inside TLS when both are on). A connection that fails TLS
or authentication while no stream is up fails the running transfers at once
with :class:`~pddnet.AuthError` (a misconfiguration does not heal by waiting).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..._errors import (
    AuthError,
    LocalProtocolError,
    PddnetError,
    PeerUnavailable,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from ...kv import ByteRanges
from ...wire import K_CHUNK_FLAG_TRAILER, K_CHUNK_HEADER_SIZE, ChecksumAlgo, ChunkHeader
from ...wire._auth import AuthRole
from .._auth import authenticate
from .._base import Grant, ProgressCallback, Sender, Transfer, TransferState, views_of
from ._framing import K_MAX_PAD, LinkCode, LinkFrame, LinkKind
from ._io import (
    Digest,
    EndOfStream,
    FrameReader,
    can_trail,
    close,
    connect,
    digest_of,
    open_native,
    send_all,
)
from ._pacer import Pacer, PacingDecision, TcpSample, UnsentMark, make_pacer
from ._scheduler import Chunk, Scheduler, TransferFailed, TransferProgress
from ._sockopts import (
    available_congestion,
    read_tcp_info,
    set_notsent_lowat,
    set_pacing_rate,
    tune_socket,
)
from ._tls import TlsConfig, tls_handshake

__all__ = [
    "SenderStatistics",
    "StreamStatistics",
    "WanSender",
    "WanTransfer",
    "bulk_chunk_size",
    "default_streams",
    "path_chunk_size",
]

log = logging.getLogger(__name__)

# Defaults; docs/wan.md records the measurements behind them.
# Streams per congestion control ("Stream count" in docs/wan.md): bbr gains at
# most 2-3 % goodput from 8 to 16 streams and small transfers wait longer; cubic
# needs 16 on lossy long paths (1.7-1.8x the goodput of 8 at 80 ms / 1 %).
K_DEFAULT_STREAMS = 8
K_DEFAULT_STREAMS_LOSS_BASED = 16
K_DEFAULT_URGENT_PACING = 0.9
# One express stream (priority > 0 chunks only, unpaced, warmed up at connect):
# small urgent transfers skip the bulk streams' pacing, unsent bytes and loss
# holes ("Express stream" in docs/wan.md).
K_DEFAULT_EXPRESS_STREAMS = 1
K_EXPRESS_WARMUP = 1 << 20
# K_EXPRESS_CHECK_RTTS after connecting, an express stream must have been granted a
# receive window of at least this much, else it is re-opened (at most
# K_EXPRESS_REOPENS times per stream): in about one fresh connection in four on the
# emulated WAN the receiver's window stayed at its initial ~10 segments (94 KB) for
# good, and every small transfer took three RTTs ("Express stream window" in
# docs/wan.md).
K_EXPRESS_MIN_WINDOW = 256 << 10
K_EXPRESS_REOPENS = 3
K_EXPRESS_CHECK_RTTS = 4
K_DEFAULT_CHUNK = 1 << 20
# Chunk size per path ("Chunking" in docs/wan.md): on a path whose RTT floor is
# under K_FAST_PATH_RTT, with (almost) no retransmissions, chunks grow up to
# K_MAX_CHUNK (max_chunk_size), as large as one stream moves in K_CHUNK_TIME at
# its pacing rate.
# There the per-chunk work (Python on both sides, one ack) is what limits
# goodput, and a stream still frees up within a few ms for an urgent chunk.
K_MAX_CHUNK = 8 << 20
K_FAST_PATH_RTT = 1e-3
K_CHUNK_TIME = 2e-3
K_FAST_PATH_MAX_RETRANS = 1e-3  # retransmitted / sent on the current connections
K_DEFAULT_BUFFER = 32 << 20
K_DEFAULT_NOTSENT_LOWAT = 256 << 10
# On a fast path (chunks above the base size) the bulk streams' unsent low-water
# mark rises to this: 4x fewer sendmsg calls and wake-ups per chunk; loopback
# goodput 0.69-0.72 -> 0.80-0.83 of plain TCP in A/B (docs/wan.md "Chunking").
# Urgent chunks take the express stream, which keeps the configured mark.
K_FAST_NOTSENT_LOWAT = 1 << 20
# On any path the bulk streams' mark rises to K_IDLE_NOTSENT_LOWAT while no urgent
# transfer runs (:class:`~._pacer.UnsentMark`), and stays at the configured mark
# until K_MARK_HOLD after the last urgent one ended (docs/wan.md, "The unsent mark
# only while no urgent transfer runs").
K_IDLE_NOTSENT_LOWAT = 1 << 20
K_MARK_HOLD = 0.2
# In the same state (the mark high: no urgent transfer for K_MARK_HOLD) the bulk
# chunks are at least this large (at most max_chunk_size): fewer per-chunk headers,
# grant lookups, cancel scopes and acks on both sides (docs/wan.md, "Larger chunks
# while no urgent transfer runs"); an urgent transfer's start drops the size back.
# 8 MiB: 0.91 -> 0.72 CPU s/GB (both sides) against 4 MiB in paired A/B on the
# quick emulated link, the trio thread's wake-ups 921 -> 640 per GB (session 11).
K_BULK_CHUNK = 8 << 20
K_DEFAULT_ALGO = ChecksumAlgo.XXH3_64
# A chunk at least this long, sent for the first time over the native mover with
# XXH3, carries its checksum in a trailer: hashed right after the kernel's copy
# (in cache) instead of in a cold pass before it, 2-3x cheaper under memory
# contention (docs/wan.md). Shorter (urgent) chunks keep it in the header.
K_TRAILER_MIN_CHUNK = 1 << 20
K_SAMPLE_PERIOD = 0.1
K_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def path_chunk_size(samples: Sequence[TcpSample], *, base: int, largest: int) -> int:
    """The chunk size for the path that the bulk streams' ``TCP_INFO`` samples show.

    ``base`` unless the path is short and clean: every stream's RTT floor under
    ``K_FAST_PATH_RTT`` and at most ``K_FAST_PATH_MAX_RETRANS`` of the bytes
    retransmitted. Then the largest ``base * 2**k`` (at most ``largest``) that one
    stream moves within ``K_CHUNK_TIME`` at its pacing rate (the median stream's),
    so a large chunk still frees its stream within a few ms for an urgent chunk.

    Args:
        samples: the latest sample of each connected bulk stream.
        base: the chunk size for long or lossy paths (and with no samples).
        largest: the most it may grow to.

    Returns:
        The chunk size in bytes.
    """
    if largest <= base or not samples:
        return base
    floor = max(x.min_rtt or x.rtt for x in samples)
    retrans = sum(x.bytes_retrans for x in samples)
    if floor >= K_FAST_PATH_RTT or retrans > K_FAST_PATH_MAX_RETRANS * sum(
        x.bytes_sent for x in samples
    ):
        return base
    rates = sorted(x.pacing_rate for x in samples)
    fits = min(rates[len(rates) // 2] * K_CHUNK_TIME, largest)
    size = base
    while size * 2 <= fits:
        size *= 2
    return size


def bulk_chunk_size(path: int, *, largest: int, bulk_only: bool) -> int:
    """The chunk size the scheduler cuts now.

    The path's size (:func:`path_chunk_size`) while an urgent transfer is about;
    with bulk alone (:meth:`~._pacer.UnsentMark.bulk_only`) at least
    ``K_BULK_CHUNK``, at most ``largest``: no urgent chunk waits for a stream
    then, and one that comes later is cut after the size has dropped back.

    Args:
        path: the path's chunk size.
        largest: the most it may grow to (``max_chunk_size``).
        bulk_only: whether no urgent transfer runs or ended within the hold.

    Returns:
        The chunk size in bytes.
    """
    return max(path, min(K_BULK_CHUNK, largest)) if bulk_only else path


def express_window_ok(sample: TcpSample | None) -> bool:
    """Whether an express stream's receive window is wide enough for urgent
    transfers (a kernel that does not report it counts as wide enough)."""
    return sample is None or sample.snd_wnd == 0 or sample.snd_wnd >= K_EXPRESS_MIN_WINDOW


class _Reopen(Exception):
    """Drop this connection and make a new one (a window-limited express stream)."""


def _zeros(n: int) -> memoryview:
    return memoryview(bytes(n))


def _default_congestion() -> str | None:
    return "bbr" if "bbr" in available_congestion() else None


def default_streams(congestion: str | None) -> int:
    """The default stream count for a congestion control (None: the system's).

    Args:
        congestion: a ``TCP_CONGESTION`` name, or None for the system default.

    Returns:
        8 for bbr; 16 for loss-based controls (cubic, reno, the usual system
        default), which need more parallel windows on lossy long paths.
    """
    return K_DEFAULT_STREAMS if congestion == "bbr" else K_DEFAULT_STREAMS_LOSS_BASED


@dataclass(frozen=True, slots=True)
class StreamStatistics:
    """One stream: counters and its latest ``TCP_INFO`` sample."""

    index: int
    up: bool
    congestion: str
    bytes_sent: int
    chunks_sent: int
    chunks_trailed: int  # of chunks_sent: with the checksum in a trailer (docs/wire.md)
    connects: int
    rtt: float
    delivery_rate: float
    bytes_retrans: int
    pacing_rate: float


@dataclass(frozen=True, slots=True)
class SenderStatistics:
    """Counters of a :class:`WanSender` (bytes are payload bytes)."""

    bytes_sent: int
    bytes_verified: int
    bytes_resent: int
    chunks_hedged: int
    transfers_running: int
    active_streams: int
    rate_per_stream: float | None
    streams: tuple[StreamStatistics, ...]
    chunk_size: int = K_DEFAULT_CHUNK

    @property
    def bytes_retrans(self) -> int:
        """TCP-level retransmitted bytes over all streams (current connections)."""
        return sum(s.bytes_retrans for s in self.streams)


class WanTransfer(Transfer):
    """The sender's handle on one transfer (see :class:`~pddnet.transport.Transfer`)."""

    def __init__(
        self,
        sender: WanSender,
        grant: Grant,
        views: list[memoryview],
        ranges: ByteRanges,
        progress: ProgressCallback | None,
    ) -> None:
        self.transfer_id = grant.transfer_id
        self.grant = grant
        self.views = views
        self.ranges = ranges
        self.progress = progress
        self._sender = sender
        self._state = TransferState.RUNNING
        self._done = trio.Event()
        self.error: PddnetError | None = None
        self.started_at = trio.current_time()
        self.finished_at: float | None = None

    @property
    def state(self) -> TransferState:
        return self._state

    def mark_ready(self, lo: int, hi: int) -> None:
        if self._state is not TransferState.RUNNING:
            return
        self._sender._sched.mark_ready(self.transfer_id, lo, hi)
        self._sender._wake()

    def mark_layer_ready(self, layer: int) -> None:
        if not 0 <= layer < len(self.grant.layer_ends):
            raise LocalProtocolError(f"grant has no layer {layer}", transfer_id=self.transfer_id)
        self.mark_ready(*self.grant.layer_span(layer))

    async def wait(self) -> None:
        await self._done.wait()
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self._sender._cancel(self.transfer_id)

    def _finish(self, error: PddnetError | None) -> None:
        if self._done.is_set():
            return
        self.error = error
        self.finished_at = trio.current_time()
        if error is None:
            self._state = TransferState.DONE
        elif isinstance(error, TransferCancelled):
            self._state = TransferState.CANCELLED
        else:
            self._state = TransferState.FAILED
        self._done.set()


@dataclass(eq=False)
class _Stream:
    index: int
    sock: Any = None
    up: bool = False
    congestion: str = ""
    bytes_sent: int = 0
    chunks_sent: int = 0
    chunks_trailed: int = 0  # of chunks_sent: checksum in a trailer (K_TRAILER_MIN_CHUNK)
    connects: int = 0
    control: list[LinkFrame] = field(default_factory=list)
    sample: TcpSample | None = None
    notsent_lowat: int = 0  # as set on the current connection
    reopens: int = 0  # express: connections dropped for a narrow receive window


class WanSender(Sender):
    """N persistent TCP streams to one WAN receiver, shared by every transfer to it.

    Use as ``async with WanSender(address) as tx:``; connections are made once
    and reused; a lost one is re-made with backoff.

    Args:
        address: the receiver's ``host:port`` (:attr:`WanReceiver.address`).
        streams: TCP connections to open for bulk data (None: :func:`default_streams`
            of the congestion control, 8 for bbr, 16 for cubic).
        express_streams: extra connections reserved for ``priority > 0`` transfers
            (with the ``priority`` policy): bulk never fills their sockets, they are
            not paced, and each is warmed up at connect (``express_warmup``). One by
            default (small urgent transfers' p50 about 0.7x, docs/wan.md); 0: none.
        express_congestion: congestion control of the express streams (default:
            as ``congestion``).
        express_warmup: padding bytes an express stream sends once it connects,
            so its congestion window is open before the first urgent chunk (at
            most ``K_MAX_PAD``; 0: none).
        chunk_size: largest chunk payload; None (default): chosen per path, 1 MiB,
            or up to ``max_chunk_size`` on a fast short path (RTT floor under 1 ms,
            no loss; see docs/wan.md "Chunking"); on any path at least 8 MiB
            (``K_BULK_CHUNK``, at most ``max_chunk_size``) while no urgent
            transfer runs (:func:`bulk_chunk_size`).
        max_chunk_size: the largest chunk the per-path choice may use (8 MiB by
            default; at most the receiver's ``max_chunk``, 16 MiB by default).
        congestion: ``TCP_CONGESTION`` per socket (default bbr where available).
        algo: payload checksum algorithm.
        pacer: a registered pacer name (``adaptive``, ``fixed``) or a Pacer.
        pacer_options: keyword arguments for a pacer given by name.
        rate_cap: operator cap on the aggregate rate, bytes/s.
        policy: ``priority`` or ``fifo`` (see :class:`~._scheduler.Scheduler`).
        hedge: allow tail hedging.
        urgent_pacing: while a ``priority > 0`` transfer runs, pace the bulk
            streams to at most this fraction of the 10 s maximum aggregate
            delivery rate, so no stream bursts into the bottleneck queue the
            urgent chunks must cross (docs/wan.md); None: off.
        buffer_bytes: ``SO_SNDBUF``/``SO_RCVBUF`` of each stream.
        notsent_lowat: ``TCP_NOTSENT_LOWAT`` of each stream (0 disables); the
            bulk streams use ``K_IDLE_NOTSENT_LOWAT`` while no ``priority > 0``
            transfer runs (this from when one starts until ``K_MARK_HOLD`` after
            the last one ended), and at least ``K_FAST_NOTSENT_LOWAT`` on a fast path.
        secret: if set, every stream proves the shared secret to the receiver
            (challenge-response, :mod:`pddnet.transport._auth`) before any chunk.
        tls: if set, every stream is TLS (:class:`TlsConfig`: ``ca`` to verify the
            receiver, ``cert``/``key`` for mutual TLS); the challenge-response,
            if on, runs inside it.
        peer_timeout: seconds with no stream connected (or unacknowledged data
            stuck, via ``TCP_USER_TIMEOUT``) before running transfers fail with
            PeerUnavailable.

    Raises:
        LocalProtocolError: on a malformed address, no streams, or a TLS
            configuration that cannot be loaded.
    """

    def __init__(
        self,
        address: str,
        *,
        streams: int | None = None,
        express_streams: int = K_DEFAULT_EXPRESS_STREAMS,
        express_congestion: str | None = None,
        express_warmup: int = K_EXPRESS_WARMUP,
        chunk_size: int | None = None,
        max_chunk_size: int = K_MAX_CHUNK,
        congestion: str | None = "default",
        algo: ChecksumAlgo = K_DEFAULT_ALGO,
        pacer: str | Pacer = "adaptive",
        pacer_options: dict[str, Any] | None = None,
        rate_cap: float | None = None,
        policy: str = "priority",
        hedge: bool = True,
        urgent_pacing: float | None = K_DEFAULT_URGENT_PACING,
        buffer_bytes: int = K_DEFAULT_BUFFER,
        notsent_lowat: int = K_DEFAULT_NOTSENT_LOWAT,
        peer_timeout: float = 10.0,
        max_backoff: float = 1.0,
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise LocalProtocolError(f"bad WAN address {address!r}; want host:port")
        self.address = address
        self._addr = (host, int(port))
        self.congestion = _default_congestion() if congestion == "default" else congestion
        if streams is None:
            streams = default_streams(self.congestion)
        if streams < 1:
            raise LocalProtocolError("a WAN sender needs at least one stream")
        self.express_congestion = express_congestion
        if not 0 <= express_warmup <= K_MAX_PAD:
            raise LocalProtocolError(f"express_warmup must be in [0, {K_MAX_PAD}]")
        self.express_warmup = express_warmup
        self.algo = algo
        self.buffer_bytes = buffer_bytes
        self.notsent_lowat = notsent_lowat
        self._mark = UnsentMark(notsent_lowat, K_IDLE_NOTSENT_LOWAT, K_MARK_HOLD)
        self.peer_timeout = peer_timeout
        self.secret = secret
        self.tls = tls
        self._tls_ctx = tls.client_context() if tls is not None else None
        self._tls_name = (tls.server_hostname or host) if tls is not None else None
        self.auth_failures = 0
        self.max_backoff = max_backoff
        self._base_chunk = K_DEFAULT_CHUNK if chunk_size is None else chunk_size
        self._max_chunk = self._base_chunk if chunk_size is not None else max_chunk_size
        if self._base_chunk < 1 or self._max_chunk < 1:
            raise LocalProtocolError("chunk sizes must be positive")
        self._path_chunk = self._base_chunk  # path_chunk_size's latest choice
        self._sched = Scheduler(self._base_chunk, policy=policy, max_copies=2 if hedge else 1)
        self._sched.active_streams = streams
        self._sched.express = frozenset(range(streams, streams + express_streams))
        self._pacer = (
            pacer
            if isinstance(pacer, Pacer)
            else make_pacer(pacer, max_streams=streams, rate_cap=rate_cap, **(pacer_options or {}))
        )
        self._decision = PacingDecision(None, streams)
        self.urgent_pacing = urgent_pacing
        self._applied_rate: float | None = None
        self._delivered: deque[tuple[float, float]] = deque()  # (time, aggregate rate)
        self._nbulk = streams
        self._streams = [_Stream(i) for i in range(streams + express_streams)]
        self._transfers: dict[int, WanTransfer] = {}
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._session = secrets.randbits(63)
        self._down_since: float | None = None
        self._closed = False

    async def __aenter__(self) -> WanSender:
        open_native()
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._down_since = trio.current_time()
        for s in self._streams:
            self._nursery.start_soon(self._run_stream, s)
        self._nursery.start_soon(self._timer_loop)
        self._nursery.start_soon(self._sample_loop)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        await self.aclose()
        return bool(await self._nursery_cm.__aexit__(*exc))

    async def aclose(self) -> None:
        """Close every stream; running transfers fail with TransferCancelled."""
        self._closed = True
        for tid in list(self._transfers):
            self._sched.cancel(tid, TransferCancelled("sender closed", transfer_id=tid))
        self._pump()
        if self._nursery is not None:
            # the stream tasks close their own sockets as they unwind
            self._nursery.cancel_scope.cancel()

    async def wait_connected(self, n: int | None = None) -> None:
        """Wait until ``n`` (default all) streams are connected. Cancel-safe."""
        want = len(self._streams) if n is None else n
        while sum(s.up for s in self._streams) < want:
            await self._wait_change(trio.current_time() + 0.05)

    # -- transfers -------------------------------------------------------------

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
    ) -> WanTransfer:
        if self._closed:
            raise LocalProtocolError("sender is closed")
        if ranges.total != grant.total:
            raise LocalProtocolError(
                f"source has {ranges.total} bytes, grant {grant.total}",
                transfer_id=grant.transfer_id,
            )
        mvs = views_of(views)
        if len(ranges) and any(
            int(o + n) > len(mvs[int(b)])
            for b, o, n in zip(ranges.buffer, ranges.offset, ranges.length, strict=True)
        ):
            raise LocalProtocolError("source ranges run past their buffers")
        t = WanTransfer(self, grant, mvs, ranges, progress)
        now = trio.current_time()
        self._transfers[grant.transfer_id] = t
        self._sched.add_transfer(
            grant.transfer_id,
            grant.total,
            priority=priority,
            deadline=None if timeout is None else now + timeout,
        )
        if ready and grant.total:
            self._sched.mark_ready(grant.transfer_id, 0, grant.total)
        if priority > 0:
            self._apply_mark()  # before any stream can pull its first chunk
            self._apply_pacing()
        self._pump()
        self._wake()
        return t

    def _cancel(self, tid: int) -> None:
        if self._sched.cancel(tid):
            self._queue_control(LinkFrame(LinkKind.CANCEL, tid))
        self._pump()

    def _queue_control(self, frame: LinkFrame) -> None:
        up = [s for s in self._streams if s.up] or self._streams
        up[0].control.append(frame)
        self._wake()

    def bytes_ahead(self, nbytes: int, priority: int = 0) -> int:
        """Bytes this sender sends before a new transfer of ``nbytes`` at
        ``priority`` would finish (the scheduler's order and what is already
        in flight): the router's queue-aware estimate. Read-only."""
        return self._sched.bytes_ahead(nbytes, priority)

    def statistics(self) -> SenderStatistics:
        streams = tuple(
            StreamStatistics(
                index=s.index,
                up=s.up,
                congestion=s.congestion,
                bytes_sent=s.bytes_sent,
                chunks_sent=s.chunks_sent,
                chunks_trailed=s.chunks_trailed,
                connects=s.connects,
                rtt=s.sample.rtt if s.sample else math.nan,
                delivery_rate=s.sample.delivery_rate if s.sample else math.nan,
                bytes_retrans=s.sample.bytes_retrans if s.sample else 0,
                pacing_rate=s.sample.pacing_rate if s.sample else math.nan,
            )
            for s in self._streams
        )
        return SenderStatistics(
            bytes_sent=self._sched.bytes_sent,
            bytes_verified=self._sched.bytes_acked,
            bytes_resent=self._sched.bytes_resent,
            chunks_hedged=self._sched.chunks_hedged,
            transfers_running=len(self._transfers),
            active_streams=self._sched.active_streams,
            rate_per_stream=self._decision.rate_per_stream,
            streams=streams,
            chunk_size=self._sched.chunk_size,
        )

    # -- plumbing ----------------------------------------------------------------

    def _wake(self) -> None:
        # Everyone waiting holds the old event; set it and start a fresh one.
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self, deadline: float | None) -> None:
        ev = self._changed
        with trio.move_on_at(math.inf if deadline is None else deadline):
            await ev.wait()

    def _pump(self) -> None:
        ended = False
        for ev in self._sched.events():
            t = self._transfers.get(ev.transfer_id)
            if isinstance(ev, TransferProgress):
                if t is not None and t.progress is not None:
                    t.progress(ev.transfer_id, ev.acked, ev.total)
                continue
            ended = True
            if t is None:
                continue
            del self._transfers[ev.transfer_id]
            t._finish(ev.error if isinstance(ev, TransferFailed) else None)
        # Progress alone (one per ack) changes nothing a waiter depends on: an ack only
        # removes work (and hedging candidates), so it wakes nobody. A transfer that
        # ended changes the timers, the urgent pacing and what wait_connected sees.
        if ended:
            self._apply_mark()
            if self.urgent_pacing is not None:
                self._apply_pacing()
            self._wake()

    def _bulk_rate(self) -> float | None:
        """Per-stream pacing of the bulk streams: the pacer's, lowered to
        ``urgent_pacing`` x the recent peak while an urgent transfer runs."""
        rate = self._decision.rate_per_stream
        if self.urgent_pacing is not None and self._delivered and self._sched.urgent_running():
            peak = max(d for _, d in self._delivered)
            if peak > 0:
                cap = self.urgent_pacing * peak / max(self._sched.active_streams, 1)
                rate = cap if rate is None else min(rate, cap)
        return rate

    def _apply_pacing(self) -> None:
        rate = self._bulk_rate()
        if rate == self._applied_rate:
            return
        self._applied_rate = rate
        for s in self._streams[: self._nbulk]:
            if s.up and s.sock is not None:
                with contextlib.suppress(OSError):
                    set_pacing_rate(s.sock, rate)

    async def _timer_loop(self) -> None:
        while True:
            timer = self._sched.get_timer()
            if self._down_since is not None and self._transfers:
                dead_at = self._down_since + self.peer_timeout
                timer = dead_at if timer is None else min(timer, dead_at)
            await self._wait_change(timer)
            now = trio.current_time()
            before = set(self._sched.running())
            self._sched.handle_timer(now)
            for tid in before - set(self._sched.running()):
                if tid in self._transfers:  # timed out: free the receiver's grant too
                    self._queue_control(LinkFrame(LinkKind.CANCEL, tid))
            if (
                self._down_since is not None
                and now - self._down_since >= self.peer_timeout
                and self._transfers
            ):
                for tid in self._sched.running():
                    self._sched.cancel(
                        tid,
                        PeerUnavailable(
                            f"no stream to {self.address} for {self.peer_timeout:.1f} s",
                            peer=self.address,
                            transfer_id=tid,
                        ),
                    )
            self._pump()
            await trio.lowlevel.checkpoint()

    async def _sample_loop(self) -> None:
        while True:
            await trio.sleep(self._pacer.sample_interval() or K_SAMPLE_PERIOD)
            now = trio.current_time()
            for s in self._streams:
                if s.up and s.sock is not None:
                    sample = read_tcp_info(s.sock, s.index)
                    if sample is not None:
                        s.sample = sample
                        if s.index < self._nbulk:  # the express lane is not paced
                            self._pacer.on_sample(sample, now)
            self._choose_chunk()
            decision = self._pacer.decide(now)
            if self.urgent_pacing is not None:
                total = sum(
                    s.sample.delivery_rate
                    for s in self._streams[: self._nbulk]
                    if s.up and s.sample is not None
                )
                self._delivered.append((now, total))
                while self._delivered and now - self._delivered[0][0] > 10.0:
                    self._delivered.popleft()
            if decision != self._decision or self.urgent_pacing is not None:
                changed = decision != self._decision
                self._decision = decision
                self._sched.active_streams = max(1, min(decision.active_streams, self._nbulk))
                self._apply_pacing()
                if changed:
                    self._wake()
                    self._pump()

    def _choose_chunk(self) -> None:
        samples = [s.sample for s in self._streams[: self._nbulk] if s.up and s.sample is not None]
        self._path_chunk = path_chunk_size(samples, base=self._base_chunk, largest=self._max_chunk)
        self._apply_mark()

    def _apply_mark(self) -> None:
        """Set the bulk streams' unsent mark where it changed, and the chunk size
        (:class:`UnsentMark`, :func:`bulk_chunk_size`): both from one state."""
        now = trio.current_time()
        lowat = self._mark.update(now, self._sched.urgent_running())
        self._sched.chunk_size = bulk_chunk_size(
            self._path_chunk, largest=self._max_chunk, bulk_only=self._mark.bulk_only(now)
        )
        if lowat and self._path_chunk > self._base_chunk:
            lowat = max(lowat, K_FAST_NOTSENT_LOWAT)
        for s in self._streams[: self._nbulk]:
            if s.up and s.sock is not None and s.notsent_lowat != lowat:
                with contextlib.suppress(OSError):
                    set_notsent_lowat(s.sock, lowat)
                    s.notsent_lowat = lowat

    def _stream_state_changed(self) -> None:
        if any(s.up for s in self._streams):
            self._down_since = None
        elif self._down_since is None:
            self._down_since = trio.current_time()
        self._wake()
        self._pump()

    async def _connect(self, s: _Stream) -> Any:
        sock: Any = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            express = s.index >= self._nbulk
            s.congestion = tune_socket(
                sock,
                buffer_bytes=self.buffer_bytes,
                congestion=(self.express_congestion or self.congestion)
                if express
                else self.congestion,
                notsent_lowat=self.notsent_lowat,
                sender=True,
            )
            # unacknowledged data stuck this long kills the connection (dead peer)
            sock.setsockopt(socket.IPPROTO_TCP, K_TCP_USER_TIMEOUT, int(self.peer_timeout * 1000))
            if self._applied_rate is not None and s.index < self._nbulk:
                set_pacing_rate(sock, self._applied_rate)
            await connect(sock, self._addr)
            if self._tls_ctx is not None:
                assert self.tls is not None
                try:
                    sock = await tls_handshake(
                        sock,
                        self._tls_ctx,
                        server_side=False,
                        server_hostname=self._tls_name,
                        timeout=self.tls.handshake_timeout,
                    )
                except BaseException:
                    sock = None  # detached by the wrap; tls_handshake closed it
                    raise
            if self.secret is not None:
                await authenticate(sock, self.secret, AuthRole.INITIATOR, channel="wan")
        except BaseException:
            if sock is not None:
                close(sock)
            raise
        return sock

    async def _run_stream(self, s: _Stream) -> None:
        backoff = 0.01
        while True:
            try:
                sock = await self._connect(s)
            except (OSError, AuthError, PeerUnavailable) as exc:
                if isinstance(exc, AuthError):
                    self.auth_failures += 1
                    if self.auth_failures == 1:
                        log.warning("stream to %s: authentication failed: %s", self.address, exc)
                    self._auth_failed(exc)
                log.debug("stream %d: connect to %s failed: %s", s.index, self.address, exc)
                await trio.sleep(backoff * (0.5 + secrets.randbelow(1000) / 1000))
                backoff = min(backoff * 2, self.max_backoff)
                continue
            backoff = 0.01
            s.sock, s.up = sock, True
            s.notsent_lowat = self.notsent_lowat
            s.connects += 1
            # the handshake's RTT and initial pacing rate: enough for the first
            # chunk-size choice before the sampling task has run
            s.sample = read_tcp_info(sock, s.index)
            self._choose_chunk()
            self._stream_state_changed()
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._ack_loop, s, sock)
                    if s.index >= self._nbulk and self.express_warmup:
                        # beside the send loop: a narrow window also slows the warm-up
                        n.start_soon(self._check_express_window, s, sock)
                    await self._send_loop(s, sock)
            except* (
                _Reopen,
                EndOfStream,
                OSError,
                RemoteProtocolError,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
            ) as group:
                log.debug("stream %d lost: %r", s.index, group.exceptions[0])
            finally:
                s.up = False
                s.sock = None
                close(sock)
                self._sched.on_stream_failed(s.index)
                self._stream_state_changed()
            await trio.sleep(backoff)

    def _auth_failed(self, exc: AuthError) -> None:
        """TLS or the challenge-response failed: with no stream up, fail what runs."""
        if any(s.up for s in self._streams):
            return
        for tid in self._sched.running():
            self._sched.cancel(
                tid,
                AuthError(
                    f"cannot connect to {self.address}: {exc.message}",
                    peer=self.address,
                    transfer_id=tid,
                ),
            )
        self._pump()

    async def _send_loop(self, s: _Stream, sock: Any) -> None:
        hello = LinkFrame(LinkKind.HELLO, self._session, s.index)
        await send_all(sock, [memoryview(hello.encode())])
        if s.index >= self._nbulk and self.express_warmup:
            # Open the idle express stream's congestion window now: a fresh one
            # (10 packets) needs 2-3 extra RTTs for the first urgent transfers.
            pad = LinkFrame(LinkKind.PAD, self._session, s.index, self.express_warmup)
            await send_all(sock, [memoryview(pad.encode()), _zeros(self.express_warmup)])
        sched = self._sched
        # With an unsent mark, a chunk is pulled only once the socket has room
        # under it; each send returns only then (send_all's room), so the mark
        # seen before it is the one its wait ended under.
        room = bool(self.notsent_lowat)
        has_room = False
        lowat = s.notsent_lowat
        while True:
            if room:
                if not has_room:
                    lowat = s.notsent_lowat
                    await trio.lowlevel.wait_writable(sock)
                has_room = False
                if s.notsent_lowat < lowat:
                    # lowered while this task was woken but had not run yet: wait for
                    # room under the new mark before pulling (maybe urgent) a chunk
                    continue
            # checked after every wait: a frame may be queued while we were waiting
            if s.control:
                lowat = s.notsent_lowat
                await send_all(sock, [memoryview(s.control.pop(0).encode())], room=room)
                has_room = room
                continue
            ch = sched.next_chunk(s.index, trio.current_time())
            if ch is None:
                await self._wait_change(sched.get_timer(s.index))
                continue
            lowat = s.notsent_lowat
            await self._send_chunk(s, sock, ch, room)
            has_room = room

    async def _check_express_window(self, s: _Stream, sock: Any) -> None:
        """A few RTTs after connecting: re-open the connection if the receiver's
        window is still too narrow (bulk streams take urgent chunks meanwhile)."""
        if s.reopens >= K_EXPRESS_REOPENS:
            return
        first = read_tcp_info(sock, s.index)
        rtt = first.rtt if first is not None and first.rtt > 0 else 0.05
        await trio.sleep(K_EXPRESS_CHECK_RTTS * rtt)
        sample = read_tcp_info(sock, s.index)
        if not express_window_ok(sample):
            assert sample is not None
            s.reopens += 1
            log.debug("express stream %d: window %d bytes; re-opening", s.index, sample.snd_wnd)
            raise _Reopen

    async def _send_chunk(self, s: _Stream, sock: Any, ch: Chunk, room: bool) -> None:
        t = self._transfers.get(ch.transfer_id)
        if t is None:  # ended between scheduling and now
            return
        pieces = [t.views[b][o : o + n] for b, o, n in t.ranges.pieces(ch.lo, ch.hi)]
        if (
            ch.checksum is None
            and ch.length >= K_TRAILER_MIN_CHUNK
            and self.algo is ChecksumAlgo.XXH3_64
            and can_trail(sock)
        ):
            # Hashed as written, the digest after the payload; a re-send of this
            # chunk (hedge, DUP, new connection) puts it in the header.
            trail = Digest(self.algo)
            header = ChunkHeader(
                ch.transfer_id, ch.lo, ch.length, 0, self.algo, flags=K_CHUNK_FLAG_TRAILER
            ).encode()
            await send_all(sock, [memoryview(header), *pieces], trail, len(header), room=room)
            ch.checksum = trail.value()
            s.chunks_trailed += 1
        else:
            if ch.checksum is None:
                ch.checksum = digest_of(pieces, self.algo)
            header = ChunkHeader(ch.transfer_id, ch.lo, ch.length, ch.checksum, self.algo).encode()
            await send_all(sock, [memoryview(header), *pieces], room=room)
        s.bytes_sent += ch.length
        s.chunks_sent += 1

    async def _ack_loop(self, s: _Stream, sock: Any) -> None:
        acks = FrameReader(sock, K_CHUNK_HEADER_SIZE)
        sched = self._sched
        while True:
            f = LinkFrame.decode(await acks.read())
            now = trio.current_time()
            if f.kind is LinkKind.ACK:
                sched.on_ack(s.index, f.transfer_id, f.offset, f.offset + f.length, now)
            elif f.kind is LinkKind.DUP:
                sched.on_dup(s.index, f.transfer_id, f.offset, f.offset + f.length)
                self._wake()  # the chunk may be back in a queue: idle streams look again
            elif f.kind is LinkKind.CANCELLED:
                err: PddnetError
                if f.code is LinkCode.TIMEOUT:
                    err = TransferTimeout("the receiver's grant expired", transfer_id=f.transfer_id)
                else:
                    err = TransferCancelled("cancelled by the receiver", transfer_id=f.transfer_id)
                sched.cancel(f.transfer_id, err)
            elif f.kind is LinkKind.FAIL:
                sched.cancel(
                    f.transfer_id,
                    RemoteProtocolError(
                        f"the receiver failed the transfer ({f.code.name})",
                        peer=self.address,
                        transfer_id=f.transfer_id,
                    ),
                )
            else:
                raise RemoteProtocolError(f"unexpected {f.kind.name} frame from the receiver")
            self._pump()
