"""Sans-IO chunk scheduler of the WAN sender: striping, priority, hedging, recovery.

Theory of operation
-------------------
Streams *pull*: whenever a stream can accept more bytes (its socket reports
writable below ``TCP_NOTSENT_LOWAT``) its driver calls :meth:`Scheduler.next_chunk`.
Nothing is assigned to a stream in advance, so a stream stalled by loss simply
pulls less, and the others carry the transfer (no static round-robin, no
head-of-line blocking between streams).

Which chunk: transfers are ordered by priority class (higher first), then by
remaining unacknowledged bytes (fewest first), then by arrival; ``policy="fifo"``
orders by arrival only (the baseline the benchmark compares with). Within a
transfer, chunks whose stream died come first (``retry``), then fresh bytes in
the order they became ready. A fresh chunk is ``chunk_size`` bytes, or less for
a small remainder: ``remaining / active_streams`` (at least ``min_chunk``), so
a 256 KiB transfer is striped over several streams instead of queueing on one.

Chunk boundaries never change once cut: a resent chunk is byte-for-byte the
same ``[lo, hi)``, which lets the receiver recognise duplicates exactly.

Tail hedging: when no chunk is waiting anywhere, an idle stream may resend a
chunk that has been in flight on one other stream for longer than
``hedge_factor`` times the smoothed acknowledgement latency (at least
``min_hedge_s``). A high-priority transfer (``priority > 0``) with nothing left
to cut hedges its slow chunks *before* lower-ranked transfers get fresh
chunks, so a small urgent transfer does not wait out a loss recovery on one
stream. Streams in ``express`` (opt-in) carry only such transfers, never
bulk, so an urgent chunk finds a socket with nothing queued in it. The first
verified copy wins; the receiver acknowledges the other one as a duplicate.
At most ``max_copies`` copies are in flight.

Recovery: :meth:`on_stream_failed` puts every unacknowledged chunk that was only
on that stream back at the front of its transfer's queue. Deadlines are timers
(:meth:`get_timer` / :meth:`handle_timer`), as in aioquic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..._errors import LocalProtocolError, PddnetError, TransferCancelled, TransferTimeout
from .._intervals import IntervalSet

__all__ = ["Chunk", "Scheduler", "TransferCompleted", "TransferFailed", "TransferProgress"]

K_SMALL_CHUNK = 256 << 10  # ack latency is tracked apart for chunks up to this size


@dataclass(eq=False, slots=True)
class Chunk:
    """One chunk: logical ``[lo, hi)`` of a transfer, and where copies are in flight."""

    transfer_id: int
    lo: int
    hi: int
    streams: set[int] = field(default_factory=set)
    sent_at: float = 0.0
    sends: int = 0
    acked: bool = False
    checksum: int | None = None  # computed on first send, reused by resends

    @property
    def length(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class TransferCompleted:
    transfer_id: int


@dataclass(frozen=True, slots=True)
class TransferFailed:
    transfer_id: int
    error: PddnetError


@dataclass(frozen=True, slots=True)
class TransferProgress:
    transfer_id: int
    acked: int
    total: int


Event = TransferCompleted | TransferFailed | TransferProgress


@dataclass(eq=False, slots=True)
class _Tx:
    tid: int
    total: int
    priority: int
    seq: int
    deadline: float | None
    ready: IntervalSet = field(default_factory=IntervalSet)
    unsent: deque[list[int]] = field(default_factory=deque)  # [lo, hi] pairs, mutable
    unsent_bytes: int = 0
    retry: deque[Chunk] = field(default_factory=deque)
    inflight: dict[int, Chunk] = field(default_factory=dict)  # lo -> chunk
    acked: int = 0

    def has_work(self) -> bool:
        return bool(self.retry or self.unsent)


class Scheduler:
    """Which chunk each stream sends next (sans-IO).

    Args:
        chunk_size: largest chunk payload.
        min_chunk: smallest chunk cut from a large-enough remainder.
        policy: ``"priority"`` (class, then fewest remaining bytes) or ``"fifo"``.
        hedge_factor: hedge a chunk in flight this many smoothed ack latencies.
        urgent_hedge_factor: the same for ``priority > 0`` transfers (sooner: a
            lost tail packet of a small chunk otherwise waits for a TCP timeout).
        min_hedge_s: never hedge a chunk younger than this.
        max_copies: most copies of one chunk in flight (1 disables hedging).
    """

    def __init__(
        self,
        chunk_size: int = 1 << 20,
        *,
        min_chunk: int = 64 << 10,
        policy: str = "priority",
        hedge_factor: float = 2.0,
        urgent_hedge_factor: float = 1.0,
        min_hedge_s: float = 0.02,
        max_copies: int = 2,
    ) -> None:
        if policy not in ("priority", "fifo"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.chunk_size = chunk_size
        self.min_chunk = min(min_chunk, chunk_size)
        self.policy = policy
        self.hedge_factor = hedge_factor
        self.urgent_hedge_factor = urgent_hedge_factor
        self.min_hedge_s = min_hedge_s
        self.max_copies = max_copies
        self.active_streams = 1
        # streams reserved for priority > 0 transfers (the express lane): bulk never
        # queues bytes on them, so an urgent chunk finds an empty socket at once
        self.express: frozenset[int] = frozenset()
        self._txs: dict[int, _Tx] = {}
        self._seq = 0
        self._events: list[Event] = []
        # EWMA of ack latency, seconds, for small and for large chunks: a 64 KiB
        # chunk is acknowledged much sooner than a 1 MiB one on a busy stream
        self._latency: dict[bool, float | None] = {False: None, True: None}
        # counters
        self.bytes_sent = 0
        self.bytes_resent = 0
        self.bytes_acked = 0
        self.chunks_hedged = 0

    # -- transfers -------------------------------------------------------------

    def add_transfer(
        self, transfer_id: int, total: int, *, priority: int = 0, deadline: float | None = None
    ) -> None:
        """Register a transfer with nothing ready yet (see :meth:`mark_ready`).

        Raises:
            LocalProtocolError: if the id is already running.
        """
        if transfer_id in self._txs:
            raise LocalProtocolError(
                f"transfer {transfer_id} already running", transfer_id=transfer_id
            )
        self._seq += 1
        self._txs[transfer_id] = _Tx(transfer_id, total, priority, self._seq, deadline)
        if total == 0:
            del self._txs[transfer_id]
            self._events.append(TransferCompleted(transfer_id))

    def mark_ready(self, transfer_id: int, lo: int, hi: int) -> None:
        """Logical ``[lo, hi)`` of the source may be sent (idempotent per byte).

        Raises:
            LocalProtocolError: outside ``[0, total)`` or for an unknown transfer.
        """
        tx = self._txs.get(transfer_id)
        if tx is None:
            raise LocalProtocolError(
                f"transfer {transfer_id} is not running", transfer_id=transfer_id
            )
        if not 0 <= lo <= hi <= tx.total:
            raise LocalProtocolError(
                f"ready range [{lo}, {hi}) outside [0, {tx.total})", transfer_id=transfer_id
            )
        pos = lo
        while (gap := tx.ready.first_gap(pos, hi)) is not None:
            tx.unsent.append([gap[0], gap[1]])
            tx.unsent_bytes += gap[1] - gap[0]
            pos = gap[1]
        tx.ready.add(lo, hi)

    def cancel(self, transfer_id: int, error: PddnetError | None = None) -> bool:
        """Drop a transfer; emits TransferFailed. Returns whether it was running."""
        if transfer_id not in self._txs:
            return False
        err = error or TransferCancelled("transfer cancelled", transfer_id=transfer_id)
        self._fail(transfer_id, err)
        return True

    def _fail(self, tid: int, err: PddnetError) -> None:
        del self._txs[tid]
        self._events.append(TransferFailed(tid, err))

    def running(self) -> list[int]:
        return list(self._txs)

    def remaining(self, transfer_id: int) -> int:
        tx = self._txs[transfer_id]
        return tx.total - tx.acked

    def bytes_ahead(self, nbytes: int, priority: int = 0) -> int:
        """Bytes that go out before a transfer of ``nbytes`` at ``priority``
        added now would finish: the unacknowledged bytes of every transfer
        ranked ahead of it (the ``policy``'s order; ready or not yet), and
        the chunks of the others already in flight (cut and on a socket)."""
        fifo = self.policy == "fifo"
        ahead = 0
        for tx in self._txs.values():
            left = tx.total - tx.acked
            if fifo or tx.priority > priority or (tx.priority == priority and left <= nbytes):
                ahead += left
            else:
                ahead += sum(ch.hi - ch.lo for ch in tx.inflight.values())
        return ahead

    # -- streams ---------------------------------------------------------------

    def _key(self, tx: _Tx) -> tuple[int, ...]:
        if self.policy == "fifo":
            return (tx.seq,)
        return (-tx.priority, tx.total - tx.acked, tx.seq)

    def _serves(self, stream: int, tx: _Tx) -> bool:
        """Whether ``stream`` may carry chunks of ``tx`` (the express-lane rule)."""
        if stream in self.express:
            return self.policy == "priority" and tx.priority > 0
        return True

    def urgent_running(self) -> bool:
        """Whether a ``priority > 0`` transfer is running (``priority`` policy only)."""
        return self.policy == "priority" and any(tx.priority > 0 for tx in self._txs.values())

    def has_work(self) -> bool:
        """Whether a fresh or retry chunk is waiting (ignores hedging)."""
        return any(tx.has_work() for tx in self._txs.values())

    def next_chunk(self, stream: int, now: float) -> Chunk | None:
        """The chunk ``stream`` should send now, or None (then wait for a change or the timer)."""
        if stream >= self.active_streams and stream not in self.express:
            return None
        hedging = self.max_copies >= 2
        txs: Iterable[_Tx] = self._txs.values()
        if len(self._txs) > 1:
            if not hedging and not any(tx.retry or tx.unsent for tx in txs):
                return None  # nothing to cut or resend and no hedging: no order needed
            txs = sorted(txs, key=self._key)
        if stream in self.express:
            txs = [tx for tx in txs if self._serves(stream, tx)]
        for tx in txs:
            if tx.retry:
                ch = tx.retry.popleft()
                self.bytes_resent += ch.length
                return self._launch(ch, stream, now)
            if tx.unsent:
                return self._launch(self._cut(tx), stream, now)
            # A transfer with nothing left to cut may hedge its slow chunks before
            # lower-ranked transfers get fresh ones: a small urgent transfer must
            # not wait out a loss recovery behind bulk.
            if hedging and tx.priority > 0 and self.policy == "priority":
                hedged = self._hedge_one(tx, stream, now)
                if hedged is not None:
                    return hedged
        return self._hedge(txs, stream, now) if hedging else None

    def _cut(self, tx: _Tx) -> Chunk:
        span = tx.unsent[0]
        share = math.ceil(tx.unsent_bytes / max(self.active_streams, 1))
        size = min(self.chunk_size, max(self.min_chunk, share), span[1] - span[0])
        ch = Chunk(tx.tid, span[0], span[0] + size)
        span[0] += size
        tx.unsent_bytes -= size
        if span[0] == span[1]:
            tx.unsent.popleft()
        tx.inflight[ch.lo] = ch
        return ch

    def _launch(self, ch: Chunk, stream: int, now: float) -> Chunk:
        ch.streams.add(stream)
        ch.sent_at = now
        ch.sends += 1
        self.bytes_sent += ch.length
        return ch

    @property
    def ack_latency(self) -> float | None:
        """Smoothed ack latency of large chunks (of small ones if none yet)."""
        return self._latency[False] or self._latency[True]

    def hedge_after(self, length: int | None = None, urgent: bool = False) -> float:
        """Age after which a chunk of ``length`` bytes may be hedged."""
        small = length is not None and length <= K_SMALL_CHUNK
        lat = self._latency[small] or self.ack_latency
        if lat is None:
            lat = 4 * self.min_hedge_s
        factor = self.urgent_hedge_factor if urgent else self.hedge_factor
        return max(self.min_hedge_s, factor * lat)

    def _hedge_ages(self, tx: _Tx) -> tuple[float, float]:
        """:meth:`hedge_after` for ``tx``'s small chunks and for its large ones
        (the only two values it takes for one transfer)."""
        urgent = tx.priority > 0
        return self.hedge_after(K_SMALL_CHUNK, urgent), self.hedge_after(None, urgent)

    def _hedge(self, txs: Iterable[_Tx], stream: int, now: float) -> Chunk | None:
        for tx in txs:
            ch = self._hedge_one(tx, stream, now)
            if ch is not None:
                return ch
        return None

    def _hedge_one(self, tx: _Tx, stream: int, now: float) -> Chunk | None:
        if self.max_copies < 2 or not tx.inflight:
            return None
        small_after, large_after = self._hedge_ages(tx)
        small_before, large_before = now - small_after, now - large_after
        best: Chunk | None = None
        for ch in tx.inflight.values():
            if (
                stream not in ch.streams
                and 0 < len(ch.streams) < self.max_copies
                and ch.sent_at <= (small_before if ch.hi - ch.lo <= K_SMALL_CHUNK else large_before)
                and (best is None or ch.sent_at < best.sent_at)
            ):
                best = ch
        if best is None:
            return None
        self.chunks_hedged += 1
        self.bytes_resent += best.length
        sent_at = best.sent_at
        ch = self._launch(best, stream, now)
        ch.sent_at = sent_at  # age counts from the first copy
        return ch

    def on_ack(self, stream: int, transfer_id: int, lo: int, hi: int, now: float) -> bool:
        """The receiver verified ``[lo, hi)``. Returns False for an ack matching nothing."""
        tx = self._txs.get(transfer_id)
        if tx is None:
            return False
        ch = tx.inflight.get(lo)
        if ch is None or ch.hi != hi:
            return False
        del tx.inflight[lo]
        ch.acked = True
        ch.streams.clear()
        if ch in tx.retry:
            tx.retry.remove(ch)
        lat = max(now - ch.sent_at, 0.0)
        length = ch.hi - ch.lo
        small = length <= K_SMALL_CHUNK
        old = self._latency[small]
        self._latency[small] = lat if old is None else 0.8 * old + 0.2 * lat
        tx.acked += length
        self.bytes_acked += length
        self._events.append(TransferProgress(transfer_id, tx.acked, tx.total))
        if tx.acked == tx.total:
            del self._txs[transfer_id]
            self._events.append(TransferCompleted(transfer_id))
        return True

    def on_dup(self, stream: int, transfer_id: int, lo: int, hi: int) -> None:
        """The receiver dropped this stream's copy (its twin was in progress)."""
        self._unhook(stream, transfer_id, lo, hi)

    def _unhook(self, stream: int, tid: int, lo: int, hi: int) -> None:
        tx = self._txs.get(tid)
        ch = tx.inflight.get(lo) if tx else None
        if tx is None or ch is None or ch.hi != hi:
            return
        ch.streams.discard(stream)
        if not ch.streams and ch not in tx.retry:
            tx.retry.appendleft(ch)

    def on_stream_failed(self, stream: int) -> int:
        """Requeue every unacknowledged chunk that was only on ``stream``; returns how many."""
        n = 0
        for tx in self._txs.values():
            for ch in list(tx.inflight.values()):
                if stream in ch.streams:
                    ch.streams.discard(stream)
                    if not ch.streams and ch not in tx.retry:
                        tx.retry.appendleft(ch)
                        n += 1
        return n

    # -- timers and events -----------------------------------------------------

    def get_timer(self, stream: int | None = None) -> float | None:
        """When :meth:`handle_timer` has work (the earliest deadline), or, given an idle
        ``stream``, when that stream may first hedge a chunk, whichever is sooner."""
        times = [tx.deadline for tx in self._txs.values() if tx.deadline is not None]
        if (
            stream is not None
            and (stream < self.active_streams or stream in self.express)
            and self.max_copies >= 2
        ):
            # (an idle stream only exists when nothing is waiting, so every
            # transfer's in-flight chunks are candidates here)
            for tx in self._txs.values():
                if not tx.inflight or not self._serves(stream, tx):
                    continue
                small_after, large_after = self._hedge_ages(tx)
                times += [
                    ch.sent_at + (small_after if ch.hi - ch.lo <= K_SMALL_CHUNK else large_after)
                    for ch in tx.inflight.values()
                    if 0 < len(ch.streams) < self.max_copies and stream not in ch.streams
                ]
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        """Fail transfers past their deadline."""
        for tx in list(self._txs.values()):
            if tx.deadline is not None and tx.deadline <= now:
                self._fail(
                    tx.tid,
                    TransferTimeout(
                        f"deadline passed with {tx.acked}/{tx.total} bytes verified",
                        transfer_id=tx.tid,
                    ),
                )

    def events(self) -> list[Event]:
        """Drain the events produced since the last call."""
        out, self._events = self._events, []
        return out
