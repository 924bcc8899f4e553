"""P's mirror of MD's cache, and the delta it implies.

P cannot afford a round trip to MD to learn what to send before it starts
planning, so it keeps a mirror: the set of chain keys MD announced
(:class:`DrcInserted` / :class:`DrcEvicted`, applied in ``seq`` order). The
tree is prefix-closed, so the blocks MD holds of a prompt are a prefix, and
its length is found by binary search over the prompt's keys: 13 set probes
for 8192 blocks. The cost of a delta is therefore the hash chain.

The mirror is a *prediction*. It lags MD by the control plane's latency and
can miss events; :class:`CacheServer` answers every plan from the real tree,
and :meth:`CacheMirror.confirm` adopts that answer, so what P sends is always
exactly the suffix MD names. A stale mirror only makes the prediction (used to
choose the route and size the transfer before the reply) wrong: if MD evicted
blocks P counted on, the real delta is larger, and the accounting keeps both
numbers (``overpredicted_blocks``) so the cost is visible.

Blocks P shipped to MD and saw land are *expected* (:meth:`CacheMirror.expect`):
MD caches a prompt's blocks when its request ends, and its insert event
reaches P a one-way delay after that, while a session's next turn may already
be routed (after a relayed turn MD's request ends a round trip with RLD after
its last token). The prediction counts expected blocks as held until MD's
insert or evict event for them arrives, or ``expect_s`` passes
(:meth:`CacheMirror.expire`). Blocks still in flight to MD are not expected:
they are not there yet.

A gap (a ``seq`` skipped) or a new ``epoch`` (MD restarted) whose first
event is not ``seq`` 1 sets :attr:`CacheMirror.needs_snapshot` (false while a
snapshot is being collected); the driver then sends
:class:`DrcSnapshotRequest`. Events keep being applied meanwhile (best
effort), and those newer than the snapshot are replayed on top of it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LayoutMismatch, RemoteProtocolError
from ..wire import Message, encode_tokens
from ._hash import as_tokens, block_hashes
from ._messages import (
    DrcEvicted,
    DrcInserted,
    DrcPlanAbort,
    DrcPlanReply,
    DrcPlanRequest,
    DrcSnapshot,
    DrcSnapshotRequest,
)

__all__ = ["CacheMirror", "DeltaPlan", "MirrorStats"]


@dataclass(frozen=True, slots=True)
class DeltaPlan:
    """What P must send to MD for one prompt.

    Attributes:
        request_id: the request.
        num_tokens: prompt length.
        block_size: tokens per block.
        keys: chain keys of the full blocks.
        predicted_blocks: leading blocks the mirror expects MD to hold.
        hit_blocks: leading blocks MD confirmed and pinned (None until
            :meth:`CacheMirror.confirm`).
        plan_id: MD's pin (None until confirmed).
    """

    request_id: str
    num_tokens: int
    block_size: int
    keys: npt.NDArray[np.uint64]
    predicted_blocks: int
    hit_blocks: int | None = None
    plan_id: int | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks of the prompt, the partial tail included."""
        return -(-self.num_tokens // self.block_size)

    @property
    def full_blocks(self) -> int:
        return int(self.keys.size)

    @property
    def confirmed(self) -> bool:
        return self.hit_blocks is not None

    @property
    def send_from(self) -> int:
        """First block to send: MD's answer if confirmed, else the prediction."""
        return self.predicted_blocks if self.hit_blocks is None else self.hit_blocks

    def send_blocks(self) -> npt.NDArray[np.int64]:
        """Indexes (within the prompt) of the blocks to send: a suffix."""
        return np.arange(self.send_from, self.num_blocks, dtype=np.int64)

    @property
    def send_tokens(self) -> tuple[int, int]:
        """Token range ``[lo, hi)`` whose KV must be sent."""
        return min(self.send_from * self.block_size, self.num_tokens), self.num_tokens


@dataclass(frozen=True, slots=True)
class MirrorStats:
    """P-side accounting (a snapshot).

    ``predicted_*`` come from the mirror, ``md_*`` from MD's confirmed answers,
    ``p_*`` from the engine's own prefix cache (:meth:`CacheMirror.record_prefill`).
    Bytes count only confirmed plans.
    """

    plans: int
    confirmed: int
    queried_blocks: int
    predicted_hit_blocks: int
    md_hit_blocks: int
    overpredicted_blocks: int
    underpredicted_blocks: int
    bytes_sent: int
    bytes_saved: int
    p_hit_tokens: int
    p_total_tokens: int
    events_applied: int
    gaps: int
    snapshots: int

    @property
    def md_hit_rate(self) -> float:
        return self.md_hit_blocks / self.queried_blocks if self.queried_blocks else 0.0

    @property
    def predicted_hit_rate(self) -> float:
        return self.predicted_hit_blocks / self.queried_blocks if self.queried_blocks else 0.0

    @property
    def p_hit_rate(self) -> float:
        return self.p_hit_tokens / self.p_total_tokens if self.p_total_tokens else 0.0


class _AsInts:
    """``keys[i]`` as a Python int, converted when probed (a binary search
    reads a few of an array's keys; ``tolist()`` would convert them all)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: npt.NDArray[np.uint64] | Sequence[int]) -> None:
        self._keys = keys

    def __getitem__(self, i: int) -> int:
        return int(self._keys[i])


class CacheMirror:
    """P's view of one MD's cache.

    Args:
        block_size: tokens per block (MD's).
        algo: hash-chain algorithm (MD's).
        bytes_per_token: KV bytes per token (``KVLayout.kv_bytes_per_token``),
            for the byte accounting.
        expect_s: how long blocks given to :meth:`expect` count as held
            without MD's insert event.
    """

    def __init__(
        self,
        block_size: int,
        *,
        algo: str = "xxh3_64",
        bytes_per_token: int = 0,
        expect_s: float = 10.0,
    ) -> None:
        block_hashes([], block_size, algo=algo)  # validates
        self.block_size = block_size
        self.algo = algo
        self.bytes_per_token = bytes_per_token
        self.expect_s = expect_s
        self.epoch: int | None = None
        self.seq = 0
        self._keys: set[int] = set()
        self._expected: dict[int, float] = {}  # key -> until when it counts as held
        self._expiry: deque[tuple[float, list[int]]] = deque()
        self._needs_snapshot = False
        self._collect: tuple[int, int, int, set[int]] | None = None  # epoch, seq, next part, keys
        self._buffered: list[DrcInserted | DrcEvicted] = []
        self._c = dict.fromkeys(
            (
                "plans",
                "confirmed",
                "queried_blocks",
                "predicted_hit_blocks",
                "md_hit_blocks",
                "overpredicted_blocks",
                "underpredicted_blocks",
                "bytes_sent",
                "bytes_saved",
                "p_hit_tokens",
                "p_total_tokens",
                "events_applied",
                "gaps",
                "snapshots",
            ),
            0,
        )

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return int(key) in self._keys

    @property
    def needs_snapshot(self) -> bool:
        """True when the mirror knows it may be wrong and no snapshot is being collected."""
        return self._needs_snapshot and self._collect is None

    def snapshot_request(self) -> DrcSnapshotRequest:
        """The message that asks MD for a snapshot."""
        return DrcSnapshotRequest(self.epoch if self.epoch is not None else 0)

    # --------------------------------------------------------------- events
    def apply(self, msg: Message) -> None:
        """Apply one event or snapshot part from MD.

        Raises:
            LayoutMismatch: if a snapshot says MD uses another block size or
                hash algorithm.
            RemoteProtocolError: for a message the mirror does not take.
        """
        if isinstance(msg, DrcSnapshot):
            self._apply_snapshot(msg)
        elif isinstance(msg, DrcInserted | DrcEvicted):
            self._apply_event(msg)
        else:
            raise RemoteProtocolError(f"DRC mirror can't handle {type(msg).__name__}")

    def _apply_event(self, ev: DrcInserted | DrcEvicted) -> None:
        if self._collect is not None:
            self._buffered.append(ev)
        if ev.epoch != self.epoch:
            # An MD new to us, or restarted: what we knew is void. Unless this
            # is its very first event, the gap check below asks for a snapshot.
            self._keys.clear()
            self._expected.clear()
            self._expiry.clear()
            self.epoch, self.seq = ev.epoch, 0
        if ev.seq <= self.seq:
            return  # duplicate or already covered by a snapshot
        if ev.seq != self.seq + 1:
            self._needs_snapshot = True
            self._c["gaps"] += 1
        self.seq = ev.seq
        if isinstance(ev, DrcInserted):
            self._keys.update(ev.keys)
        else:
            self._keys.difference_update(ev.keys)
        if self._expected:  # MD's own word on these keys replaces the expectation
            for k in ev.keys:
                self._expected.pop(k, None)
            if isinstance(ev, DrcEvicted):
                self._unexpect_below(set(ev.keys))
        self._c["events_applied"] += 1

    def _apply_snapshot(self, snap: DrcSnapshot) -> None:
        if snap.block_size != self.block_size or snap.algo != self.algo:
            raise LayoutMismatch(
                f"MD caches blocks of {snap.block_size} with {snap.algo}; "
                f"this mirror uses {self.block_size} with {self.algo}"
            )
        if snap.part == 0:
            self._collect = (snap.epoch, snap.seq, 0, set())
            self._buffered = []
        if self._collect is None:
            return  # a stray part of a snapshot we did not start on
        epoch, seq, part, keys = self._collect
        if (snap.epoch, snap.seq, snap.part) != (epoch, seq, part):
            self._collect = None
            self._needs_snapshot = True
            return
        keys.update(snap.keys)
        if not snap.final:
            self._collect = (epoch, seq, part + 1, keys)
            return
        self._collect = None
        self._keys = keys
        self.epoch, self.seq = epoch, seq
        self._needs_snapshot = False
        self._c["snapshots"] += 1
        buffered, self._buffered = self._buffered, []
        for ev in buffered:
            if ev.epoch == epoch and ev.seq > seq:
                self._apply_event(ev)

    # ---------------------------------------------------------------- delta
    def predict(self, keys: npt.NDArray[np.uint64] | Sequence[int]) -> int:
        """Leading blocks (of a prompt with chain ``keys``) the mirror expects MD to hold.

        ``keys`` as a list (``keys.tolist()``) is faster to probe than the
        array: P routing across several MDs converts once and asks each mirror.
        """
        hi = len(keys)
        if hi == 0:
            return 0
        # an array's few probed keys as ints, not all of it
        at: list[int] | _AsInts = keys if isinstance(keys, list) else _AsInts(keys)
        held, expected = self._keys, self._expected  # (the probes inline: this is the hot path)
        key = at[0]
        if key not in held and key not in expected:
            return 0
        key = at[hi - 1]
        if key in held or key in expected:
            return hi
        lo = 1  # invariant: keys[:lo] present, keys[hi:] absent
        while lo < hi:
            mid = (lo + hi) // 2
            key = at[mid]
            if key in held or key in expected:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def expect(self, keys: npt.NDArray[np.uint64] | Sequence[int], now: float) -> None:
        """P's transfer of a prompt's blocks (chain ``keys``) to MD landed:
        count them as held until MD's event about them, or ``expect_s`` after ``now``."""
        until = now + self.expect_s
        chain = keys.tolist() if isinstance(keys, np.ndarray) else list(map(int, keys))
        held, expected = self._keys, self._expected
        for k in chain:
            if k not in held:
                expected[k] = until
        self._expiry.append((until, chain))

    def _unexpect_below(self, evicted: set[int]) -> None:
        # MD evicted a block: the expected blocks after it in a chain are no
        # use to a prompt (the prefix breaks there), so the union of what MD
        # holds and what P expects stays prefix-closed, as predict assumes.
        for until, chain in self._expiry:
            if evicted.isdisjoint(chain):
                continue  # (most chains: one C-level pass instead of a Python one)
            cut = next(i for i, k in enumerate(chain) if k in evicted)
            for k in chain[cut:]:
                if self._expected.get(k) == until:
                    del self._expected[k]

    def expire(self, now: float) -> None:
        """Forget the expectations older than ``expect_s``."""
        while self._expiry and self._expiry[0][0] <= now:
            until, keys = self._expiry.popleft()
            for k in keys:
                if self._expected.get(k) == until:
                    del self._expected[k]

    def plan(self, request_id: str, tokens: Any) -> tuple[DeltaPlan, DrcPlanRequest]:
        """Predict the delta for a prompt and build the request that confirms it.

        Returns:
            ``(plan, request)``: send ``request`` to MD and pass its reply to
            :meth:`confirm`.
        """
        toks = as_tokens(tokens)
        keys = block_hashes(toks, self.block_size, algo=self.algo)
        predicted = self.predict(keys)
        plan = DeltaPlan(request_id, int(toks.size), self.block_size, keys, predicted)
        req = DrcPlanRequest(
            request_id, encode_tokens(toks), int(toks.size), self.block_size, predicted
        )
        self._c["plans"] += 1
        return plan, req

    def confirm(self, plan: DeltaPlan, reply: DrcPlanReply) -> DeltaPlan:
        """Adopt MD's answer to a plan request, and account for it.

        Returns:
            The confirmed plan (``hit_blocks`` and ``plan_id`` set).

        Raises:
            RemoteProtocolError: if the reply does not fit the plan.
        """
        if reply.request_id != plan.request_id or reply.full_blocks != plan.full_blocks:
            raise RemoteProtocolError(
                f"plan reply for {reply.request_id!r} with {reply.full_blocks} blocks does not "
                f"fit the plan ({plan.full_blocks} blocks)",
                request_id=plan.request_id,
            )
        if not 0 <= reply.hit_blocks <= plan.full_blocks:
            raise RemoteProtocolError(
                f"MD claims {reply.hit_blocks} of {plan.full_blocks} blocks",
                request_id=plan.request_id,
            )
        if reply.epoch != self.epoch:
            self._needs_snapshot = True
        c = self._c
        hit = reply.hit_blocks
        c["confirmed"] += 1
        c["queried_blocks"] += plan.full_blocks
        c["predicted_hit_blocks"] += plan.predicted_blocks
        c["md_hit_blocks"] += hit
        c["overpredicted_blocks"] += max(0, plan.predicted_blocks - hit)
        c["underpredicted_blocks"] += max(0, hit - plan.predicted_blocks)
        saved_tokens = hit * self.block_size
        c["bytes_saved"] += saved_tokens * self.bytes_per_token
        c["bytes_sent"] += (plan.num_tokens - saved_tokens) * self.bytes_per_token
        return dataclasses.replace(plan, hit_blocks=hit, plan_id=reply.plan_id)

    def abort(self, plan: DeltaPlan) -> DrcPlanAbort | None:
        """The message that releases a confirmed plan's pin on MD (None if unconfirmed)."""
        return None if plan.plan_id is None else DrcPlanAbort(plan.plan_id)

    def record_prefill(self, hit_tokens: int, total_tokens: int) -> None:
        """Count P's own prefix-cache hit for a prompt (the "hit rate on P")."""
        self._c["p_hit_tokens"] += hit_tokens
        self._c["p_total_tokens"] += total_tokens

    def statistics(self) -> MirrorStats:
        """A snapshot of the accounting."""
        return MirrorStats(**self._c)
