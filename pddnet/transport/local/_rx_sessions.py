"""The receiver's sender sessions: each admitted sender, its tags, endpoints and
UCX worker, and how a session ends.

**Dead senders: one UCX worker per sender session** (the default; see
docs/local.md). An admitted sender gets a worker of its own (sharing the
receiver's UCX context): its data and control messages arrive there, the
endpoint back to it belongs to it, and halting it (a drain deadline) stops
only that sender. Without session workers every session uses the public
worker, as before.

A session is *dropped* when it is no longer admitted (its BYE, eviction, a
lost peer, a halt); its worker is *retired* (closed) once no receive posted on
it can still write into granted memory. A halted worker is never progressed
nor destroyed while the receiver lives (destroying one might progress it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from ..._errors import PeerUnavailable, TransportError
from ._auth import K_TAG_CTRL_RX, SessionTags
from ._messages import Code, Ctl, pack, pack_done
from ._rx_grants import RxGrants, RxTransfer
from ._service import Inbox, UcxService
from ._worker import UcxWorker

__all__ = ["Session", "SessionTable"]

log = logging.getLogger("pddnet.transport.local")

K_MAX_SESSIONS = 1024  # admitted senders a receiver keeps (the oldest idle one goes)
# With a UCX worker per session (the default) each costs ~11 fds (epoll, eventfd,
# tcp sockets, shared-memory FIFO) and ~4 MB (measured), so fewer are kept; an
# admission beyond this evicts the oldest idle session or, all busy, is refused.
K_MAX_SESSION_WORKERS = 64
K_BYE_GRACE_S = 0.5  # a session's worker outlives its BYE this long (the sender's flush)

# A session's control message: (session, kind, sender id, transfer id, code, blob).
SessionHandler = Callable[["Session", Ctl, int, int, int, bytes], None]


class Session:
    """An admitted sender: its endpoint, its session's tags and its UCX worker.

    With per-session workers (the default) ``worker`` is the session's own:
    its data and control messages arrive there, ``ep`` (back to the sender)
    belongs to it, and halting it (a drain deadline) stops only this sender.
    """

    __slots__ = ("dropped", "ep", "hello_ep", "inbox", "scope", "sid", "tags", "worker")

    def __init__(self, sid: int, ep: Any, tags: SessionTags, worker: UcxWorker) -> None:
        self.sid = sid
        self.ep = ep
        self.tags = tags
        self.inbox: Inbox | None = None  # its control inbox, if it has its own
        self.worker = worker
        self.hello_ep: Any = None  # the public worker's endpoint (handshake, ACCEPT)
        self.scope = trio.CancelScope()  # its worker's progress task
        self.dropped = False  # no longer admitted: its worker goes once nothing is posted


class SessionTable:
    """The receiver's sessions: admitted, retiring (dropped, worker still up), halted.

    Args:
        service: the receiver's UCX end (its worker is the public one).
        grants: the receiver's transfers (whether a worker is still written to).
        session_workers: give each session its own UCX worker.
        on_message: handles a session's control messages (its inbox).
    """

    def __init__(
        self,
        service: UcxService,
        grants: RxGrants,
        session_workers: bool,
        on_message: SessionHandler,
    ) -> None:
        self._svc = service
        self._grants = grants
        self.session_workers = session_workers
        self._on_message = on_message
        self.live: dict[int, Session] = {}  # admitted, oldest first
        self.retiring: dict[int, Session] = {}  # dropped sessions whose worker still runs
        self.halted: list[UcxWorker] = []  # halted session workers: kept, never progressed
        self.rx_tags: set[int] = set()  # the admitted sessions' inbox tags
        self.last_worker: UcxWorker | None = None  # where the latest START arrived
        self.admissions = 0
        self.retired_epoll = 0
        self._done_out: dict[int, list[int]] = {}
        self.done_msgs = 0

    def workers(self) -> list[UcxWorker]:
        """Every worker the receiver progresses (or keeps halted), the public one first."""
        pub = self._svc.worker
        out = [pub]
        out += [s.worker for s in self.live.values() if s.worker is not pub]
        out += [s.worker for s in self.retiring.values()]
        return out + self.halted

    def session_worker_count(self) -> int:
        """UCX workers of admitted (or ending) sessions, halted ones too."""
        pub = self._svc.worker
        own = sum(s.worker is not pub for s in self.live.values())
        return own + len(self.retiring) + len(self.halted)

    # -------------------------------------------------------------- admission
    @property
    def bound(self) -> int:
        """How many sessions (admitted and retiring) the receiver keeps."""
        return K_MAX_SESSION_WORKERS if self.session_workers else K_MAX_SESSIONS

    def make_room(self) -> bool:
        """Whether one more session fits, evicting the oldest idle one if need be."""
        return len(self.live) + len(self.retiring) < self.bound or self._evict()

    def add(
        self, sender: int, ep: Any, tags: SessionTags, errh: bool = False, address: bytes = b""
    ) -> None:
        """Admit a sender: with session workers, a UCX worker of its own for its
        data and control messages, whose address goes out in the ACCEPT."""
        svc = self._svc
        if not self.session_workers:
            s = Session(sender, ep, tags, svc.worker)
            if tags.rx_tag != K_TAG_CTRL_RX:  # an authenticated session: its own inbox
                s.inbox = svc.listen(tags.rx_tag, lambda *m: self._on_message(s, *m))
                self.rx_tags.add(tags.rx_tag)
            self.live[sender] = s
            self.admissions += 1
            svc.send_ctrl(ep, tags.tx_tag, pack(Ctl.ACCEPT, sender, 0))
            return
        try:
            w = UcxWorker(spin_us=svc.spin_us, context_of=svc.worker)
            back = w.connect(address, error_handling=errh)
        except (TransportError, PeerUnavailable) as exc:
            log.warning("no UCX worker for sender %08x: %s", sender, exc)
            svc.worker.close_endpoint(ep)
            return
        s = Session(sender, back, tags, w)
        s.hello_ep = ep
        # Its inbox is posted before the ACCEPT leaves: a START sent right after
        # it finds the receive (or waits in this worker's unexpected queue).
        s.inbox = svc.listen(tags.rx_tag, lambda *m: self._on_message(s, *m), w)
        self.rx_tags.add(tags.rx_tag)
        self.live[sender] = s
        self.admissions += 1
        svc.nursery.start_soon(self._run, s)
        svc.send_ctrl(ep, tags.tx_tag, pack(Ctl.ACCEPT, sender, 0, 0, w.address))

    @staticmethod
    async def _run(s: Session) -> None:
        with s.scope:
            await s.worker.run()

    def _evict(self) -> bool:
        """Drop the oldest idle session (or a retiring one); whether one went."""
        for r in list(self.retiring.values()):  # ending already: retire it now if idle
            if self.retire_if_idle(r):
                return True
        busy = self._grants.busy_senders()
        for sid, s in self.live.items():  # oldest first
            if sid not in busy:
                self.drop(s)
                return True
        return False

    # ---------------------------------------------------------------- replies
    def tell(self, t: RxTransfer, code: int | None) -> None:
        """Tell ``t``'s sender (if still admitted) its end: DONE, or CANCEL with ``code``."""
        s = self.live.get(t.sender) if t.sender is not None else None
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
        msg = pack(Ctl.CANCEL, s.sid, t.tid, code)
        self._svc.send_ctrl(s.ep, s.tags.tx_tag, msg, s.worker)

    def _flush_done(self, sender: int) -> None:
        tids = self._done_out.pop(sender, None)
        s = self.live.get(sender)
        if s is not None and tids:
            self._send_done(s, tids)

    def _send_done(self, s: Session, tids: list[int]) -> None:
        for msg in pack_done(s.sid, tids):
            self._svc.send_ctrl(s.ep, s.tags.tx_tag, msg, s.worker)
            self.done_msgs += 1

    def poll_worker(self, t: RxTransfer) -> UcxWorker:
        """The worker a low-latency wait on ``t`` polls: its session's, or (not
        bound yet) the one the latest START came to, or else the only session's."""
        if t.sender is not None:
            return t.worker
        if self.last_worker is not None:
            return self.last_worker
        if len(self.live) == 1:
            return next(iter(self.live.values())).worker
        return self._svc.worker

    # -------------------------------------------------------------------- end
    def drop(self, s: Session, *, retire: bool = True) -> None:
        """The sender is no longer admitted; its worker is retired once nothing is posted."""
        del self.live[s.sid]
        s.dropped = True
        self.rx_tags.discard(s.tags.rx_tag)
        if s.inbox is not None:
            self._svc.unlisten(s.inbox)
        if self.last_worker is s.worker:
            self.last_worker = None
        if retire and s.worker is not self._svc.worker and not s.worker.halted:
            self.retiring[s.sid] = s
            self.retire_if_idle(s)

    def on_bye(self, s: Session) -> None:
        """``s`` ends its session: its running transfers are cancelled, its
        endpoints closed, and its worker retired after a grace (its flush)."""
        if self.live.get(s.sid) is not s:
            return
        self.drop(s, retire=False)  # nothing more is told to it
        self._grants.end_session(s)
        self.close_eps(s)  # flushed while its worker still runs (the grace)
        if s.worker is not self._svc.worker and not s.worker.halted:
            self.retiring[s.sid] = s  # after its flush, or once its drains end
            self._svc.nursery.start_soon(self._retire_later, s)

    async def _retire_later(self, s: Session) -> None:
        # A BYE: the sender still flushes its endpoint to this worker; let it.
        await trio.sleep(K_BYE_GRACE_S)
        if self.retiring.get(s.sid) is s:
            self.retire_if_idle(s)

    def on_released(self, t: RxTransfer) -> None:
        """``t``'s end was reported: a dropped session of it may retire now."""
        s = t.session
        if s is not None and s.dropped and self.retiring.get(s.sid) is s:
            self.retire_if_idle(s)

    def retire_if_idle(self, s: Session) -> bool:
        """Stop and drop a dropped session's worker if no receive of it can still
        write into granted memory (running or draining transfers); whether it went."""
        w = s.worker
        if w.closed:
            return True
        if w.halted or self._grants.live_on(w):
            return False
        if self.retiring.get(s.sid) is s:
            del self.retiring[s.sid]
        self.close_eps(s)  # (at its BYE already, usually)
        s.scope.cancel()
        self.retired_epoll += w.epoll_waits
        w.close()  # its requests are dropped; the UCX worker goes with the last reference
        self._grants.detach(w)
        s.inbox = None
        return True

    def halt(self, w: UcxWorker, s: Session | None, tid: int) -> None:
        """Halt session worker ``w`` (of ``s``, if still known) for good: tell the
        sender (``tid`` is the transfer that could not drain) and drop the session.

        The worker is never progressed again, so nothing more lands through it;
        it is kept (not destroyed) until the receiver closes.
        """
        w.halt()
        self.halted.append(w)
        if s is None:
            return
        pub = self._svc.worker
        if s.hello_ep is not None and not pub.halted:
            # Tell the sender through the public worker (tag matching ignores
            # which worker sent it), else it would wait for its own deadlines.
            self._svc.send_ctrl(
                s.hello_ep, s.tags.tx_tag, pack(Ctl.CANCEL, s.sid, tid, Code.HALTED)
            )
        s.scope.cancel()  # its progress task: a halted worker has nothing to do
        # Its worker's endpoint is never progressed (its destructor must not
        # progress it either); the public one's close flushes the CANCEL first.
        self.close_eps(s)
        if self.retiring.get(s.sid) is s:
            del self.retiring[s.sid]
        if self.live.get(s.sid) is s:
            self.drop(s)

    def close_eps(self, s: Session) -> list[tuple[UcxWorker, int]]:
        """Start closing ``s``'s endpoints (nothing more is sent to it), without
        blocking: see :meth:`UcxWorker.close_endpoint`. A halted worker's
        endpoint is closed without progressing that worker.

        Returns:
            The closes still in flight, as (worker, handle).
        """
        pub = self._svc.worker
        out: list[tuple[UcxWorker, int]] = []
        if s.ep is not None:
            out.append((s.worker, s.worker.close_endpoint(s.ep)))
        if s.hello_ep is not None and s.hello_ep is not s.ep:
            out.append((pub, pub.close_endpoint(s.hello_ep)))
        s.ep = s.hello_ep = None
        return [(w, h) for w, h in out if h]

    def close_all_eps(self) -> list[tuple[UcxWorker, int]]:
        """Start closing every session's endpoints; the closes still in flight."""
        closing: list[tuple[UcxWorker, int]] = []
        for s in [*self.live.values(), *self.retiring.values()]:
            closing += self.close_eps(s)
        return closing
