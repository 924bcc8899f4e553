"""The local path's sending end, :class:`UcxSender`, composed of its parts:

* :class:`~._service.UcxService`: the sender's UCX worker, its nursery,
  control inboxes and sends;
* :class:`~._tx_session.Joiner` and :class:`~._tx_session.TxSession`: joining
  the receiver (HELLO, the handshake, ACCEPT) and the session's tags and
  endpoints;
* :class:`~._tx_transfers.SendQueue`: the transfers and the pump that sends
  their pieces.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..._errors import LocalProtocolError, TransportError
from ...kv import ByteRanges
from .._auth import K_AUTH_TIMEOUT_S
from .._base import Grant, ProgressCallback, Sender
from ._addressing import K_ADDR_PREFIX, parse_address, tls_for_peer, unb64
from ._ep_info import endpoint_transports
from ._messages import K_INLINE_MAX, Ctl, pack
from ._service import K_POLL_MAX_BYTES, UcxService, flat_views
from ._tx_session import Joiner, TxSession
from ._tx_transfers import SendQueue, UcxTransfer

__all__ = ["UcxSender", "UcxSenderStatistics"]

K_LENS_CACHE = 1024  # decoded grant piece lists kept by a sender
K_SEND_DRAIN_S = 2.0  # a closing sender lets sends in flight finish for this long


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
    poll_rounds: int = 0  # busy-poll rounds (low-latency mode, or a lingering wait)
    linger_rounds: int = 0  # idle progress rounds while lingering (back-to-back transfers)


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


class UcxSender(Sender):
    """The sending end of the local path, bound to one receiver.

    ``async with`` connects and waits until the receiver admits this sender
    (with a ``secret``: after the challenge-response in both directions).

    Args:
        address: the receiver's :attr:`UcxReceiver.address`.
        tls: UCX transports (default: ``UCX_TLS``, else ``tcp,sm,self``). A
            receiver in another network namespace gets no shared-memory
            transports (they never deliver across namespaces).
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
        peer_netns, peer_address = parse_address(self.peer)
        svc = UcxService(
            tls_for_peer(tls, peer_netns),
            spin_us,
            secret,
            auth_timeout,
            busy_poll_us,
            busy_poll_max_bytes,
        )
        self._service = svc
        self.sender_id = secrets.randbits(32)
        self._session = TxSession(self.sender_id, self.peer)
        self._queue = SendQueue(svc, self._session, max_inflight)
        self._joiner = Joiner(
            svc, self._session, peer_address, error_handling, self._queue.on_reply
        )
        self._lens_cache: dict[str, tuple[Any, list[int], list[int]]] = {}

    @property
    def secret(self) -> bytes | None:
        """The data-plane secret, if any."""
        return self._service.secret

    @property
    def auth_timeout(self) -> float:
        """Seconds to wait for admission."""
        return self._service.auth_timeout

    @property
    def error_handling(self) -> bool:
        """Whether this sender's endpoints have UCX error handling (decided in
        ``__aenter__``)."""
        return self._session.error_handling

    @property
    def max_inflight(self) -> int:
        """Pieces posted to UCX at once (over all transfers)."""
        return self._queue.max_inflight

    @property
    def ctrl_dropped(self) -> int:
        """Control messages dropped as malformed."""
        return self._service.ctrl_dropped

    async def __aenter__(self) -> UcxSender:
        await self._service.start()
        try:
            await self._joiner.join()
        except BaseException:
            await self._service.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every transfer, say BYE and close (each step bounded).

        Sends in flight (UCX cannot cancel a send) are let finish for up to 2 s,
        so the receiver's drain completes instead of timing out.
        """
        svc, s, q = self._service, self._session, self._queue
        q.cancel_all("sender closed")
        if svc.is_open and q.inflight > 0:
            # UCX cannot cancel a send: let those in flight finish (bounded), so
            # the receiver's drain completes instead of timing out and closing
            # its path (see UcxReceiver, drain_timeout).
            with trio.move_on_after(K_SEND_DRAIN_S):
                while q.inflight > 0:
                    await trio.sleep(0.002)
        if svc.is_open and s.open_ok and _ep_alive(s.data_ep):
            # The session ends: the receiver retires its worker for us.
            svc.send_ctrl(s.data_ep, s.tags.rx_tag, pack(Ctl.BYE, s.sender_id, 0))
        eps = [s.data_ep] if s.data_ep is not s.ep else []
        for ep in [*eps, s.ep]:
            await self._close_ep(ep)
        await svc.close()
        s.ep = s.data_ep = None  # closed (or closing): never closed again

    async def _close_ep(self, ep: Any) -> None:
        """Close ``ep`` gracefully (bounded): it flushes what UCX still holds for
        the receiver; without it a process exiting right after a cancel could
        cut a rendezvous short, and the receiver's drain would time out."""
        if not self._service.is_open or ep is None or not _ep_alive(ep):
            return
        w = self._service.worker
        # Started even on a halted worker (then never progressed, not waited
        # for): otherwise the endpoint's destructor would progress it, without
        # a bound (see UcxWorker.close_endpoint).
        handle = w.close_endpoint(ep)
        if not handle or w.halted:
            return
        with trio.move_on_after(K_SEND_DRAIN_S):
            while w.in_flight(handle):
                w.wake()  # progress now
                await trio.sleep(0.002)

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
        s, q = self._session, self._queue
        if not s.open_ok:
            raise LocalProtocolError("UcxSender used outside `async with`")
        if s.halted_error:
            raise TransportError(s.halted_error, transfer_id=grant.transfer_id, peer=self.peer)
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
        if grant.transfer_id in q.transfers:
            raise LocalProtocolError("transfer already running", transfer_id=grant.transfer_id)
        inline = ready and flags == "i" and grant.total <= K_INLINE_MAX
        early = ready and not inline and grant.total > 0
        mvs = flat_views(views)
        if early:
            # START first: the receiver's wake-up overlaps the bookkeeping
            # below, and the first piece usually arrives while the receiver is
            # still handling START (docs/local.md, *Per-transfer cost*).
            q.send_start(grant.transfer_id)
        elif inline and grant.total > 0:  # the same for a small transfer's DATA
            q.send_data(grant.transfer_id, mvs, ranges)
        src_len = ranges.length.tolist()  # plain lists: cheaper than NumPy for few pieces
        bufs, offs = ranges.buffer.tolist(), ranges.offset.tolist()
        if 0 in src_len:
            nz = [i for i, n in enumerate(src_len) if n]
            src_len = [src_len[i] for i in nz]
            bufs, offs = [bufs[i] for i in nz], [offs[i] for i in nz]
        if src_len == length_list:  # the usual case: one source range per piece
            sources = [[(b, o, n)] for b, o, n in zip(bufs, offs, length_list, strict=True)]
        else:
            sources = [ranges.pieces(bounds[i], bounds[i + 1]) for i in range(lengths.size)]
        t = UcxTransfer(q, grant, sources, bounds, mvs, priority, progress)
        t.started = early
        q.add(t, timeout)
        if inline and sources:
            q.sent_inline(t)
        elif ready and sources:  # START left already, or goes with the first piece (pump)
            t.mark_ready(0, grant.total)
        else:  # START now: the receiver can report its own deadline, cancel or DONE
            q.start(t)
        return t

    def _piece_list(self, lens: str, total: int) -> tuple[Any, list[int], list[int]]:
        """A grant's piece lengths, their logical bounds, and the lengths as a list.

        Grants of the same shape repeat (one per request and layer), so the
        decoded lists are cached by their encoding.
        """
        hit = self._lens_cache.get(lens)
        if hit is None:
            lengths = np.frombuffer(unb64(lens), "<i8").astype(np.int64)
            if (lengths <= 0).any():
                raise LocalProtocolError("the grant's piece list has empty pieces")
            bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
            hit = (lengths, bounds, lengths.tolist())
            if len(self._lens_cache) >= K_LENS_CACHE:
                self._lens_cache.clear()
            self._lens_cache[lens] = hit
        if int(hit[1][-1]) != total:
            raise LocalProtocolError("the grant's piece list does not add up")
        return hit

    def transports(self) -> tuple[str, ...]:
        """The UCX transports (``transport/device``) of this sender's data
        endpoint, as UCX chose them for this receiver, e.g. ``("tcp/eth0",)``
        between two network namespaces; empty before ``__aenter__`` or after
        ``aclose``."""
        return endpoint_transports(self._session.data_ep or self._session.ep)

    def statistics(self) -> UcxSenderStatistics:
        q, w = self._queue, self._service.worker
        return UcxSenderStatistics(
            q.bytes,
            q.staged,
            q.pieces,
            len(q.transfers),
            q.ok,
            w.epoll_waits,
            q.inline,
            w.poll_rounds,
            w.linger_rounds,
        )
