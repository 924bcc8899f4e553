"""The decode-side radix cache (DRC): MD's prefix tree over token blocks.

Theory of operation
-------------------
The tree stores history KV by *block*: a node is one full block of
``block_size`` tokens, holding the id of the MD pool block that contains its
KV. A node is indexed by its chain key (:mod:`pddnet.cache._hash`), which names
the whole prefix ending in it, and keeps a pointer to its parent. So the tree
is a radix tree whose edges are blocks, and looking up a child is one dict
probe on the child's key.

The blocks one insert adds form a *run*: consecutive nodes, each the parent
of the next, whose token bytes, keys and block ids the run keeps in three
flat buffers (a node is its run and its position in it). An insert whose
cached prefix ends at the last node of a run with all its nodes cached
extends that run, so a conversation's turns make one run. A match walks a
run in one step: having accepted the run's node ``j`` for block ``i``, it
accepts blocks ``i+1 ..`` as long as their keys and token bytes equal the
run's nodes ``j+1 ..`` (two byte-string comparisons, not a dict probe and a
comparison per block). That is the per-block rule below, not a shortcut of
it: a live node is the only node under its key and its parent is the run's
previous node, so equal keys give the node the per-block walk would find,
with the right parent, and equal bytes its token check. The walk goes back
to per-block probes where the run ends or differs. A run's live nodes are
always a prefix of it (a node's successor in its run is its child, evicted
first), so ``alive`` counts them. A run's buffers live as long as any of
its nodes: a run evicted down to one block still holds all its bytes.

Rules, and why they hold:

1. **Prefix-closed.** A node exists only while its parent exists. Inserting
   walks from the root; eviction removes leaves only. So the set of cached
   blocks of any prompt is always a prefix of its blocks, and "what MD lacks"
   is always a suffix ``[hit, n)``.
2. **Exact matches.** :meth:`RadixCache.match_prefix` accepts block ``i`` only
   if the node under key ``i`` has the node of block ``i-1`` as parent *and*
   holds the same token bytes. Keys only index; they never decide. A hash
   collision (or a crafted one) ends the match early: it costs a miss, never a
   wrong prefix. ``statistics().collisions`` counts them.
3. **Pins protect paths.** A plan in flight pins the *tip* of its matched
   path (a per-node count). Eviction takes only unpinned leaves, and every
   ancestor of a pinned node has a child on the way to it, so no ancestor is
   ever a leaf: pinning the tip protects the whole prefix in O(1). Thus a
   block is evictable iff it is unpinned and has no pinned descendant, and
   no leaf-only eviction can break that.
4. **LRU over leaves.** Every match or insert *touches* its tip with a fresh,
   strictly increasing tick. A node's recency is the newest touch anywhere in
   its subtree; rather than touching every ancestor (O(path)), a node takes
   the max of its own tick and the tick of each child evicted below it
   (lazy propagation), which equals that max by the time the node becomes a
   leaf. Eviction pops the leaf with the oldest recency from a heap with
   lazy deletion. Ticks are unique, so the victim order is deterministic
   (tests compare it with a naive reference).
5. **Change log.** Every insert and eviction is appended, in order, to a log
   of ``(op, keys)`` batches; :class:`~pddnet.cache.CacheServer` turns it into
   the events that feed P's mirror.

The cache never allocates or frees pool blocks itself: :meth:`insert` adopts
the ids the engine hands in (and hands back the ones it did not need), and
:meth:`evict` returns the ids it released. The engine calls ``evict`` when its
allocator runs short, as SGLang's radix cache is used.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LayoutMismatch, LocalProtocolError
from ._hash import as_tokens, block_hashes

__all__ = ["CacheOp", "CacheStats", "InsertResult", "Match", "RadixCache"]


class CacheOp(enum.IntEnum):
    INSERT = 0
    EVICT = 1


class _Run:
    """Consecutive blocks, each the parent of the next: flat buffers, one entry per node."""

    __slots__ = ("alive", "block_ids", "keys", "size", "tokens")

    def __init__(self) -> None:
        self.tokens = bytearray()  # token bytes (little-endian uint32), block_size * 4 per node
        self.keys = bytearray()  # chain keys (native uint64), 8 per node
        self.block_ids: npt.NDArray[np.int64] = np.empty(0, np.int64)
        self.size = 0  # nodes ever added
        self.alive = 0  # its nodes 0 .. alive - 1 are cached


class _Node:
    __slots__ = ("alive", "block_id", "children", "key", "parent", "pins", "pos", "run", "tick")

    def __init__(
        self, key: int, parent: _Node | None, run: _Run, pos: int, block_id: int, tick: int
    ) -> None:
        self.key = key
        self.parent = parent
        self.run = run
        self.pos = pos
        self.block_id = block_id
        self.children = 0
        self.pins = 0
        self.tick = tick
        self.alive = True


@dataclass(frozen=True, slots=True)
class Match:
    """The cached prefix of a prompt.

    Attributes:
        num_blocks: full blocks of the prompt that are cached (a prefix).
        block_ids: their MD pool block ids, in prompt order (int64 array).
        keys: chain keys of *all* full blocks of the prompt (uint64 array).
        full_blocks: number of full blocks in the prompt.
    """

    num_blocks: int
    block_ids: npt.NDArray[np.int64]
    keys: npt.NDArray[np.uint64]
    full_blocks: int
    _tip: _Node | None = None


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`RadixCache.insert` did.

    Attributes:
        cached_before: leading blocks that were already cached (their ids stay
            the cache's; the caller's ids for them are in ``unused_block_ids``).
        inserted: blocks newly adopted by the cache.
        unused_block_ids: caller block ids the cache did not adopt (duplicates,
            blocks past a collision, ids beyond the full blocks); the caller
            frees them.
    """

    cached_before: int
    inserted: int
    unused_block_ids: list[int]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a :class:`RadixCache`'s counters."""

    size_blocks: int
    pinned_nodes: int
    lookups: int
    queried_blocks: int
    hit_blocks: int
    inserted_blocks: int
    evicted_blocks: int
    collisions: int

    @property
    def hit_rate(self) -> float:
        """Hit blocks over queried full blocks (0.0 before any lookup)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


def _leading_equal(buf: bytearray, row: int, mine: npt.NDArray[Any]) -> int:
    """How many leading rows of ``mine`` (2-D) equal ``buf``'s rows ``row ..``."""
    offset = row * mine.itemsize * mine.shape[1]
    theirs = np.frombuffer(buf, mine.dtype, mine.size, offset).reshape(mine.shape)
    return int(np.argmax((theirs != mine).any(axis=1)))


class RadixCache:
    """MD's decode-side radix cache (see the module docstring for the rules).

    Args:
        block_size: tokens per block (must equal the engine's KV block size).
        algo: hash-chain algorithm, ``"xxh3_64"`` or ``"blake2b"``.

    Raises:
        LayoutMismatch: for a bad ``block_size`` or ``algo``.
    """

    def __init__(self, block_size: int, *, algo: str = "xxh3_64") -> None:
        block_hashes([], block_size, algo=algo)  # validates both
        self.block_size = block_size
        self.algo = algo
        self._nodes: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, _Node]] = []
        self._heap_seq = itertools.count()
        self._tick = 0
        self._pins: dict[int, _Node | None] = {}
        self._pin_ids = itertools.count(1)
        self._log: list[tuple[CacheOp, list[int]]] = []
        self._lookups = self._queried = self._hits = 0
        self._inserted = self._evicted = self._collisions = 0

    # ------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: int) -> bool:
        return int(key) in self._nodes

    def keys(self) -> list[int]:
        """Every cached key (any order)."""
        return list(self._nodes)

    def hashes(self, tokens: Any) -> npt.NDArray[np.uint64]:
        """The chain keys of ``tokens``' full blocks under this cache's algorithm."""
        return block_hashes(tokens, self.block_size, algo=self.algo)

    def match_prefix(self, tokens: Any, *, keys: Any = None, touch: bool = True) -> Match:
        """The longest cached prefix of ``tokens``, verified block by block.

        Args:
            tokens: the prompt's token ids.
            keys: its chain keys, if already computed (must be this cache's).
            touch: count this as a use for LRU and in the hit statistics.

        Returns:
            A :class:`Match`; pass it to :meth:`pin` to keep it cached.
        """
        toks = as_tokens(tokens)
        n = toks.size // self.block_size
        key_arr = self.hashes(toks) if keys is None else np.ascontiguousarray(keys, dtype=np.uint64)
        if key_arr.size != n:
            raise LayoutMismatch(f"{key_arr.size} keys for {n} full blocks")
        hit, tip, pieces, _ = self._walk(toks, key_arr, n)
        if touch:
            self._lookups += 1
            self._queried += n
            self._hits += hit
            if tip is not None:
                self._touch(tip)
        ids = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        return Match(hit, ids, key_arr, n, tip)

    # -------------------------------------------------------------- pinning
    def pin(self, match: Match) -> int:
        """Keep ``match``'s blocks from eviction until :meth:`unpin`. O(1).

        Returns:
            A pin id (an empty match gets one too; unpinning it is a no-op).

        Raises:
            LocalProtocolError: if the matched blocks were evicted since the match.
        """
        tip = match._tip
        if tip is not None:
            if not tip.alive:
                raise LocalProtocolError("can't pin a match whose blocks were evicted since")
            tip.pins += 1
        pin_id = next(self._pin_ids)
        self._pins[pin_id] = tip
        return pin_id

    def unpin(self, pin_id: int) -> None:
        """Release a pin.

        Raises:
            LocalProtocolError: for an unknown or already released pin id.
        """
        try:
            tip = self._pins.pop(pin_id)
        except KeyError:
            raise LocalProtocolError(f"unknown DRC pin id {pin_id}") from None
        if tip is not None:
            tip.pins -= 1
            self._maybe_candidate(tip)

    @property
    def pinned(self) -> int:
        """Number of live pins."""
        return len(self._pins)

    # ------------------------------------------------------------ mutation
    def insert(
        self, tokens: Any, block_ids: Sequence[int] | Any, *, keys: Any = None
    ) -> InsertResult:
        """Cache the full blocks of ``tokens``, stored in MD pool blocks ``block_ids``.

        Blocks already cached keep their existing pool block; the caller's id
        for them is returned in ``unused_block_ids``. The new tip is touched.

        Args:
            tokens: token ids (a trailing partial block is ignored).
            block_ids: pool block id of each block of ``tokens``, in order; at
                least one per full block.
            keys: the chain keys of ``tokens``, if already computed.

        Raises:
            LayoutMismatch: if there are fewer block ids than full blocks.
        """
        toks = as_tokens(tokens)
        bs = self.block_size
        n = toks.size // bs
        id_arr = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        ids: list[int] = id_arr.tolist()
        if len(ids) < n:
            raise LayoutMismatch(f"{len(ids)} block ids for {n} full blocks")
        key_arr = self.hashes(toks) if keys is None else np.ascontiguousarray(keys, np.uint64)
        if key_arr.size != n:
            raise LayoutMismatch(f"{key_arr.size} keys for {n} full blocks")
        cached, prev, _, collided = self._walk(toks, key_arr, n)
        if collided:
            self._touch_if(prev)
            return InsertResult(cached, 0, ids)
        nodes = self._nodes
        new_keys: list[int] = []
        tick = self._next_tick()
        if prev is not None and prev.pos + 1 == prev.run.alive == prev.run.size:
            run = prev.run  # the prefix ends where its run does: extend it
        else:
            run = _Run()
        base = run.size
        for j, key in enumerate(key_arr[cached:].tolist()):
            if key in nodes:  # an unrelated prefix owns this key: a collision
                self._collisions += 1
                break
            node = _Node(key, prev, run, base + j, ids[cached + j], tick)
            if prev is not None:
                prev.children += 1
            nodes[key] = node
            new_keys.append(key)
            prev = node
        inserted = len(new_keys)
        if new_keys:
            end = cached + inserted
            run.tokens += toks[cached * bs : end * bs].data
            run.keys += key_arr[cached:end].data
            run.block_ids = np.concatenate((run.block_ids, id_arr[cached:end]))
            run.size = run.alive = base + inserted
            self._inserted += inserted
            self._record(CacheOp.INSERT, new_keys)
        self._touch_if(prev)
        return InsertResult(cached, inserted, ids[:cached] + ids[cached + inserted :])

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` least recently used unpinned leaves.

        Returns:
            The freed pool block ids, in eviction order (fewer than asked if
            everything else is pinned or needed as an ancestor).
        """
        freed: list[int] = []
        heap = self._heap
        keys: list[int] = []
        while len(freed) < num_blocks and heap:
            tick, _, node = heapq.heappop(heap)
            if not node.alive or node.children or node.pins or node.tick != tick:
                continue
            node.alive = False
            node.run.alive = node.pos  # its successors in the run went first
            del self._nodes[node.key]
            freed.append(node.block_id)
            keys.append(node.key)
            parent = node.parent
            if parent is not None:
                parent.children -= 1
                if node.tick > parent.tick:
                    parent.tick = node.tick
                self._maybe_candidate(parent)
        if keys:
            self._evicted += len(keys)
            self._record(CacheOp.EVICT, keys)
        # Drop dead heap entries once they dominate, so the heap stays O(size).
        if len(heap) > 4 * len(self._nodes) + 64:
            self._heap = [e for e in heap if self._valid(e)]
            heapq.heapify(self._heap)
        return freed

    @property
    def evictable_blocks(self) -> int:
        """Blocks that :meth:`evict` could free now (unpinned, no pinned descendant). O(n)."""
        protected: set[int] = set()
        for tip in self._pins.values():
            node = tip
            while node is not None and node.key not in protected:
                protected.add(node.key)
                node = node.parent
        return len(self._nodes) - len(protected)

    # ------------------------------------------------------------ the log
    def take_changes(self) -> list[tuple[CacheOp, list[int]]]:
        """The insert/evict batches since the last call, in order."""
        log, self._log = self._log, []
        return log

    def statistics(self) -> CacheStats:
        """A snapshot of the counters."""
        return CacheStats(
            size_blocks=len(self._nodes),
            pinned_nodes=sum(1 for t in self._pins.values() if t is not None),
            lookups=self._lookups,
            queried_blocks=self._queried,
            hit_blocks=self._hits,
            inserted_blocks=self._inserted,
            evicted_blocks=self._evicted,
            collisions=self._collisions,
        )

    # ----------------------------------------------------------- internals
    def _walk(
        self, toks: npt.NDArray[np.uint32], key_arr: npt.NDArray[np.uint64], n: int
    ) -> tuple[int, _Node | None, list[npt.NDArray[np.int64]], bool]:
        """The verified cached prefix of ``n`` blocks.

        Follows rule 2 block by block, taking a run's agreeing blocks in one
        step (module docstring), and counts a collision where one ends it.

        Returns:
            Its length, its tip, its block ids (in pieces) and whether a
            collision ended it.
        """
        bs = self.block_size
        nodes = self._nodes
        pieces: list[npt.NDArray[np.int64]] = []
        prev: _Node | None = None
        i = 0
        while i < n:
            node = nodes.get(key_arr.item(i))
            if node is None:
                break
            run, pos = node.run, node.pos
            span = min(run.alive - pos, n - i) if node.parent is prev else 0
            # Keys first (where the prompt leaves the run, they differ), then the
            # tokens of the blocks whose keys agree; all equal is one memcmp each.
            mine = key_arr[i : i + span]
            if span and not run.keys.startswith(mine.data, pos * 8):
                span = _leading_equal(run.keys, pos, mine.reshape(span, 1))
            rows = toks[i * bs : (i + span) * bs]
            if span and not run.tokens.startswith(rows.data, pos * 4 * bs):
                span = _leading_equal(run.tokens, pos, rows.reshape(span, bs))
            if span == 0:
                self._collisions += 1
                return i, prev, pieces, True
            pieces.append(run.block_ids[pos : pos + span])
            i += span
            prev = node if span == 1 else nodes[key_arr.item(i - 1)]
        return i, prev, pieces, False

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _touch(self, node: _Node) -> None:
        node.tick = self._next_tick()
        self._maybe_candidate(node)

    def _touch_if(self, node: _Node | None) -> None:
        if node is not None:
            self._touch(node)

    def _maybe_candidate(self, node: _Node) -> None:
        if node.alive and not node.children and not node.pins:
            heapq.heappush(self._heap, (node.tick, next(self._heap_seq), node))

    @staticmethod
    def _valid(entry: tuple[int, int, _Node]) -> bool:
        tick, _, node = entry
        return node.alive and not node.children and not node.pins and node.tick == tick

    def _record(self, op: CacheOp, keys: list[int]) -> None:
        if self._log and self._log[-1][0] is op:
            self._log[-1][1].extend(keys)
        else:
            self._log.append((op, keys))
