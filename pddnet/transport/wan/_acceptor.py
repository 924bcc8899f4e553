"""Sans-IO chunk acceptance on the receiver: grants, bounds, duplicates, readiness.

Theory of operation
-------------------
The receiver holds a table of live *grants*: transfer id -> destination
:class:`~pddnet.kv.ByteRanges` in a logical byte space ``[0, total)``. For
every chunk header a connection reads, the driver asks :meth:`GrantTable.begin`
what to do with the payload *before* reading it:

* ``WRITE``: the payload goes straight into the returned destination pieces
  (``recv_into``, no intermediate copy). Afterwards the driver checks the
  payload checksum and calls :meth:`GrantTable.finish`; only a matching
  checksum marks the bytes verified. A mismatch leaves them unverified (they
  were inside the grant, so nothing outside it was touched) and the
  connection is dropped; the sender re-sends the chunk.
* ``DRAIN``: the payload is read into a scratch buffer and thrown away: the
  chunk duplicates bytes already verified, also of a transfer that completed
  (an ACK is still sent, so a hedging sender, or one whose ACK was lost with
  its connection, learns it is done), or one another connection is receiving
  right now (a DUP is sent: the copy proves nothing), or its transfer failed
  or was cancelled recently (a CANCELLED is sent so the sender stops).
* a :class:`~pddnet.RemoteProtocolError` (the connection is dropped): unknown
  transfer id, a range outside ``[0, total)``, a partial overlap with verified
  or in-progress bytes. A known transfer also fails.

Duplicates are bounded: an honest sender re-sends a chunk when it hedges or
when an ACK was lost with its connection, so a transfer takes
``K_DUP_SLACK`` duplicate chunks (``DRAIN_ACK`` and ``DRAIN_DUP``, also
stragglers after it completed) plus ``K_DUPS_PER_CHUNK`` for every chunk
verified. One more is a :class:`~pddnet.RemoteProtocolError` that drops the
connection but not the transfer (issue 19: a peer re-sending one verified
1-byte chunk back to back kept a receiver busy for minutes); the allowance
stays spent, so a peer that reconnects and goes on is dropped at its next
duplicate. Chunks of a transfer that failed or was cancelled spend it too.

Chunks are bounded as well: a grant of ``total`` bytes takes at most
``K_CHUNK_SLACK + ceil(total / K_CHUNK_FLOOR)`` chunks, plus one per layer,
written (verified or in progress). An honest sender cuts chunks of at least
its ``min_chunk`` (64 KiB by default) except a ready span's remainder, and
spans follow layers, so it stays far inside; 1-byte chunks of a large grant
(a receiver then spends its CPU per byte) pass the budget after a few hundred
and fail the transfer with a :class:`~pddnet.RemoteProtocolError`.

Resource bounds (:class:`~._limits.WanLimits`): :meth:`GrantTable.add` refuses
a grant that would take the live grants, or their bytes, past a bound (in
total or for its peer) with :class:`~._limits.WanLimitExceeded`, before
registering anything; the per-peer counts fall back when a grant ends.

Invariants: a byte outside a grant is never returned as a destination piece,
and no byte is written into a grant's pieces after it ended (its
:class:`WritePermit` is revoked; the driver checks it before every read);
two connections never write the same destination bytes at once; a chunk
counts once; a transfer completes exactly when ``verified.total == total``.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..._errors import (
    PddnetError,
    RemoteProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from ...kv import ByteRanges
from ...wire import ChunkHeader
from .._intervals import IntervalSet
from ._limits import WanLimits, check

__all__ = [
    "Action",
    "Decision",
    "GrantTable",
    "LayerVerified",
    "TransferEnded",
    "TransferVerified",
]

K_TOMBSTONES = 4096  # recently ended transfer ids whose stragglers are drained, not errors
K_MAX_CHECKSUM_FAILURES = 3  # per transfer, before it fails
K_DUP_SLACK = 64  # duplicate chunks a transfer takes before any chunk is verified
K_DUPS_PER_CHUNK = 2  # and for each chunk verified (a hedged twin, a resend after a lost ACK)
K_CHUNK_SLACK = 256  # chunks a grant takes whatever its size (remainders, tiny grants)
K_CHUNK_FLOOR = 4 << 10  # and one per this many bytes (16x below the sender's min_chunk)


class Action(enum.Enum):
    WRITE = "write"
    DRAIN_ACK = "drain_ack"  # duplicate of verified bytes
    DRAIN_DUP = "drain_dup"  # twin in progress on another connection
    DRAIN_ENDED = "drain_ended"  # transfer ended (cancelled, timed out, done)


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    pieces: tuple[tuple[int, int, int], ...] = ()
    permit: WritePermit | None = None  # WRITE: check it before every read into ``pieces``


@dataclass(frozen=True, slots=True)
class LayerVerified:
    transfer_id: int
    layer: int


@dataclass(frozen=True, slots=True)
class TransferVerified:
    transfer_id: int


@dataclass(frozen=True, slots=True)
class TransferEnded:
    """The transfer ended without completing; ``error`` says how."""

    transfer_id: int
    error: PddnetError


Event = LayerVerified | TransferVerified | TransferEnded


class WritePermit:
    """A grant's licence to write into its blocks, revoked the moment the grant ends.

    The driver reads a ``WRITE`` payload in several ``recv_into`` calls and
    checks :attr:`live` before each one, with no await in between: once a
    transfer was cancelled, failed or timed out (and its blocks may belong to
    someone else), not one more byte of it lands in them.
    """

    __slots__ = ("_watchers", "live")

    def __init__(self) -> None:
        self.live = True
        self._watchers: dict[object, Callable[[], None]] = {}

    def watch(self, key: object, on_revoke: Callable[[], None]) -> None:
        """Call ``on_revoke`` from :meth:`revoke` (a read handed to another thread
        takes it back there, see ``_io``), until ``unwatch(key)``."""
        self._watchers[key] = on_revoke

    def unwatch(self, key: object) -> None:
        self._watchers.pop(key, None)

    def revoke(self) -> None:
        """End the licence: :attr:`live` is false and every watcher has run."""
        self.live = False
        watchers, self._watchers = self._watchers, {}
        for on_revoke in watchers.values():
            on_revoke()


class _Duplicates:
    """How many more duplicate chunks a transfer takes (kept by its tombstone too)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = K_DUP_SLACK


@dataclass(slots=True, eq=False)
class _Grant:
    transfer_id: int
    ranges: ByteRanges
    layer_ends: tuple[int, ...]
    deadline: float | None
    peer: str | None = None
    verified: IntervalSet = field(default_factory=IntervalSet)
    pending: dict[tuple[int, int], object] = field(default_factory=dict)  # (lo, hi) -> conn
    layers_done: set[int] = field(default_factory=set)
    checksum_failures: int = 0
    permit: WritePermit = field(default_factory=WritePermit)
    duplicates: _Duplicates = field(default_factory=_Duplicates)
    chunks: int = 0  # verified
    chunk_budget: int = 0  # most chunks written (verified or in progress), see the module doc


class GrantTable:
    """The receiver's live grants and the chunk-acceptance rules (sans-IO).

    Args:
        max_chunk: largest chunk payload accepted.
        limits: bounds on live grants (default :class:`~._limits.WanLimits`).
    """

    def __init__(self, max_chunk: int, limits: WanLimits | None = None) -> None:
        self.max_chunk = max_chunk
        self.limits = WanLimits() if limits is None else limits
        self.bytes_granted = 0  # bytes of live grants
        self._peer_use: dict[str, tuple[int, int]] = {}  # peer -> (live grants, bytes)
        self._grants: dict[int, _Grant] = {}
        # tid -> (total, ok, duplicates allowed)
        self._ended: OrderedDict[int, tuple[int, bool, _Duplicates]] = OrderedDict()
        self.bytes_verified = 0
        self.bytes_dropped = 0
        self.checksum_failures = 0
        self.duplicate_floods = 0  # chunks refused for passing the duplicate allowance
        self.chunk_floods = 0  # transfers failed for more chunks than their budget
        self._failed: list[Event] = []

    def __contains__(self, transfer_id: int) -> bool:
        return transfer_id in self._grants

    def __len__(self) -> int:
        return len(self._grants)

    def add(
        self,
        transfer_id: int,
        ranges: ByteRanges,
        layer_ends: tuple[int, ...] = (),
        deadline: float | None = None,
        peer: str | None = None,
    ) -> list[Event]:
        """Register a grant; returns events (an empty grant is verified at once).

        Raises:
            WanLimitExceeded: if the grant would pass a bound of :attr:`limits`
                (nothing is registered).
        """
        if transfer_id in self._grants or transfer_id in self._ended:
            raise ValueError(f"transfer id {transfer_id} reused")
        self.check_limits(ranges.total, peer, transfer_id)
        g = _Grant(transfer_id, ranges, layer_ends, deadline, peer)
        g.chunk_budget = K_CHUNK_SLACK + -(-ranges.total // K_CHUNK_FLOOR) + len(layer_ends)
        self._grants[transfer_id] = g
        self.bytes_granted += ranges.total
        if peer is not None:
            n, b = self._peer_use.get(peer, (0, 0))
            self._peer_use[peer] = (n + 1, b + ranges.total)
        return self._progress(g, 0, 0)

    def check_limits(self, nbytes: int, peer: str | None, transfer_id: int | None = None) -> None:
        """Raise if one more grant of ``nbytes`` for ``peer`` would pass a bound.

        Raises:
            WanLimitExceeded: naming the first bound passed.
        """
        lim, tid = self.limits, transfer_id
        check(lim, "max_transfers", len(self._grants), 1, peer=peer, transfer_id=tid)
        check(lim, "max_bytes", self.bytes_granted, nbytes, peer=peer, transfer_id=tid)
        if peer is not None:
            n, b = self._peer_use.get(peer, (0, 0))
            check(lim, "max_transfers_per_peer", n, 1, peer=peer, transfer_id=tid)
            check(lim, "max_bytes_per_peer", b, nbytes, peer=peer, transfer_id=tid)

    def peer_usage(self, peer: str) -> tuple[int, int]:
        """``(live grants, bytes of live grants)`` of ``peer``."""
        return self._peer_use.get(peer, (0, 0))

    def verified_bytes(self, transfer_id: int) -> int:
        g = self._grants.get(transfer_id)
        return g.verified.total if g else 0

    def begin(self, header: ChunkHeader, conn: object) -> Decision:
        """Decide what to do with the payload of ``header`` arriving on ``conn``.

        Raises:
            RemoteProtocolError: the connection must be dropped; if the transfer
                is known it has failed too (its event comes from
                :meth:`take_failures`).
        """
        tid, lo = header.transfer_id, header.offset
        hi = lo + header.length
        if header.length > self.max_chunk:
            raise self._violation(tid, f"chunk of {header.length} bytes over {self.max_chunk}")
        g = self._grants.get(tid)
        if g is None:
            ended = self._ended.get(tid)
            if ended is not None and hi <= ended[0]:
                # a straggler (hedged twin, resend after a lost ACK): of a completed
                # transfer it is a duplicate, acknowledged; of a failed one, refused
                self._duplicate(tid, ended[2])
                return Decision(Action.DRAIN_ACK if ended[1] else Action.DRAIN_ENDED)
            raise RemoteProtocolError(f"chunk for unknown transfer id {tid}", transfer_id=tid)
        if hi > g.ranges.total:
            raise self._violation(tid, f"chunk [{lo}, {hi}) outside grant [0, {g.ranges.total})")
        done = g.verified.overlap(lo, hi)
        if done == hi - lo:
            self._duplicate(tid, g.duplicates)
            return Decision(Action.DRAIN_ACK)
        if done:
            raise self._violation(tid, f"chunk [{lo}, {hi}) partially overlaps verified bytes")
        for plo, phi in g.pending:
            if plo < hi and lo < phi:
                if (plo, phi) == (lo, hi) and g.pending[(plo, phi)] is not conn:
                    self._duplicate(tid, g.duplicates)
                    return Decision(Action.DRAIN_DUP)
                raise self._violation(tid, f"chunk [{lo}, {hi}) overlaps one in progress")
        if g.chunks + len(g.pending) >= g.chunk_budget:
            self.chunk_floods += 1
            raise self._violation(
                tid,
                f"more than {g.chunk_budget} chunks for a grant of {g.ranges.total} bytes "
                f"({K_CHUNK_SLACK} + 1 per {K_CHUNK_FLOOR} bytes + 1 per layer)",
            )
        g.pending[(lo, hi)] = conn
        return Decision(Action.WRITE, tuple(g.ranges.pieces(lo, hi)), g.permit)

    def _duplicate(self, tid: int, allowed: _Duplicates) -> None:
        """Spend one of a transfer's duplicates; raise when none is left (see the module doc)."""
        allowed.left -= 1
        if allowed.left < 0:
            self.duplicate_floods += 1
            raise RemoteProtocolError(
                f"more duplicate chunks than transfer {tid} allows ({K_DUP_SLACK} "
                f"+ {K_DUPS_PER_CHUNK} per chunk verified)",
                transfer_id=tid,
            )

    def _violation(self, tid: int, why: str) -> RemoteProtocolError:
        err = RemoteProtocolError(why, transfer_id=tid)
        if tid in self._grants:
            self._failed.append(self._end(tid, err))
        return err

    def take_failures(self) -> list[Event]:
        """Events of transfers that :meth:`begin` failed on a violation (then cleared)."""
        out, self._failed = self._failed, []
        return out

    def finish(self, header: ChunkHeader, conn: object, ok: bool) -> list[Event]:
        """The payload of a ``WRITE`` chunk was read; ``ok`` says if its checksum matched.

        Returns events; a mismatch may fail the transfer (too many mismatches).
        """
        tid, lo = header.transfer_id, header.offset
        hi = lo + header.length
        g = self._grants.get(tid)
        if g is None:  # ended while the payload was in flight
            return []
        g.pending.pop((lo, hi), None)
        if not ok:
            self.checksum_failures += 1
            g.checksum_failures += 1
            if g.checksum_failures >= K_MAX_CHECKSUM_FAILURES:
                err = RemoteProtocolError(
                    f"{g.checksum_failures} chunks failed their checksum", transfer_id=tid
                )
                return [self._end(tid, err)]
            return []
        added = g.verified.add(lo, hi)
        self.bytes_verified += added
        g.chunks += 1
        g.duplicates.left += K_DUPS_PER_CHUNK
        return self._progress(g, lo, hi)

    def abort(self, header: ChunkHeader, conn: object) -> None:
        """The payload of a ``WRITE`` chunk was not fully read (connection lost)."""
        g = self._grants.get(header.transfer_id)
        if g is not None and g.pending.get((header.offset, header.offset + header.length)) is conn:
            del g.pending[(header.offset, header.offset + header.length)]

    def _progress(self, g: _Grant, lo: int, hi: int) -> list[Event]:
        out: list[Event] = []
        ends = g.layer_ends
        if ends:
            # layers touched by [lo, hi) (all of them for the initial check)
            if hi > lo:
                first = bisect_right(ends, lo)
                last = min(bisect_right(ends, hi - 1), len(ends) - 1)
            else:
                first, last = 0, len(ends) - 1
            for layer in range(first, last + 1):
                if layer in g.layers_done:
                    continue
                start = ends[layer - 1] if layer else 0
                if g.verified.covers(start, ends[layer]):
                    g.layers_done.add(layer)
                    out.append(LayerVerified(g.transfer_id, layer))
        if g.verified.total == g.ranges.total:
            out.append(TransferVerified(g.transfer_id))
            self._retire(g.transfer_id, True)
        return out

    def _retire(self, tid: int, ok: bool) -> None:
        g = self._grants.pop(tid)
        g.permit.revoke()  # payloads still arriving for it go nowhere
        self.bytes_granted -= g.ranges.total
        if g.peer is not None:
            n, b = self._peer_use.pop(g.peer)
            if n > 1:
                self._peer_use[g.peer] = (n - 1, b - g.ranges.total)
        self._ended[tid] = (g.ranges.total, ok, g.duplicates)
        while len(self._ended) > K_TOMBSTONES:
            self._ended.popitem(last=False)

    def _end(self, tid: int, error: PddnetError) -> TransferEnded:
        self._retire(tid, False)
        return TransferEnded(tid, error)

    def cancel(self, transfer_id: int, error: PddnetError | None = None) -> list[Event]:
        """End a live grant (local cancel, the sender's CANCEL, aclose). Idempotent."""
        if transfer_id not in self._grants:
            return []
        err = error or TransferCancelled("transfer cancelled", transfer_id=transfer_id)
        return [self._end(transfer_id, err)]

    def get_timer(self) -> float | None:
        """The earliest grant deadline, or None."""
        ds = [g.deadline for g in self._grants.values() if g.deadline is not None]
        return min(ds) if ds else None

    def handle_timer(self, now: float) -> list[Event]:
        """Expire grants whose deadline passed."""
        out: list[Event] = []
        for tid, g in list(self._grants.items()):
            if g.deadline is not None and g.deadline <= now:
                err = TransferTimeout(
                    f"grant expired with {g.verified.total}/{g.ranges.total} bytes verified",
                    transfer_id=tid,
                )
                out.append(self._end(tid, err))
        return out

    def live(self) -> list[int]:
        return list(self._grants)
