"""The local (intra-datacenter) path over UCX, through ucxx's tag API.

ucxx's Python layer has tagged and active-message send/receive but no
one-sided put/get, so the *receiver* places the data: when it grants a
destination it pre-posts one tagged receive per coalesced destination range,
straight into the engine's KV memory (no staging). The grant carries the
range lengths; the sender sends exactly those pieces, each from one contiguous
source range when the two sides' ranges line up (always the case for a
:class:`~pddnet.kv.TransferPlan`, whose runs are coalesced on both sides at
once), or gathered into a staging buffer when they do not (a counted copy).

Tags (64 bits)::

    0x8 << 60 | transfer_id << 24 | piece      data piece (transfer ids < 2**32, pieces < 2**24)
    0xC << 60                                  receiver's control inbox
    0xD << 60 | sender_id                      a sender's control inbox

Control messages are a fixed little-endian header ``u32 length, u8 kind, u8
code, u32 sender_id, u32 transfer_id`` and a blob (no msgpack on the hot
path): HELLO (sender -> receiver, blob = the sender's worker address), START
(so the receiver knows whom to tell; posted right before the transfer's first
piece, so both arrive in one wake-up, or at ``start`` when nothing is ready
yet), DONE (receiver: every piece landed; one per sender per round of
completions, further transfer ids as u32s in the blob), CANCEL (either way,
with code cancelled / timeout / rejected).

A receiver's address is ``ucx:NETNS:B64``: its network namespace (inode) and
its worker address. A sender in another namespace leaves out UCX's
shared-memory transports, which never deliver across namespaces.

A message longer than its posted receive fails with UCX's truncation error
and the transfer is rejected; a message with a tag nobody posted stays in
UCX's unexpected queue and never touches memory. So the sender cannot write
outside its grant. (ucxx does not report the received length, so a *shorter*
message cannot be detected; senders are trusted for that inside a datacenter.)
"""

from __future__ import annotations

import base64
import enum
import itertools
import logging
import os
import secrets
import struct
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..._errors import (
    LocalProtocolError,
    PddnetError,
    PeerUnavailable,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from ...kv import ByteRanges
from .._base import Grant, ProgressCallback, Receiver, Sender, Transfer, TransferState, views_of
from .._intervals import IntervalSet
from ._worker import K_DEFAULT_TLS, UcxWorker

__all__ = [
    "UcxReceiver",
    "UcxReceiverStatistics",
    "UcxSender",
    "UcxSenderStatistics",
    "UcxTransfer",
]

log = logging.getLogger("pddnet.transport.local")

K_TAG_DATA = 0x8 << 60
K_TAG_CTRL_RX = 0xC << 60
K_TAG_CTRL_TX = 0xD << 60
K_CTRL_MAX = 1 << 16
K_MAX_PIECES = 1 << 24
K_ADDR_PREFIX = "ucx:"
K_SHM_TLS = {"sm", "shm", "posix", "sysv", "mm"}  # break between network namespaces
K_KEEP_FINISHED = 4096  # finished transfers remembered for late waiters
K_LENS_CACHE = 1024  # decoded grant piece lists kept by a sender
K_DONE_BATCH = (K_CTRL_MAX - 64) // 4  # transfer ids per DONE message
K_INLINE_BURST = 256  # sends completed while posted before the pump yields to trio


class _Ctl(enum.IntEnum):
    HELLO = 1
    START = 2
    DONE = 3
    CANCEL = 4


class _Code(enum.IntEnum):
    CANCELLED = 1
    TIMEOUT = 2
    REJECTED = 3


def _data_tag(tid: int, piece: int) -> int:
    return K_TAG_DATA | (tid & 0xFFFFFFFF) << 24 | piece


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


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text.encode())


def _netns_id() -> str:
    """This process's network namespace (its inode), or "" if unknown."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def _parse_address(address: str) -> tuple[str, bytes]:
    """``ucx:[NETNS:]B64`` -> (the receiver's network namespace or "", its worker address)."""
    body = address[len(K_ADDR_PREFIX) :]
    netns, _, b64 = body.rpartition(":")
    try:
        return netns, _unb64(b64)
    except ValueError as exc:
        raise LocalProtocolError(f"malformed UCX address: {exc}") from exc


def _tls_for_peer(tls: str | None, peer_netns: str) -> str | None:
    """The transports to use towards a receiver in ``peer_netns``.

    UCX's shared-memory transports (``sm`` = ``posix``/``sysv``) connect but
    never deliver between network namespaces of one host (measured: every
    transfer timed out; ``tcp`` and ``cma`` work). So when the receiver is in
    another namespace they are replaced by ``cma`` (zero-copy rendezvous for
    large messages; small ones go over ``tcp``).
    """
    mine = _netns_id()
    if not peer_netns or not mine or peer_netns == mine:
        return tls
    current = tls or os.environ.get("UCX_TLS") or K_DEFAULT_TLS
    names = [x for x in current.split(",") if x]
    kept = [x for x in names if x not in K_SHM_TLS]
    if kept == names:
        return tls
    if "cma" not in kept:
        kept.append("cma")
    log.info("UCX receiver in another network namespace: UCX_TLS %s -> %s", current, kept)
    return ",".join(kept)


def _error_for(code: int, tid: int, peer: str) -> PddnetError:
    if code == _Code.TIMEOUT:
        return TransferTimeout("the peer's deadline passed", transfer_id=tid, peer=peer)
    if code == _Code.REJECTED:
        return RemoteProtocolError("the receiver rejected the transfer", transfer_id=tid, peer=peer)
    return TransferCancelled("the peer cancelled the transfer", transfer_id=tid, peer=peer)


class _Service(ABC):
    """A worker plus the nursery that progresses it and runs timers."""

    _worker: UcxWorker
    _nursery: trio.Nursery

    def __init__(self, tls: str | None, spin_us: float) -> None:
        self._tls = tls
        self._spin_us = spin_us
        self._stack: AsyncExitStack | None = None

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
            while any(e[3] for e in self._worker._pending.values()):
                await trio.sleep(0.001)
        self._nursery.cancel_scope.cancel()
        stack, self._stack = self._stack, None
        await stack.aclose()
        self._worker.close()

    def _recv_ctrl(self, tag: int, buf: Any = None) -> None:
        # One buffer per inbox, reused: a message is parsed (copied out) before
        # the next receive is posted into it.
        if buf is None:
            buf = np.empty(K_CTRL_MAX, np.uint8)

        def done(req: Any, err: BaseException | None) -> None:
            if self._worker.closed or err is not None:
                return
            try:
                self._on_ctrl(*_unpack(buf))
            except PddnetError as exc:
                log.warning("dropping a UCX control message: %s", exc)
            self._recv_ctrl(tag, buf)

        self._worker.recv(buf, tag, done)

    @abstractmethod
    def _on_ctrl(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        """Handle one control message (receiver and sender differ)."""

    def _send_ctrl(self, ep: Any, tag: int, msg: bytes) -> None:
        def done(req: Any, err: BaseException | None) -> None:
            if err is not None and not self._worker.closed:
                log.debug("UCX control send failed: %s", err)

        self._worker.send(ep, msg, tag, done, spin=True)


# ====================================================================== receiver
class _RxTransfer:
    __slots__ = (
        "bytes_done",
        "done",
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
        "state",
        "tid",
        "total",
    )

    def __init__(self, tid: int, total: int) -> None:
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


class UcxReceiver(_Service, Receiver):
    """The receiving end of the local path: grants memory and pre-posts receives into it.

    Use as ``async with UcxReceiver() as rx``; pass :attr:`address` to the
    senders.

    Args:
        tls: UCX transports (default: ``UCX_TLS``, else ``tcp,sm,self``).
        spin_us: see :class:`~pddnet.transport.local.UcxWorker`.

    Raises:
        MissingExtraError: if ucxx is not installed (see :func:`open_local_receiver`
            for the TCP fallback).
    """

    def __init__(self, *, tls: str | None = None, spin_us: float = 0.0) -> None:
        super().__init__(tls, spin_us)
        self._transfers: dict[int, _RxTransfer] = {}
        self._finished: deque[int] = deque()
        self._peers: dict[int, Any] = {}
        self._tids = itertools.count(secrets.randbits(20))
        self._done_out: dict[int, list[int]] = {}
        self._done_msgs = 0
        self._bytes = self._posted = self._ok = self._failed = 0

    async def __aenter__(self) -> UcxReceiver:
        await self._open()
        self.address = f"{K_ADDR_PREFIX}{_netns_id()}:{_b64(self._worker.address)}"
        self._recv_ctrl(K_TAG_CTRL_RX)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for t in list(self._transfers.values()):
            self._finish(
                t,
                TransferState.CANCELLED,
                TransferCancelled("receiver closed", transfer_id=t.tid),
                _Code.CANCELLED,
            )
        await self._close()

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
        mvs = _flat_views(views)
        keep = ranges.length > 0
        lengths = ranges.length[keep]
        if lengths.size >= K_MAX_PIECES:
            raise LocalProtocolError(f"{lengths.size} ranges exceed the {K_MAX_PIECES} limit")
        tid = next(self._tids) & 0xFFFFFFFF
        while tid in self._transfers:
            tid = next(self._tids) & 0xFFFFFFFF
        t = _RxTransfer(tid, ranges.total)
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
        # One completion queue per layer: layers may arrive in any order, and
        # the worker polls only queue heads (see UcxWorker._reap).
        layers = ranges.layer[keep].tolist() if nl else [0] * int(lengths.size)
        queues: dict[int, int] = {}
        recv = self._worker.recv
        for i, (b, o, n) in enumerate(zip(bufs, offs, lengths.tolist(), strict=True)):
            cb = self._piece_done(t, i, n)
            tag = _data_tag(tid, i)
            q = queues.get(layers[i])
            if q is None:
                q = queues[layers[i]] = self._worker.new_queue(dormant=True)
            t.handles.append(recv(mvs[b][o : o + n], tag, cb, spin=True, queue=q))
        t.queues = list(queues.values())
        self._posted += int(lengths.size)
        if t.pieces_left == 0:
            self._finish(t, TransferState.DONE, None, None)
        elif timeout is not None:
            self._nursery.start_soon(self._deadline, t, timeout)
        address = f"{self.address}#{_b64(lengths.astype('<i8').tobytes())}"
        return Grant(tid, ranges.total, layer_ends, address)

    def _piece_done(self, t: _RxTransfer, i: int, n: int) -> Any:
        def cb(req: Any, err: BaseException | None) -> None:
            if t.state is not TransferState.RUNNING:
                return
            if err is not None:
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
        for h in t.handles:
            self._worker.forget(h)  # cancels receives still posted
        t.handles = []
        for ev in t.layer_events:
            if error is None:
                ev.set()
        if t.scope is not None:
            t.scope.cancel()
        t.done.set()
        if error is None:
            self._ok += 1
        else:
            self._failed += 1
            for ev in t.layer_events:
                ev.set()
        self._finished.append(t.tid)
        while len(self._finished) > K_KEEP_FINISHED:
            self._transfers.pop(self._finished.popleft(), None)

    def _tell(self, t: _RxTransfer, code: int | None) -> None:
        ep = self._peers.get(t.sender) if t.sender is not None else None
        if ep is None or t.sender is None:
            return
        if code is None:  # DONE: batched per sender until this round of completions ends
            if not self._done_out:
                self._worker.after_reap(self._flush_done)
            self._done_out.setdefault(t.sender, []).append(t.tid)
            return
        self._send_ctrl(ep, K_TAG_CTRL_TX | t.sender, _pack(_Ctl.CANCEL, t.sender, t.tid, code))

    def _flush_done(self) -> None:
        """One DONE per sender: the first transfer id in the header, the rest as u32s."""
        out, self._done_out = self._done_out, {}
        for sender, tids in out.items():
            ep = self._peers.get(sender)
            for i in range(0, len(tids), K_DONE_BATCH):
                part = tids[i : i + K_DONE_BATCH]
                more = struct.pack(f"<{len(part) - 1}I", *part[1:])
                msg = _pack(_Ctl.DONE, sender, part[0], 0, more)
                self._send_ctrl(ep, K_TAG_CTRL_TX | sender, msg)
                self._done_msgs += 1

    def _on_ctrl(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        if kind is _Ctl.HELLO:
            try:
                self._peers[sender] = self._worker.connect(blob)
            except PeerUnavailable as exc:
                log.warning("cannot reach UCX sender %08x: %s", sender, exc)
            return
        t = self._transfers.get(tid)
        if t is None:
            return
        if kind is _Ctl.START:
            t.sender = sender
            for q in t.queues:
                self._worker.activate(q)
            if t.state is not TransferState.RUNNING:
                self._tell(t, self._code_of(t))
        elif kind is _Ctl.CANCEL:
            t.sender = sender
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
        await t.done.wait()
        if t.error is not None:
            raise t.error

    async def wait_layer(self, transfer_id: int, layer: int) -> None:
        """Wait until every byte of ``layer`` landed (raises like :meth:`wait_transfer`)."""
        t = self._get(transfer_id)
        if not t.layer_events:
            raise LocalProtocolError("grant was made without num_layers", transfer_id=transfer_id)
        await t.layer_events[layer].wait()
        if t.error is not None:
            raise t.error

    def cancel(self, transfer_id: int) -> None:
        """Revoke the grant: posted receives are cancelled, the sender told. Idempotent."""
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
            self._worker.epoll_waits,
            self._done_msgs,
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


class UcxSender(_Service, Sender):
    """The sending end of the local path, bound to one receiver.

    Args:
        address: the receiver's :attr:`UcxReceiver.address`.
        tls: UCX transports (default: ``UCX_TLS``, else ``tcp,sm,self``).
        spin_us: see :class:`~pddnet.transport.local.UcxWorker`.
        max_inflight: pieces posted to UCX at once (over all transfers).

    Raises:
        LocalProtocolError: for an address that is not a UCX one.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: str | None = None,
        spin_us: float = 0.0,
        max_inflight: int = 16,
    ) -> None:
        if not address.startswith(K_ADDR_PREFIX):
            raise LocalProtocolError(f"not a UCX address: {address[:40]!r}")
        self.peer = address.split("#", 1)[0]
        peer_netns, self._peer_address = _parse_address(self.peer)
        super().__init__(_tls_for_peer(tls, peer_netns), spin_us)
        self.sender_id = secrets.randbits(32)
        self.max_inflight = max_inflight
        self._transfers: dict[int, UcxTransfer] = {}
        self._inflight = 0
        self._bytes = self._staged = self._pieces = self._ok = 0
        self._ep: Any = None
        self._lens_cache: dict[str, tuple[Any, Any, list[int]]] = {}
        self._resume_pending = False

    async def __aenter__(self) -> UcxSender:
        await self._open()
        self._recv_ctrl(K_TAG_CTRL_TX | self.sender_id)
        self._ep = self._worker.connect(self._peer_address)
        hello = _pack(_Ctl.HELLO, self.sender_id, 0, 0, self._worker.address)
        self._send_ctrl(self._ep, K_TAG_CTRL_RX, hello)
        return self

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
        await self._close()

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
        """
        if self._ep is None:
            raise LocalProtocolError("UcxSender used outside `async with`")
        peer, _, lens = grant.address.partition("#")
        if peer != self.peer:
            raise LocalProtocolError("the grant is for another UCX receiver")
        if ranges.total != grant.total:
            raise LocalProtocolError(
                f"source ranges hold {ranges.total} bytes, the grant {grant.total}",
                transfer_id=grant.transfer_id,
            )
        lengths, bounds, length_list = self._piece_list(lens, grant.total)
        keep: Any = ranges.length > 0
        if keep.all():
            keep = slice(None)
        src_len = ranges.length[keep]
        if np.array_equal(src_len, lengths):  # the usual case: one source range per piece
            sources = [
                [(b, o, n)]
                for b, o, n in zip(
                    ranges.buffer[keep].tolist(),
                    ranges.offset[keep].tolist(),
                    length_list,
                    strict=True,
                )
            ]
        else:
            sources = [
                ranges.pieces(int(bounds[i]), int(bounds[i + 1])) for i in range(lengths.size)
            ]
        t = UcxTransfer(self, grant, sources, bounds, _flat_views(views), priority, progress)
        if grant.transfer_id in self._transfers:
            raise LocalProtocolError("transfer already running", transfer_id=grant.transfer_id)
        self._transfers[grant.transfer_id] = t
        if timeout is not None:
            self._nursery.start_soon(self._deadline, t, timeout)
        if ready and sources:  # START goes with the first piece (see _pump)
            t.mark_ready(0, grant.total)
        else:  # START now: the receiver can report its own deadline, cancel or DONE
            self._start(t)
        return t

    def _start(self, t: UcxTransfer) -> None:
        t.started = True
        self._send_ctrl(self._ep, K_TAG_CTRL_RX, _pack(_Ctl.START, self.sender_id, t.transfer_id))

    def _piece_list(self, lens: str, total: int) -> tuple[Any, Any, list[int]]:
        """A grant's piece lengths, their logical bounds, and the lengths as a list.

        Grants of the same shape repeat (one per request and layer), so the
        decoded lists are cached by their encoding.
        """
        hit = self._lens_cache.get(lens)
        if hit is None:
            lengths = np.frombuffer(_unb64(lens), "<i8").astype(np.int64)
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
            tag = _data_tag(t.transfer_id, i)
            t.remaining -= n
            h = self._worker.send(self._ep, buf, tag, self._sent(t, n, slot), queue=t.queue)
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
                    exc = PeerUnavailable(f"UCX send failed: {err}", transfer_id=t.transfer_id)
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
        for h, n in t._inflight.items():  # still posted (completed ones left the dict)
            self._worker.forget(h)
            self._inflight -= 1
            if error is None:  # the receiver has it all: these sends completed too
                t.bytes_sent += n
                self._bytes += n
                self._pieces += 1
        t._inflight.clear()
        t._ready.clear()
        if t.scope is not None:
            t.scope.cancel()
        if error is None:
            self._ok += 1
            if t._progress is not None and t._reported != t.grant.total:
                t._progress(t.transfer_id, t.grant.total, t.grant.total)
        if code is not None and self._ep is not None:
            msg = _pack(_Ctl.CANCEL, self.sender_id, t.transfer_id, code)
            self._send_ctrl(self._ep, K_TAG_CTRL_RX, msg)
        del self._transfers[t.transfer_id]
        t._done.set()
        self._pump()

    def _on_ctrl(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        if kind is _Ctl.DONE:  # a batch: tid, then more u32 transfer ids in the blob
            if len(blob) % 4:
                raise RemoteProtocolError("malformed DONE batch", peer=self.peer)
            for done in (tid, *struct.unpack(f"<{len(blob) // 4}I", blob)):
                t = self._transfers.get(done)
                if t is not None:
                    self._end(t, TransferState.DONE, None, None)
            return
        t = self._transfers.get(tid)
        if t is None:
            return
        if kind is _Ctl.CANCEL:
            err = _error_for(code, tid, "receiver")
            state = TransferState.CANCELLED if code == _Code.CANCELLED else TransferState.FAILED
            self._end(t, state, err, None)

    def statistics(self) -> UcxSenderStatistics:
        return UcxSenderStatistics(
            self._bytes,
            self._staged,
            self._pieces,
            len(self._transfers),
            self._ok,
            self._worker.epoll_waits,
        )
