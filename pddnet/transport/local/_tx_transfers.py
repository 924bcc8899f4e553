"""The sender's transfers: the START / data / DONE exchange from the sending side.

The receiver's grant carries the pieces' lengths; the sender sends exactly
those pieces as tagged messages under the session's data tags, each from one
contiguous source range when the two sides' ranges line up (always the case
for a :class:`~pddnet.kv.TransferPlan`, whose runs are coalesced on both sides
at once), or gathered into a staging buffer when they do not (a counted copy).
START goes right before a transfer's first piece (or at ``start`` when
nothing is ready yet); a small transfer all ready at start goes inside it
(DATA). The receiver's DONE ends a transfer; its CANCEL fails it.

:class:`SendQueue` holds the transfers and posts ready pieces to UCX, highest
priority and fewest remaining bytes first, at most ``max_inflight`` at once.
UCX cannot cancel a send: one in flight keeps its slot until it completes.

**Layer by layer.** A mark (:meth:`UcxTransfer.mark_ready`) that finds no
piece in flight posts its pieces at once. One that comes while others are in
flight queues them for the worker's next round (:meth:`UcxWorker.soon
<pddnet.transport.local.UcxWorker.soon>`, within one send tick), which posts
every piece marked since, before it progresses: the layers' RTS leave
together, ahead of the data that round pushes, and their RTRs come back
together, instead of a wake-up, a round and a push per mark (measured:
docs/local.md, *Layer by layer*).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from typing import Any

import numpy as np
import trio

from ..._errors import (
    LocalProtocolError,
    PddnetError,
    PeerUnavailable,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from ...kv import ByteRanges
from .._base import Grant, ProgressCallback, Transfer, TransferState
from .._intervals import IntervalSet
from ._messages import Code, Ctl, error_for, header, pack, unpack_done
from ._service import UcxService
from ._tx_session import TxSession

__all__ = ["SendQueue", "UcxTransfer"]

K_INLINE_BURST = 256  # sends completed while posted before the pump yields to trio


class UcxTransfer(Transfer):
    """The sender's handle on one transfer over the local path."""

    def __init__(
        self,
        queue: SendQueue,
        grant: Grant,
        sources: list[list[tuple[int, int, int]]],
        bounds: list[int],
        mvs: list[Any],
        priority: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.transfer_id = grant.transfer_id
        self.grant = grant
        self._owner = queue
        self._sources = sources
        self._bounds = bounds  # piece i is logical [bounds[i], bounds[i+1])
        self._mvs = mvs
        self.priority = priority
        self._progress = progress
        self._state = TransferState.RUNNING
        self._error: PddnetError | None = None
        self._done = trio.Event()
        self._ready: deque[int] = deque()
        self._queued = bytearray(len(sources))  # piece i queued (until _all_queued)
        self._from = IntervalSet()
        self._all_queued = False
        self.started = False  # START sent
        self._inflight: dict[int, int] = {}  # handle -> bytes
        self.bytes_sent = 0
        self._reported = -1
        self.queue = queue.new_queue()
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
            self._ready.extend(range(len(self._sources)))
            self._owner.pump()
            return
        ready, queued, b = self._from, self._queued, self._bounds
        ready.add(lo, hi)
        first = max(bisect_right(b, lo) - 1, 0)
        last = min(bisect_left(b, hi), len(self._sources))
        for i in range(first, last):
            if not queued[i] and ready.covers(b[i], b[i + 1]):
                queued[i] = 1
                self._ready.append(i)
        if self._owner.inflight:  # posted in the worker's next round, with later marks
            self._owner.pump_soon()
        else:
            self._owner.pump()

    def mark_layer_ready(self, layer: int) -> None:
        """Declare one layer of the grant ready."""
        lo, hi = self.grant.layer_span(layer)
        self.mark_ready(lo, hi)

    async def wait(self) -> None:
        """Wait until the receiver confirmed every byte; cancelling the wait leaves it running."""
        await self._owner.wait(self._done, self.grant.total)
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop sending and tell the receiver. Idempotent."""
        exc = TransferCancelled("cancelled by the sender", transfer_id=self.transfer_id)
        self._owner.end(self, TransferState.CANCELLED, exc, Code.CANCELLED)


class SendQueue:
    """The sender's running transfers and the pump that posts their pieces.

    Args:
        service: the sender's UCX end.
        session: the session the pieces and control messages go through.
        max_inflight: pieces posted to UCX at once (over all transfers).
    """

    def __init__(self, service: UcxService, session: TxSession, max_inflight: int) -> None:
        self._svc = service
        self._s = session
        self.max_inflight = max_inflight
        self.transfers: dict[int, UcxTransfer] = {}
        self.inflight = 0
        self.bytes = self.staged = self.pieces = self.ok = self.inline = 0
        self._resume_pending = False
        self._pump_soon = False  # a pump waits for the worker's next round

    def new_queue(self) -> int:
        """A completion queue for one transfer's sends."""
        return self._svc.worker.new_queue()

    async def wait(self, done: trio.Event, total: int) -> None:
        """Wait for a transfer of ``total`` bytes (low-latency mode: busy-poll first)."""
        await self._svc.wait_small(done, total)

    def _send(self, msg: bytes) -> None:
        s = self._s
        self._svc.send_ctrl(s.data_ep, s.tags.rx_tag, msg)

    def send_start(self, tid: int) -> None:
        """START for ``tid``."""
        self._send(pack(Ctl.START, self._s.sender_id, tid))

    def send_data(self, tid: int, mvs: list[Any], ranges: ByteRanges) -> None:
        """A small transfer in one DATA message: its START with the bytes after
        the header, in logical order (one copy, into the message)."""
        lens = ranges.length.tolist()
        parts = [
            mvs[b][o : o + n]
            for b, o, n in zip(ranges.buffer.tolist(), ranges.offset.tolist(), lens, strict=True)
            if n
        ]
        head = header(Ctl.DATA, self._s.sender_id, tid, sum(lens))
        self._send(b"".join([head, *parts]))

    def add(self, t: UcxTransfer, timeout: float | None) -> None:
        """Track ``t`` (and its deadline, if any)."""
        self.transfers[t.transfer_id] = t
        if timeout is not None:
            self._svc.nursery.start_soon(self._deadline, t, timeout)

    def sent_inline(self, t: UcxTransfer) -> None:
        """Account for a transfer whose DATA message left (:meth:`send_data`)."""
        t.started = t._all_queued = True
        t.remaining = 0
        self.inline += 1
        self.pieces += len(t._sources) - 1  # _account counts one
        self._account(t, t.grant.total)

    def start(self, t: UcxTransfer) -> None:
        """Send ``t``'s START now."""
        t.started = True
        self.send_start(t.transfer_id)

    async def _deadline(self, t: UcxTransfer, timeout: float) -> None:
        with trio.CancelScope() as scope:
            t.scope = scope
            await trio.sleep(timeout)
            exc = TransferTimeout(f"no completion within {timeout} s", transfer_id=t.transfer_id)
            self.end(t, TransferState.FAILED, exc, Code.TIMEOUT)

    def pump(self) -> None:
        """Post ready pieces while slots are free."""
        inline = 0
        s, w = self._s, self._svc.worker
        while self.inflight < self.max_inflight:
            if inline >= K_INLINE_BURST:  # let trio run; go on in a moment
                if not self._resume_pending:
                    self._resume_pending = True
                    self._svc.nursery.start_soon(self._resume_pump)
                return
            ready = [t for t in self.transfers.values() if t._ready]
            if not ready:
                return
            t = min(ready, key=lambda x: (-x.priority, x.remaining))
            i = t._ready.popleft()
            if not t.started:  # right before the data: both reach the receiver in one wake-up
                self.start(t)
            src = t._sources[i]
            if len(src) == 1:
                b, o, n = src[0]
                buf: Any = t._mvs[b][o : o + n]
            else:  # source and destination ranges differ: gather (a counted copy)
                buf = np.concatenate(
                    [np.frombuffer(t._mvs[b][o : o + n], np.uint8) for b, o, n in src]
                )  # host memory only: device sources must line up with the grant
                n = int(buf.nbytes)
                self.staged += n
            slot: list[int] = []
            tag = s.tags.data_tag(t.transfer_id, i)
            t.remaining -= n
            h = w.send(s.data_ep, buf, tag, self._sent(t, n, slot), queue=t.queue)
            if h == 0:  # completed while posted (eager): account for it now
                self._account(t, n)
                inline += 1
                continue
            slot.append(h)
            t._inflight[h] = n
            self.inflight += 1

    def pump_soon(self) -> None:
        """Post ready pieces at the start of the worker's next round (see
        :meth:`UcxWorker.soon <pddnet.transport.local.UcxWorker.soon>`)."""
        if not self._pump_soon:
            self._pump_soon = True
            self._svc.worker.soon(self._pump_now)

    def _pump_now(self) -> None:
        self._pump_soon = False
        self.pump()

    async def _resume_pump(self) -> None:
        await trio.lowlevel.checkpoint()
        self._resume_pending = False
        self.pump()

    def _account(self, t: UcxTransfer, n: int) -> None:
        t.bytes_sent += n
        self.bytes += n
        self.pieces += 1
        if t._progress is not None:
            t._reported = t.bytes_sent
            t._progress(t.transfer_id, t.bytes_sent, t.grant.total)

    def _sent(self, t: UcxTransfer, n: int, slot: list[int]) -> Any:
        def cb(req: Any, err: BaseException | None) -> None:
            self.inflight -= 1
            if t._state is TransferState.RUNNING:
                t._inflight.pop(slot[0], None)
                if err is not None:
                    exc = PeerUnavailable(
                        f"UCX send failed: {err}", transfer_id=t.transfer_id, peer=self._s.peer
                    )
                    self.end(t, TransferState.FAILED, exc, Code.CANCELLED)
                else:
                    self._account(t, n)
            self.pump()

        return cb

    def end(
        self, t: UcxTransfer, state: TransferState, error: PddnetError | None, code: int | None
    ) -> None:
        """End ``t`` (once); with ``code``, tell the receiver (CANCEL)."""
        if t._state is not TransferState.RUNNING:
            return
        t._state, t._error = state, error
        if error is None:  # the receiver has it all: sends still registered completed too
            for h, n in t._inflight.items():
                self._svc.worker.forget(h)
                self.inflight -= 1
                t.bytes_sent += n
                self.bytes += n
                self.pieces += 1
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
            self.ok += 1
            if t._progress is not None and t._reported != t.grant.total:
                t._progress(t.transfer_id, t.grant.total, t.grant.total)
        if code is not None and self._s.open_ok:
            self._send(pack(Ctl.CANCEL, self._s.sender_id, t.transfer_id, code))
        del self.transfers[t.transfer_id]
        t._done.set()
        self.pump()

    def cancel_all(self, why: str) -> None:
        """Cancel every running transfer (telling the receiver)."""
        for t in list(self.transfers.values()):
            exc = TransferCancelled(why, transfer_id=t.transfer_id)
            self.end(t, TransferState.CANCELLED, exc, Code.CANCELLED)

    def on_reply(self, kind: Ctl, tid: int, code: int, blob: bytes) -> None:
        """The receiver's DONE (a batch of transfer ids) or CANCEL."""
        if kind is Ctl.DONE:
            tids = unpack_done(tid, blob, self._s.peer)
            self._svc.progress_first = True  # the waiting tasks run before the repost
            for done in tids:
                t = self.transfers.get(done)
                if t is not None:
                    self.end(t, TransferState.DONE, None, None)
            return
        if kind is Ctl.CANCEL and code == Code.HALTED:
            self._session_halted()
            return
        t = self.transfers.get(tid)
        if t is None:
            return
        if kind is Ctl.CANCEL:
            err = error_for(code, tid, "receiver")
            state = TransferState.CANCELLED if code == Code.CANCELLED else TransferState.FAILED
            self.end(t, state, err, None)

    def _session_halted(self) -> None:
        """The receiver halted our session's UCX worker: nothing we send is taken any more."""
        why = (
            "the receiver halted the UCX worker of this sender's session (a receive into "
            "one of its grants was still in flight at its drain deadline) and failed its "
            "transfers; open a new UcxSender"
        )
        self._s.halted_error = why
        for t in list(self.transfers.values()):
            exc = TransportError(why, transfer_id=t.transfer_id, peer=self._s.peer)
            self.end(t, TransferState.FAILED, exc, None)
