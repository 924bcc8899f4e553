"""The WAN receiver: a trio driver around :class:`~._acceptor.GrantTable`.

It listens for data connections from any number of senders. Each connection
task reads a 40-byte frame, asks the grant table what to do, and ``recv_into``
the payload straight into the destination pieces (no intermediate copy),
checks the checksum, and acknowledges on the same connection. A connection
that breaks a rule is answered with a FAIL frame (best effort) and closed.

A connection task yields to the scheduler at least every
``K_YIELD_FRAMES`` frames or ``K_YIELD_BYTES`` payload bytes. The socket
helpers only wait (and so yield) when the kernel has nothing queued, so a
peer that keeps its connection full, with tiny chunks above all, would
otherwise keep the whole trio loop: control pings, other connections and
grant deadlines (issue 19, attacks 3 and 4: 92 s without a scheduler pass).

A fresh connection first passes the connection bounds of :class:`WanLimits`
(else it is closed unread), then, if configured, the TLS handshake
(:class:`TlsConfig`), then the challenge-response under the shared secret
(inside TLS when both are on), all within ``handshake_timeout``; only then is
a chunk header read.

Handshake slots: when ``max_handshakes`` (or an address's
``max_handshakes_per_peer``) is full, the new connection is kept and the
*oldest* handshake is shed: of the address holding the most handshakes (of
the new one's address when that one is full), the oldest. Refusing the
newest instead lets strangers hold every slot by reopening as fast as the
deadline frees them (64 slots and a 5 s deadline took 13 opens a second:
issue 19, attack 2, an honest sender locked out for 15 s). Shedding the
oldest, an honest peer gets a slot at once and keeps it until
``max_handshakes`` newer connections arrive; it needs a few round trips, so
strangers must open faster than ``max_handshakes`` per handshake time
(thousands a second), and, shed by address, still lose their own first.

A frame to the peer (ACK, DUP, CANCELLED) goes into a send buffer bounded to
``K_SEND_BUFFER``; when it is full the writer waits at most
``send_timeout`` for the peer to read, then drops the connection. An honest
sender reads its ACKs all the time into a large receive buffer, so only a
peer that stops reading meets it; the grant timer's CANCELLED broadcast runs
in its own task, one send per connection at once, so grant deadlines fire on
time whatever a peer does.

The accept loop outlives descriptor exhaustion: when ``accept`` fails for
lack of descriptors or kernel memory (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
``ENOMEM``) the pending connection stays in the kernel's backlog, so the loop
backs off (10 ms, doubling to 250 ms) instead of spinning or dying, logs at
most once a second, and resumes as soon as descriptors free up. The
connection bounds are kept well below ``RLIMIT_NOFILE`` (see
:class:`WanLimits`) so that this receiver's own connections cannot cause it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import resource
import secrets
import socket
import ssl
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
    ResourceLimitError,
    TransferCancelled,
)
from ..._ratelog import LogLimiter
from ...kv import ByteRanges
from ...wire import K_CHUNK_HEADER_SIZE, K_CHUNK_TRAILER_SIZE, ChunkHeader
from ...wire._auth import K_AUTH_MAGIC, AuthFrame, AuthKind, AuthRole
from .._auth import authenticate
from .._base import Grant, Receiver, views_of
from ._acceptor import Action, Event, GrantTable, LayerVerified, TransferEnded, TransferVerified
from ._framing import K_LINK_MAGIC, K_MAX_PAD, LinkCode, LinkFrame, LinkKind
from ._io import (
    Digest,
    EndOfStream,
    LowWater,
    Revoked,
    accept,
    close,
    open_native,
    recv_exact,
    send_all,
)
from ._limits import WanLimitExceeded, WanLimits, check
from ._sockopts import tune_socket
from ._tls import TlsConfig, tls_handshake

__all__ = ["ReceiverStatistics", "WanReceiver"]

log = logging.getLogger(__name__)

K_DEFAULT_MAX_CHUNK = 16 << 20
K_DEFAULT_BUFFER = 32 << 20
K_SCRATCH = 1 << 20
_TLS_HANDSHAKE = 0x16  # the content type of a TLS handshake record: a ClientHello's first byte
_SOCKET_ERRORS = (OSError, trio.ClosedResourceError, trio.BrokenResourceError)
# accept() failed for want of descriptors or memory: the connection waits in the backlog
_ACCEPT_CAPACITY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# accept() reports a pending error of the new connection (accept(2), Linux): skip it
_ACCEPT_TRANSIENT = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.ENETDOWN,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETUNREACH,
        errno.EPERM,
    }
)
K_ACCEPT_BACKOFF_MIN = 0.01
K_ACCEPT_BACKOFF_MAX = 0.25
# A connection yields after this many frames or payload bytes without a wait. A
# scheduler pass costs about 3 us; 64 tiny chunks take well under a millisecond,
# 4 MiB about 4 ms at the 1 GB/s loopback goodput measured (issue 19). A single
# chunk is read whole before the check: max_chunk bounds that.
K_YIELD_FRAMES = 64
K_YIELD_BYTES = 4 << 20
# SO_SNDBUF of a data connection (the kernel doubles it): it carries only 40-byte
# frames, about 26,000 of them; tune_socket's buffer_bytes (32 MiB, doubled) held
# 1.6 M ACKs for a peer that never reads them (issue 19, attack 4). At 200 ms RTT
# it still carries over 100,000 ACKs a second.
K_SEND_BUFFER = 512 << 10


@dataclass(frozen=True, slots=True)
class ReceiverStatistics:
    """Counters of a :class:`WanReceiver`."""

    bytes_verified: int
    bytes_dropped: int
    checksum_failures: int
    protocol_errors: int
    connections: int
    grants: int
    bytes_granted: int = 0
    tls_failures: int = 0
    auth_failures: int = 0
    limit_rejections: int = 0
    accept_stalls: int = 0  # accept() failures for want of descriptors (EMFILE, ENFILE, ...)
    duplicate_floods: int = 0  # connections dropped for more duplicate chunks than allowed
    chunk_floods: int = 0  # transfers failed for more chunks than their grant allows
    handshakes_shed: int = 0  # handshakes closed to make room for a newer connection
    handshake_timeouts: int = 0  # handshakes not finished within handshake_timeout
    send_timeouts: int = 0  # connections dropped: the peer did not read within send_timeout


@dataclass(eq=False)
class _Waiter:
    views: list[memoryview]
    done: trio.Event = field(default_factory=trio.Event)
    error: PddnetError | None = None
    layers: dict[int, trio.Event] = field(default_factory=dict)
    layers_done: set[int] = field(default_factory=set)


class _SendTimeout(RemoteProtocolError):
    """The peer left a frame unread in a full send buffer for ``send_timeout`` seconds."""


@dataclass(eq=False, slots=True)
class _Handshake:
    """A connection still in TLS or authentication (a slot of ``max_handshakes``)."""

    ip: str
    seq: int  # admission order
    scope: trio.CancelScope
    counted: bool = True  # still in the handshake tables (False once ended or shed)


class _Conn:
    def __init__(self, sock: Any, send_timeout: float | None) -> None:
        self.sock = sock
        self.lock = trio.StrictFIFOLock()
        self.closed = False
        self.send_timeout = math.inf if send_timeout is None else send_timeout

    async def send_frame(self, frame: LinkFrame) -> None:
        """Send one frame; waits at most ``send_timeout`` for room.

        Raises:
            _SendTimeout: the peer did not read in time (a frame may be cut off:
                the connection is marked closed and must be dropped).
            OSError: on a socket error.
        """
        if self.closed:
            return
        data = memoryview(frame.encode())
        if not self.lock.locked() and not isinstance(self.sock, ssl.SSLSocket):
            # Fast path (one per chunk): nobody is mid-frame, and a 40-byte frame
            # nearly always fits the send buffer whole, so no lock round trip (a
            # scheduler pass) is needed. No await between the check and the send.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                n = self.sock.send(data)
            except BlockingIOError:
                n = 0
            if n == len(data):
                return
            data = data[n:]  # the rest goes before any other frame: the lock is free
        with trio.move_on_after(self.send_timeout) as scope:
            async with self.lock:
                await send_all(self.sock, [data])
        if scope.cancelled_caught:
            self.closed = True
            raise _SendTimeout(
                f"peer left its send buffer full for {self.send_timeout:g} s",
                transfer_id=frame.transfer_id,
            )


class WanReceiver(Receiver):
    """Receives chunks from WAN senders into granted destination memory.

    Use as ``async with WanReceiver(...) as rx:``; ``rx.address`` is where
    senders connect.

    Args:
        host: address to listen on.
        port: port (0 picks one).
        max_chunk: largest chunk payload accepted; bigger is a protocol error.
        buffer_bytes: ``SO_RCVBUF`` of each connection.
        secret: if set, a connection must prove the shared secret
            (challenge-response) before a single chunk header is read.
        tls: if set, every connection is TLS (:class:`TlsConfig`: ``cert``
            required; ``require_client_cert`` for mutual TLS); the
            challenge-response, if on, runs inside it.
        limits: resource bounds (:class:`WanLimits`; default its defaults).

    Raises:
        LocalProtocolError: if the TLS configuration is incomplete or unreadable.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_chunk: int = K_DEFAULT_MAX_CHUNK,
        buffer_bytes: int = K_DEFAULT_BUFFER,
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
        limits: WanLimits | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.buffer_bytes = buffer_bytes
        self.secret = secret
        self.tls = tls
        self._tls_ctx = tls.server_context() if tls is not None else None
        self.limits = WanLimits() if limits is None else limits
        self._admission = _fd_bounded(self.limits)
        self.accept_stalls = 0  # accept() calls that failed for want of descriptors
        self._log = LogLimiter(log)
        self.auth_failures = 0
        self.tls_failures = 0
        self.limit_rejections = 0
        self.last_limit_error: WanLimitExceeded | None = None
        self._conn_count = 0  # accepted and not yet closed, handshaking or not
        self._conns_per_ip: dict[str, int] = {}
        self._handshakes = 0
        # ip -> its handshakes, oldest first (a dict as an ordered set)
        self._handshakes_per_ip: dict[str, dict[_Handshake, None]] = {}
        self._handshake_seq = 0
        self.handshakes_shed = 0
        self.handshake_timeouts = 0
        self.send_timeouts = 0
        self._table = GrantTable(max_chunk, self.limits)
        self._waiters: dict[int, _Waiter] = {}
        self._ended: dict[int, _Waiter] = {}
        self._conns: set[_Conn] = set()
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._listener: Any = None
        self._timer_changed = trio.Event()
        self._protocol_errors = 0
        self.address = ""

    async def __aenter__(self) -> WanReceiver:
        open_native()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self._listener = sock
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._accept_loop)
        self._nursery.start_soon(self._timer_loop)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        await self.aclose()
        return bool(await self._nursery_cm.__aexit__(*exc))

    async def aclose(self) -> None:
        """Stop listening, close every connection, fail pending grants (TransferCancelled)."""
        for tid in list(self._waiters):
            self._dispatch(
                self._table.cancel(tid, TransferCancelled("receiver closed", transfer_id=tid))
            )
        if self._nursery is not None:
            # connection tasks close their sockets as they unwind
            self._nursery.cancel_scope.cancel()

    # -- grants ------------------------------------------------------------------

    def grant(
        self,
        views: Sequence[Any],
        ranges: ByteRanges,
        *,
        num_layers: int | None = None,
        timeout: float | None = None,
        peer: str | None = None,
    ) -> Grant:
        """Register destination ``ranges`` of ``views`` (see :meth:`Receiver.grant`).

        Args:
            views: writable destination buffers, indexed by ``ranges.buffer``.
            ranges: destination byte ranges (their logical space is the grant's).
            num_layers: report per-layer readiness for this many layers.
            timeout: seconds until the grant expires with TransferTimeout.
            peer: the sender's name, for the per-peer bounds of :class:`WanLimits`
                (None: only the receiver-wide bounds apply).

        Raises:
            WanLimitExceeded: (a ResourceLimitError) if the grant would pass a
                bound; nothing is registered and no byte can arrive for it.
            LocalProtocolError: if the ranges do not fit the buffers.
        """
        mvs = views_of(views)
        for b in {int(x) for x in ranges.buffer}:
            if not 0 <= b < len(mvs):
                raise LocalProtocolError(f"ranges name buffer {b}, only {len(mvs)} given")
            if mvs[b].readonly:
                raise LocalProtocolError(f"destination buffer {b} is read-only")
        ends = ranges.offset + ranges.length
        if len(ranges) and any(
            int(m) > len(mvs[int(b)]) for b, m in zip(ranges.buffer, ends, strict=True)
        ):
            raise LocalProtocolError("destination ranges run past their buffers")
        layer_ends: tuple[int, ...] = ()
        if num_layers:
            layer_ends = tuple(int(x) for x in ranges.layer_bounds(num_layers)[:, 1])
        tid = secrets.randbits(63) or 1
        while tid in self._table or tid in self._ended:
            tid = secrets.randbits(63) or 1
        deadline = None if timeout is None else trio.current_time() + timeout
        self._waiters[tid] = _Waiter(mvs)
        try:
            events = self._table.add(tid, ranges, layer_ends, deadline, peer)
        except ResourceLimitError:
            del self._waiters[tid]
            raise
        self._dispatch(events)
        self._kick_timer()
        return Grant(tid, ranges.total, layer_ends, self.address)

    def _waiter(self, transfer_id: int) -> _Waiter:
        w = self._waiters.get(transfer_id) or self._ended.get(transfer_id)
        if w is None:
            raise LocalProtocolError(f"transfer {transfer_id} was never granted here")
        return w

    async def wait_transfer(self, transfer_id: int) -> None:
        """Wait until every granted byte is verified. Cancelling the wait keeps the grant."""
        w = self._waiter(transfer_id)
        await w.done.wait()
        if w.error is not None:
            raise w.error

    async def wait_layer(self, transfer_id: int, layer: int) -> None:
        """Wait until ``layer`` is verified. Cancelling the wait keeps the grant."""
        w = self._waiter(transfer_id)
        if layer not in w.layers_done and not w.done.is_set():
            ev = w.layers.setdefault(layer, trio.Event())
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as n:

                    async def _on_done() -> None:
                        await w.done.wait()
                        scope.cancel()

                    n.start_soon(_on_done)
                    await ev.wait()
                    n.cancel_scope.cancel()
        if layer in w.layers_done:
            return
        if w.error is not None:
            raise w.error
        if w.done.is_set():
            raise LocalProtocolError(f"transfer {transfer_id} has no layer {layer}")

    def cancel(self, transfer_id: int) -> None:
        """Revoke a grant: its waiters and the sender get TransferCancelled. Idempotent."""
        events = self._table.cancel(transfer_id)
        self._dispatch(events)
        if events and self._nursery is not None:
            frame = LinkFrame(LinkKind.CANCELLED, transfer_id, code=LinkCode.CANCELLED)
            self._nursery.start_soon(self._broadcast, frame)

    def statistics(self) -> ReceiverStatistics:
        return ReceiverStatistics(
            bytes_verified=self._table.bytes_verified,
            bytes_dropped=self._table.bytes_dropped,
            checksum_failures=self._table.checksum_failures,
            protocol_errors=self._protocol_errors,
            connections=len(self._conns),
            grants=len(self._table),
            bytes_granted=self._table.bytes_granted,
            tls_failures=self.tls_failures,
            auth_failures=self.auth_failures,
            limit_rejections=self.limit_rejections,
            accept_stalls=self.accept_stalls,
            duplicate_floods=self._table.duplicate_floods,
            chunk_floods=self._table.chunk_floods,
            handshakes_shed=self.handshakes_shed,
            handshake_timeouts=self.handshake_timeouts,
            send_timeouts=self.send_timeouts,
        )

    def peer_usage(self, peer: str) -> tuple[int, int]:
        """``(live grants, bytes of live grants)`` of ``peer``."""
        return self._table.peer_usage(peer)

    # -- internals -----------------------------------------------------------------

    def _dispatch(self, events: list[Event]) -> None:
        for ev in events:
            w = self._waiters.get(ev.transfer_id)
            if w is None:
                continue
            if isinstance(ev, LayerVerified):
                w.layers_done.add(ev.layer)
                if ev.layer in w.layers:
                    w.layers.pop(ev.layer).set()
            else:
                if isinstance(ev, TransferEnded):
                    w.error = ev.error
                del self._waiters[ev.transfer_id]
                self._ended[ev.transfer_id] = w
                while len(self._ended) > 4096:
                    del self._ended[next(iter(self._ended))]
                w.done.set()
                for e in w.layers.values():
                    e.set()
        if any(isinstance(e, TransferVerified | TransferEnded) for e in events):
            self._kick_timer()

    def _kick_timer(self) -> None:
        self._timer_changed.set()

    async def _timer_loop(self) -> None:
        while True:
            self._timer_changed = trio.Event()
            deadline = self._table.get_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timer_changed.wait()
            events = self._table.handle_timer(trio.current_time())
            self._dispatch(events)
            if events and self._nursery is not None:
                # never awaited here: a peer that does not read must not hold the timer
                frames = [
                    LinkFrame(LinkKind.CANCELLED, ev.transfer_id, code=LinkCode.TIMEOUT)
                    for ev in events
                ]
                self._nursery.start_soon(self._broadcast, *frames)

    async def _broadcast(self, *frames: LinkFrame) -> None:
        """Send ``frames`` on every connection, all connections at once."""
        async with trio.open_nursery() as nursery:
            for c in list(self._conns):
                nursery.start_soon(self._send_or_drop, c, frames)

    async def _send_or_drop(self, conn: _Conn, frames: Sequence[LinkFrame]) -> None:
        try:
            for frame in frames:
                await conn.send_frame(frame)
        except _SendTimeout as exc:
            self._send_timed_out(exc)
            close(conn.sock)  # its connection task wakes with ClosedResourceError
        except _SOCKET_ERRORS:
            pass

    def _send_timed_out(self, exc: _SendTimeout) -> None:
        self.send_timeouts += 1
        self._log.warning(
            "send", "dropping a WAN connection (%d so far): %s", self.send_timeouts, exc
        )

    async def _accept(self) -> socket.socket:
        """The next connection; waits out descriptor exhaustion (see the module doc)."""
        backoff = K_ACCEPT_BACKOFF_MIN
        while True:
            try:
                return await accept(self._listener)
            except OSError as exc:
                if exc.errno in _ACCEPT_TRANSIENT:
                    continue
                if exc.errno not in _ACCEPT_CAPACITY:
                    raise
                self.accept_stalls += 1
                self._log.warning(
                    "accept",
                    "WAN receiver %s cannot accept (%s); retrying in %.0f ms",
                    self.address,
                    errno.errorcode.get(exc.errno or 0, exc.errno),
                    backoff * 1e3,
                )
                await trio.sleep(backoff)
                backoff = min(2 * backoff, K_ACCEPT_BACKOFF_MAX)

    async def _accept_loop(self) -> None:
        assert self._nursery is not None
        try:
            while True:
                sock = await self._accept()
                try:
                    ip = str(sock.getpeername()[0])
                    tune_socket(
                        sock,
                        buffer_bytes=self.buffer_bytes,
                        congestion=None,
                        notsent_lowat=None,
                        sender=False,
                    )
                    # only 40-byte frames go this way: see K_SEND_BUFFER
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, K_SEND_BUFFER)
                    hs = self._admit(ip)  # last: nothing below can fail before _serve releases
                except OSError:  # reset before we got to it
                    close(sock)
                    continue
                except WanLimitExceeded as exc:
                    self._refused(exc)
                    close(sock)
                    continue
                self._nursery.start_soon(self._serve, sock, ip, hs)
        finally:
            close(self._listener)

    def _admit(self, ip: str) -> _Handshake | None:
        """Count a new connection from ``ip``, or raise if it passes a bound.

        Returns its handshake slot (None without TLS or a secret); a full
        handshake table sheds its oldest entry instead (see the module doc).
        """
        lim = self._admission
        per_ip = self._conns_per_ip.get(ip, 0)
        check(lim, "max_connections", self._conn_count, 1, peer=ip)
        check(lim, "max_connections_per_peer", per_ip, 1, peer=ip)
        hs = None
        if self._tls_ctx is not None or self.secret is not None:
            mine = self._handshakes_per_ip.setdefault(ip, {})
            per_peer, total = lim.max_handshakes_per_peer, lim.max_handshakes
            if per_peer is not None and len(mine) >= per_peer:
                self._shed(next(iter(mine)))
            elif total is not None and self._handshakes >= total:
                self._shed(self._oldest_of_busiest())
            timeout = lim.handshake_timeout
            deadline = math.inf if timeout is None else trio.current_time() + timeout
            self._handshake_seq += 1
            hs = _Handshake(ip, self._handshake_seq, trio.CancelScope(deadline=deadline))
            self._handshakes += 1
            self._handshakes_per_ip.setdefault(ip, {})[hs] = None
        self._conn_count += 1
        self._conns_per_ip[ip] = per_ip + 1
        return hs

    def _oldest_of_busiest(self) -> _Handshake:
        """The oldest handshake of the address holding the most (ties: the oldest)."""
        mine = max(
            (hs for hs in self._handshakes_per_ip.values() if hs),
            key=lambda hs: (len(hs), -next(iter(hs)).seq),
        )
        return next(iter(mine))

    def _shed(self, hs: _Handshake) -> None:
        self.handshakes_shed += 1
        self._log.warning(
            "shed",
            "WAN receiver handshake slots full: closing the oldest, from %s (%d shed so far)",
            hs.ip,
            self.handshakes_shed,
        )
        self._end_handshake(hs)
        hs.scope.cancel()  # its task closes the socket as it unwinds

    def _end_handshake(self, hs: _Handshake) -> None:
        if hs.counted:
            hs.counted = False
            self._handshakes -= 1
            mine = self._handshakes_per_ip[hs.ip]
            del mine[hs]
            if not mine:
                del self._handshakes_per_ip[hs.ip]

    def _release(self, ip: str) -> None:
        self._conn_count -= 1
        _decrement(self._conns_per_ip, ip)

    def _refused(self, exc: WanLimitExceeded) -> None:
        self.limit_rejections += 1
        self.last_limit_error = exc
        self._log.warning(
            "refused",
            "WAN receiver refused a connection (%d so far): %s",
            self.limit_rejections,
            exc,
        )

    async def _handshake(self, sock: Any) -> Any:
        """TLS, then the challenge-response; returns the socket to use or None.

        Closes the socket on failure or cancellation (shed, past its deadline).
        """
        if self._tls_ctx is not None:
            assert self.tls is not None
            if not await self._looks_like_tls(sock, self.tls.handshake_timeout):
                return None
            try:
                sock = await tls_handshake(
                    sock, self._tls_ctx, server_side=True, timeout=self.tls.handshake_timeout
                )
            except (AuthError, PeerUnavailable) as exc:
                self.tls_failures += 1
                if self.tls_failures == 1:
                    log.warning("dropping a WAN connection that failed TLS: %s", exc)
                return None  # tls_handshake closed it (also when cancelled)
        if self.secret is not None:
            try:
                await authenticate(sock, self.secret, AuthRole.RESPONDER, channel="wan")
            except (AuthError, PeerUnavailable) as exc:
                self.auth_failures += 1
                if self.auth_failures == 1:
                    log.warning("dropping an unauthenticated WAN connection: %s", exc)
                close(sock)
                return None
            except BaseException:
                close(sock)
                raise
        return sock

    async def _looks_like_tls(self, sock: Any, timeout: float) -> bool:
        """Peek at the first bytes; False (socket closed) if they cannot be TLS.

        A sender without TLS opens with the challenge-response's CHALLENGE frame;
        answering it with a plaintext FAIL frame makes its handshake fail at once
        with AuthError, instead of an EOF it would retry until its peer timeout.
        """
        first = b""
        with trio.move_on_after(timeout):
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    first = sock.recv(len(K_AUTH_MAGIC), socket.MSG_PEEK)
                except BlockingIOError:
                    continue
                except OSError:
                    first = b""
                    break
                if not first or len(first) == len(K_AUTH_MAGIC) or first[0] == _TLS_HANDSHAKE:
                    break
                await trio.sleep(0.01)  # a partial frame: readable stays true, wait a bit
        if first and first[0] == _TLS_HANDSHAKE:
            return True
        self.tls_failures += 1
        if self.tls_failures == 1:
            log.warning("dropping a connection to a TLS receiver that is not TLS (%r)", first)
        if first == K_AUTH_MAGIC:
            with contextlib.suppress(OSError):
                sock.send(AuthFrame(AuthKind.FAIL).encode())
        close(sock)
        return False

    async def _serve(self, sock: Any, ip: str, hs: _Handshake | None) -> None:
        try:
            if hs is not None:
                authed = None
                try:
                    with hs.scope:
                        authed = await self._handshake(sock)
                finally:
                    if hs.scope.cancelled_caught and hs.counted:  # not shed: its deadline
                        self.handshake_timeouts += 1
                    self._end_handshake(hs)
                if authed is None:
                    close(sock)  # if no step above did (a peek cut short, say)
                    return
                sock = authed
            await self._serve_authenticated(sock)
        finally:
            self._release(ip)

    async def _serve_authenticated(self, sock: Any) -> None:
        conn = _Conn(sock, self.limits.send_timeout)
        self._conns.add(conn)
        try:
            await self._serve_conn(conn)
        except (EndOfStream, OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        except WanLimitExceeded as exc:  # slowloris: a header without its body in time
            self._refused(exc)
        except _SendTimeout as exc:
            self._send_timed_out(exc)
        except RemoteProtocolError as exc:
            self._protocol_errors += 1
            self._log.warning(
                "protocol",
                "dropping WAN connection (%d protocol errors so far): %s",
                self._protocol_errors,
                exc,
            )
            self._dispatch(self._table.take_failures())
            # A checksum mismatch on a live transfer only costs the connection: the
            # sender re-sends the chunk. Anything else failed the transfer: say so.
            if exc.transfer_id is not None and exc.transfer_id not in self._table:
                frame = LinkFrame(LinkKind.FAIL, exc.transfer_id, code=LinkCode.PROTOCOL)
                with trio.move_on_after(0.5), contextlib.suppress(*_SOCKET_ERRORS, _SendTimeout):
                    await conn.send_frame(frame)
        finally:
            self._conns.discard(conn)
            conn.closed = True
            close(sock)

    async def _serve_conn(self, conn: _Conn) -> None:
        sock = conn.sock
        hbuf = bytearray(K_CHUNK_HEADER_SIZE)
        hv = memoryview(hbuf)
        tv = memoryview(bytearray(K_CHUNK_TRAILER_SIZE))
        scratch: memoryview | None = None
        lowat = LowWater(sock)
        table = self._table
        body_timeout = self.limits.body_timeout
        frames = nbytes = 0  # since this task last yielded for sure
        while True:
            if frames >= K_YIELD_FRAMES or nbytes >= K_YIELD_BYTES:
                await trio.lowlevel.checkpoint()  # see the module doc: fairness
                frames = nbytes = 0
            await recv_exact(sock, hv, lowat)
            frames += 1
            if hbuf[:4] == K_LINK_MAGIC:
                frame = LinkFrame.decode(hv)
                if frame.kind is LinkKind.PAD:  # an express stream's warm-up: drop it
                    nbytes += frame.length
                    if scratch is None:
                        scratch = memoryview(bytearray(K_SCRATCH))
                    await self._drain_pad(sock, lowat, frame, scratch)
                    continue
                await self._on_link_frame(frame)
                continue
            try:
                header = ChunkHeader.decode(hv, table.max_chunk)
            except RemoteProtocolError as exc:
                if exc.transfer_id is not None:  # e.g. oversized: that transfer fails too
                    self._dispatch(table.cancel(exc.transfer_id, exc))
                raise
            nbytes += header.length
            decision = table.begin(header, conn)
            tid = header.transfer_id
            body_by = math.inf if body_timeout is None else trio.current_time() + body_timeout
            # the payload, then its checksum trailer if it has one
            action, left = decision.action, header.length + header.trailer
            if action is Action.WRITE:
                views = self._waiters[tid].views
                digest = Digest(header.algo)
                want = header.checksum
                try:
                    with trio.move_on_at(body_by) as scope:
                        for b, o, n in decision.pieces:
                            dst = views[b][o : o + n]
                            await recv_exact(sock, dst, lowat, decision.permit, digest)
                            left -= n
                        if header.trailer:
                            await recv_exact(sock, tv, lowat)
                            left = 0
                            want = int.from_bytes(tv, "little")
                    if scope.cancelled_caught:
                        raise self._slow_body(header, body_by)
                except Revoked as exc:
                    # The transfer ended while this payload arrived, and its blocks may
                    # be someone else's now: the rest of it goes to scratch.
                    left -= exc.got
                    action = Action.DRAIN_ENDED
                except BaseException:
                    table.abort(header, conn)
                    raise
                if action is Action.WRITE:
                    ok = digest.value() == want
                    self._dispatch(table.finish(header, conn, ok))
                    if not ok:
                        raise RemoteProtocolError(
                            "chunk payload checksum mismatch", transfer_id=tid
                        )
                    frame = LinkFrame(LinkKind.ACK, tid, header.offset, header.length)
                    await conn.send_frame(frame)
                    continue
            # drain (the rest of) a payload we will not keep
            if scratch is None:
                scratch = memoryview(bytearray(K_SCRATCH))
            table.bytes_dropped += max(0, left - header.trailer)
            with trio.move_on_at(body_by) as scope:
                while left:
                    k = min(left, len(scratch))
                    await recv_exact(sock, scratch[:k], lowat)
                    left -= k
            if scope.cancelled_caught:
                raise self._slow_body(header, body_by)
            kind = {
                Action.DRAIN_ACK: LinkKind.ACK,
                Action.DRAIN_DUP: LinkKind.DUP,
                Action.DRAIN_ENDED: LinkKind.CANCELLED,
            }[action]
            code = LinkCode.CANCELLED if kind is LinkKind.CANCELLED else LinkCode.NONE
            await conn.send_frame(LinkFrame(kind, tid, header.offset, header.length, code))

    async def _drain_pad(
        self, sock: Any, lowat: LowWater, frame: LinkFrame, scratch: memoryview
    ) -> None:
        """Read and drop the padding a PAD frame announces (bounded size and time)."""
        if frame.length > K_MAX_PAD:
            raise RemoteProtocolError(f"PAD of {frame.length} bytes (at most {K_MAX_PAD})")
        left, timeout = frame.length, self.limits.body_timeout
        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            while left:
                k = min(left, len(scratch))
                await recv_exact(sock, scratch[:k], lowat)
                left -= k
        if scope.cancelled_caught:
            assert timeout is not None
            raise WanLimitExceeded("body_timeout", timeout, timeout)

    def _slow_body(self, header: ChunkHeader, body_by: float) -> WanLimitExceeded:
        """The error for a payload not read by ``body_by`` (requested: seconds taken so far)."""
        timeout = self.limits.body_timeout
        assert timeout is not None
        taken = timeout + trio.current_time() - body_by
        return WanLimitExceeded("body_timeout", timeout, taken, transfer_id=header.transfer_id)

    async def _on_link_frame(self, frame: LinkFrame) -> None:
        if frame.kind is LinkKind.CANCEL:
            self._dispatch(
                self._table.cancel(
                    frame.transfer_id,
                    TransferCancelled("cancelled by the sender", transfer_id=frame.transfer_id),
                )
            )
        elif frame.kind is LinkKind.HELLO:
            log.debug("WAN session %x stream %d connected", frame.transfer_id, frame.offset)
        else:
            raise RemoteProtocolError(f"unexpected {frame.kind.name} frame from a sender")


def _decrement(counts: dict[str, int], key: str) -> None:
    n = counts.pop(key) - 1
    if n:
        counts[key] = n


def _fd_bounded(limits: WanLimits) -> WanLimits:
    """``limits`` with the connection bounds kept below the descriptor limit.

    At most half of ``RLIMIT_NOFILE`` (soft) for connections and a sixteenth
    for handshakes, leaving the rest to the process (control plane, files,
    other receivers) so that strangers alone cannot exhaust it.
    """
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return limits
    caps = {
        "max_connections": max(1, soft // 2),
        "max_handshakes": max(1, soft // 16),
        "max_handshakes_per_peer": max(1, soft // 16),
    }
    changes = {
        name: cap
        for name, cap in caps.items()
        if getattr(limits, name) is None or getattr(limits, name) > cap
    }
    return dataclasses.replace(limits, **changes) if changes else limits
