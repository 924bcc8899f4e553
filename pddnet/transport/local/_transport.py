"""The local (intra-datacenter) path over UCX, through ucxx's tag API.

ucxx's Python layer has tagged and active-message send/receive but no
one-sided put/get, so the *receiver* places the data: when it grants a
destination it pre-posts one tagged receive per coalesced destination range,
straight into the engine's KV memory (no staging). The grant carries the
range lengths; the sender sends exactly those pieces, each from one contiguous
source range when the two sides' ranges line up (always the case for a
:class:`~pddnet.kv.TransferPlan`, whose runs are coalesced on both sides at
once), or gathered into a staging buffer when they do not (a counted copy).

**Authentication.** With a shared ``secret`` a sender must pass the data-plane
challenge-response (:class:`pddnet.wire.AuthHandshake`, the WAN streams'
handshake, channel ``local``) before anything else: its HELLO carries its
CHALLENGE, the receiver answers CHALLENGE + PROOF, the sender checks that and
sends its PROOF, the receiver checks it and answers ACCEPT. Both ends then
derive the session's tags from the secret and both nonces (see
:mod:`._auth`): the data tags' mask and two private inboxes. The receiver
posts receives into granted memory only when an authenticated session's START
names the transfer, and only under that session's tags, so a peer that fails
or skips the handshake can never match one (UCX's tag matching does not tell
endpoints apart: unguessable tags are what does). A failed handshake is an
:class:`~pddnet.AuthError` on both sides (the sender's ``__aenter__`` raises;
the receiver counts it in ``statistics().auth_failures`` and keeps the last
ones in :attr:`UcxReceiver.auth_errors`).

Tags (64 bits)::

    0x8 << 60 | ((transfer_id << 24 | piece) ^ mask)   data (ids < 2**32, pieces < 2**24)
    0xC << 60                                  receiver's public inbox (HELLO, AUTH)
    0xD << 60 | sender_id                      a sender's public inbox (AUTH)
    0xE << 60 | 60 session bits                a session's inbox on the receiver
    0xF << 60 | 60 session bits                a session's inbox on the sender

Without a secret the mask is 0 and the public inboxes carry everything.

Control messages are a fixed little-endian header ``u32 length, u8 kind, u8
code, u32 sender_id, u32 transfer_id`` and a blob (no msgpack on the hot
path): HELLO (sender -> receiver, blob = [the sender's CHALLENGE frame] + its
worker address; code bit 0 when the frame is there, bit 1 when the sender's
endpoint asked UCX for error handling, which the receiver's endpoint back must
match), AUTH (40-byte handshake
frames, either way), ACCEPT (receiver: the sender is admitted; the blob is the
address of the UCX worker the receiver made for this session, to which the
sender then sends everything else), BYE (sender: the session ends, its worker
can go), START (so the
receiver knows whom to tell and posts the transfer's receives; posted right
before the transfer's first piece, so both arrive in one wake-up, or at
``start`` when nothing is ready yet), DONE (receiver: every piece landed; one
per sender per round of completions, further transfer ids as u32s in the
blob), CANCEL (either way, with code cancelled / timeout / rejected).

**Low-latency mode** (opt-in, ``busy_poll_us > 0``): waiting on a transfer of
at most ``busy_poll_max_bytes`` first busy-polls the UCX worker from the
waiting task for up to ``busy_poll_us`` (:meth:`UcxWorker.poll`), so neither
side pays an epoll sleep and a trio task switch; then it sleeps as usual. It
burns a core for up to the budget per wait.

A receiver's address is ``ucx:NETNS:B64``: its network namespace (inode) and
its worker address. A sender in another namespace leaves out UCX's
shared-memory transports, which never deliver across namespaces.

A message longer than its posted receive fails with UCX's truncation error
and the transfer is rejected; a message with a tag nobody posted waits in
UCX's unexpected queue, never touching granted memory, and the receiver sweeps
it out (that queue has no bound of its own). So the sender cannot write
outside its grant. (ucxx does not report the received length, so a *shorter*
message cannot be detected; senders are trusted for that inside a datacenter.)

**Ending a grant.** UCX cancels a tag receive only while it is unmatched; one
whose data is in flight goes on writing until it completes. So a grant that
ends early is reported ended (``wait_transfer`` raises; the engine may reuse
the blocks) only once each of its receives completed or was confirmed
cancelled, bounded by ``drain_timeout``, after which the receiver halts the
UCX worker of that grant's sender session so nothing more lands (docs/local.md,
*Ending a grant*); other senders, on their own workers, go on (*Dead senders:
one UCX worker per sender session*).
"""

from __future__ import annotations

import enum
import itertools
import logging
import secrets
import struct
import time
from abc import ABC
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..._errors import (
    AuthError,
    LocalProtocolError,
    PddnetError,
    PeerUnavailable,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from ...kv import ByteRanges
from ...wire._auth import (
    K_AUTH_FRAME_SIZE,
    K_AUTH_MIN_SECRET,
    AuthFrame,
    AuthHandshake,
    AuthKind,
    AuthRole,
)
from .._auth import K_AUTH_TIMEOUT_S
from .._base import Grant, ProgressCallback, Receiver, Sender, Transfer, TransferState, views_of
from .._intervals import IntervalSet
from ._addressing import (
    K_ADDR_PREFIX,
    b64,
    netns_id,
    parse_address,
    tls_for_peer,
    tls_without_peer_reads,
    unb64,
)
from ._auth import (
    K_TAG_CTRL_RX,
    K_TAG_CTRL_TX,
    SessionTags,
    challenge_nonce,
    legacy_tags,
    session_tags,
    ucx_auth_context,
)
from ._ep_info import endpoint_transports
from ._worker import UcxWorker, detects_dead_peers

__all__ = [
    "UcxReceiver",
    "UcxReceiverStatistics",
    "UcxSender",
    "UcxSenderStatistics",
    "UcxTransfer",
]

log = logging.getLogger("pddnet.transport.local")

K_CTRL_MAX = 1 << 16
K_MAX_PIECES = 1 << 24
K_KEEP_FINISHED = 4096  # finished transfers remembered for late waiters
K_LENS_CACHE = 1024  # decoded grant piece lists kept by a sender
K_DONE_BATCH = (K_CTRL_MAX - 64) // 4  # transfer ids per DONE message
K_INLINE_BURST = 256  # sends completed while posted before the pump yields to trio
K_MAX_PENDING_AUTH = 64  # handshakes in progress on a receiver (more are dropped)
K_MAX_SESSIONS = 1024  # admitted senders a receiver keeps (the oldest idle one goes)
# With a UCX worker per session (the default) each costs ~11 fds (epoll, eventfd,
# tcp sockets, shared-memory FIFO) and ~4 MB (measured), so fewer are kept; an
# admission beyond this evicts the oldest idle session or, all busy, is refused.
K_MAX_SESSION_WORKERS = 64
# Halted session workers are never progressed nor destroyed again while the
# receiver lives (destroying one might progress it); beyond this many the next
# drain deadline halts the whole receiver, as without session workers.
K_MAX_HALTED_WORKERS = 16
K_BYE_GRACE_S = 0.5  # a session's worker outlives its BYE this long (the sender's flush)
K_KEEP_AUTH_ERRORS = 16
K_POLL_MAX_BYTES = 64 << 10  # low-latency mode: only transfers up to this size busy-poll
K_POLL_YIELD_S = 1e-3  # low-latency mode: a full trio checkpoint at least this often
# A transfer of at most this many bytes, all ready at start, travels inside its
# START message (DATA) when the grant allows it (host memory): one message each
# way instead of START + pieces + posted receives. Below UCX's rendezvous
# threshold (8 KiB), so it is one eager message.
K_INLINE_MAX = 8192 - 64
# A grant that ends (cancelled, failed, timed out, receiver closing) is reported
# only once every receive posted into it completed or UCX confirmed it
# cancelled. UCX cannot cancel a receive whose message already matched (a
# rendezvous transfer in flight); if such a receive has not completed after this
# long, the receiver halts its UCX worker (see UcxReceiver, drain_timeout).
K_DRAIN_TIMEOUT_S = 5.0
K_EP_CLOSE_S = 0.5  # a closing receiver lets its endpoints' flushes finish for this long
K_SEND_DRAIN_S = 2.0  # a closing sender lets sends in flight finish for this long
# Messages whose tag no receive is posted for wait in UCX's unexpected queue,
# which has no bound: a stranger with the worker address could fill memory
# (measured: 20,000 4 KiB messages grew a receiver by 128 MB). The receiver
# sweeps it: every K_SWEEP_S, unexpected messages that nothing live awaits are
# received into scratch and dropped, at most K_SWEEP_MAX per round.
K_SWEEP_S = 0.1
K_SWEEP_MAX = 4096


# ucxx errors (class names) with which UCX fails a receive whose sender's
# endpoint failed (error handling on; measured: a SIGKILLed sender gives
# UCXXConnectionResetError within milliseconds).
K_PEER_FAILURES = (
    "ConnectionReset",
    "EndpointTimeout",
    "Unreachable",
    "NotConnected",
    "LinkFailure",
    "EndpointFailure",
    "IOError",
)
K_HELLO_AUTH = 1  # HELLO code bits: a CHALLENGE frame leads the blob
K_HELLO_ERRH = 2  # the sender's endpoint has UCX error handling (both ends must agree)


class _Ctl(enum.IntEnum):
    HELLO = 1
    START = 2
    DONE = 3
    CANCEL = 4
    AUTH = 5
    ACCEPT = 6  # blob: the address of the session's own UCX worker (empty: the public one)
    DATA = 7  # START with a small transfer's bytes inline
    BYE = 8  # sender -> receiver: the session ends (its worker can be retired)


class _Code(enum.IntEnum):
    CANCELLED = 1
    TIMEOUT = 2
    REJECTED = 3
    HALTED = 4  # the receiver halted this session's UCX worker: every transfer of it failed


_HDR = struct.Struct("<IBBII")  # length (of the rest), kind, code, sender, transfer id


def _pack(kind: _Ctl, sender: int, tid: int, code: int = 0, blob: bytes = b"") -> bytes:
    return _HDR.pack(_HDR.size - 4 + len(blob), kind, code, sender, tid) + blob


def _unpack(buf: Any) -> tuple[_Ctl, int, int, int, bytes]:
    mv = memoryview(buf)
    if mv.nbytes < _HDR.size:
        raise RemoteProtocolError("truncated UCX control message")
    n, kind, code, sender, tid = _HDR.unpack_from(mv)
    if n > min(K_CTRL_MAX, mv.nbytes) - 4:
        raise RemoteProtocolError("oversized UCX control message")
    if n < _HDR.size - 4:
        raise RemoteProtocolError(f"UCX control message of {n} bytes is too short")
    try:
        ctl = _Ctl(kind)
    except ValueError:
        raise RemoteProtocolError(f"unknown UCX control message kind {kind}") from None
    return ctl, sender, tid, code, bytes(mv[_HDR.size : 4 + n])


def _flat_views(views: Sequence[Any]) -> list[Any]:
    """Flat byte views that slice without copying: memoryviews for host buffers,
    flat ``uint8`` device arrays for CUDA ones (ucxx sends from and receives into
    anything with ``__cuda_array_interface__`` when UCX has a CUDA transport).
    The device branch is untested here: this machine has no GPU."""
    out: list[Any] = []
    for v in views:
        if hasattr(v, "__cuda_array_interface__") and not isinstance(v, memoryview):
            out.append(v.reshape(-1).view("uint8"))
        else:
            out.extend(views_of([v]))
    return out


def _error_for(code: int, tid: int, peer: str) -> PddnetError:
    if code == _Code.TIMEOUT:
        return TransferTimeout("the peer's deadline passed", transfer_id=tid, peer=peer)
    if code == _Code.REJECTED:
        return RemoteProtocolError("the receiver rejected the transfer", transfer_id=tid, peer=peer)
    return TransferCancelled("the peer cancelled the transfer", transfer_id=tid, peer=peer)


class _Inbox:
    """A control-message tag this end listens on: one reused buffer, one posted receive."""

    __slots__ = ("buf", "closed", "handle", "handler", "tag", "worker")

    def __init__(self, tag: int, handler: Any, worker: UcxWorker) -> None:
        self.tag = tag
        self.handler = handler
        self.worker = worker
        self.buf = np.empty(K_CTRL_MAX, np.uint8)
        self.handle = 0
        self.closed = False


def _check_secret(secret: bytes | None) -> bytes | None:
    if secret is not None and len(secret) < K_AUTH_MIN_SECRET:
        raise AuthError(f"the data-plane secret must be at least {K_AUTH_MIN_SECRET} bytes")
    return secret


class _Service(ABC):
    """A worker plus the nursery that progresses it and runs timers."""

    _worker: UcxWorker
    _nursery: trio.Nursery

    def __init__(
        self,
        tls: str | None,
        spin_us: float,
        secret: bytes | None,
        auth_timeout: float,
        busy_poll_us: float,
        busy_poll_max_bytes: int,
    ) -> None:
        self._tls = tls
        self._spin_us = spin_us
        self.secret = _check_secret(secret)
        self.auth_timeout = auth_timeout
        self._poll_s = max(0.0, busy_poll_us) * 1e-6
        self._poll_max = busy_poll_max_bytes
        self._last_yield = 0.0
        self._progress_first = False  # a handler asks: progress before the inbox repost
        self.ctrl_dropped = 0
        self._stack: AsyncExitStack | None = None

    def _should_poll(self, total: int) -> bool:
        return self._poll_s > 0 and total <= self._poll_max

    def _workers(self) -> list[UcxWorker]:
        """Every worker this end progresses (the receiver adds its sessions')."""
        return [self._worker]

    async def _poll_wait(self, event: trio.Event, worker: UcxWorker | None = None) -> None:
        """Wait for ``event``, busy-polling first (low-latency mode, small transfers)."""
        w = worker or self._worker
        if not event.is_set() and not w.closed and w.poll(event.is_set, self._poll_s):
            # Done within the budget: a full trio checkpoint would hand the loop
            # to the progress task (its epoll fd is readable now) before we
            # return. Check for cancellation only, yielding at least every ms.
            now = time.perf_counter()
            if now - self._last_yield < K_POLL_YIELD_S:
                await trio.lowlevel.checkpoint_if_cancelled()
                return
            self._last_yield = now
        await event.wait()

    async def _open(self) -> None:
        self._worker = UcxWorker(tls=self._tls, spin_us=self._spin_us)
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        await self._nursery.start(self._worker.run)

    async def _close(self) -> None:
        if self._stack is None:
            return
        # Give queued control messages (CANCEL, DONE) a moment to leave.
        with trio.move_on_after(0.05):
            while any(e[3] for w in self._workers() if not w.halted for e in w._pending.values()):
                await trio.sleep(0.001)
        workers = self._workers()
        self._nursery.cancel_scope.cancel()
        stack, self._stack = self._stack, None
        await stack.aclose()
        for w in workers:
            w.close()

    def _listen(self, tag: int, handler: Any, worker: UcxWorker | None = None) -> _Inbox:
        """Receive control messages on ``tag``: ``handler(kind, sender, tid, code, blob)``."""
        box = _Inbox(tag, handler, worker or self._worker)
        self._post_inbox(box)
        return box

    def _post_inbox(self, box: _Inbox) -> None:
        # One buffer per inbox, reused: a message is parsed (copied out) before
        # the next receive is posted into it.
        w = box.worker

        def done(req: Any, err: BaseException | None) -> None:
            if w.closed or box.closed:
                return
            if err is not None:  # e.g. an oversized message: drop it, keep listening
                self._drop_ctrl(err)
            else:
                try:
                    box.handler(*_unpack(box.buf))
                except PddnetError as exc:
                    self._drop_ctrl(exc)
            if box.closed:
                return
            if w.polling or self._progress_first:
                # Latency first: repost after the next progress batch, which
                # runs the copy a large START's receives matched, or the tasks
                # a DONE woke. A message arriving meanwhile waits in UCX's
                # unexpected queue.
                self._progress_first = False
                w.defer(repost)
            else:  # at once: a burst of messages is handled (and answered) in one round
                self._post_inbox(box)

        def repost() -> None:
            if not (box.closed or w.closed):
                self._post_inbox(box)

        box.handle = w.recv(box.buf, box.tag, done)

    def _drop_ctrl(self, exc: BaseException) -> None:
        self.ctrl_dropped += 1  # a peer can send junk: warn once, then count
        level = logging.WARNING if self.ctrl_dropped == 1 else logging.DEBUG
        log.log(level, "dropping a UCX control message: %s", exc)

    def _unlisten(self, box: _Inbox) -> None:
        box.closed = True
        box.worker.forget(box.handle)

    def _send_ctrl(self, ep: Any, tag: int, msg: bytes, worker: UcxWorker | None = None) -> None:
        if ep is None:  # closed already (the session ended): nothing more goes to it
            return
        w = worker or self._worker  # the worker ``ep`` belongs to

        def done(req: Any, err: BaseException | None) -> None:
            if err is not None and not w.closed:
                log.debug("UCX control send failed: %s", err)

        w.send(ep, msg, tag, done, spin=True)


# ====================================================================== receiver
class _RxTransfer:
    __slots__ = (
        "bytes_done",
        "done",
        "drain_scope",
        "draining",
        "error",
        "handles",
        "layer_events",
        "layer_left",
        "lengths",
        "piece_layer",
        "pieces_left",
        "queues",
        "scope",
        "sender",
        "session",
        "state",
        "targets",
        "tid",
        "total",
        "worker",
    )

    def __init__(self, tid: int, total: int, worker: UcxWorker) -> None:
        self.tid = tid
        self.total = total
        self.state = TransferState.RUNNING
        self.error: PddnetError | None = None
        self.done = trio.Event()
        self.sender: int | None = None
        self.handles: list[int] = []
        self.bytes_done = 0
        self.pieces_left = 0
        self.lengths: Any = None
        self.piece_layer: Any = None
        self.layer_left: Any = None
        self.layer_events: list[trio.Event] = []
        self.scope: trio.CancelScope | None = None
        self.queues: list[int] = []
        self.targets: list[Any] = []  # granted memory, piece by piece: posted at START
        self.draining = 0  # ended, but this many receives may still write into it
        self.drain_scope: trio.CancelScope | None = None
        self.worker = worker  # where its receives are posted: its session's worker
        self.session: _Session | None = None


class _Session:
    """An admitted sender: its endpoint, its session's tags and its UCX worker.

    With per-session workers (the default) ``worker`` is the session's own:
    its data and control messages arrive there, ``ep`` (back to the sender)
    belongs to it, and halting it (a drain deadline) stops only this sender.
    """

    __slots__ = ("dropped", "ep", "errh", "hello_ep", "inbox", "scope", "sid", "tags", "worker")

    def __init__(
        self, sid: int, ep: Any, tags: SessionTags, worker: UcxWorker, errh: bool = False
    ) -> None:
        self.sid = sid
        self.ep = ep
        self.tags = tags
        self.errh = errh  # UCX error handling: a dead sender fails its receives in flight
        self.inbox: _Inbox | None = None
        self.worker = worker
        self.hello_ep: Any = None  # the public worker's endpoint (handshake, ACCEPT)
        self.scope = trio.CancelScope()  # its worker's progress task
        self.dropped = False  # no longer admitted: its worker goes once nothing is posted


class _Pending:
    """A handshake in progress on the receiver."""

    __slots__ = ("address", "ep", "errh", "hs", "n_i", "n_r", "scope")

    def __init__(
        self,
        hs: AuthHandshake,
        ep: Any,
        n_i: bytes,
        n_r: bytes,
        errh: bool = False,
        address: bytes = b"",
    ) -> None:
        self.hs = hs
        self.ep = ep
        self.n_i = n_i
        self.n_r = n_r
        self.errh = errh
        self.address = address  # the sender's worker address (its HELLO)
        self.scope = trio.CancelScope()


@dataclass(frozen=True, slots=True)
class UcxReceiverStatistics:
    """Counters of a :class:`UcxReceiver`."""

    bytes_received: int
    pieces_posted: int
    transfers_running: int
    transfers_done: int
    transfers_failed: int
    epoll_waits: int
    done_messages: int
    senders: int = 0  # admitted sessions
    auth_failures: int = 0  # handshakes failed, skipped or timed out
    unauthenticated_dropped: int = 0  # control messages from no admitted sender
    transfers_draining: int = 0  # ended, not yet reported: receives still in flight
    unexpected_dropped: int = 0  # messages swept from UCX's unexpected queue
    unexpected_dropped_bytes: int = 0
    drains: int = 0  # ends that had to wait for receives in flight
    path_closed: bool = False  # the whole receiver was halted (a drain deadline passed)
    peers_lost: int = 0  # senders UCX reported unreachable (error handling: a dead sender)
    session_workers: int = 0  # UCX workers of admitted (or ending) sessions, halted ones too
    sessions_halted: int = 0  # session workers halted by a drain deadline (one sender each)
    sessions_admitted: int = 0  # senders admitted since the start (``senders``: those now)


class UcxReceiver(_Service, Receiver):
    """The receiving end of the local path: grants memory and pre-posts receives into it.

    Use as ``async with UcxReceiver() as rx``; pass :attr:`address` to the
    senders.

    Args:
        tls: UCX transports (default: ``UCX_TLS``, else ``tcp,sm,self``).
        spin_us: see :class:`~pddnet.transport.local.UcxWorker`.
        secret: if set (at least 16 bytes), a sender must prove it before the
            receiver posts any receive for it (see the module docstring).
        auth_timeout: seconds a sender has to finish the handshake.
        busy_poll_us: low-latency mode: ``wait_transfer``/``wait_layer`` on a
            transfer of at most ``busy_poll_max_bytes`` busy-poll this long
            before sleeping (0: off, the default).
        busy_poll_max_bytes: the low-latency mode's size threshold.
        drain_timeout: when a grant ends (cancelled, failed, timed out, the
            receiver closing), its end is reported (``wait_transfer`` raises)
            only after every receive posted into it completed or was confirmed
            cancelled: UCX cannot cancel a receive whose data is already in
            flight. If one is still in flight after this many seconds, the
            receiver halts the UCX worker of that grant's sender session, so
            that nothing more can land in memory the engine may reuse, and
            fails that session's transfers with :class:`~pddnet.TransportError`
            saying so; other senders go on. Without session workers (or past
            16 halted ones) it halts its only worker instead, fails every
            transfer and refuses new grants (open a new receiver).
        session_workers: give each admitted sender its own UCX worker (the
            default; see docs/local.md, *Dead senders*). False: one worker for
            all, as before.
        cma: let UCX use the transports through which the receiver reads the
            sender's memory (``cma``, part of ``sm``). With them a sender that
            dies mid-rendezvous makes UCX **abort this process** (no error
            handling is possible with shared memory); False leaves them out
            (``sm`` becomes ``posix,sysv``), so a dead sender only stalls its
            own session until ``drain_timeout`` (measured cost: docs/local.md).

    Raises:
        MissingExtraError: if ucxx is not installed (see :func:`open_local_receiver`
            for the TCP fallback).
        AuthError: if ``secret`` is shorter than 16 bytes.
    """

    def __init__(
        self,
        *,
        tls: str | None = None,
        spin_us: float = 0.0,
        secret: bytes | None = None,
        auth_timeout: float = K_AUTH_TIMEOUT_S,
        busy_poll_us: float = 0.0,
        busy_poll_max_bytes: int = K_POLL_MAX_BYTES,
        drain_timeout: float = K_DRAIN_TIMEOUT_S,
        session_workers: bool = True,
        cma: bool = True,
    ) -> None:
        if not cma:
            tls = tls_without_peer_reads(tls)
        super().__init__(tls, spin_us, secret, auth_timeout, busy_poll_us, busy_poll_max_bytes)
        self.drain_timeout = drain_timeout
        self.session_workers = session_workers
        self._retiring: dict[int, _Session] = {}  # dropped sessions whose worker still runs
        self._halted: list[UcxWorker] = []  # halted session workers: kept, never progressed
        self._last_worker: UcxWorker | None = None  # where the latest START arrived
        self._retired_epoll = 0
        self.path_error: TransportError | None = None  # set when the worker was halted
        self._drains = 0
        self._peers_lost = 0
        self._admissions = 0
        self._swept = self._swept_bytes = 0
        self._transfers: dict[int, _RxTransfer] = {}
        self._finished: deque[int] = deque()
        self._sessions: dict[int, _Session] = {}
        self._session_tags: set[int] = set()
        self._pending_auth: dict[int, _Pending] = {}
        self._tids = itertools.count(secrets.randbits(20))
        self._done_out: dict[int, list[int]] = {}
        self._done_msgs = 0
        self._bytes = self._posted = self._ok = self._failed = 0
        self.auth_failures = 0
        self.auth_errors: deque[AuthError] = deque(maxlen=K_KEEP_AUTH_ERRORS)
        self._unauth = 0

    async def __aenter__(self) -> UcxReceiver:
        await self._open()
        self.address = f"{K_ADDR_PREFIX}{netns_id()}:{b64(self._worker.address)}"
        self._listen(K_TAG_CTRL_RX, self._on_public)
        self._nursery.start_soon(self._sweeper)
        return self

    def _workers(self) -> list[UcxWorker]:
        out = [self._worker]
        out += [s.worker for s in self._sessions.values() if s.worker is not self._worker]
        out += [s.worker for s in self._retiring.values()]
        return out + self._halted

    async def _sweeper(self) -> None:
        while True:
            await trio.sleep(K_SWEEP_S)
            try:
                # Each worker's unexpected queue: the public one's, then each session's.
                places: list[tuple[UcxWorker, _Session | None]] = [(self._worker, None)]
                places += [(s.worker, s) for s in self._sessions.values() if self.session_workers]
                for w, s in places:
                    while not w.halted and not w.closed and self._sweep(w, s) >= K_SWEEP_MAX:
                        await trio.lowlevel.checkpoint()  # a flood: go on, but let others run
            except Exception as exc:  # never take the receiver down for housekeeping
                log.error("sweeping UCX's unexpected queue failed; stopped: %r", exc)
                return

    def _sweep(self, w: UcxWorker, s: _Session | None = None) -> int:
        """Drop unexpected messages nothing live awaits from ``w`` (the worker of
        session ``s``, or the public one), oldest first; returns how many.

        Stops at the first message something may still receive (an inbox's, or
        data for a live grant under its session's mask, whose receives are posted
        at START): UCX's probe only sees the oldest, and that one is matched soon.
        Data for a grant that ended (a piece that crossed the CANCEL) goes too.
        """
        n = 0
        while n < K_SWEEP_MAX:
            head = w.oldest_unexpected()
            if head is None or self._awaited(head[0], s) or not w.discard(head[0]):
                break
            n += 1
            self._swept_bytes += head[1]
        if n:
            self._swept += n
            level = logging.WARNING if self._swept == n else logging.DEBUG
            log.log(level, "dropped %d UCX messages no receive was posted for", n)
        return n

    def _awaited(self, tag: int, session: _Session | None = None) -> bool:
        """Whether a receive may still be posted for ``tag`` on the worker of
        ``session`` (None: the public worker; see :meth:`_sweep`)."""
        kind = tag >> 60
        if session is not None:  # a session's own worker: only that session's tags
            if tag == session.tags.rx_tag:
                return not session.dropped
            sessions: Any = (session,)
        elif kind == K_TAG_CTRL_RX >> 60:
            return tag == K_TAG_CTRL_RX
        elif self.session_workers:  # sessions' messages never come to the public worker
            return False
        elif kind == 0xE:
            return tag in self._session_tags
        else:
            sessions = self._sessions.values()
        if kind != 0x8:
            return False
        low = tag & ((1 << 56) - 1)
        for s in sessions:
            t = self._transfers.get((low ^ s.tags.mask) >> 24)
            if t is not None and t.state is TransferState.RUNNING and t.sender in (None, s.sid):
                return True
        return False

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every grant and close; returns once nothing more can land in them.

        Receives still in flight are waited for up to ``drain_timeout``; then
        the worker is halted and those transfers fail with TransportError.
        """
        if self._stack is None:
            return
        for t in list(self._transfers.values()):
            self._finish(
                t,
                TransferState.CANCELLED,
                TransferCancelled("receiver closed", transfer_id=t.tid),
                _Code.CANCELLED,
            )
        draining = [t for t in self._transfers.values() if t.draining]
        if draining:
            with trio.move_on_after(self.drain_timeout):
                for t in draining:
                    await t.done.wait()
            for t in draining:
                if t.draining:  # halts its session's worker (or, without those, all)
                    self._close_path(t, "the receiver is closing")
        await self._close_all_eps()
        await self._close()

    async def _close_all_eps(self) -> None:
        """Close every endpoint to a sender while the workers are still progressed,
        waiting (bounded) for the flushes of those whose worker runs."""
        closing: list[tuple[UcxWorker, int]] = []
        for s in [*self._sessions.values(), *self._retiring.values()]:
            closing += self._close_eps(s)
        for p in self._pending_auth.values():
            p.scope.cancel()
            if p.ep is not None:
                closing.append((self._worker, self._worker.close_endpoint(p.ep)))
                p.ep = None
        closing = [(w, h) for w, h in closing if h and not w.halted and not w.closed]
        with trio.move_on_after(K_EP_CLOSE_S):
            while any(w.in_flight(h) for w, h in closing):
                await trio.sleep(0.002)

    # ------------------------------------------------------------------ grant
    def grant(
        self,
        views: Sequence[Any],
        ranges: ByteRanges,
        *,
        num_layers: int | None = None,
        timeout: float | None = None,
    ) -> Grant:
        """Pre-post a receive per destination range and return the grant.

        Raises:
            LocalProtocolError: before ``async with``, or for more than 2**24 ranges.
        """
        if self._stack is None:
            raise LocalProtocolError("UcxReceiver used outside `async with`")
        if self.path_error is not None:
            raise TransportError(f"this UCX receiver is closed: {self.path_error}")
        mvs = _flat_views(views)
        keep = ranges.length > 0
        lengths = ranges.length[keep]
        if lengths.size >= K_MAX_PIECES:
            raise LocalProtocolError(f"{lengths.size} ranges exceed the {K_MAX_PIECES} limit")
        tid = next(self._tids) & 0xFFFFFFFF
        while tid in self._transfers:
            tid = next(self._tids) & 0xFFFFFFFF
        t = _RxTransfer(tid, ranges.total, self._worker)
        t.lengths = lengths
        nl = num_layers or 0
        layer_ends: tuple[int, ...] = ()
        if nl:
            layer_ends = tuple(int(x) for x in ranges.layer_bounds(nl)[:, 1])
            t.piece_layer = ranges.layer[keep]
            t.layer_left = np.bincount(t.piece_layer, minlength=nl)[:nl].astype(np.int64)
            t.layer_events = [trio.Event() for _ in range(nl)]
            for layer in np.flatnonzero(t.layer_left == 0).tolist():
                t.layer_events[layer].set()
        self._transfers[tid] = t
        t.pieces_left = int(lengths.size)
        bufs, offs = ranges.buffer[keep].tolist(), ranges.offset[keep].tolist()
        # Nothing is posted yet: receives go into this memory only once an
        # admitted sender's START names the transfer (see _post).
        t.targets = [
            mvs[b][o : o + n] for b, o, n in zip(bufs, offs, lengths.tolist(), strict=True)
        ]
        if t.pieces_left == 0:
            self._finish(t, TransferState.DONE, None, None)
        elif timeout is not None:
            self._nursery.start_soon(self._deadline, t, timeout)
        address = f"{self.address}#{b64(lengths.astype('<i8').tobytes())}"
        if t.total <= K_INLINE_MAX and all(isinstance(b, memoryview) for b in t.targets):
            address += "#i"  # host memory: the sender may send it inline (DATA)
        return Grant(tid, ranges.total, layer_ends, address)

    def _post(self, t: _RxTransfer, s: _Session) -> None:
        """Bind ``t`` to session ``s`` and post its receives under the session's tags
        (on the session's worker)."""
        t.sender = s.sid
        t.session, t.worker = s, s.worker
        # One completion queue per layer: layers may arrive in any order, and
        # the worker polls only queue heads (see UcxWorker._reap).
        layers = t.piece_layer.tolist() if t.piece_layer is not None else None
        queues: dict[int, int] = {}
        w = s.worker
        recv, data_tag, lengths = w.recv, s.tags.data_tag, t.lengths.tolist()
        for i, buf in enumerate(t.targets):
            layer = layers[i] if layers is not None else 0
            q = queues.get(layer)
            if q is None:
                q = queues[layer] = w.new_queue()
            cb = self._piece_done(t, i, lengths[i])
            t.handles.append(recv(buf, data_tag(t.tid, i), cb, spin=True, queue=q))
        t.queues = list(queues.values())
        t.targets = []
        self._posted += len(t.handles)
        self._progress_first = t.total > K_POLL_MAX_BYTES  # its copy may start now

    def _place_inline(self, t: _RxTransfer, s: _Session, blob: bytes) -> None:
        """A small transfer's bytes, inline in its DATA message: exact size or rejected."""
        t.sender = s.sid
        t.session, t.worker = s, s.worker
        if len(blob) != t.total or not all(isinstance(b, memoryview) for b in t.targets):
            exc = RemoteProtocolError(
                f"inline transfer of {len(blob)} bytes for a grant of {t.total}", transfer_id=t.tid
            )
            self._finish(t, TransferState.FAILED, exc, _Code.REJECTED)
            return
        mv, off = memoryview(blob), 0
        for buf in t.targets:
            n = len(buf)
            buf[:] = mv[off : off + n]
            off += n
        self._posted += len(t.targets)
        t.bytes_done = t.total
        self._bytes += t.total
        t.pieces_left = 0
        self._finish(t, TransferState.DONE, None, None)

    def _piece_done(self, t: _RxTransfer, i: int, n: int) -> Any:
        def cb(req: Any, err: BaseException | None) -> None:
            if t.state is not TransferState.RUNNING:
                if t.draining:  # a receive UCX could not cancel has now stopped
                    t.draining -= 1
                    if t.draining == 0:
                        self._release(t)
                return
            if err is not None:
                name = type(err).__name__
                if any(x in name for x in K_PEER_FAILURES):  # its sender's endpoint failed
                    self._peer_lost(t, i, n, err)
                else:  # e.g. truncated: longer than granted, the sender's fault
                    exc = RemoteProtocolError(
                        f"piece {i} of {n} bytes failed: {err}", transfer_id=t.tid
                    )
                    self._finish(t, TransferState.FAILED, exc, _Code.REJECTED)
                return
            t.bytes_done += n
            self._bytes += n
            t.pieces_left -= 1
            if t.layer_left is not None:
                layer = int(t.piece_layer[i])
                t.layer_left[layer] -= 1
                if t.layer_left[layer] == 0:
                    t.layer_events[layer].set()
            if t.pieces_left == 0:
                self._finish(t, TransferState.DONE, None, None)

        return cb

    def _peer_lost(self, t: _RxTransfer, i: int, n: int, err: BaseException) -> None:
        """UCX failed a receive of ``t``: its sender is unreachable (with UCX error
        handling, a dead sender fails its receives in flight within milliseconds).

        Only that sender's transfers fail, with PeerUnavailable; its session is
        dropped. Each ends as usual: unmatched receives are cancelled, receives in
        flight count down as they fail, and the end is reported when none is left,
        so the worker goes on serving the other senders (no halt).
        """
        sid = t.sender
        who = f"ucx-sender-{sid:08x}" if sid is not None else None
        first = PeerUnavailable(
            f"UCX receive of piece {i} ({n} bytes) failed: {err}; the sender is unreachable",
            transfer_id=t.tid,
            peer=who,
        )
        self._peers_lost += 1
        log.warning("%s", first)
        s = self._sessions.get(sid) if sid is not None else None
        if s is not None:
            self._drop_session(s)  # nothing more is told to it; its tags are free
        self._finish(t, TransferState.FAILED, first, None)
        for u in list(self._transfers.values()):
            if u is not t and u.sender == sid and u.state is TransferState.RUNNING:
                exc = PeerUnavailable(
                    f"the UCX sender of this transfer is unreachable: {err}",
                    transfer_id=u.tid,
                    peer=who,
                )
                exc.__cause__ = first
                self._finish(u, TransferState.FAILED, exc, None)

    async def _deadline(self, t: _RxTransfer, timeout: float) -> None:
        with trio.CancelScope() as scope:
            t.scope = scope
            await trio.sleep(timeout)
            exc = TransferTimeout(f"grant expired after {timeout} s", transfer_id=t.tid)
            self._finish(t, TransferState.FAILED, exc, _Code.TIMEOUT)

    def _finish(
        self, t: _RxTransfer, state: TransferState, error: PddnetError | None, code: int | None
    ) -> None:
        if t.state is not TransferState.RUNNING:
            return
        t.state, t.error = state, error
        if t.sender is not None:  # first: the sender's wake-up overlaps our bookkeeping
            self._tell(t, code)
        w = t.worker
        if error is None:  # every piece landed: nothing is posted any more
            for h in t.handles:
                w.forget(h)
            t.handles = []
        else:
            # Unmatched receives are cancelled at once; a receive whose data is in
            # flight cannot be, and may write into the blocks until it completes.
            # The end is reported (and the engine may reuse the blocks) only when
            # each has completed: see _piece_done, and _drain_deadline for the bound.
            t.handles = w.cancel(t.handles)
        t.targets = []
        if t.scope is not None:
            t.scope.cancel()
        if t.handles and not w.halted:
            t.draining = len(t.handles)
            self._drains += 1
            log.debug("transfer %d ended with %d receives in flight", t.tid, t.draining)
            self._nursery.start_soon(self._drain_deadline, t)
            return
        self._release(t)

    async def _drain_deadline(self, t: _RxTransfer) -> None:
        with trio.CancelScope() as scope:
            t.drain_scope = scope
            await trio.sleep(self.drain_timeout)
            if t.draining:
                self._close_path(t, "its grant ended")

    def _close_path(self, t: _RxTransfer, why: str) -> None:
        """The last resort: receives into ``t`` did not stop in time. Halt its worker.

        Closing the endpoints would not do: UCX keeps a matched receive going over
        its own endpoint (measured: a stalled rendezvous still landed after
        ``ep.close()``). Over tcp and shared memory the bytes land only inside
        this process's ``progress()``, so a worker never progressed again
        writes nothing more. With a worker per session only that session's
        transfers fail (:meth:`_halt_session`); otherwise every transfer fails
        and the receiver takes no grant.
        """
        if t.worker.halted:
            return
        if t.worker is not self._worker and len(self._halted) < K_MAX_HALTED_WORKERS:
            self._halt_session(t, why)
            return
        exc = self._drain_error(
            t, why, "the receiver halted its UCX worker so nothing more can land, and is closed"
        )
        self.path_error = exc
        log.error("%s", exc)
        for w in self._workers():
            w.halt()
        for u in list(self._transfers.values()):
            if u.state is TransferState.RUNNING or u.draining:
                err = (
                    exc
                    if u is t
                    else TransportError(f"the UCX receiver was closed: {exc}", transfer_id=u.tid)
                )
                self._fail_halted(u, err, keep_cause=u is not t)

    def _drain_error(self, t: _RxTransfer, why: str, what: str) -> TransportError:
        """The error for receives of ``t`` still in flight at the drain deadline."""
        exc = TransportError(
            f"{t.draining} UCX receive(s) into transfer {t.tid} were still in flight "
            f"{self.drain_timeout} s after {why} (UCX cannot cancel a receive whose data "
            f"is in flight); {what}",
            transfer_id=t.tid,
            peer=f"ucx-sender-{t.sender:08x}" if t.sender is not None else None,
        )
        exc.__cause__ = t.error
        return exc

    def _halt_session(self, t: _RxTransfer, why: str) -> None:
        """Halt the worker of ``t``'s session: only that sender's transfers fail.

        The worker is never progressed again, so nothing more lands through it;
        it is kept (not destroyed) until the receiver closes. Its session is
        dropped; the sender, if alive, must open a new one.
        """
        w = t.worker
        s = t.session
        exc = self._drain_error(
            t,
            why,
            "the receiver halted the UCX worker of this sender's session so nothing more "
            "can land, and failed that session's transfers",
        )
        log.error("%s", exc)
        w.halt()
        self._halted.append(w)
        if s is not None:
            if s.hello_ep is not None and not self._worker.halted:
                # Tell the sender through the public worker (tag matching ignores
                # which worker sent it), else it would wait for its own deadlines.
                msg = _pack(_Ctl.CANCEL, s.sid, t.tid, _Code.HALTED)
                self._send_ctrl(s.hello_ep, s.tags.tx_tag, msg)
            s.scope.cancel()  # its progress task: a halted worker has nothing to do
            # Its worker's endpoint is never progressed (its destructor must not
            # progress it either); the public one's close flushes the CANCEL first.
            self._close_eps(s)
            if self._retiring.get(s.sid) is s:
                del self._retiring[s.sid]
            if self._sessions.get(s.sid) is s:
                self._drop_session(s)
        for u in list(self._transfers.values()):
            if u.worker is not w or not (u.state is TransferState.RUNNING or u.draining):
                continue
            err = exc
            if u is not t:
                err = TransportError(
                    f"the UCX worker of this transfer's sender session was halted: {exc}",
                    transfer_id=u.tid,
                    peer=exc.peer,
                )
            self._fail_halted(u, err, keep_cause=u is not t)

    def _fail_halted(self, u: _RxTransfer, err: TransportError, *, keep_cause: bool) -> None:
        """Fail ``u``, whose worker was halted: a running one as usual; a draining
        one (already ended, its receives stuck) is reported ended with ``err``."""
        if u.state is TransferState.RUNNING:
            self._finish(u, TransferState.FAILED, err, _Code.CANCELLED)
            return
        if keep_cause:
            err.__cause__ = u.error
        u.error = err
        u.state = TransferState.FAILED
        self._release(u)

    def _release(self, t: _RxTransfer) -> None:
        """Report ``t``'s end: nothing can write into its blocks any more."""
        t.draining = 0
        t.handles = []
        if t.drain_scope is not None:
            t.drain_scope.cancel()
        for ev in t.layer_events:
            ev.set()
        t.done.set()
        if t.error is None:
            self._ok += 1
        else:
            self._failed += 1
        self._finished.append(t.tid)
        while len(self._finished) > K_KEEP_FINISHED:
            self._transfers.pop(self._finished.popleft(), None)
        s = t.session
        if s is not None and s.dropped and self._retiring.get(s.sid) is s:
            self._retire_if_idle(s)

    def _tell(self, t: _RxTransfer, code: int | None) -> None:
        s = self._sessions.get(t.sender) if t.sender is not None else None
        if s is None:
            return
        if code is None:
            # DONE: the round's first leaves at once (its sender is waiting),
            # later ones batch until the round of completions ends
            # (docs/local.md, *Per-transfer cost*).
            tids = self._done_out.get(s.sid)
            if tids is None:
                self._done_out[s.sid] = []
                s.worker.after_reap(lambda: self._flush_done(s.sid))
                self._send_done(s, [t.tid])
            else:
                tids.append(t.tid)
            return
        msg = _pack(_Ctl.CANCEL, s.sid, t.tid, code)
        self._send_ctrl(s.ep, s.tags.tx_tag, msg, s.worker)

    def _flush_done(self, sender: int) -> None:
        """One DONE for ``sender``: the first transfer id in the header, the rest as u32s."""
        tids = self._done_out.pop(sender, None)
        s = self._sessions.get(sender)
        if s is not None and tids:
            self._send_done(s, tids)

    def _send_done(self, s: _Session, tids: list[int]) -> None:
        for i in range(0, len(tids), K_DONE_BATCH):
            part = tids[i : i + K_DONE_BATCH]
            more = struct.pack(f"<{len(part) - 1}I", *part[1:])
            msg = _pack(_Ctl.DONE, s.sid, part[0], 0, more)
            self._send_ctrl(s.ep, s.tags.tx_tag, msg, s.worker)
            self._done_msgs += 1

    # ------------------------------------------------------- admission (auth)
    def _on_public(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """The public inbox: HELLO and handshake frames; everything else only without a secret."""
        if kind is _Ctl.HELLO:
            self._on_hello(sender, code, blob)
        elif kind is _Ctl.AUTH:
            self._on_auth(sender, blob)
        elif (
            self.secret is None
            and sender in self._sessions
            and self._sessions[sender].worker is self._worker  # else: only to its own worker
        ):
            self._on_session(self._sessions[sender], kind, sender, tid, code, blob)
        else:
            self._unauth += 1
            log.debug("dropping an unauthenticated UCX %s from %08x", kind.name, sender)

    def _auth_failed(self, sender: int, exc: AuthError) -> None:
        self.auth_failures += 1
        self.auth_errors.append(exc)
        level = logging.WARNING if self.auth_failures == 1 else logging.DEBUG
        log.log(level, "dropping UCX sender %08x: %s", sender, exc)

    def _reject(self, sender: int, ep: Any, exc: AuthError, out: bytes) -> None:
        """Fail a sender's admission: tell it (a FAIL frame) if we can, and count it."""
        if ep is not None and out:
            self._send_ctrl(ep, K_TAG_CTRL_TX | sender, _pack(_Ctl.AUTH, sender, 0, 0, out))
        if ep is not None:  # not used again: its close flushes the FAIL first
            self._worker.close_endpoint(ep)
        self._auth_failed(sender, AuthError(str(exc), peer=f"ucx-sender-{sender:08x}"))

    def _on_hello(self, sender: int, code: int, blob: bytes) -> None:
        if sender in self._sessions or sender in self._pending_auth:
            self._unauth += 1  # a duplicate (or a spoofed id): the first one stands
            return
        wants_auth = bool(code & K_HELLO_AUTH)
        errh = bool(code & K_HELLO_ERRH)
        frame, address = b"", blob
        if wants_auth:
            frame, address = blob[:K_AUTH_FRAME_SIZE], blob[K_AUTH_FRAME_SIZE:]
        if not address:
            self._auth_failed(sender, AuthError("malformed HELLO: no worker address"))
            return
        if self.secret is not None and len(self._pending_auth) >= K_MAX_PENDING_AUTH:
            self._auth_failed(sender, AuthError("too many UCX handshakes in progress"))
            return
        try:
            # The same error-handling mode as the sender's endpoint: UCX never
            # delivered between endpoints whose modes differ (measured).
            ep = self._worker.connect(address, error_handling=errh)
        except PeerUnavailable as exc:
            log.warning("cannot reach UCX sender %08x: %s", sender, exc)
            return
        fail = AuthFrame(AuthKind.FAIL).encode()
        if self.secret is None:
            if wants_auth:
                err = AuthError("the sender asked to authenticate; this receiver has no secret")
                self._reject(sender, ep, err, fail)
            else:
                self._admit(sender, ep, legacy_tags(sender), errh, address)
            return
        if not wants_auth:
            self._reject(sender, ep, AuthError("the sender skipped authentication"), fail)
            return
        hs = AuthHandshake(
            AuthRole.RESPONDER,
            self.secret,
            ucx_auth_context(sender),
            now=trio.current_time(),
            timeout=self.auth_timeout,
        )
        mine = hs.data_to_send()  # our CHALLENGE
        try:
            hs.receive_data(frame)
            n_i = challenge_nonce(frame)
        except AuthError as exc:
            self._reject(sender, ep, exc, hs.data_to_send() or fail)
            return
        p = _Pending(hs, ep, n_i, challenge_nonce(mine), errh, address)
        self._pending_auth[sender] = p
        self._send_ctrl(
            ep, K_TAG_CTRL_TX | sender, _pack(_Ctl.AUTH, sender, 0, 0, mine + hs.data_to_send())
        )
        self._nursery.start_soon(self._auth_deadline, sender, p)

    def _on_auth(self, sender: int, blob: bytes) -> None:
        p = self._pending_auth.get(sender)
        if p is None:  # no handshake with this sender (or it ended): ignore
            self._unauth += 1
            return
        try:
            p.hs.receive_data(blob)
        except AuthError as exc:
            del self._pending_auth[sender]
            p.scope.cancel()
            self._reject(sender, p.ep, exc, p.hs.data_to_send())
            return
        if not p.hs.done:
            return
        del self._pending_auth[sender]
        p.scope.cancel()
        assert self.secret is not None
        tags = session_tags(self.secret, p.n_i, p.n_r, sender)
        if tags.rx_tag in self._session_tags or p.hs.leftover:  # ~2**-60, or junk after PROOF
            err = AuthError("unusable UCX session (tag collision or trailing bytes)")
            self._reject(sender, p.ep, err, AuthFrame(AuthKind.FAIL).encode())
            return
        self._admit(sender, p.ep, tags, p.errh, p.address)

    def _admit(
        self, sender: int, ep: Any, tags: SessionTags, errh: bool = False, address: bytes = b""
    ) -> None:
        """Admit a sender: with session workers, a UCX worker of its own for its
        data and control messages, whose address goes out in the ACCEPT."""
        bound = K_MAX_SESSION_WORKERS if self.session_workers else K_MAX_SESSIONS
        if len(self._sessions) + len(self._retiring) >= bound and not self._evict_session():
            exc = AuthError(f"{bound} UCX sender sessions are busy; admission refused")
            self._reject(sender, ep, exc, AuthFrame(AuthKind.FAIL).encode())
            return
        if not self.session_workers:
            s = _Session(sender, ep, tags, self._worker, errh)
            if tags.rx_tag != K_TAG_CTRL_RX:  # an authenticated session: its own inbox
                s.inbox = self._listen(tags.rx_tag, lambda *m: self._on_session(s, *m))
                self._session_tags.add(tags.rx_tag)
            self._sessions[sender] = s
            self._admissions += 1
            self._send_ctrl(ep, tags.tx_tag, _pack(_Ctl.ACCEPT, sender, 0))
            return
        try:
            w = UcxWorker(spin_us=self._spin_us, context_of=self._worker)
            back = w.connect(address, error_handling=errh)
        except (TransportError, PeerUnavailable) as exc:
            log.warning("no UCX worker for sender %08x: %s", sender, exc)
            self._worker.close_endpoint(ep)
            return
        s = _Session(sender, back, tags, w, errh)
        s.hello_ep = ep
        # Its inbox is posted before the ACCEPT leaves: a START sent right after
        # it finds the receive (or waits in this worker's unexpected queue).
        s.inbox = self._listen(tags.rx_tag, lambda *m: self._on_session(s, *m), w)
        self._session_tags.add(tags.rx_tag)
        self._sessions[sender] = s
        self._admissions += 1
        self._nursery.start_soon(self._run_session, s)
        self._send_ctrl(ep, tags.tx_tag, _pack(_Ctl.ACCEPT, sender, 0, 0, w.address))

    @staticmethod
    async def _run_session(s: _Session) -> None:
        with s.scope:
            await s.worker.run()

    def _evict_session(self) -> bool:
        """Drop the oldest idle session (or a retiring one); whether one went."""
        for r in list(self._retiring.values()):  # ending already: retire it now if idle
            if self._retire_if_idle(r):
                return True
        busy = {t.sender for t in self._transfers.values() if t.state is TransferState.RUNNING}
        busy |= {t.sender for t in self._transfers.values() if t.draining}
        for sid, s in self._sessions.items():  # oldest first
            if sid not in busy:
                self._drop_session(s)
                return True
        return False

    def _drop_session(self, s: _Session, *, retire: bool = True) -> None:
        """The sender is no longer admitted; its worker is retired once nothing is posted."""
        del self._sessions[s.sid]
        s.dropped = True
        self._session_tags.discard(s.tags.rx_tag)
        if s.inbox is not None:
            self._unlisten(s.inbox)
        if self._last_worker is s.worker:
            self._last_worker = None
        if retire and s.worker is not self._worker and not s.worker.halted:
            self._retiring[s.sid] = s
            self._retire_if_idle(s)

    def _retire_if_idle(self, s: _Session) -> bool:
        """Stop and drop a dropped session's worker if no receive of it can still
        write into granted memory (running or draining transfers); whether it went."""
        w = s.worker
        if w.closed:
            return True
        if w.halted or any(
            t.worker is w and (t.state is TransferState.RUNNING or t.draining)
            for t in self._transfers.values()
        ):
            return False
        if self._retiring.get(s.sid) is s:
            del self._retiring[s.sid]
        self._close_eps(s)  # (at its BYE already, usually)
        s.scope.cancel()
        self._retired_epoll += w.epoll_waits
        w.close()  # its requests are dropped; the UCX worker goes with the last reference
        for t in self._transfers.values():  # finished ones, kept for late waiters
            if t.worker is w:
                t.worker, t.session = self._worker, None
        s.inbox = None
        return True

    def _close_eps(self, s: _Session) -> list[tuple[UcxWorker, int]]:
        """Start closing ``s``'s endpoints (nothing more is sent to it), without
        blocking: see :meth:`UcxWorker.close_endpoint`. A halted worker's
        endpoint is closed without progressing that worker.

        Returns:
            The closes still in flight, as (worker, handle).
        """
        out: list[tuple[UcxWorker, int]] = []
        if s.ep is not None:
            out.append((s.worker, s.worker.close_endpoint(s.ep)))
        if s.hello_ep is not None and s.hello_ep is not s.ep:
            out.append((self._worker, self._worker.close_endpoint(s.hello_ep)))
        s.ep = s.hello_ep = None
        return [(w, h) for w, h in out if h]

    async def _retire_later(self, s: _Session) -> None:
        # A BYE: the sender still flushes its endpoint to this worker; let it.
        await trio.sleep(K_BYE_GRACE_S)
        if self._retiring.get(s.sid) is s:
            self._retire_if_idle(s)

    async def _auth_deadline(self, sender: int, p: _Pending) -> None:
        with p.scope:
            deadline = p.hs.get_timer()
            await trio.sleep_until(deadline if deadline is not None else trio.current_time())
            if self._pending_auth.get(sender) is p:
                del self._pending_auth[sender]
                try:
                    p.hs.handle_timer(trio.current_time())
                except AuthError as exc:
                    self._reject(sender, p.ep, exc, p.hs.data_to_send())

    def _on_session(
        self, s: _Session, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes
    ) -> None:
        """An admitted sender's control message (its session inbox)."""
        if sender != s.sid:
            raise RemoteProtocolError(f"session of {s.sid:08x} used by {sender:08x}")
        if kind is _Ctl.BYE:
            if self._sessions.get(s.sid) is s:
                self._drop_session(s, retire=False)  # nothing more is told to it
                for u in list(self._transfers.values()):  # bound and still running: cancelled
                    if u.session is s and u.state is TransferState.RUNNING:
                        exc = TransferCancelled("the sender closed", transfer_id=u.tid)
                        self._finish(u, TransferState.CANCELLED, exc, None)
                self._close_eps(s)  # flushed while its worker still runs (the grace)
                if s.worker is not self._worker and not s.worker.halted:
                    self._retiring[s.sid] = s  # after its flush, or once its drains end
                    self._nursery.start_soon(self._retire_later, s)
            return
        t = self._transfers.get(tid)
        if t is None:
            return
        if s.worker is not self._worker:
            self._last_worker = s.worker
        if kind is _Ctl.START or kind is _Ctl.DATA:
            if t.sender is not None:  # bound to a session already: the first START stands
                if t.sender != s.sid:
                    self._unauth += 1
                return
            if t.state is not TransferState.RUNNING:
                t.sender = s.sid
                self._tell(t, self._code_of(t))
            elif kind is _Ctl.START:
                self._post(t, s)
            else:
                self._place_inline(t, s, blob)
        elif kind is _Ctl.CANCEL:
            if t.sender is not None and t.sender != s.sid:
                return
            t.sender = s.sid
            err = TransferCancelled("the sender cancelled the transfer", transfer_id=tid)
            if t.state is TransferState.RUNNING:
                t.sender = None  # it knows
                self._finish(t, TransferState.CANCELLED, err, _Code.CANCELLED)

    @staticmethod
    def _code_of(t: _RxTransfer) -> int | None:
        if t.state is TransferState.DONE:
            return None
        if isinstance(t.error, TransferTimeout):
            return _Code.TIMEOUT
        if isinstance(t.error, RemoteProtocolError):
            return _Code.REJECTED
        return _Code.CANCELLED

    # ------------------------------------------------------------------ waits
    def _get(self, tid: int) -> _RxTransfer:
        t = self._transfers.get(tid)
        if t is None:
            raise LocalProtocolError(f"transfer {tid} was never granted here", transfer_id=tid)
        return t

    async def wait_transfer(self, transfer_id: int) -> None:
        """Wait until every granted byte landed. Cancelling the wait leaves the grant."""
        t = self._get(transfer_id)
        if self._should_poll(t.total):
            await self._poll_wait(t.done, self._poll_worker(t))
        else:
            await t.done.wait()
        if t.error is not None:
            raise t.error

    async def wait_layer(self, transfer_id: int, layer: int) -> None:
        """Wait until every byte of ``layer`` landed (raises like :meth:`wait_transfer`)."""
        t = self._get(transfer_id)
        if not t.layer_events:
            raise LocalProtocolError("grant was made without num_layers", transfer_id=transfer_id)
        if self._should_poll(t.total):
            await self._poll_wait(t.layer_events[layer], self._poll_worker(t))
        else:
            await t.layer_events[layer].wait()
        if t.error is not None:
            raise t.error

    def _poll_worker(self, t: _RxTransfer) -> UcxWorker:
        """The worker a low-latency wait polls: the transfer's session's, or (not
        bound yet) the one the latest START came to, or else the only session's."""
        if t.sender is not None:
            return t.worker
        if self._last_worker is not None:
            return self._last_worker
        if len(self._sessions) == 1:
            return next(iter(self._sessions.values())).worker
        return self._worker

    def cancel(self, transfer_id: int) -> None:
        """Revoke the grant: posted receives are cancelled, the sender told. Idempotent.

        Receives whose data is already in flight cannot be cancelled by UCX:
        ``wait_transfer`` raises only once they stopped (see ``drain_timeout``),
        so reuse the blocks after ``wait_transfer``/``wait_layer`` raised, not
        right after this call.
        """
        t = self._transfers.get(transfer_id)
        if t is not None:
            exc = TransferCancelled("the receiver cancelled the transfer", transfer_id=transfer_id)
            self._finish(t, TransferState.CANCELLED, exc, _Code.CANCELLED)

    def statistics(self) -> UcxReceiverStatistics:
        running = sum(t.state is TransferState.RUNNING for t in self._transfers.values())
        return UcxReceiverStatistics(
            self._bytes,
            self._posted,
            running,
            self._ok,
            self._failed,
            self._retired_epoll + sum(w.epoll_waits for w in self._workers()),
            self._done_msgs,
            len(self._sessions),
            self.auth_failures,
            self._unauth,
            sum(t.draining > 0 for t in self._transfers.values()),
            self._swept,
            self._swept_bytes,
            self._drains,
            self.path_error is not None,
            self._peers_lost,
            sum(s.worker is not self._worker for s in self._sessions.values())
            + len(self._retiring)
            + len(self._halted),
            len(self._halted),
            self._admissions,
        )


# ====================================================================== sender
class UcxTransfer(Transfer):
    """The sender's handle on one transfer over the local path."""

    def __init__(
        self,
        owner: UcxSender,
        grant: Grant,
        sources: list[list[tuple[int, int, int]]],
        bounds: Any,
        mvs: list[Any],
        priority: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.transfer_id = grant.transfer_id
        self.grant = grant
        self._owner = owner
        self._sources = sources
        self._bounds = bounds  # piece i is logical [bounds[i], bounds[i+1])
        self._mvs = mvs
        self.priority = priority
        self._progress = progress
        self._state = TransferState.RUNNING
        self._error: PddnetError | None = None
        self._done = trio.Event()
        self._ready: deque[int] = deque()
        self._queued = np.zeros(len(sources), bool)
        self._from = IntervalSet()
        self._all_queued = False
        self.started = False  # START sent
        self._inflight: dict[int, int] = {}  # handle -> bytes
        self.bytes_sent = 0
        self._reported = -1
        self.queue = owner._worker.new_queue()
        self.remaining = grant.total
        self.scope: trio.CancelScope | None = None

    @property
    def state(self) -> TransferState:
        return self._state

    def mark_ready(self, lo: int, hi: int) -> None:
        """Declare logical ``[lo, hi)`` ready; whole pieces inside ready ranges are sent."""
        if not 0 <= lo <= hi <= self.grant.total:
            raise LocalProtocolError(
                f"[{lo}, {hi}) is outside the grant [0, {self.grant.total})",
                transfer_id=self.transfer_id,
            )
        if self._state is not TransferState.RUNNING or hi == lo or self._all_queued:
            return
        if lo == 0 and hi == self.grant.total and not self._ready and not self._from:
            # the whole grant at once (the usual ``ready=True``): no interval work
            self._all_queued = True
            self._queued[:] = True
            self._ready.extend(range(len(self._sources)))
            self._owner._pump()
            return
        self._from.add(lo, hi)
        b = self._bounds
        first = max(int(np.searchsorted(b, lo, side="right")) - 1, 0)
        last = min(int(np.searchsorted(b, hi, side="left")), len(self._sources))
        for i in range(first, last):
            if not self._queued[i] and self._from.covers(int(b[i]), int(b[i + 1])):
                self._queued[i] = True
                self._ready.append(i)
        self._owner._pump()

    def mark_layer_ready(self, layer: int) -> None:
        """Declare one layer of the grant ready."""
        lo, hi = self.grant.layer_span(layer)
        self.mark_ready(lo, hi)

    async def wait(self) -> None:
        """Wait until the receiver confirmed every byte; cancelling the wait leaves it running."""
        if self._owner._should_poll(self.grant.total):
            await self._owner._poll_wait(self._done)
        else:
            await self._done.wait()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop sending and tell the receiver. Idempotent."""
        exc = TransferCancelled("cancelled by the sender", transfer_id=self.transfer_id)
        self._owner._end(self, TransferState.CANCELLED, exc, _Code.CANCELLED)


@dataclass(frozen=True, slots=True)
class UcxSenderStatistics:
    """Counters of a :class:`UcxSender`."""

    bytes_sent: int
    bytes_staged: int
    pieces_sent: int
    transfers_running: int
    transfers_done: int
    epoll_waits: int
    inline_transfers: int = 0  # small transfers sent inside their START (DATA)
    poll_rounds: int = 0  # low-latency mode: busy-poll rounds


class UcxSender(_Service, Sender):
    """The sending end of the local path, bound to one receiver.

    ``async with`` connects and waits until the receiver admits this sender
    (with a ``secret``: after the challenge-response in both directions).

    Args:
        address: the receiver's :attr:`UcxReceiver.address`.
        tls: UCX transports (default: ``UCX_TLS``, else ``tcp,sm,self``).
        spin_us: see :class:`~pddnet.transport.local.UcxWorker`.
        max_inflight: pieces posted to UCX at once (over all transfers).
        secret: the shared secret (at least 16 bytes), if the receiver has one.
        auth_timeout: seconds to wait for admission.
        busy_poll_us: low-latency mode: :meth:`UcxTransfer.wait` on a transfer
            of at most ``busy_poll_max_bytes`` busy-polls this long before
            sleeping (0: off, the default).
        busy_poll_max_bytes: the low-latency mode's size threshold.
        error_handling: ask UCX for peer-failure handling on this connection
            (the receiver follows; both ends must agree). None (default): only
            when every transport in use can detect a dead peer
            (:func:`~pddnet.transport.local.detects_dead_peers`, e.g.
            ``UCX_TLS=tcp``); then a dead sender fails only its own transfers
            on the receiver, at once. Forcing it with shared memory in the
            transports makes UCX use tcp instead (docs/local.md).

    Raises:
        LocalProtocolError: for an address that is not a UCX one.
        AuthError: if ``secret`` is shorter than 16 bytes; from ``__aenter__``,
            if authentication fails or is not finished within ``auth_timeout``.
        PeerUnavailable: from ``__aenter__``, if a receiver without a secret
            does not answer within ``auth_timeout``.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: str | None = None,
        spin_us: float = 0.0,
        max_inflight: int = 16,
        secret: bytes | None = None,
        auth_timeout: float = K_AUTH_TIMEOUT_S,
        busy_poll_us: float = 0.0,
        busy_poll_max_bytes: int = K_POLL_MAX_BYTES,
        error_handling: bool | None = None,
    ) -> None:
        if not address.startswith(K_ADDR_PREFIX):
            raise LocalProtocolError(f"not a UCX address: {address[:40]!r}")
        self.peer = address.split("#", 1)[0]
        peer_netns, self._peer_address = parse_address(self.peer)
        super().__init__(
            tls_for_peer(tls, peer_netns),
            spin_us,
            secret,
            auth_timeout,
            busy_poll_us,
            busy_poll_max_bytes,
        )
        self.sender_id = secrets.randbits(32)
        self._want_errh = error_handling
        self.error_handling = False  # decided in __aenter__: see detects_dead_peers
        self.max_inflight = max_inflight
        self._transfers: dict[int, UcxTransfer] = {}
        self._inflight = 0
        self._bytes = self._staged = self._pieces = self._ok = self._inline = 0
        self._ep: Any = None  # to the receiver's public worker (HELLO, the handshake)
        self._data_ep: Any = None  # to our session's worker there (everything else)
        self._open_ok = False  # admitted by the receiver
        self._halted_error = ""  # why the receiver halted our session (then start() raises)
        self._tags = legacy_tags(self.sender_id)
        self._lens_cache: dict[str, tuple[Any, Any, list[int]]] = {}
        self._resume_pending = False
        self._hs: AuthHandshake | None = None
        self._n_i = b""
        self._admitted = trio.Event()
        self._auth_error: PddnetError | None = None
        self._public: _Inbox | None = None

    async def __aenter__(self) -> UcxSender:
        await self._open()
        try:
            await self._join()
        except BaseException:
            await self._close()
            raise
        return self

    async def _join(self) -> None:
        """HELLO (with our CHALLENGE), the handshake, and the receiver's ACCEPT."""
        sid = self.sender_id
        self._public = self._listen(K_TAG_CTRL_TX | sid, self._on_public)
        # UCX error handling only where no shared-memory transport is in play
        # (asking for it excludes them): then a dead receiver fails our sends,
        # and our death fails the receiver's receives, at once.
        want = self._want_errh
        self.error_handling = detects_dead_peers(self._worker.tls) if want is None else want
        self._ep = self._worker.connect(self._peer_address, error_handling=self.error_handling)
        address = self._worker.address
        flags = K_HELLO_ERRH if self.error_handling else 0
        if self.secret is not None:
            self._hs = AuthHandshake(
                AuthRole.INITIATOR,
                self.secret,
                ucx_auth_context(sid),
                now=trio.current_time(),
                timeout=self.auth_timeout,
            )
            first = self._hs.data_to_send()
            self._n_i = challenge_nonce(first)
            hello = _pack(_Ctl.HELLO, sid, 0, flags | K_HELLO_AUTH, first + address)
        else:
            hello = _pack(_Ctl.HELLO, sid, 0, flags, address)
        self._send_ctrl(self._ep, K_TAG_CTRL_RX, hello)
        with trio.move_on_after(self.auth_timeout):
            await self._admitted.wait()
        if self._auth_error is not None:
            raise self._auth_error
        if not self._open_ok:
            if self.secret is not None:
                raise AuthError(
                    f"the UCX receiver did not complete authentication in {self.auth_timeout} s",
                    peer=self.peer,
                )
            raise PeerUnavailable(
                f"the UCX receiver did not answer in {self.auth_timeout} s", peer=self.peer
            )

    def _on_public(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """Our public inbox: the receiver's handshake frames (everything without a secret)."""
        if sender != self.sender_id or (self._admitted.is_set() and self.secret is not None):
            return
        if kind is _Ctl.AUTH:
            self._on_auth(blob)
        elif self.secret is None:
            self._on_session(kind, sender, tid, code, blob)

    def _on_auth(self, blob: bytes) -> None:
        hs = self._hs
        if hs is None:  # we have no secret: the receiver demands one
            exc = AuthError("the UCX receiver requires authentication; no secret given")
            self._auth_error = AuthError(str(exc), peer=self.peer)
            self._admitted.set()
            return
        try:
            hs.receive_data(blob)  # the receiver's CHALLENGE and PROOF
        except AuthError as exc:
            out = hs.data_to_send()  # our FAIL, unless the receiver sent one
            if out:
                msg = _pack(_Ctl.AUTH, self.sender_id, 0, 0, out)
                self._send_ctrl(self._ep, K_TAG_CTRL_RX, msg)
            self._auth_error = AuthError(str(exc), peer=self.peer)
            self._admitted.set()
            return
        if not hs.done:
            return
        # The receiver proved the secret: derive the session, listen on its inbox,
        # then send our PROOF (its ACCEPT comes to the session inbox).
        assert self.secret is not None
        self._tags = session_tags(self.secret, self._n_i, challenge_nonce(blob), self.sender_id)
        self._listen(self._tags.tx_tag, self._on_session)
        msg = _pack(_Ctl.AUTH, self.sender_id, 0, 0, hs.data_to_send())
        self._send_ctrl(self._ep, K_TAG_CTRL_RX, msg)

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for t in list(self._transfers.values()):
            self._end(
                t,
                TransferState.CANCELLED,
                TransferCancelled("sender closed", transfer_id=t.transfer_id),
                _Code.CANCELLED,
            )
        if self._stack is not None and self._inflight > 0:
            # UCX cannot cancel a send: let those in flight finish (bounded), so
            # the receiver's drain completes instead of timing out and closing
            # its path (see UcxReceiver, drain_timeout).
            with trio.move_on_after(K_SEND_DRAIN_S):
                while self._inflight > 0:
                    await trio.sleep(0.002)
        if self._stack is not None and self._open_ok and self._ep_alive(self._data_ep):
            # The session ends: the receiver retires its worker for us.
            self._send_ctrl(self._data_ep, self._tags.rx_tag, _pack(_Ctl.BYE, self.sender_id, 0))
        eps = [self._data_ep] if self._data_ep is not self._ep else []
        for ep in [*eps, self._ep]:
            await self._close_ep(ep)
        await self._close()
        self._ep = self._data_ep = None  # closed (or closing): never closed again

    async def _close_ep(self, ep: Any) -> None:
        """Close ``ep`` gracefully (bounded): it flushes what UCX still holds for
        the receiver; without it a process exiting right after a cancel could
        cut a rendezvous short, and the receiver's drain would time out."""
        if self._stack is None or ep is None or not self._ep_alive(ep):
            return
        w = self._worker
        # Started even on a halted worker (then never progressed, not waited
        # for): otherwise the endpoint's destructor would progress it, without
        # a bound (see UcxWorker.close_endpoint).
        handle = w.close_endpoint(ep)
        if not handle or w.halted:
            return
        with trio.move_on_after(K_SEND_DRAIN_S):
            while w.in_flight(handle):
                w._wake()
                await trio.sleep(0.002)

    @staticmethod
    def _ep_alive(ep: Any) -> bool:
        """Whether ``ep`` is still up. With UCX error handling, ucxx closes an
        endpoint whose peer failed; closing it again returned a request whose
        ``completed`` crashed the process (SIGSEGV, measured: receiver killed)."""
        if ep is None:
            return False
        try:
            return bool(ep.alive)
        except Exception:  # an older ucxx: assume it is
            return True

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
    ) -> UcxTransfer:
        """Start sending ``ranges`` of ``views`` into ``grant`` (see :class:`Sender`).

        Raises:
            LocalProtocolError: if the ranges do not match the grant, the grant
                is for another receiver, or the sender is not open.
            TransportError: if the receiver halted this sender's session (its
                drain deadline; see docs/local.md): open a new sender.
        """
        if not self._open_ok:
            raise LocalProtocolError("UcxSender used outside `async with`")
        if self._halted_error:
            raise TransportError(self._halted_error, transfer_id=grant.transfer_id, peer=self.peer)
        peer, _, lens = grant.address.partition("#")
        lens, _, flags = lens.partition("#")
        if peer != self.peer:
            raise LocalProtocolError("the grant is for another UCX receiver")
        if ranges.total != grant.total:
            raise LocalProtocolError(
                f"source ranges hold {ranges.total} bytes, the grant {grant.total}",
                transfer_id=grant.transfer_id,
            )
        lengths, bounds, length_list = self._piece_list(lens, grant.total)
        if grant.transfer_id in self._transfers:
            raise LocalProtocolError("transfer already running", transfer_id=grant.transfer_id)
        inline = ready and flags == "i" and grant.total <= K_INLINE_MAX
        early = ready and not inline and grant.total > 0
        mvs = _flat_views(views)
        if early:
            # START first: the receiver's wake-up overlaps the bookkeeping
            # below, and the first piece usually arrives while the receiver is
            # still handling START (docs/local.md, *Per-transfer cost*).
            self._send_start(grant.transfer_id)
        elif inline and grant.total > 0:  # the same for a small transfer's DATA
            self._send_data(grant.transfer_id, mvs, ranges)
        src_len = ranges.length.tolist()  # plain lists: cheaper than NumPy for few pieces
        bufs, offs = ranges.buffer.tolist(), ranges.offset.tolist()
        if 0 in src_len:
            nz = [i for i, n in enumerate(src_len) if n]
            src_len = [src_len[i] for i in nz]
            bufs, offs = [bufs[i] for i in nz], [offs[i] for i in nz]
        if src_len == length_list:  # the usual case: one source range per piece
            sources = [[(b, o, n)] for b, o, n in zip(bufs, offs, length_list, strict=True)]
        else:
            sources = [
                ranges.pieces(int(bounds[i]), int(bounds[i + 1])) for i in range(lengths.size)
            ]
        t = UcxTransfer(self, grant, sources, bounds, mvs, priority, progress)
        t.started = early
        self._transfers[grant.transfer_id] = t
        if timeout is not None:
            self._nursery.start_soon(self._deadline, t, timeout)
        if inline and sources:
            self._sent_inline(t)
        elif ready and sources:  # START left already, or goes with the first piece (_pump)
            t.mark_ready(0, grant.total)
        else:  # START now: the receiver can report its own deadline, cancel or DONE
            self._start(t)
        return t

    def _send_data(self, tid: int, mvs: list[Any], ranges: ByteRanges) -> None:
        """A small transfer in one DATA message: its START with the bytes after
        the header, in logical order (one copy, into the message)."""
        lens = ranges.length.tolist()
        parts = [
            mvs[b][o : o + n]
            for b, o, n in zip(ranges.buffer.tolist(), ranges.offset.tolist(), lens, strict=True)
            if n
        ]
        head = _HDR.pack(_HDR.size - 4 + sum(lens), _Ctl.DATA, 0, self.sender_id, tid)
        self._send_ctrl(self._data_ep, self._tags.rx_tag, b"".join([head, *parts]))

    def _sent_inline(self, t: UcxTransfer) -> None:
        """Account for a transfer whose DATA message left (:meth:`_send_data`)."""
        t.started = t._all_queued = True
        t._queued[:] = True
        t.remaining = 0
        self._inline += 1
        self._pieces += len(t._sources) - 1  # _account counts one
        self._account(t, t.grant.total)

    def _start(self, t: UcxTransfer) -> None:
        t.started = True
        self._send_start(t.transfer_id)

    def _send_start(self, tid: int) -> None:
        self._send_ctrl(self._data_ep, self._tags.rx_tag, _pack(_Ctl.START, self.sender_id, tid))

    def _piece_list(self, lens: str, total: int) -> tuple[Any, Any, list[int]]:
        """A grant's piece lengths, their logical bounds, and the lengths as a list.

        Grants of the same shape repeat (one per request and layer), so the
        decoded lists are cached by their encoding.
        """
        hit = self._lens_cache.get(lens)
        if hit is None:
            lengths = np.frombuffer(unb64(lens), "<i8").astype(np.int64)
            if (lengths <= 0).any():
                raise LocalProtocolError("the grant's piece list has empty pieces")
            bounds = np.concatenate(([0], np.cumsum(lengths)))
            hit = (lengths, bounds, lengths.tolist())
            if len(self._lens_cache) >= K_LENS_CACHE:
                self._lens_cache.clear()
            self._lens_cache[lens] = hit
        if int(hit[1][-1]) != total:
            raise LocalProtocolError("the grant's piece list does not add up")
        return hit

    async def _deadline(self, t: UcxTransfer, timeout: float) -> None:
        with trio.CancelScope() as scope:
            t.scope = scope
            await trio.sleep(timeout)
            exc = TransferTimeout(f"no completion within {timeout} s", transfer_id=t.transfer_id)
            self._end(t, TransferState.FAILED, exc, _Code.TIMEOUT)

    def _pump(self) -> None:
        inline = 0
        while self._inflight < self.max_inflight:
            if inline >= K_INLINE_BURST:  # let trio run; go on in a moment
                if not self._resume_pending:
                    self._resume_pending = True
                    self._nursery.start_soon(self._resume_pump)
                return
            ready = [t for t in self._transfers.values() if t._ready]
            if not ready:
                return
            t = min(ready, key=lambda x: (-x.priority, x.remaining))
            i = t._ready.popleft()
            if not t.started:  # right before the data: both reach the receiver in one wake-up
                self._start(t)
            src = t._sources[i]
            if len(src) == 1:
                b, o, n = src[0]
                buf: Any = t._mvs[b][o : o + n]
            else:  # source and destination ranges differ: gather (a counted copy)
                buf = np.concatenate(
                    [np.frombuffer(t._mvs[b][o : o + n], np.uint8) for b, o, n in src]
                )  # host memory only: device sources must line up with the grant
                n = int(buf.nbytes)
                self._staged += n
            slot: list[int] = []
            tag = self._tags.data_tag(t.transfer_id, i)
            t.remaining -= n
            h = self._worker.send(self._data_ep, buf, tag, self._sent(t, n, slot), queue=t.queue)
            if h == 0:  # completed while posted (eager): account for it now
                self._account(t, n)
                inline += 1
                continue
            slot.append(h)
            t._inflight[h] = n
            self._inflight += 1

    async def _resume_pump(self) -> None:
        await trio.lowlevel.checkpoint()
        self._resume_pending = False
        self._pump()

    def _account(self, t: UcxTransfer, n: int) -> None:
        t.bytes_sent += n
        self._bytes += n
        self._pieces += 1
        if t._progress is not None:
            t._reported = t.bytes_sent
            t._progress(t.transfer_id, t.bytes_sent, t.grant.total)

    def _sent(self, t: UcxTransfer, n: int, slot: list[int]) -> Any:
        def cb(req: Any, err: BaseException | None) -> None:
            self._inflight -= 1
            if t._state is TransferState.RUNNING:
                t._inflight.pop(slot[0], None)
                if err is not None:
                    exc = PeerUnavailable(
                        f"UCX send failed: {err}", transfer_id=t.transfer_id, peer=self.peer
                    )
                    self._end(t, TransferState.FAILED, exc, _Code.CANCELLED)
                else:
                    self._account(t, n)
            self._pump()

        return cb

    def _end(
        self, t: UcxTransfer, state: TransferState, error: PddnetError | None, code: int | None
    ) -> None:
        if t._state is not TransferState.RUNNING:
            return
        t._state, t._error = state, error
        if error is None:  # the receiver has it all: sends still registered completed too
            for h, n in t._inflight.items():
                self._worker.forget(h)
                self._inflight -= 1
                t.bytes_sent += n
                self._bytes += n
                self._pieces += 1
        # Otherwise sends in flight stay registered: UCX cannot cancel a send
        # (ucp_request_cancel affects receives only), and the receiver reports
        # the grant's end only once its receives stopped, so the worker goes on
        # progressing them (send ticks). Their callbacks (_sent) free the slot;
        # a send that never completes (a dead or halted receiver) keeps its
        # max_inflight slot, like the receiver it was bound to, which is gone.
        t._inflight.clear()
        t._ready.clear()
        if t.scope is not None:
            t.scope.cancel()
        if error is None:
            self._ok += 1
            if t._progress is not None and t._reported != t.grant.total:
                t._progress(t.transfer_id, t.grant.total, t.grant.total)
        if code is not None and self._open_ok:
            msg = _pack(_Ctl.CANCEL, self.sender_id, t.transfer_id, code)
            self._send_ctrl(self._data_ep, self._tags.rx_tag, msg)
        del self._transfers[t.transfer_id]
        t._done.set()
        self._pump()

    def _on_session(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """The receiver's messages on our session inbox: ACCEPT, DONE, CANCEL."""
        if sender != self.sender_id:
            return
        if kind is _Ctl.ACCEPT:
            if not self._admitted.is_set():
                if blob:  # the receiver's worker for this session: our data go there
                    try:
                        self._data_ep = self._worker.connect(
                            blob, error_handling=self.error_handling
                        )
                    except PeerUnavailable as exc:
                        self._auth_error = PeerUnavailable(
                            f"cannot reach the receiver's session worker: {exc}", peer=self.peer
                        )
                        self._admitted.set()
                        return
                else:  # one worker for all senders there
                    self._data_ep = self._ep
                self._open_ok = True
                self._admitted.set()
                if self.secret is not None and self._public is not None:
                    self._unlisten(self._public)  # nothing more comes there
            return
        if not self._open_ok:
            return
        if kind is _Ctl.DONE:  # a batch: tid, then more u32 transfer ids in the blob
            if len(blob) % 4:
                raise RemoteProtocolError("malformed DONE batch", peer=self.peer)
            self._progress_first = True  # the waiting tasks run before the repost
            for done in (tid, *struct.unpack(f"<{len(blob) // 4}I", blob)):
                t = self._transfers.get(done)
                if t is not None:
                    self._end(t, TransferState.DONE, None, None)
            return
        if kind is _Ctl.CANCEL and code == _Code.HALTED:
            self._session_halted()
            return
        t = self._transfers.get(tid)
        if t is None:
            return
        if kind is _Ctl.CANCEL:
            err = _error_for(code, tid, "receiver")
            state = TransferState.CANCELLED if code == _Code.CANCELLED else TransferState.FAILED
            self._end(t, state, err, None)

    def _session_halted(self) -> None:
        """The receiver halted our session's UCX worker: nothing we send is taken any more."""
        why = (
            "the receiver halted the UCX worker of this sender's session (a receive into "
            "one of its grants was still in flight at its drain deadline) and failed its "
            "transfers; open a new UcxSender"
        )
        self._halted_error = why
        for t in list(self._transfers.values()):
            exc = TransportError(why, transfer_id=t.transfer_id, peer=self.peer)
            self._end(t, TransferState.FAILED, exc, None)

    def transports(self) -> tuple[str, ...]:
        """The UCX transports (``transport/device``) of this sender's data
        endpoint, as UCX chose them for this receiver, e.g. ``("tcp/eth0",)``
        between two network namespaces; empty before ``__aenter__`` or after
        ``aclose``."""
        return endpoint_transports(self._data_ep or self._ep)

    def statistics(self) -> UcxSenderStatistics:
        return UcxSenderStatistics(
            self._bytes,
            self._staged,
            self._pieces,
            len(self._transfers),
            self._ok,
            self._worker.epoll_waits,
            self._inline,
            self._worker.poll_rounds,
        )
