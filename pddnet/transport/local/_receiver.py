"""The local path's receiving end, :class:`UcxReceiver`, composed of its parts:

* :class:`~._service.UcxService`: the public UCX worker, its nursery, control
  inboxes and sends;
* :class:`~._rx_admission.Admission`: HELLO, the handshake and ACCEPT;
* :class:`~._rx_sessions.SessionTable`: admitted senders, their workers and
  replies (DONE, CANCEL);
* :class:`~._rx_grants.RxGrants`: the grants and the START / data / DONE exchange;
* :class:`~._rx_teardown.Teardown`: lost senders, stuck drains and closing;
* :class:`~._rx_sweep.Sweeper`: UCX's unexpected queue.

Tags (64 bits)::

    0x8 << 60 | ((transfer_id << 24 | piece) ^ mask)   data (ids < 2**32, pieces < 2**24)
    0xC << 60                                  receiver's public inbox (HELLO, AUTH)
    0xD << 60 | sender_id                      a sender's public inbox (AUTH)
    0xE << 60 | 60 session bits                a session's inbox on the receiver
    0xF << 60 | 60 session bits                a session's inbox on the sender

Without a secret the mask is 0 and the public inboxes carry everything. The
control messages are described in :mod:`._messages`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._errors import AuthError, LocalProtocolError, RemoteProtocolError, TransportError
from ...kv import ByteRanges
from .._auth import K_AUTH_TIMEOUT_S
from .._base import Grant, Receiver
from ._addressing import K_ADDR_PREFIX, b64, netns_id, tls_without_peer_reads
from ._messages import Ctl
from ._rx_admission import Admission
from ._rx_grants import RxGrants, RxTransfer
from ._rx_sessions import Session, SessionTable
from ._rx_sweep import Sweeper
from ._rx_teardown import Teardown
from ._service import K_POLL_MAX_BYTES, UcxService

__all__ = ["UcxReceiver", "UcxReceiverStatistics"]

# A grant that ends (cancelled, failed, timed out, receiver closing) is reported
# only once every receive posted into it completed or UCX confirmed it
# cancelled; past this long the receiver halts a UCX worker (drain_timeout).
K_DRAIN_TIMEOUT_S = 5.0


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


class UcxReceiver(Receiver):
    """The receiving end of the local path: grants memory and pre-posts receives into it.

    Use as ``async with UcxReceiver() as rx``; pass :attr:`address` (``ucx:NETNS:B64``:
    its network namespace and worker address) to the senders.

    Args:
        tls: UCX transports (default: ``UCX_TLS``, else ``tcp,sm,self``).
        spin_us: see :class:`~pddnet.transport.local.UcxWorker`.
        secret: if set (at least 16 bytes), a sender must prove it before the
            receiver posts any receive for it (see :mod:`._rx_admission`).
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
        svc = UcxService(tls, spin_us, secret, auth_timeout, busy_poll_us, busy_poll_max_bytes)
        self._service = svc
        self._grants = RxGrants(
            svc,
            drain_timeout,
            tell=self._tell,
            peer_lost=self._peer_lost,
            stuck=self._stuck,
            released=self._released,
        )
        self._sessions = SessionTable(svc, self._grants, session_workers, self._on_session)
        self._admission = Admission(svc, self._sessions, self._on_session)
        self._teardown = Teardown(svc, self._grants, self._sessions)
        self._sweeper = Sweeper(svc, self._sessions, self._grants)

    # The parts are made in order (grants first); these forward their hooks.
    def _tell(self, t: RxTransfer, code: int | None) -> None:
        self._sessions.tell(t, code)

    def _peer_lost(self, t: RxTransfer, i: int, n: int, err: BaseException) -> None:
        self._teardown.peer_lost(t, i, n, err)

    def _stuck(self, t: RxTransfer, why: str) -> None:
        self._teardown.close_path(t, why)

    def _released(self, t: RxTransfer) -> None:
        self._sessions.on_released(t)

    @property
    def secret(self) -> bytes | None:
        """The data-plane secret, if any."""
        return self._service.secret

    @property
    def auth_timeout(self) -> float:
        """Seconds a sender has to finish the handshake."""
        return self._service.auth_timeout

    @property
    def drain_timeout(self) -> float:
        """See the class arguments."""
        return self._grants.drain_timeout

    @property
    def session_workers(self) -> bool:
        """Whether each admitted sender gets its own UCX worker."""
        return self._sessions.session_workers

    @property
    def path_error(self) -> TransportError | None:
        """Why the whole receiver was halted (a drain deadline), else None."""
        return self._teardown.path_error

    @property
    def auth_failures(self) -> int:
        """Handshakes failed, skipped or timed out."""
        return self._admission.auth_failures

    @property
    def auth_errors(self) -> deque[AuthError]:
        """The last handshake failures (up to 16)."""
        return self._admission.auth_errors

    @property
    def ctrl_dropped(self) -> int:
        """Control messages dropped as malformed."""
        return self._service.ctrl_dropped

    async def __aenter__(self) -> UcxReceiver:
        svc = self._service
        await svc.start()
        self.address = f"{K_ADDR_PREFIX}{netns_id()}:{b64(svc.worker.address)}"
        self._admission.listen()
        svc.nursery.start_soon(self._sweeper.run)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every grant and close; returns once nothing more can land in them.

        Receives still in flight are waited for up to ``drain_timeout``; then
        the worker is halted and those transfers fail with TransportError.
        """
        if not self._service.is_open:
            return
        await self._teardown.end_all()
        await self._teardown.close_endpoints(self._admission.close_pending())
        await self._service.close(self._sessions.workers)

    def _on_session(
        self, s: Session, kind: Ctl, sender: int, tid: int, code: int, blob: bytes
    ) -> None:
        """An admitted sender's control message (its session inbox)."""
        if sender != s.sid:
            raise RemoteProtocolError(f"session of {s.sid:08x} used by {sender:08x}")
        if kind is Ctl.BYE:
            self._sessions.on_bye(s)
            return
        t = self._grants.transfers.get(tid)
        if t is None:
            return
        if s.worker is not self._service.worker:
            self._sessions.last_worker = s.worker
        if kind is Ctl.START or kind is Ctl.DATA:
            if not self._grants.on_start(t, s, kind, blob):
                self._admission.unauthenticated += 1
        elif kind is Ctl.CANCEL:
            self._grants.on_cancel(t, s)

    # ------------------------------------------------------------------ grant
    def grant(
        self,
        views: Sequence[Any],
        ranges: ByteRanges,
        *,
        num_layers: int | None = None,
        timeout: float | None = None,
    ) -> Grant:
        """Grant ``ranges`` of ``views``: receives are posted into them when the
        sender's START names the transfer.

        Raises:
            LocalProtocolError: before ``async with``, or for more than 2**24 ranges.
            TransportError: if the receiver was halted (a drain deadline passed).
        """
        if not self._service.is_open:
            raise LocalProtocolError("UcxReceiver used outside `async with`")
        if self.path_error is not None:
            raise TransportError(f"this UCX receiver is closed: {self.path_error}")
        return self._grants.grant(self.address, views, ranges, num_layers, timeout)

    async def wait_transfer(self, transfer_id: int) -> None:
        """Wait until every granted byte landed. Cancelling the wait leaves the grant."""
        t = self._grants.get(transfer_id)
        await self._service.wait_small(t.done, t.total, self._sessions.poll_worker(t))
        if t.error is not None:
            raise t.error

    async def wait_layer(self, transfer_id: int, layer: int) -> None:
        """Wait until every byte of ``layer`` landed (raises like :meth:`wait_transfer`)."""
        t = self._grants.get(transfer_id)
        if not t.layer_events:
            raise LocalProtocolError("grant was made without num_layers", transfer_id=transfer_id)
        svc = self._service
        if svc.should_poll(t.total):
            await svc.poll_wait(t.layer_events[layer], self._sessions.poll_worker(t))
        else:
            await t.layer_events[layer].wait()
        if t.error is not None:
            raise t.error

    def cancel(self, transfer_id: int) -> None:
        """Revoke the grant: posted receives are cancelled, the sender told. Idempotent.

        Receives whose data is already in flight cannot be cancelled by UCX:
        ``wait_transfer`` raises only once they stopped (see ``drain_timeout``),
        so reuse the blocks after ``wait_transfer``/``wait_layer`` raised, not
        right after this call.
        """
        self._grants.cancel(transfer_id)

    def statistics(self) -> UcxReceiverStatistics:
        g, s = self._grants, self._sessions
        return UcxReceiverStatistics(
            g.bytes,
            g.posted,
            g.running(),
            g.ok,
            g.failed,
            s.retired_epoll + sum(w.epoll_waits for w in s.workers()),
            s.done_msgs,
            len(s.live),
            self._admission.auth_failures,
            self._admission.unauthenticated,
            g.draining(),
            self._sweeper.dropped,
            self._sweeper.dropped_bytes,
            g.drains,
            self.path_error is not None,
            self._teardown.peers_lost,
            s.session_worker_count(),
            len(s.halted),
            s.admissions,
        )
