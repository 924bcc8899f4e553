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

Control messages are ``u32 length || msgpack [kind, sender_id, transfer_id,
code, blob]``: HELLO (sender -> receiver, blob = the sender's worker address),
START (sent before any data of a transfer, so the receiver knows whom to
tell), DONE (receiver: every piece landed), CANCEL (either way, with code
cancelled / timeout / rejected).

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
import secrets
import struct
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgpack
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
from ._worker import UcxWorker

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
K_KEEP_FINISHED = 4096  # finished transfers remembered for late waiters


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


def _pack(kind: _Ctl, sender: int, tid: int, code: int = 0, blob: bytes = b"") -> bytes:
    body = msgpack.packb([int(kind), sender, tid, code, blob], use_bin_type=True)
    return struct.pack("<I", len(body)) + body


def _unpack(buf: Any) -> tuple[_Ctl, int, int, int, bytes]:
    mv = memoryview(buf)
    (n,) = struct.unpack_from("<I", mv)
    if n > K_CTRL_MAX - 4:
        raise RemoteProtocolError("oversized UCX control message")
    try:
        kind, sender, tid, code, blob = msgpack.unpackb(bytes(mv[4 : 4 + n]), raw=False)
        return _Ctl(kind), int(sender), int(tid), int(code), bytes(blob)
    except Exception as exc:
        raise RemoteProtocolError(f"malformed UCX control message: {exc}") from exc


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


def _error_for(code: int, tid: int, peer: str) -> PddnetError:
    if code == _Code.TIMEOUT:
        return TransferTimeout("the peer's deadline passed", transfer_id=tid, peer=peer)
    if code == _Code.REJECTED:
        return RemoteProtocolError("the receiver rejected the transfer", transfer_id=tid, peer=peer)
    return TransferCancelled("the peer cancelled the transfer", transfer_id=tid, peer=peer)


class _Service:
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

    def _recv_ctrl(self, tag: int) -> None:
        buf = np.zeros(K_CTRL_MAX, np.uint8)

        def done(req: Any, err: BaseException | None) -> None:
            if self._worker.closed or err is not None:
                return
            try:
                self._on_ctrl(*_unpack(buf))
            except PddnetError as exc:
                log.warning("dropping a UCX control message: %s", exc)
            self._recv_ctrl(tag)

        self._worker.recv(buf, tag, done)

    def _on_ctrl(self, kind: _Ctl, sender: int, tid: int, code: int, blob: bytes) -> None:
        raise NotImplementedError

    def _send_ctrl(self, ep: Any, tag: int, msg: bytes) -> None:
        def done(req: Any, err: BaseException | None) -> None:
            if err is not None and not self._worker.closed:
                log.debug("UCX control send failed: %s", err)

        self._worker.send(ep, np.frombuffer(msg, np.uint8), tag, done, spin=True)


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
        self._bytes = self._posted = self._ok = self._failed = 0

    async def __aenter__(self) -> UcxReceiver:
        await self._open()
        self.address = K_ADDR_PREFIX + _b64(self._worker.address)
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
        if t.sender is not None:
            self._tell(t, code)
        self._finished.append(t.tid)
        while len(self._finished) > K_KEEP_FINISHED:
            self._transfers.pop(self._finished.popleft(), None)

    def _tell(self, t: _RxTransfer, code: int | None) -> None:
        ep = self._peers.get(t.sender) if t.sender is not None else None
        if ep is None or t.sender is None:
            return
        kind = _Ctl.DONE if code is None else _Ctl.CANCEL
        self._send_ctrl(ep, K_TAG_CTRL_TX | t.sender, _pack(kind, t.sender, t.tid, code or 0))

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
            self._bytes, self._posted, running, self._ok, self._failed, self._worker.epoll_waits
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
        self._from = __import__(
            "pddnet.transport._intervals", fromlist=["IntervalSet"]
        ).IntervalSet()
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
        if self._state is not TransferState.RUNNING or hi == lo:
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
        super().__init__(tls, spin_us)
        self.peer = address.split("#", 1)[0]
        self.sender_id = secrets.randbits(32)
        self.max_inflight = max_inflight
        self._transfers: dict[int, UcxTransfer] = {}
        self._inflight = 0
        self._bytes = self._staged = self._pieces = self._ok = 0
        self._ep: Any = None

    async def __aenter__(self) -> UcxSender:
        await self._open()
        self._recv_ctrl(K_TAG_CTRL_TX | self.sender_id)
        self._ep = self._worker.connect(_unb64(self.peer[len(K_ADDR_PREFIX) :]))
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
        lengths = np.frombuffer(_unb64(lens), "<i8").astype(np.int64)
        if int(lengths.sum()) != grant.total or (lengths <= 0).any():
            raise LocalProtocolError("the grant's piece list does not add up")
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        src_len = ranges.length[ranges.length > 0]
        if np.array_equal(src_len, lengths):  # the usual case: one source range per piece
            keep = ranges.length > 0
            sources = [
                [(b, o, n)]
                for b, o, n in zip(
                    ranges.buffer[keep].tolist(),
                    ranges.offset[keep].tolist(),
                    lengths.tolist(),
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
        self._send_ctrl(self._ep, K_TAG_CTRL_RX, _pack(_Ctl.START, self.sender_id, t.transfer_id))
        if timeout is not None:
            self._nursery.start_soon(self._deadline, t, timeout)
        if ready:
            t.mark_ready(0, grant.total)
        return t

    async def _deadline(self, t: UcxTransfer, timeout: float) -> None:
        with trio.CancelScope() as scope:
            t.scope = scope
            await trio.sleep(timeout)
            exc = TransferTimeout(f"no completion within {timeout} s", transfer_id=t.transfer_id)
            self._end(t, TransferState.FAILED, exc, _Code.TIMEOUT)

    def _pump(self) -> None:
        while self._inflight < self.max_inflight:
            ready = [t for t in self._transfers.values() if t._ready]
            if not ready:
                return
            t = min(ready, key=lambda x: (-x.priority, x.remaining))
            i = t._ready.popleft()
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
            h = self._worker.send(self._ep, buf, tag, self._sent(t, n, slot), queue=t.queue)
            slot.append(h)
            t._inflight[h] = n
            t.remaining -= n
            self._inflight += 1

    def _sent(self, t: UcxTransfer, n: int, slot: list[int]) -> Any:
        def cb(req: Any, err: BaseException | None) -> None:
            self._inflight -= 1
            if t._state is TransferState.RUNNING:
                t._inflight.pop(slot[0], None)
                if err is not None:
                    exc = PeerUnavailable(f"UCX send failed: {err}", transfer_id=t.transfer_id)
                    self._end(t, TransferState.FAILED, exc, _Code.CANCELLED)
                else:
                    t.bytes_sent += n
                    self._bytes += n
                    self._pieces += 1
                    if t._progress is not None:
                        t._reported = t.bytes_sent
                        t._progress(t.transfer_id, t.bytes_sent, t.grant.total)
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
        t = self._transfers.get(tid)
        if t is None:
            return
        if kind is _Ctl.DONE:
            self._end(t, TransferState.DONE, None, None)
        elif kind is _Ctl.CANCEL:
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
