"""A control-plane node: named peers over pyzmq, driven from trio.

Theory of operation
-------------------
Each node binds one ROUTER socket; peers that connect to it are known by the
zmq identity they set (their node name). To reach a peer, a node opens a
DEALER to the peer's ROUTER. Messages may flow either way on either socket:
``send(peer, ...)`` uses our DEALER to ``peer`` if we opened one, otherwise
the ROUTER route ``peer`` opened to us.

Connections are authenticated before they carry a frame: every socket runs
zmq's CURVE mechanism with a key pair derived from the shared secret
(:func:`~pddnet.control._secret.curve_keys`), so a peer without the secret
fails the ZMTP handshake and zmq closes its connection before it has a
routing identity: a stranger can neither claim a node's name nor receive a
frame (and frames are encrypted on the wire). Because only peers holding the
secret get that far, the ROUTER sets ``ROUTER_HANDOVER``: a node that
reconnects under its name (a restart, a new connection) takes the name over
at once and zmq ends the stale connection. A connection that has not
finished the handshake within 3 s (``HANDSHAKE_IVL``) is closed. Failed
handshakes are counted (``rejected_handshakes``) and logged at most once a
second.

Every socket has one reader task. The zmq FD is *edge-triggered*: it becomes
readable when the socket's state changes, and any zmq call (a send included)
may consume that edge. So the reader drains until ``EVENTS`` shows no
``POLLIN`` before it sleeps in ``wait_readable``, and every send re-checks
``EVENTS`` afterwards and wakes the reader (by cancelling its wait) if input
arrived meanwhile: a send that fails too (no route to the peer, a full
queue), since zmq processed the socket's pending commands before it
refused, and with them the edge. Senders blocked by the high-water mark
park until the reader sees ``POLLOUT``. Nothing polls in a loop, and no
thread is used.

Frames are authenticated (:func:`pddnet.wire.decode_frame`) and checked for
replay per socket, sender and path (:class:`~pddnet.control._paths.PathGuard`).
A forged, tampered, malformed or replayed frame is dropped, counted in
:meth:`ControlNode.statistics` and logged at most once a second per reason
(the next line says how many were suppressed); it is never delivered.
Nothing a stranger sends is remembered per stranger: the replay guards and
twin routes grow only for senders whose frames authenticated, and the log
limiter keeps one entry per reason. (The frame MAC stands beside CURVE: it
binds sender, recipient and sequence number, which CURVE does not.) Replies
resolve the waiting :meth:`request`; requests and events go, in arrival
order, through a bounded inbox to one dispatcher task that runs the routed
handler. A full inbox stops the readers, so zmq's
high-water marks push back on senders: nothing is dropped for lack of room.

Redundant paths
---------------
``connect(peer, address, paths=2)`` opens a second DEALER (a *twin*, with its
own TCP connection and the zmq identity ``name\\0\\x01``) beside the primary
one. Every frame to that peer then goes out on every connected path, and the
peer answers and sends on every route it has heard us on, so a frame is late
only if *all* its copies are: a lost segment of a one-packet message no longer
waits for TCP's tail-loss probe (2 SRTT + 200 ms with one packet in flight).
The receiver delivers the first copy and counts the others as ``duplicates``
(not as replays). Frames keep their order while every path carries every
frame; one that a path missed (not connected yet, or full) may be overtaken
by later frames on another path.

TCP tuning
----------
``ControlNode(..., tcp=TcpTuning.wan())`` sets a lower minimum RTO and
delayed-ACK ceiling on every connection the node makes or accepts (through a
zmq socket monitor, which reports each connection's descriptor; see
:mod:`pddnet.control._tcp`). Where the kernel lacks an option the node logs
once and carries on.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import struct
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
from .._ratelog import LogLimiter
from ..wire import (
    ControlLimits,
    ErrorReply,
    Frame,
    FrameKind,
    Message,
    Ping,
    Pong,
    SeqClock,
    decode_frame,
    encode_frame,
)
from ._paths import K_MAX_PATHS, PathGuard, Verdict, path_identity, split_identity
from ._secret import curve_keys, load_secret
from ._tcp import TcpTuning, tune_fd

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
# A connection must finish its ZMTP/CURVE handshake (3 round trips) within this;
# zmq's default of 30 s let strangers hold descriptors ten times as long.
K_HANDSHAKE_IVL_MS = 3000
_HANDSHAKE_FAILED = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITOR_BATCH = 64  # monitor events handled between two checkpoints
# Plain ints: zmq's flag enums cost microseconds per operation on this hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_MONITOR_IDS = itertools.count()
# a DEALER group's copies carry no zmq prefix
_NO_PREFIX: list[list[list[bytes]]] = [[[]] * n for n in range(K_MAX_PATHS + 1)]
_ACCEPT, _DUPLICATE = Verdict.ACCEPT, Verdict.DUPLICATE


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
    duplicates: int = 0  # copies dropped because another path delivered the frame first
    copies_sent: int = 0  # extra copies sent on twin paths (``sent`` counts each frame once)
    tcp_tuned: int = 0  # connections whose TCP options were set (``tcp=``)
    rejected_handshakes: int = 0  # connections refused at the CURVE handshake (no secret)


class _Pump:
    """One zmq socket and the state of its reader task.

    The DEALERs of one peer (primary and twins) form a group: they share the
    group list, the :class:`PathGuard` and the parking lot of blocked writers.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        peer: str | None,
        guard: PathGuard,
        *,
        path: int = 0,
        group: list[_Pump] | None = None,
        writers: trio.lowlevel.ParkingLot | None = None,
    ) -> None:
        self.sock = sock
        self.peer = peer  # a DEALER's fixed peer; None for the ROUTER
        self.path = path  # a DEALER's path number (0: primary)
        self.address = ""  # a DEALER's peer address
        self.fd = typing.cast(int, sock.getsockopt(zmq.FD))
        self.guard = guard
        self.group = group if group is not None else []
        self.group.append(self)
        self.wait_scope: trio.CancelScope | None = None
        self.reader_scope = trio.CancelScope()
        self.writers = writers or trio.lowlevel.ParkingLot()
        self.monitor: zmq.Socket[Any] | None = None  # connection and handshake events
        self.monitor_scope = trio.CancelScope()

    def close(self) -> None:
        """Stop the reader, wake parked writers, close the socket."""
        self.reader_scope.cancel()
        trio.lowlevel.notify_closing(self.fd)
        self.writers.unpark_all()
        if self.monitor is not None:
            self.monitor_scope.cancel()
            trio.lowlevel.notify_closing(typing.cast(int, self.monitor.getsockopt(zmq.FD)))
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)

    def kick(self) -> None:
        """Wake the reader if input arrived behind the edge a send consumed
        (a send that failed included)."""
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
        tcp: TCP options for every connection this node makes or accepts
            (e.g. :meth:`TcpTuning.wan` for peers across a WAN); None leaves
            the system defaults.

    Raises:
        AuthError: if no secret is configured.
        LocalProtocolError: if the name is empty, too long or holds a NUL byte.
    """

    def __init__(
        self,
        name: str,
        *,
        secret: bytes | str | None = None,
        bind: str = "tcp://127.0.0.1:0",
        limits: ControlLimits | None = None,
        replay_window_s: float = 30.0,
        tcp: TcpTuning | None = None,
    ) -> None:
        if not name or len(name.encode()) > 255 or "\0" in name:
            raise LocalProtocolError(f"bad node name {name!r}")
        self.name = name
        self._key = load_secret(secret)
        self._bind = bind
        self.limits = limits or ControlLimits()
        self._replay_window_s = replay_window_s
        self._tcp_options = tcp.options() if tcp is not None else []
        self._tcp_unsupported: set[str] = set()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._curve_public, self._curve_secret = curve_keys(self._key)
        self._clock = SeqClock()
        # type -> (handler, is_async)
        self._routes: dict[type[Message], tuple[Handler, bool]] = {Ping: (_on_ping, False)}
        self._queued = 0  # frames handed to the dispatcher and not yet handled
        self._dealers: dict[str, _Pump] = {}  # peer -> primary DEALER (twins in its group)
        self._router: _Pump | None = None
        self._twin_routes: dict[str, list[bytes]] = {}  # peer -> twin identities heard
        self._pending: dict[int, tuple[trio.Event, list[Frame]]] = {}
        self._next_corr = 1
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[tuple[_Pump, str, Frame]](
            K_INBOX_SIZE
        )
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._log = LogLimiter(log)  # keyed by reason, never by (unauthenticated) peer
        self._stats = dict.fromkeys(ControlStatistics.__dataclass_fields__, 0)
        self.address = ""

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> ControlNode:
        sock = self._socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Only a peer that passed the CURVE handshake (so holds the secret) ever
        # presents an identity, so a new connection under a taken name is that
        # node come back: it takes the route over and zmq ends the old one.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        accepted = zmq.EVENT_ACCEPTED if self._tcp_options else 0
        monitor = self._monitor(sock, accepted | _HANDSHAKE_FAILED)
        try:
            sock.bind(self._bind)
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(0)
            sock.close(0)
            raise PeerUnavailable(f"cannot bind {self._bind}: {exc}", peer=self.name) from exc
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = _Pump(sock, None, PathGuard(self._replay_window_s))
        self._router.monitor = monitor
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._reader, self._router)
        if monitor is not None:
            self._nursery.start_soon(self._watch, self._router)
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
        for primary in self._dealers.values():
            for pump in primary.group:
                pump.close()
        if self._router is not None:
            self._router.close()
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
        sock.setsockopt(zmq.HANDSHAKE_IVL, K_HANDSHAKE_IVL_MS)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve_secret)
        else:  # every node holds the one key pair, as server and as client
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve_secret)
        return sock

    # ------------------------------------------- TCP tuning, handshake failures
    def _monitor(self, sock: zmq.Socket[Any], events: int) -> zmq.Socket[Any] | None:
        """A PAIR socket that receives ``sock``'s ``events`` (None if there are none)."""
        if not events:
            return None
        addr = f"inproc://pddnet-monitor-{id(self):x}-{next(_MONITOR_IDS)}"
        sock.monitor(addr, events)
        mon = self._ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)
        return mon

    async def _watch(self, pump: _Pump) -> None:
        """Tune each connection ``pump``'s monitor reports; count failed handshakes.

        The monitor is drained promptly: libzmq's I/O thread blocks on a full
        monitor socket. A checkpoint every few events keeps a flood of
        strangers' handshakes from holding the loop.
        """
        mon = pump.monitor
        assert mon is not None
        fd = typing.cast(int, mon.getsockopt(zmq.FD))
        with pump.monitor_scope, contextlib.suppress(trio.ClosedResourceError):
            while True:
                handled = 0
                while typing.cast(int, mon.getsockopt(_EVENTS)) & _POLLIN:
                    parts = mon.recv_multipart(_NOBLOCK)
                    if len(parts) == 2 and len(parts[0]) == 6:
                        event, value = struct.unpack("=Hi", parts[0])
                        if event & _HANDSHAKE_FAILED:
                            self._handshake_failed(pump, event, value)
                        else:
                            self._tune(value, parts[1], event == zmq.EVENT_ACCEPTED)
                    handled += 1
                    if handled % _MONITOR_BATCH == 0:
                        await trio.lowlevel.checkpoint()
                await trio.lowlevel.wait_readable(fd)

    def _handshake_failed(self, pump: _Pump, event: int, code: int) -> None:
        self._stats["rejected_handshakes"] += 1
        where = f"from a peer on {self.address}" if pump.peer is None else f"to {pump.peer!r}"
        self._log.warning(
            "handshake",
            "%s: refused a control connection %s: CURVE handshake failed "
            "(event %#x, code %#x; not our secret?)",
            self.name,
            where,
            event,
            code,
        )

    def _tune(self, fd: int, endpoint: bytes, accepted: bool) -> None:
        options = [o for o in self._tcp_options if o[0] not in self._tcp_unsupported]
        if not options:
            return
        try:
            done, unsupported = tune_fd(fd, endpoint, accepted, options)
        except OSError as exc:
            self._log.warning(
                "tune", "%s: cannot tune TCP connection %s: %s", self.name, endpoint, exc
            )
            return
        for name in unsupported:
            self._tcp_unsupported.add(name)
            log.warning("%s: the kernel does not take %s; not setting it", self.name, name)
        if done and not unsupported:
            self._stats["tcp_tuned"] += 1

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

    async def connect(self, peer: str, address: str, *, paths: int = 1) -> None:
        """Open (or replace) our DEALER(s) to ``peer`` at ``address``.

        zmq connects in the background: an absent peer shows up as a
        :class:`TransferTimeout` on the first :meth:`request`. Connecting again
        to the same address with the same ``paths`` keeps the open connections:
        a second connection under our name would take the name over and end
        the first (the peer's ROUTER hands an authenticated name over to its
        newest connection), dropping what was queued on it. A changed
        ``paths`` opens or closes twins beside the primary connection.

        Args:
            peer: the name we address the peer by.
            address: its ROUTER's zmq endpoint.
            paths: TCP connections to open (1 to 4). With more than one, every
                frame to ``peer`` (and every frame ``peer`` sends us, as it
                answers on every route it heard) travels once per path and the
                first copy to arrive wins: use it for peers across a lossy WAN,
                where a lone lost segment otherwise costs a tail-loss probe
                (about 2 RTT + 200 ms). It multiplies the control bytes by
                ``paths``.

        Raises:
            LocalProtocolError: if the node is not running or ``paths`` is out
                of range.
        """
        await trio.lowlevel.checkpoint()
        if self._nursery is None:
            raise LocalProtocolError("node is not running; use 'async with'", peer=peer)
        if not 1 <= paths <= K_MAX_PATHS:
            raise LocalProtocolError(f"paths must be 1..{K_MAX_PATHS}, not {paths}", peer=peer)
        idents = [path_identity(self.name, k) for k in range(paths)]
        current = self._dealers.get(peer)
        if current is not None and current.address == address:
            # Keep the open connections; close or open twins to match ``paths``.
            group = current.group
            while len(group) > paths:
                group.pop().close()
        else:
            if current is not None:
                for pump in self._dealers.pop(peer).group:
                    pump.close()
            group = []
            current = None
        guard = current.guard if current else PathGuard(self._replay_window_s)
        writers = current.writers if current else trio.lowlevel.ParkingLot()
        for k in range(len(group), paths):
            sock = self._socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, idents[k])
            # Queue nothing for a peer that is not connected: sends wait (and time
            # out) instead of piling up frames for a peer that may never come.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            monitor = self._monitor(sock, zmq.EVENT_CONNECTED if self._tcp_options else 0)
            sock.connect(address)
            pump = _Pump(sock, peer, guard, path=k, group=group, writers=writers)
            pump.address = address
            pump.monitor = monitor
            self._nursery.start_soon(self._reader, pump)
            if monitor is not None:
                self._nursery.start_soon(self._watch, pump)
        self._dealers[peer] = group[0]

    def disconnect(self, peer: str) -> None:
        """Close our DEALER(s) to ``peer`` (twins included) and forget its twin routes.

        Each socket's reader (and monitor) stops, writers parked on it wake
        (their sends fail or take the ROUTER route), and zmq closes the TCP
        connections at once (``LINGER`` 0: frames still queued to the peer
        are dropped). A request waiting for the peer's reply gets none on the
        closed socket and times out. Afterwards ``send`` and ``request`` reach
        ``peer`` only through a connection it opened to us (else they raise
        :class:`PeerUnavailable`), and :meth:`connect` opens new connections.
        An unknown peer is ignored.
        """
        primary = self._dealers.pop(peer, None)
        if primary is not None:
            for pump in primary.group:
                pump.close()
        self._twin_routes.pop(peer, None)

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
    def _targets(self, peer: str, via: _Pump | None) -> tuple[_Pump, list[list[bytes]]]:
        """The socket to send to ``peer`` on, and the zmq prefix of each copy.

        A DEALER group sends one copy per DEALER; the ROUTER one per route
        (identity) ``peer`` has been heard on.
        """
        pump = self._dealers.get(peer) if via is None else via
        if pump is None:
            if self._router is None:
                raise LocalProtocolError("node is not running", peer=peer)
            pump = self._router
        if pump.peer is not None:
            return pump, _NO_PREFIX[len(pump.group)]
        twins = self._twin_routes.get(peer)
        if not twins:
            return pump, [[peer.encode()]]
        return pump, [[peer.encode()], *([i] for i in twins)]

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
        while True:
            # (again after a wait: connect() may have changed the paths meanwhile)
            pump, prefixes = self._targets(peer, via)
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
            copies, blocked, error = self._send_copies(pump, prefixes, frame, peer)
            if copies:
                break
            if error is not None and not blocked:
                if error.errno == zmq.EHOSTUNREACH:
                    raise PeerUnavailable(f"no route to peer {peer!r}", peer=peer) from error
                raise PeerUnavailable(f"send to {peer!r} failed: {error}", peer=peer) from error
            # Every path is full or not connected. The reader unparks us when
            # EVENTS shows POLLOUT. zmq does not promise an FD edge for every
            # POLLOUT change (a connection completing, say), so we also re-try
            # every 20 ms while blocked.
            with trio.move_on_after(K_WRITE_RECHECK_S):
                await pump.writers.park()
            checkpoint = False
        self._stats["sent"] += 1
        self._stats["copies_sent"] += copies - 1
        if checkpoint:  # callers that wait right after (request, replies) skip this yield
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _send_copies(
        self, pump: _Pump, prefixes: list[list[bytes]], frame: bytes, peer: str
    ) -> tuple[int, bool, zmq.ZMQError | None]:
        """Hand ``frame`` to zmq once per target, never blocking.

        Every attempt kicks the target's reader, the failed ones too: a send
        that fails (no route, a full queue) has still processed the socket's
        commands, and with them the FD edge that announced new input.

        Returns (copies handed over, whether some target was full or not yet
        connected, the first other error).
        """
        if len(prefixes) == 1:  # the common case: one path
            try:
                pump.sock.send_multipart([*prefixes[0], frame], flags=_NOBLOCK)
            except zmq.Again:
                return 0, True, None
            except zmq.ZMQError as exc:
                return 0, False, exc
            finally:
                pump.kick()
            return 1, False, None
        copies, blocked, error = 0, False, None
        for k, prefix in enumerate(prefixes):
            target = pump.group[k] if pump.peer is not None else pump
            try:
                target.sock.send_multipart([*prefix, frame], flags=_NOBLOCK)
            except zmq.Again:
                blocked = True
                continue
            except zmq.ZMQError as exc:
                error = error or exc
                if k and pump.peer is None and exc.errno == zmq.EHOSTUNREACH:
                    # a twin route that went away; heard again, it comes back
                    with contextlib.suppress(ValueError):
                        self._twin_routes[peer].remove(prefix[0])
                continue
            finally:
                target.kick()
            copies += 1
        return copies, blocked, error

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
            who = split_identity(parts[0])
            if who is None:
                self._reject("malformed", repr(parts[0][:32]), "bad identity")
                return
            peer, path = who
        else:
            if len(parts) != 1:
                self._reject("malformed", pump.peer, f"{len(parts)} zmq parts")
                return
            peer, path = pump.peer, pump.path
        try:
            frame = decode_frame(
                parts[-1], key=self._key, src=peer, dst=self.name, limits=self.limits
            )
        except AuthError as exc:
            self._reject("auth", peer, exc.message)
            return
        except RemoteProtocolError as exc:
            self._reject("malformed", peer, exc.message)
            return
        verdict = pump.guard.check(peer, path, frame.seq)
        if verdict is not _ACCEPT:
            if verdict is not _DUPLICATE:
                self._reject("replay", peer, f"{verdict.value} control frame (seq {frame.seq})")
                return
            self._stats["duplicates"] += 1
        if path and pump.peer is None:  # an authenticated twin route: answer on it too
            routes = self._twin_routes.setdefault(peer, [])
            if parts[0] not in routes:
                routes.append(parts[0])
        if verdict is _DUPLICATE:
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
        self._log.warning(
            reason, "%s: dropped %s control frame from %s: %s", self.name, reason, peer, detail
        )

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
            try:
                await self._send(
                    peer, reply, FrameKind.REPLY, frame.corr, via=pump, checkpoint=False
                )
            except LocalProtocolError as exc:
                # the handler's reply breaks its schema or the size limit: a bug
                # of ours, answered as one instead of killing the node
                self._stats["handler_errors"] += 1
                log.error("%s: bad reply to %s: %s", self.name, type(frame.message).__name__, exc)
                error = ErrorReply("InternalError", f"bad reply: {exc}"[:1000])
                await self._send(
                    peer, error, FrameKind.REPLY, frame.corr, via=pump, checkpoint=False
                )
        except PeerUnavailable as exc:
            log.warning("%s: reply to %s lost: %s", self.name, peer, exc)


def _on_ping(peer: str, msg: Ping) -> Message:
    return Pong(msg.payload)
