"""The receiver's sweep of UCX's unexpected queue.

Messages whose tag no receive is posted for wait in UCX's unexpected queue,
which has no bound: a stranger with the worker address could fill memory
(measured: 20,000 4 KiB messages grew a receiver by 128 MB). The receiver
sweeps it: every :data:`K_SWEEP_S`, unexpected messages that nothing live
awaits are received into scratch and dropped, at most :data:`K_SWEEP_MAX` per
round, on the public worker and on each session's.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from .._base import TransferState
from ._auth import K_TAG_CTRL_RX
from ._rx_grants import RxGrants
from ._rx_sessions import Session, SessionTable
from ._service import UcxService
from ._worker import UcxWorker

__all__ = ["Sweeper"]

log = logging.getLogger("pddnet.transport.local")

K_SWEEP_S = 0.1
K_SWEEP_MAX = 4096


class Sweeper:
    """Drops unexpected messages nothing live awaits (:meth:`run` is its task)."""

    def __init__(self, service: UcxService, sessions: SessionTable, grants: RxGrants) -> None:
        self._svc = service
        self._sessions = sessions
        self._grants = grants
        self.dropped = 0
        self.dropped_bytes = 0

    async def run(self) -> None:
        """Sweep every :data:`K_SWEEP_S` until cancelled (or it fails: logged, stopped)."""
        while True:
            await trio.sleep(K_SWEEP_S)
            try:
                # Each worker's unexpected queue: the public one's, then each session's.
                places: list[tuple[UcxWorker, Session | None]] = [(self._svc.worker, None)]
                if self._sessions.session_workers:
                    places += [(s.worker, s) for s in self._sessions.live.values()]
                for w, s in places:
                    while not w.halted and not w.closed and self.sweep(w, s) >= K_SWEEP_MAX:
                        await trio.lowlevel.checkpoint()  # a flood: go on, but let others run
            except Exception as exc:  # never take the receiver down for housekeeping
                log.error("sweeping UCX's unexpected queue failed; stopped: %r", exc)
                return

    def sweep(self, w: UcxWorker, s: Session | None = None) -> int:
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
            self.dropped_bytes += head[1]
        if n:
            self.dropped += n
            level = logging.WARNING if self.dropped == n else logging.DEBUG
            log.log(level, "dropped %d UCX messages no receive was posted for", n)
        return n

    def _awaited(self, tag: int, session: Session | None = None) -> bool:
        """Whether a receive may still be posted for ``tag`` on the worker of
        ``session`` (None: the public worker; see :meth:`sweep`)."""
        kind = tag >> 60
        if session is not None:  # a session's own worker: only that session's tags
            if tag == session.tags.rx_tag:
                return not session.dropped
            sessions: Any = (session,)
        elif kind == K_TAG_CTRL_RX >> 60:
            return tag == K_TAG_CTRL_RX
        elif self._sessions.session_workers:  # sessions' messages never come to the public worker
            return False
        elif kind == 0xE:
            return tag in self._sessions.rx_tags
        else:
            sessions = self._sessions.live.values()
        if kind != 0x8:
            return False
        low = tag & ((1 << 56) - 1)
        for s in sessions:
            t = self._grants.transfers.get((low ^ s.tags.mask) >> 24)
            if t is not None and t.state is TransferState.RUNNING and t.sender in (None, s.sid):
                return True
        return False
