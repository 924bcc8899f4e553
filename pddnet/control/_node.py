"""A control-plane node: named peers over pyzmq, driven from trio.

Theory of operation
-------------------
Each node binds one ROUTER socket; peers that connect to it are known by the
zmq identity they set (their node name). To reach a peer, a node opens a
DEALER to the peer's ROUTER. Messages may flow either way on either socket:
``send(peer, ...)`` uses our DEALER to ``peer`` if we opened one, otherwise
the ROUTER route ``peer`` opened to us.

Every socket has one reader task. The zmq FD is *edge-triggered*: it becomes
readable when the socket's state changes, and any zmq call (a send included)
may consume that edge. So the reader drains until ``EVENTS`` shows no
``POLLIN`` before it sleeps in ``wait_readable``, and every send re-checks
``EVENTS`` afterwards and wakes the reader (by cancelling its wait) if input
arrived meanwhile. Senders blocked by the high-water mark park until the
reader sees ``POLLOUT``. Nothing polls in a loop, and no thread is used.

Frames are authenticated (:func:`pddnet.wire.decode_frame`) and checked for
replay per socket and sender (:class:`pddnet.wire.ReplayGuard`). A forged,
tampered, malformed or replayed frame is dropped, counted in
:meth:`ControlNode.statistics` and logged once per peer and reason; it is
never delivered. Replies resolve the waiting :meth:`request`; requests and
events go, in arrival order, through a bounded inbox to one dispatcher task
that runs the routed handler. A full inbox stops the readers, so zmq's
high-water marks push back on senders: nothing is dropped for lack of room.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import trio
import zmq

from .._errors import (
    AuthError,
    LocalProtocolError,
    PddnetError,
    PeerUnavailable,
    RemoteCallError,
    RemoteProtocolError,
    TransferTimeout,
)
from ..wire import (
    ControlLimits,
    ErrorReply,
    Frame,
    FrameKind,
    Message,
    Ping,
    Pong,
    ReplayGuard,
    SeqClock,
    decode_frame,
    encode_frame,
)
from ._secret import load_secret

__all__ = ["ControlNode", "ControlStatistics", "Handler"]

log = logging.getLogger("pddnet.control")

M = TypeVar("M", bound=Message)
Handler = Callable[[str, Any], Awaitable[Message | None] | Message | None]

K_DEFAULT_TIMEOUT = 5.0
K_INBOX_SIZE = 1024
K_HWM = 10_000
K_WRITE_RECHECK_S = 0.02
K_HEARTBEAT_MS = 2000  # zmq-level pings
# A silent connection dies after 30 s; shorter, and a WAN blip would drop queued frames.
K_HEARTBEAT_TIMEOUT_MS = 30_000
# Plain ints: zmq's flag enums cost microseconds per operation on this hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True, slots=True)
class ControlStatistics:
    """A snapshot of a node's counters."""

    sent: int
    received: int
    delivered: int
    rejected_auth: int
    rejected_replay: int
    rejected_malformed: int
    unrouted: int
    late_replies: int
    timeouts: int
    handler_errors: int


class _Pump:
    """One zmq socket and the state of its reader task."""

    def __init__(self, sock: zmq.Socket[Any], peer: str | None) -> None:
        self.sock = sock
        self.peer = peer  # a DEALER's fixed peer; None for the ROUTER
        self.address = ""  # a DEALER's peer address
        self.fd = typing.cast(int, sock.getsockopt(zmq.FD))
        self.guard = ReplayGuard()
        self.wait_scope: trio.CancelScope | None = None
        self.reader_scope = trio.CancelScope()
        self.writers = trio.lowlevel.ParkingLot()

    def close(self) -> None:
        """Stop the reader, wake parked writers, close the socket."""
        self.reader_scope.cancel()
        trio.lowlevel.notify_closing(self.fd)
        self.writers.unpark_all()
        self.sock.close(0)

    def kick(self) -> None:
        """Wake the reader if input arrived behind the edge a send consumed."""
        if (
            self.wait_scope is not None
            and typing.cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN
        ):
            self.wait_scope.cancel()


class ControlNode:
    """A named control-plane endpoint.

    Use as ``async with ControlNode("md0", secret=key) as node:``. The node binds
    at once; ``node.address`` is where peers connect.

    Args:
        name: this node's name; peers address it by this name.
        secret: the shared HMAC key, or None to read ``$PDDNET_SECRET``.
        bind: zmq endpoint to bind the ROUTER to (port 0 picks a free port).
        limits: message size and count limits for encoding and decoding.
        replay_window_s: how far a frame's timestamp may be from our clock.

    Raises:
        AuthError: if no secret is configured.
    """

    def __init__(
        self,
        name: str,
        *,
        secret: bytes | str | None = None,
        bind: str = "tcp://127.0.0.1:0",
        limits: ControlLimits | None = None,
        replay_window_s: float = 30.0,
    ) -> None:
        if not name or len(name.encode()) > 255:
            raise LocalProtocolError(f"bad node name {name!r}")
        self.name = name
        self._key = load_secret(secret)
        self._bind = bind
        self.limits = limits or ControlLimits()
        self._replay_window_s = replay_window_s
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._clock = SeqClock()
        # type -> (handler, is_async)
        self._routes: dict[type[Message], tuple[Handler, bool]] = {Ping: (_on_ping, False)}
        self._queued = 0  # frames handed to the dispatcher and not yet handled
        self._dealers: dict[str, _Pump] = {}
        self._router: _Pump | None = None
        self._pending: dict[int, tuple[trio.Event, list[Frame]]] = {}
        self._next_corr = 1
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[tuple[_Pump, str, Frame]](
            K_INBOX_SIZE
        )
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._warned: set[tuple[str, str]] = set()
        self._stats = dict.fromkeys(ControlStatistics.__dataclass_fields__, 0)
        self.address = ""

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> ControlNode:
        sock = self._socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # No ROUTER_HANDOVER: a connection claiming a name already connected is
        # ignored, so a stranger cannot take over a peer's route (zmq identities
        # are not authenticated; frames are). A restarted peer gets its name
        # back once heartbeats declare the old connection dead.
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise PeerUnavailable(f"cannot bind {self._bind}: {exc}", peer=self.name) from exc
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = _Pump(sock, None)
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._reader, self._router)
        self._nursery.start_soon(self._dispatcher)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        try:
            return bool(await self._nursery_cm.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:
            # Unwrap the body's own exception, so that callers see a plain
            # TransferTimeout rather than a group holding only it.
            if exc is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc:
                return False
            raise
        finally:
            self._close_sockets()

    async def aclose(self) -> None:
        """Stop all tasks and close every socket. Pending requests are cancelled."""
        if self._nursery is not None:
            await self.__aexit__(None, None, None)

    def _close_sockets(self) -> None:
        for pump in [*self._dealers.values(), *([self._router] if self._router else [])]:
            pump.close()
        self._dealers.clear()
        self._router = None
        self._nursery = None

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, K_HWM)
        sock.setsockopt(zmq.RCVHWM, K_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes + 1024)
        sock.setsockopt(zmq.HEARTBEAT_IVL, K_HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, K_HEARTBEAT_TIMEOUT_MS)
        return sock

    # --------------------------------------------------------------- public
    def route(
        self,
        cls: type[M],
        handler: Callable[[str, M], Awaitable[Message | None] | Message | None],
    ) -> None:
        """Deliver requests and events of type ``cls`` to ``handler(peer, msg)``.

        ``handler`` is an async function, or a plain function for cheap work
        that never blocks (it then runs straight from the socket reader when
        nothing is queued ahead of it, saving a task switch per call).

        For a request, the handler's return value is the reply (None replies
        with an empty :class:`~pddnet.wire.Pong`); a :class:`PddnetError` it
        raises is sent back and raised by the caller's :meth:`request` as
        :class:`RemoteCallError`. Handlers run one at a time in arrival order,
        so they should be quick: start longer work in a task of your own.
        """
        self._routes[cls] = (handler, inspect.iscoroutinefunction(handler))

    async def connect(self, peer: str, address: str) -> None:
        """Open (or replace) our DEALER to ``peer`` at ``address``.

        zmq connects in the background: an absent peer shows up as a
        :class:`TransferTimeout` on the first :meth:`request`. Connecting again
        to the same address keeps the open connection: the peer would ignore a
        second connection under our name until it noticed the first one close
        (no ``ROUTER_HANDOVER``), and drop what we sent on it.
        """
        await trio.lowlevel.checkpoint()
        if self._nursery is None:
            raise LocalProtocolError("node is not running; use 'async with'", peer=peer)
        current = self._dealers.get(peer)
        if current is not None and current.address == address:
            return
        old = self._dealers.pop(peer, None)
        if old is not None:
            old.close()
        sock = self._socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        # Queue nothing for a peer that is not connected: sends wait (and time
        # out) instead of piling up frames for a peer that may never come.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(address)
        pump = _Pump(sock, peer)
        pump.address = address
        self._dealers[peer] = pump
        self._nursery.start_soon(self._reader, pump)

    async def send(self, peer: str, msg: Message, *, timeout: float = K_DEFAULT_TIMEOUT) -> None:
        """Send a one-way event to ``peer``.

        Returns once zmq has queued the frame; it waits only while the
        peer's queue is at its high-water mark.

        Raises:
            PeerUnavailable: if we neither connected to ``peer`` nor hear from it.
            TransferTimeout: if the peer's queue stayed full for ``timeout`` seconds.
            LocalProtocolError: if ``msg`` breaks its schema or the size limit.

        Cancellation: the frame was either handed to zmq whole or not at all.
        """
        with trio.move_on_after(timeout) as scope:
            await self._send(peer, msg, FrameKind.EVENT, 0)
        if scope.cancelled_caught:
            self._stats["timeouts"] += 1
            raise TransferTimeout(f"{peer!r} did not drain its queue in {timeout:g}s", peer=peer)

    async def request(
        self, peer: str, msg: Message, *, timeout: float = K_DEFAULT_TIMEOUT
    ) -> Message:
        """Send ``msg`` to ``peer`` and wait for its reply.

        Raises:
            TransferTimeout: if no reply came within ``timeout`` seconds.
            RemoteCallError: if the peer's handler failed.
            PeerUnavailable: if there is no route to ``peer``.

        Cancellation: the request may still have reached the peer; a late reply
        is counted and discarded.
        """
        corr = self._next_corr
        self._next_corr += 1
        done = trio.Event()
        slot: list[Frame] = []
        self._pending[corr] = (done, slot)
        try:
            with trio.move_on_after(timeout):
                await self._send(peer, msg, FrameKind.REQUEST, corr, checkpoint=False)
                await done.wait()
        finally:
            del self._pending[corr]
        if not slot:
            self._stats["timeouts"] += 1
            raise TransferTimeout(
                f"no reply to {type(msg).__name__} within {timeout:g}s", peer=peer
            )
        reply = slot[0].message
        if isinstance(reply, ErrorReply):
            raise RemoteCallError(f"{reply.code}: {reply.reason}", code=reply.code, peer=peer)
        return reply

    async def ping(self, peer: str, *, timeout: float = K_DEFAULT_TIMEOUT) -> float:
        """Round-trip time to ``peer`` in seconds."""
        t0 = trio.current_time()
        await self.request(peer, Ping(), timeout=timeout)
        return trio.current_time() - t0

    @property
    def key(self) -> bytes:
        """The shared secret; the data plane's handshake proves the same one."""
        return self._key

    def peers(self) -> set[str]:
        """Peers we opened a DEALER to."""
        return set(self._dealers)

    def statistics(self) -> ControlStatistics:
        return ControlStatistics(**self._stats)

    # ------------------------------------------------------------- sending
    def _path(self, peer: str) -> tuple[_Pump, list[bytes]]:
        pump = self._dealers.get(peer)
        if pump is not None:
            return pump, []
        if self._router is None:
            raise LocalProtocolError("node is not running", peer=peer)
        return self._router, [peer.encode()]

    async def _send(
        self,
        peer: str,
        msg: Message,
        kind: FrameKind,
        corr: int,
        via: _Pump | None = None,
        *,
        checkpoint: bool = True,
    ) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if via is None:
            pump, prefix = self._path(peer)
        else:
            pump, prefix = via, ([peer.encode()] if via.peer is None else [])
        while True:
            # The sequence number is taken at the moment the frame is handed to
            # zmq: a frame that waited on a full or unconnected socket must not
            # carry an older number than one sent meanwhile, or the peer's
            # replay guard would drop it.
            frame = encode_frame(
                msg,
                key=self._key,
                src=self.name,
                dst=peer,
                seq=self._clock.next(),
                corr=corr,
                kind=kind,
                limits=self.limits,
            )
            try:
                pump.sock.send_multipart([*prefix, frame], flags=_NOBLOCK)
                break
            except zmq.Again:
                # The reader unparks us when EVENTS shows POLLOUT. zmq does not
                # promise an FD edge for every POLLOUT change (a connection
                # completing, say), so we also re-try every 20 ms while blocked.
                with trio.move_on_after(K_WRITE_RECHECK_S):
                    await pump.writers.park()
                checkpoint = False
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerUnavailable(f"no route to peer {peer!r}", peer=peer) from exc
                raise PeerUnavailable(f"send to {peer!r} failed: {exc}", peer=peer) from exc
        self._stats["sent"] += 1
        pump.kick()
        if checkpoint:  # callers that wait right after (request, replies) skip this yield
            await trio.lowlevel.cancel_shielded_checkpoint()

    # ------------------------------------------------------------- receiving
    async def _reader(self, pump: _Pump) -> None:
        # ClosedResourceError: the socket was replaced or closed under us
        with pump.reader_scope, contextlib.suppress(trio.ClosedResourceError):
            await self._read_loop(pump)

    async def _read_loop(self, pump: _Pump) -> None:
        sock = pump.sock
        while True:
            while True:
                events = typing.cast(int, sock.getsockopt(_EVENTS))
                if events & _POLLOUT and pump.writers.statistics().tasks_waiting:
                    pump.writers.unpark_all()
                if not events & _POLLIN:
                    break
                parts = sock.recv_multipart(_NOBLOCK)
                await self._on_parts(pump, parts)
            with trio.CancelScope() as scope:
                pump.wait_scope = scope
                await trio.lowlevel.wait_readable(pump.fd)
            pump.wait_scope = None

    async def _on_parts(self, pump: _Pump, parts: list[bytes]) -> None:
        self._stats["received"] += 1
        if pump.peer is None:
            if len(parts) != 2:
                self._reject("malformed", "?", f"{len(parts)} zmq parts")
                return
            try:
                peer = parts[0].decode()
            except UnicodeDecodeError:
                self._reject("malformed", repr(parts[0][:32]), "bad identity")
                return
        else:
            if len(parts) != 1:
                self._reject("malformed", pump.peer, f"{len(parts)} zmq parts")
                return
            peer = pump.peer
        try:
            frame = decode_frame(
                parts[-1], key=self._key, src=peer, dst=self.name, limits=self.limits
            )
            pump.guard.check(peer, frame.seq)
        except AuthError as exc:
            self._reject("replay" if "replay" in exc.message else "auth", peer, exc.message)
            return
        except RemoteProtocolError as exc:
            self._reject("malformed", peer, exc.message)
            return
        if frame.kind is FrameKind.REPLY:
            waiter = self._pending.get(frame.corr)
            if waiter is None or waiter[1]:
                self._stats["late_replies"] += 1
                return
            waiter[1].append(frame)
            waiter[0].set()
            return
        route = self._routes.get(type(frame.message))
        if route is not None and not route[1] and not self._queued:
            # Nothing is queued ahead: a plain handler runs here, in order. (The
            # count, not the channel's buffer, decides: a frame handed straight
            # to a waiting dispatcher is in no buffer but not handled yet.)
            await self._handle(pump, peer, frame, route)
            return
        self._queued += 1
        try:
            self._inbox_send.send_nowait((pump, peer, frame))
        except trio.WouldBlock:
            await self._inbox_send.send((pump, peer, frame))

    def _reject(self, reason: str, peer: str, detail: str) -> None:
        self._stats[f"rejected_{reason}"] += 1
        if (peer, reason) not in self._warned:
            self._warned.add((peer, reason))
            log.warning("%s: dropped %s control frame from %s: %s", self.name, reason, peer, detail)

    async def _dispatcher(self) -> None:
        async for pump, peer, frame in self._inbox_recv:
            try:
                await self._handle(pump, peer, frame, self._routes.get(type(frame.message)))
            finally:
                self._queued -= 1

    async def _handle(
        self, pump: _Pump, peer: str, frame: Frame, route: tuple[Handler, bool] | None
    ) -> None:
        msg = frame.message
        if route is None:
            self._stats["unrouted"] += 1
            if frame.kind is FrameKind.REQUEST:
                reason = f"{self.name} has no handler for {type(msg).__name__}"
                await self._reply(pump, peer, frame, ErrorReply("LocalProtocolError", reason))
            else:
                self._reject("malformed", peer, f"no handler for event {type(msg).__name__}")
            return
        self._stats["delivered"] += 1
        handler, is_async = route
        reply: Message | None
        try:
            result: Any = handler(peer, msg)
            reply = await result if is_async else result
        except PddnetError as exc:
            self._stats["handler_errors"] += 1
            reply = ErrorReply(type(exc).__name__, str(exc))
        except Exception as exc:  # a handler bug must not kill the node
            self._stats["handler_errors"] += 1
            log.exception("%s: handler for %s failed", self.name, type(msg).__name__)
            reply = ErrorReply("InternalError", f"{type(exc).__name__}: {exc}")
        if frame.kind is FrameKind.REQUEST:
            await self._reply(pump, peer, frame, reply if reply is not None else Pong())

    async def _reply(self, pump: _Pump, peer: str, frame: Frame, reply: Message) -> None:
        try:
            await self._send(peer, reply, FrameKind.REPLY, frame.corr, via=pump, checkpoint=False)
        except PeerUnavailable as exc:
            log.warning("%s: reply to %s lost: %s", self.name, peer, exc)


def _on_ping(peer: str, msg: Ping) -> Message:
    return Pong(msg.payload)
