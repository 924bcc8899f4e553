"""The receiver's teardown: lost senders, drains that do not end, and closing.

A grant that ends is reported only once every receive posted into it
completed or UCX confirmed it cancelled (:mod:`._rx_grants`). UCX cannot
cancel a receive whose message already matched (a rendezvous transfer in
flight); if such a receive has not completed after ``drain_timeout``, the
receiver halts the UCX worker of that grant's sender session so nothing more
lands (docs/local.md, *Ending a grant*): only that session's transfers fail,
other senders, on their own workers, go on (*Dead senders: one UCX worker per
sender session*). Without session workers, or past
:data:`K_MAX_HALTED_WORKERS` halted ones, it halts every worker and the
receiver takes no more grants.

With UCX error handling a dead sender fails its receives in flight within
milliseconds: :meth:`Teardown.peer_lost` fails that sender's transfers and
drops its session, with no halt.
"""

from __future__ import annotations

import logging

import trio

from ..._errors import PeerUnavailable, TransferCancelled, TransportError
from .._base import TransferState
from ._messages import Code
from ._rx_grants import RxGrants, RxTransfer
from ._rx_sessions import SessionTable
from ._service import UcxService
from ._worker import UcxWorker

__all__ = ["Teardown"]

log = logging.getLogger("pddnet.transport.local")

# Halted session workers are never progressed nor destroyed again while the
# receiver lives (destroying one might progress it); beyond this many the next
# drain deadline halts the whole receiver, as without session workers.
K_MAX_HALTED_WORKERS = 16
K_EP_CLOSE_S = 0.5  # a closing receiver lets its endpoints' flushes finish for this long


class Teardown:
    """How the receiver's transfers end when senders or UCX do not cooperate."""

    def __init__(self, service: UcxService, grants: RxGrants, sessions: SessionTable) -> None:
        self._svc = service
        self._grants = grants
        self._sessions = sessions
        self.path_error: TransportError | None = None  # set when every worker was halted
        self.peers_lost = 0

    def peer_lost(self, t: RxTransfer, i: int, n: int, err: BaseException) -> None:
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
        self.peers_lost += 1
        log.warning("%s", first)
        s = self._sessions.live.get(sid) if sid is not None else None
        if s is not None:
            self._sessions.drop(s)  # nothing more is told to it; its tags are free
        self._grants.finish(t, TransferState.FAILED, first, None)
        for u in list(self._grants.transfers.values()):
            if u is not t and u.sender == sid and u.state is TransferState.RUNNING:
                exc = PeerUnavailable(
                    f"the UCX sender of this transfer is unreachable: {err}",
                    transfer_id=u.tid,
                    peer=who,
                )
                exc.__cause__ = first
                self._grants.finish(u, TransferState.FAILED, exc, None)

    def close_path(self, t: RxTransfer, why: str) -> None:
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
        sessions = self._sessions
        if t.worker is not self._svc.worker and len(sessions.halted) < K_MAX_HALTED_WORKERS:
            self._halt_session(t, why)
            return
        exc = self._drain_error(
            t, why, "the receiver halted its UCX worker so nothing more can land, and is closed"
        )
        self.path_error = exc
        log.error("%s", exc)
        for w in sessions.workers():
            w.halt()
        for u in list(self._grants.transfers.values()):
            if u.live:
                err = (
                    exc
                    if u is t
                    else TransportError(f"the UCX receiver was closed: {exc}", transfer_id=u.tid)
                )
                self._grants.fail_halted(u, err, keep_cause=u is not t)

    def _drain_error(self, t: RxTransfer, why: str, what: str) -> TransportError:
        """The error for receives of ``t`` still in flight at the drain deadline."""
        exc = TransportError(
            f"{t.draining} UCX receive(s) into transfer {t.tid} were still in flight "
            f"{self._grants.drain_timeout} s after {why} (UCX cannot cancel a receive whose "
            f"data is in flight); {what}",
            transfer_id=t.tid,
            peer=f"ucx-sender-{t.sender:08x}" if t.sender is not None else None,
        )
        exc.__cause__ = t.error
        return exc

    def _halt_session(self, t: RxTransfer, why: str) -> None:
        """Halt the worker of ``t``'s session: only that sender's transfers fail.

        The worker is never progressed again, so nothing more lands through it;
        it is kept (not destroyed) until the receiver closes. Its session is
        dropped; the sender, if alive, must open a new one.
        """
        w = t.worker
        exc = self._drain_error(
            t,
            why,
            "the receiver halted the UCX worker of this sender's session so nothing more "
            "can land, and failed that session's transfers",
        )
        log.error("%s", exc)
        self._sessions.halt(w, t.session, t.tid)
        for u in list(self._grants.transfers.values()):
            if u.worker is not w or not u.live:
                continue
            err = exc
            if u is not t:
                err = TransportError(
                    f"the UCX worker of this transfer's sender session was halted: {exc}",
                    transfer_id=u.tid,
                    peer=exc.peer,
                )
            self._grants.fail_halted(u, err, keep_cause=u is not t)

    async def end_all(self) -> None:
        """Cancel every grant; return once nothing more can land in them (receives
        in flight are waited for up to ``drain_timeout``, then their worker halts)."""
        grants = self._grants
        for t in list(grants.transfers.values()):
            exc = TransferCancelled("receiver closed", transfer_id=t.tid)
            grants.finish(t, TransferState.CANCELLED, exc, Code.CANCELLED)
        draining = [t for t in grants.transfers.values() if t.draining]
        if draining:
            with trio.move_on_after(grants.drain_timeout):
                for t in draining:
                    await t.done.wait()
            for t in draining:
                if t.draining:  # halts its session's worker (or, without those, all)
                    self.close_path(t, "the receiver is closing")

    async def close_endpoints(self, pending: list[int]) -> None:
        """Close every endpoint to a sender while the workers are still progressed,
        waiting (bounded) for the flushes of those whose worker runs; ``pending``
        are the public worker's closes of handshakes in progress."""
        closing = self._sessions.close_all_eps()
        closing += [(self._svc.worker, h) for h in pending]
        live: list[tuple[UcxWorker, int]] = [
            (w, h) for w, h in closing if h and not w.halted and not w.closed
        ]
        with trio.move_on_after(K_EP_CLOSE_S):
            while any(w.in_flight(h) for w, h in live):
                await trio.sleep(0.002)
