"""One end of the local path: its UCX worker, the nursery that progresses it,
its control inboxes and control sends, and the low-latency wait.

:class:`UcxService` is the part both :class:`~pddnet.transport.local.UcxReceiver`
and :class:`~pddnet.transport.local.UcxSender` hold. A control inbox
(:class:`Inbox`) is one tag this end listens on: one reused buffer and one
posted receive, re-posted after each message is parsed.

**Low-latency mode** (opt-in, ``busy_poll_us > 0``): waiting on a transfer of
at most ``busy_poll_max_bytes`` first busy-polls the UCX worker from the
waiting task for up to ``busy_poll_us`` (:meth:`UcxWorker.poll`), so neither
side pays an epoll sleep and a trio task switch; then it sleeps as usual. It
burns a core for up to the budget per wait.

**Linger** (the default mode, small transfers back to back): while the
worker lingers (:meth:`UcxWorker.lingering`: the previous small transfer
finished within ``K_BURST_GAP_US`` and an event came within ``linger_us``), a
wait on a small transfer polls the worker itself in short slices between trio
checkpoints instead of sleeping, so the next DATA or DONE finds it awake
(docs/local.md, *4 KiB one way: linger*). Isolated transfers do not linger.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import trio

from ..._errors import AuthError, PddnetError
from ...wire._auth import K_AUTH_MIN_SECRET
from .._base import views_of
from ._messages import K_CTRL_MAX, Ctl, unpack
from ._worker import UcxWorker

__all__ = ["K_POLL_MAX_BYTES", "Handler", "Inbox", "UcxService", "flat_views"]

log = logging.getLogger("pddnet.transport.local")

K_POLL_MAX_BYTES = 64 << 10  # low-latency mode: only transfers up to this size busy-poll
K_POLL_YIELD_S = 1e-3  # low-latency mode: a full trio checkpoint at least this often
# A lingering wait polls its worker in slices of this long between trio
# checkpoints: measured cross-host 4 KiB one way, 0 (a checkpoint per round)
# 40 µs, 30 µs slices 33 µs (and less CPU); other tasks wait at most a slice.
K_LINGER_SLICE_S = 30e-6
K_FLUSH_CTRL_S = 0.05  # a closing end lets queued control messages (CANCEL, DONE) leave

# An inbox's handler: (kind, sender id, transfer id, code, blob).
Handler = Callable[[Ctl, int, int, int, bytes], None]


def flat_views(views: Sequence[Any]) -> list[Any]:
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


class Inbox:
    """A control-message tag this end listens on: one reused buffer, one posted receive."""

    __slots__ = ("buf", "closed", "handle", "handler", "tag", "worker")

    def __init__(self, tag: int, handler: Handler, worker: UcxWorker) -> None:
        self.tag = tag
        self.handler = handler
        self.worker = worker
        self.buf = np.empty(K_CTRL_MAX, np.uint8)
        self.handle = 0
        self.closed = False


class UcxService:
    """A worker plus the nursery that progresses it and runs timers; this
    end's control inboxes and sends.

    Args:
        tls: UCX transports of the worker (None: the environment's).
        spin_us: see :class:`UcxWorker`.
        secret: the data-plane secret, or None.
        auth_timeout: seconds a handshake may take.
        busy_poll_us: the low-latency mode's budget per wait (0: off).
        busy_poll_max_bytes: the low-latency mode's size threshold.

    Raises:
        AuthError: if ``secret`` is shorter than 16 bytes.
    """

    worker: UcxWorker
    nursery: trio.Nursery

    def __init__(
        self,
        tls: str | None,
        spin_us: float,
        secret: bytes | None,
        auth_timeout: float,
        busy_poll_us: float,
        busy_poll_max_bytes: int,
    ) -> None:
        if secret is not None and len(secret) < K_AUTH_MIN_SECRET:
            raise AuthError(f"the data-plane secret must be at least {K_AUTH_MIN_SECRET} bytes")
        self.tls = tls
        self.spin_us = spin_us
        self.secret = secret
        self.auth_timeout = auth_timeout
        self._poll_s = max(0.0, busy_poll_us) * 1e-6
        self._poll_max = busy_poll_max_bytes
        self._last_yield = 0.0
        self.progress_first = False  # a handler asks: progress before the inbox repost
        self.ctrl_dropped = 0
        self._stack: AsyncExitStack | None = None

    @property
    def is_open(self) -> bool:
        """Between :meth:`start` and :meth:`close`."""
        return self._stack is not None

    async def start(self) -> None:
        """Create the worker and start progressing it."""
        self.worker = UcxWorker(tls=self.tls, spin_us=self.spin_us)
        self._stack = AsyncExitStack()
        self.nursery = await self._stack.enter_async_context(trio.open_nursery())
        await self.nursery.start(self.worker.run)

    async def close(self, workers: Callable[[], list[UcxWorker]] | None = None) -> None:
        """Let queued control messages leave (bounded), stop the nursery and close
        ``workers()`` (every worker this end progresses; default: its own, the
        receiver adds its sessions'). Idempotent."""
        if self._stack is None:
            return
        if workers is None:
            workers = self._own_worker
        with trio.move_on_after(K_FLUSH_CTRL_S):
            while any(w.sends_queued() for w in workers() if not w.halted):
                await trio.sleep(0.001)
        closing = workers()
        self.nursery.cancel_scope.cancel()
        stack, self._stack = self._stack, None
        await stack.aclose()
        for w in closing:
            w.close()

    def _own_worker(self) -> list[UcxWorker]:
        return [self.worker]

    # ------------------------------------------------------- low-latency wait
    def should_poll(self, total: int) -> bool:
        """Whether a wait on a transfer of ``total`` bytes busy-polls first."""
        return self._poll_s > 0 and total <= self._poll_max

    async def poll_wait(self, event: trio.Event, worker: UcxWorker | None = None) -> None:
        """Wait for ``event``, busy-polling ``worker`` (default: this end's) first."""
        w = worker or self.worker
        if not event.is_set() and not w.closed and w.poll(event.is_set, self._poll_s):
            # Done within the budget: a full trio checkpoint would hand the loop
            # to the progress task (its epoll fd is readable now) before we return.
            await self._yield_now_and_then()
            return
        await event.wait()

    async def wait_small(
        self, event: trio.Event, total: int, worker: UcxWorker | None = None
    ) -> None:
        """Wait for ``event`` of a transfer of ``total`` bytes: busy-poll first in
        the low-latency mode; in the default mode, a small transfer's wait polls
        ``worker`` (default: this end's) between trio checkpoints while it
        lingers (:meth:`UcxWorker.lingering`), and tells it when it is done."""
        if self.should_poll(total):
            await self.poll_wait(event, worker)
            return
        w = worker or self.worker
        if total > self._poll_max:
            await event.wait()
            return
        try:
            await self._linger_wait(event, w)
        finally:
            if event.is_set():
                w.small_done()

    async def _linger_wait(self, event: trio.Event, w: UcxWorker) -> None:
        if not w.lingering():
            await event.wait()
            return
        yielded = False
        w.pollers += 1  # its progress task stands by: completions run here, no task switch
        try:
            while not event.is_set() and not w.closed and w.lingering():
                if w.poll(event.is_set, K_LINGER_SLICE_S):
                    break
                os.sched_yield()  # a process sharing this core (the peer) still runs
                await trio.lowlevel.checkpoint()
                yielded = True
        finally:
            w.pollers -= 1
        if not event.is_set():
            await event.wait()
        elif yielded:
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            await self._yield_now_and_then()

    async def _yield_now_and_then(self) -> None:
        # Done without yielding: check for cancellation, a full checkpoint at
        # least every K_POLL_YIELD_S (a full one first runs the progress task).
        now = time.perf_counter()
        if now - self._last_yield < K_POLL_YIELD_S:
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        self._last_yield = now
        await trio.lowlevel.checkpoint()

    # ------------------------------------------------------ control messages
    def listen(self, tag: int, handler: Handler, worker: UcxWorker | None = None) -> Inbox:
        """Receive control messages on ``tag`` (on ``worker``, default this end's):
        ``handler(kind, sender, tid, code, blob)``; one that raises a
        :class:`~pddnet.PddnetError` is dropped and counted."""
        box = Inbox(tag, handler, worker or self.worker)
        self._post_inbox(box)
        return box

    def _post_inbox(self, box: Inbox) -> None:
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
                    box.handler(*unpack(box.buf))
                except PddnetError as exc:
                    self._drop_ctrl(exc)
            if box.closed:
                return
            if w.polling or self.progress_first:
                # Latency first: repost after the next progress batch, which
                # runs the copy a large START's receives matched, or the tasks
                # a DONE woke. A message arriving meanwhile waits in UCX's
                # unexpected queue.
                self.progress_first = False
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

    def unlisten(self, box: Inbox) -> None:
        """Stop listening on ``box``."""
        box.closed = True
        box.worker.forget(box.handle)

    def send_ctrl(self, ep: Any, tag: int, msg: bytes, worker: UcxWorker | None = None) -> None:
        """Send a control message through ``ep`` (of ``worker``, default this end's);
        nothing when ``ep`` is None (closed already: the session ended)."""
        if ep is None:
            return
        w = worker or self.worker

        def done(req: Any, err: BaseException | None) -> None:
            if err is not None and not w.closed:
                log.debug("UCX control send failed: %s", err)

        w.send(ep, msg, tag, done, spin=True)
