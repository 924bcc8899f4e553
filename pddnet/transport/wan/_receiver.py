"""The WAN receiver: a trio driver around :class:`~._acceptor.GrantTable`.

It listens for data connections from any number of senders. Each connection
task reads a 40-byte frame, asks the grant table what to do, and ``recv_into``
the payload straight into the destination pieces (no intermediate copy),
checks the checksum, and acknowledges on the same connection. A connection
that breaks a rule is answered with a FAIL frame (best effort) and closed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import socket
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
)
from ...kv import ByteRanges
from ...wire import K_CHUNK_HEADER_SIZE, ChunkHeader
from ...wire._auth import AuthRole
from .._auth import authenticate
from .._base import Grant, Receiver, views_of
from ._acceptor import Action, Event, GrantTable, LayerVerified, TransferEnded, TransferVerified
from ._framing import K_LINK_MAGIC, LinkCode, LinkFrame, LinkKind
from ._io import Digest, EndOfStream, accept, close, recv_exact, send_all
from ._sockopts import tune_socket

__all__ = ["ReceiverStatistics", "WanReceiver"]

log = logging.getLogger(__name__)

K_DEFAULT_MAX_CHUNK = 16 << 20
K_DEFAULT_BUFFER = 32 << 20
K_SCRATCH = 1 << 20
_SOCKET_ERRORS = (OSError, trio.ClosedResourceError, trio.BrokenResourceError)


@dataclass(frozen=True, slots=True)
class ReceiverStatistics:
    """Counters of a :class:`WanReceiver`."""

    bytes_verified: int
    bytes_dropped: int
    checksum_failures: int
    protocol_errors: int
    connections: int
    grants: int


@dataclass(eq=False)
class _Waiter:
    views: list[memoryview]
    done: trio.Event = field(default_factory=trio.Event)
    error: PddnetError | None = None
    layers: dict[int, trio.Event] = field(default_factory=dict)
    layers_done: set[int] = field(default_factory=set)


class _Conn:
    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.lock = trio.StrictFIFOLock()
        self.closed = False

    async def send_frame(self, frame: LinkFrame) -> None:
        if self.closed:
            return
        async with self.lock:
            await send_all(self.sock, [memoryview(frame.encode())])


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
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_chunk: int = K_DEFAULT_MAX_CHUNK,
        buffer_bytes: int = K_DEFAULT_BUFFER,
        secret: bytes | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.buffer_bytes = buffer_bytes
        self.secret = secret
        self.auth_failures = 0
        self._table = GrantTable(max_chunk)
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
    ) -> Grant:
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
        self._dispatch(self._table.add(tid, ranges, layer_ends, deadline))
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
        )

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
            for ev in events:
                frame = LinkFrame(LinkKind.CANCELLED, ev.transfer_id, code=LinkCode.TIMEOUT)
                await self._broadcast(frame)

    async def _broadcast(self, frame: LinkFrame) -> None:
        for c in list(self._conns):
            with contextlib.suppress(OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                await c.send_frame(frame)

    async def _accept_loop(self) -> None:
        assert self._nursery is not None
        try:
            while True:
                sock = await accept(self._listener)
                tune_socket(
                    sock,
                    buffer_bytes=self.buffer_bytes,
                    congestion=None,
                    notsent_lowat=None,
                    sender=False,
                )
                self._nursery.start_soon(self._serve, sock)
        finally:
            close(self._listener)

    async def _serve(self, sock: Any) -> None:
        if self.secret is not None:
            try:
                await authenticate(sock, self.secret, AuthRole.RESPONDER, channel="wan")
            except (AuthError, PeerUnavailable) as exc:
                self.auth_failures += 1
                if self.auth_failures == 1:
                    log.warning("dropping an unauthenticated WAN connection: %s", exc)
                close(sock)
                return
        conn = _Conn(sock)
        self._conns.add(conn)
        try:
            await self._serve_conn(conn)
        except (EndOfStream, OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        except RemoteProtocolError as exc:
            self._protocol_errors += 1
            log.warning("dropping WAN connection: %s", exc)
            self._dispatch(self._table.take_failures())
            # A checksum mismatch on a live transfer only costs the connection: the
            # sender re-sends the chunk. Anything else failed the transfer: say so.
            if exc.transfer_id is not None and exc.transfer_id not in self._table:
                frame = LinkFrame(LinkKind.FAIL, exc.transfer_id, code=LinkCode.PROTOCOL)
                with trio.move_on_after(0.5), contextlib.suppress(*_SOCKET_ERRORS):
                    await conn.send_frame(frame)
        finally:
            self._conns.discard(conn)
            conn.closed = True
            close(sock)

    async def _serve_conn(self, conn: _Conn) -> None:
        sock = conn.sock
        hbuf = bytearray(K_CHUNK_HEADER_SIZE)
        hv = memoryview(hbuf)
        scratch: memoryview | None = None
        table = self._table
        while True:
            await recv_exact(sock, hv)
            if hbuf[:4] == K_LINK_MAGIC:
                await self._on_link_frame(LinkFrame.decode(hv))
                continue
            try:
                header = ChunkHeader.decode(hv, table.max_chunk)
            except RemoteProtocolError as exc:
                if exc.transfer_id is not None:  # e.g. oversized: that transfer fails too
                    self._dispatch(table.cancel(exc.transfer_id, exc))
                raise
            decision = table.begin(header, conn)
            tid = header.transfer_id
            if decision.action is Action.WRITE:
                views = self._waiters[tid].views
                digest = Digest(header.algo)
                try:
                    for b, o, n in decision.pieces:
                        dst = views[b][o : o + n]
                        await recv_exact(sock, dst)
                        digest.update(dst)
                except BaseException:
                    table.abort(header, conn)
                    raise
                ok = digest.value() == header.checksum
                self._dispatch(table.finish(header, conn, ok))
                if not ok:
                    raise RemoteProtocolError("chunk payload checksum mismatch", transfer_id=tid)
                await conn.send_frame(LinkFrame(LinkKind.ACK, tid, header.offset, header.length))
                continue
            # drain a payload we will not keep
            if scratch is None:
                scratch = memoryview(bytearray(K_SCRATCH))
            left = header.length
            while left:
                k = min(left, len(scratch))
                await recv_exact(sock, scratch[:k])
                left -= k
            table.bytes_dropped += header.length
            kind = {
                Action.DRAIN_ACK: LinkKind.ACK,
                Action.DRAIN_DUP: LinkKind.DUP,
                Action.DRAIN_ENDED: LinkKind.CANCELLED,
            }[decision.action]
            code = LinkCode.CANCELLED if kind is LinkKind.CANCELLED else LinkCode.NONE
            await conn.send_frame(LinkFrame(kind, tid, header.offset, header.length, code))

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
