"""The receiver's grants: the per-transfer START / data / DONE exchange.

ucxx's Python layer has tagged and active-message send/receive but no
one-sided put/get, so the *receiver* places the data. A grant names its
destination ranges; when an admitted session's START names the transfer, one
tagged receive per coalesced destination range is posted under that session's
tags, straight into the engine's KV memory (no staging), one completion queue
per layer. A small transfer all ready at start may instead come inside its
START (DATA), when the grant allows it (host memory). When every piece landed
the transfer's sender is told (DONE, batched per round of completions); a
grant that ends otherwise tells it CANCEL with a code.

A message longer than its posted receive fails with UCX's truncation error
and the transfer is rejected; a message with a tag nobody posted waits in
UCX's unexpected queue, never touching granted memory (see :mod:`._rx_sweep`).
So the sender cannot write outside its grant. (ucxx does not report the
received length, so a *shorter* message cannot be detected; senders are
trusted for that inside a datacenter.)

**Ending a grant.** UCX cancels a tag receive only while it is unmatched; one
whose data is in flight goes on writing until it completes. So a grant that
ends early is reported ended (``wait_transfer`` raises; the engine may reuse
the blocks) only once each of its receives completed or was confirmed
cancelled: it *drains*. A drain still going after ``drain_timeout`` is handed
to the receiver's teardown (:mod:`._rx_teardown`), which halts a worker.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..._errors import (
    LocalProtocolError,
    PddnetError,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from ...kv import ByteRanges
from .._base import Grant, TransferState
from ._addressing import b64
from ._messages import K_INLINE_MAX, Code, Ctl
from ._service import K_POLL_MAX_BYTES, UcxService, flat_views
from ._worker import UcxWorker

if TYPE_CHECKING:
    from ._rx_sessions import Session

__all__ = ["RxGrants", "RxTransfer"]

log = logging.getLogger("pddnet.transport.local")

K_MAX_PIECES = 1 << 24
K_KEEP_FINISHED = 4096  # finished transfers remembered for late waiters
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


class RxTransfer:
    """One grant on the receiver, from :meth:`RxGrants.grant` to its release."""

    __slots__ = (
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
        self.pieces_left = 0
        self.lengths: Any = None
        self.piece_layer: Any = None
        self.layer_left: Any = None
        self.layer_events: list[trio.Event] = []
        self.scope: trio.CancelScope | None = None
        self.targets: list[Any] = []  # granted memory, piece by piece: posted at START
        self.draining = 0  # ended, but this many receives may still write into it
        self.drain_scope: trio.CancelScope | None = None
        self.worker = worker  # where its receives are posted: its session's worker
        self.session: Session | None = None

    @property
    def live(self) -> bool:
        """Whether a receive of it may still write into its memory (running or draining)."""
        return self.state is TransferState.RUNNING or self.draining > 0


class RxGrants:
    """The receiver's transfers: granting, posting, completion and the end.

    Args:
        service: the receiver's UCX end.
        drain_timeout: how long an ended grant may drain before ``stuck``.
        tell: tells a bound transfer's sender its end (``code`` None: DONE).
        peer_lost: a receive failed because its sender is unreachable
            (``transfer, piece, length, error``).
        stuck: a drain passed ``drain_timeout`` (``transfer, why``).
        released: a transfer's end was reported.
    """

    def __init__(
        self,
        service: UcxService,
        drain_timeout: float,
        *,
        tell: Callable[[RxTransfer, int | None], None],
        peer_lost: Callable[[RxTransfer, int, int, BaseException], None],
        stuck: Callable[[RxTransfer, str], None],
        released: Callable[[RxTransfer], None],
    ) -> None:
        self._svc = service
        self.drain_timeout = drain_timeout
        self._tell = tell
        self._peer_lost = peer_lost
        self._stuck = stuck
        self._released = released
        self.transfers: dict[int, RxTransfer] = {}
        self._finished: deque[int] = deque()
        self._tids = itertools.count(secrets.randbits(20))
        self.bytes = self.posted = self.ok = self.failed = self.drains = 0

    # ------------------------------------------------------------------ grant
    def grant(
        self,
        address: str,
        views: Sequence[Any],
        ranges: ByteRanges,
        num_layers: int | None,
        timeout: float | None,
    ) -> Grant:
        """A new grant of ``ranges`` of ``views``; nothing is posted before its START.

        Raises:
            LocalProtocolError: for more than 2**24 ranges.
        """
        mvs = flat_views(views)
        keep = ranges.length > 0
        lengths = ranges.length[keep]
        if lengths.size >= K_MAX_PIECES:
            raise LocalProtocolError(f"{lengths.size} ranges exceed the {K_MAX_PIECES} limit")
        tid = next(self._tids) & 0xFFFFFFFF
        while tid in self.transfers:
            tid = next(self._tids) & 0xFFFFFFFF
        t = RxTransfer(tid, ranges.total, self._svc.worker)
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
        self.transfers[tid] = t
        t.pieces_left = int(lengths.size)
        bufs, offs = ranges.buffer[keep].tolist(), ranges.offset[keep].tolist()
        # Nothing is posted yet: receives go into this memory only once an
        # admitted sender's START names the transfer (see _post).
        t.targets = [
            mvs[b][o : o + n] for b, o, n in zip(bufs, offs, lengths.tolist(), strict=True)
        ]
        if t.pieces_left == 0:
            self.finish(t, TransferState.DONE, None, None)
        elif timeout is not None:
            self._svc.nursery.start_soon(self._deadline, t, timeout)
        address = f"{address}#{b64(lengths.astype('<i8').tobytes())}"
        if t.total <= K_INLINE_MAX and all(isinstance(b, memoryview) for b in t.targets):
            address += "#i"  # host memory: the sender may send it inline (DATA)
        return Grant(tid, ranges.total, layer_ends, address)

    def get(self, tid: int) -> RxTransfer:
        """The transfer ``tid``.

        Raises:
            LocalProtocolError: if it was never granted here (or is long finished).
        """
        t = self.transfers.get(tid)
        if t is None:
            raise LocalProtocolError(f"transfer {tid} was never granted here", transfer_id=tid)
        return t

    # ------------------------------------------------------ the sender's side
    def on_start(self, t: RxTransfer, s: Session, kind: Ctl, blob: bytes) -> bool:
        """Session ``s``'s START or DATA for ``t``; False when ``t`` is another
        session's (the first START stands)."""
        if t.sender is not None:  # bound to a session already
            return t.sender == s.sid
        if t.state is not TransferState.RUNNING:
            t.sender = s.sid
            self._tell(t, self._code_of(t))
        elif kind is Ctl.START:
            self._post(t, s)
        else:
            self._place_inline(t, s, blob)
        return True

    def on_cancel(self, t: RxTransfer, s: Session) -> None:
        """Session ``s`` cancelled ``t``."""
        if t.sender is not None and t.sender != s.sid:
            return
        t.sender = s.sid
        err = TransferCancelled("the sender cancelled the transfer", transfer_id=t.tid)
        if t.state is TransferState.RUNNING:
            t.sender = None  # it knows
            self.finish(t, TransferState.CANCELLED, err, Code.CANCELLED)

    def end_session(self, s: Session) -> None:
        """Session ``s`` closed (its BYE): its running transfers are cancelled."""
        for u in list(self.transfers.values()):
            if u.session is s and u.state is TransferState.RUNNING:
                exc = TransferCancelled("the sender closed", transfer_id=u.tid)
                self.finish(u, TransferState.CANCELLED, exc, None)

    def _post(self, t: RxTransfer, s: Session) -> None:
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
        t.targets = []
        self.posted += len(t.handles)
        self._svc.progress_first = t.total > K_POLL_MAX_BYTES  # its copy may start now

    def _place_inline(self, t: RxTransfer, s: Session, blob: bytes) -> None:
        """A small transfer's bytes, inline in its DATA message: exact size or rejected."""
        t.sender = s.sid
        t.session, t.worker = s, s.worker
        if len(blob) != t.total or not all(isinstance(b, memoryview) for b in t.targets):
            exc = RemoteProtocolError(
                f"inline transfer of {len(blob)} bytes for a grant of {t.total}", transfer_id=t.tid
            )
            self.finish(t, TransferState.FAILED, exc, Code.REJECTED)
            return
        mv, off = memoryview(blob), 0
        for buf in t.targets:
            n = len(buf)
            buf[:] = mv[off : off + n]
            off += n
        self.posted += len(t.targets)
        self.bytes += t.total
        t.pieces_left = 0
        self.finish(t, TransferState.DONE, None, None)

    def _piece_done(self, t: RxTransfer, i: int, n: int) -> Any:
        def cb(req: Any, err: BaseException | None) -> None:
            if t.state is not TransferState.RUNNING:
                if t.draining:  # a receive UCX could not cancel has now stopped
                    t.draining -= 1
                    if t.draining == 0:
                        self.release(t)
                return
            if err is not None:
                name = type(err).__name__
                if any(x in name for x in K_PEER_FAILURES):  # its sender's endpoint failed
                    self._peer_lost(t, i, n, err)
                else:  # e.g. truncated: longer than granted, the sender's fault
                    exc = RemoteProtocolError(
                        f"piece {i} of {n} bytes failed: {err}", transfer_id=t.tid
                    )
                    self.finish(t, TransferState.FAILED, exc, Code.REJECTED)
                return
            self.bytes += n
            t.pieces_left -= 1
            if t.layer_left is not None:
                layer = int(t.piece_layer[i])
                t.layer_left[layer] -= 1
                if t.layer_left[layer] == 0:
                    t.layer_events[layer].set()
            if t.pieces_left == 0:
                self.finish(t, TransferState.DONE, None, None)

        return cb

    # -------------------------------------------------------------------- end
    async def _deadline(self, t: RxTransfer, timeout: float) -> None:
        with trio.CancelScope() as scope:
            t.scope = scope
            await trio.sleep(timeout)
            exc = TransferTimeout(f"grant expired after {timeout} s", transfer_id=t.tid)
            self.finish(t, TransferState.FAILED, exc, Code.TIMEOUT)

    def cancel(self, tid: int) -> None:
        """The receiver revokes grant ``tid`` (unknown ids are ignored)."""
        t = self.transfers.get(tid)
        if t is not None:
            exc = TransferCancelled("the receiver cancelled the transfer", transfer_id=tid)
            self.finish(t, TransferState.CANCELLED, exc, Code.CANCELLED)

    def finish(
        self, t: RxTransfer, state: TransferState, error: PddnetError | None, code: int | None
    ) -> None:
        """End ``t`` (once): tell its sender, stop its receives, and report the end
        now or, with receives in flight, once they stopped."""
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
            self.drains += 1
            log.debug("transfer %d ended with %d receives in flight", t.tid, t.draining)
            self._svc.nursery.start_soon(self._drain_deadline, t)
            return
        self.release(t)

    async def _drain_deadline(self, t: RxTransfer) -> None:
        with trio.CancelScope() as scope:
            t.drain_scope = scope
            await trio.sleep(self.drain_timeout)
            if t.draining:
                self._stuck(t, "its grant ended")

    def fail_halted(self, u: RxTransfer, err: PddnetError, *, keep_cause: bool) -> None:
        """Fail ``u``, whose worker was halted: a running one as usual; a draining
        one (already ended, its receives stuck) is reported ended with ``err``."""
        if u.state is TransferState.RUNNING:
            self.finish(u, TransferState.FAILED, err, Code.CANCELLED)
            return
        if keep_cause:
            err.__cause__ = u.error
        u.error = err
        u.state = TransferState.FAILED
        self.release(u)

    def release(self, t: RxTransfer) -> None:
        """Report ``t``'s end: nothing can write into its blocks any more."""
        t.draining = 0
        t.handles = []
        if t.drain_scope is not None:
            t.drain_scope.cancel()
        for ev in t.layer_events:
            ev.set()
        t.done.set()
        if t.error is None:
            self.ok += 1
        else:
            self.failed += 1
        self._finished.append(t.tid)
        while len(self._finished) > K_KEEP_FINISHED:
            self.transfers.pop(self._finished.popleft(), None)
        self._released(t)

    @staticmethod
    def _code_of(t: RxTransfer) -> int | None:
        if t.state is TransferState.DONE:
            return None
        if isinstance(t.error, TransferTimeout):
            return Code.TIMEOUT
        if isinstance(t.error, RemoteProtocolError):
            return Code.REJECTED
        return Code.CANCELLED

    # ---------------------------------------------------------------- queries
    def live_on(self, w: UcxWorker) -> bool:
        """Whether a receive posted on ``w`` may still write into granted memory."""
        return any(t.worker is w and t.live for t in self.transfers.values())

    def busy_senders(self) -> set[int | None]:
        """The sessions (ids) with a live transfer."""
        return {t.sender for t in self.transfers.values() if t.live}

    def detach(self, w: UcxWorker) -> None:
        """Worker ``w`` is gone: finished transfers (kept for late waiters) forget it."""
        for t in self.transfers.values():
            if t.worker is w:
                t.worker, t.session = self._svc.worker, None

    def running(self) -> int:
        """Transfers not ended yet."""
        return sum(t.state is TransferState.RUNNING for t in self.transfers.values())

    def draining(self) -> int:
        """Transfers ended, not yet reported: receives still in flight."""
        return sum(t.draining > 0 for t in self.transfers.values())
