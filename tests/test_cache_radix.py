"""RadixCache: unit cases and a Hypothesis state machine against a naive reference."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pddnet import LayoutMismatch, LocalProtocolError
from pddnet.cache import K_HASH_ALGOS, CacheOp, RadixCache, block_hashes

BS = 2


# ------------------------------------------------------------------ hashing
def test_hash_chain_names_the_whole_prefix() -> None:
    a = np.arange(64, dtype=np.int64)
    b = a.copy()
    b[5] = 999  # inside block 1 (block size 4)
    ka, kb = block_hashes(a, 4), block_hashes(b, 4)
    assert ka.dtype == np.uint64 and ka.size == 16
    assert ka[0] == kb[0]
    assert (ka[1:] != kb[1:]).all()  # every later key differs: the chain carries the change
    # Same tokens, same keys; a partial tail adds no key.
    assert (block_hashes(list(range(66)), 4) == ka).all()
    for algo in K_HASH_ALGOS:
        assert block_hashes(a, 4, algo=algo).size == 16
    with pytest.raises(LayoutMismatch):
        block_hashes(a, 4, algo="md5")
    with pytest.raises(LayoutMismatch):
        block_hashes(a, 0)
    with pytest.raises(ValueError):
        block_hashes([-1, 2], 1)


def test_hash_matches_a_per_block_reference() -> None:
    import xxhash

    toks = np.random.default_rng(1).integers(0, 2**32, 40, dtype=np.uint64)
    h = 0
    ref = []
    for i in range(0, 40 - 7, 8):
        h = xxhash.xxh3_64_intdigest(toks[i : i + 8].astype("<u4").tobytes(), h)
        ref.append(h)
    assert block_hashes(toks, 8).tolist() == ref


# ------------------------------------------------------------------ unit cases
def test_insert_match_pin_evict() -> None:
    c = RadixCache(4)
    toks = list(range(10))  # two full blocks and a partial one
    r = c.insert(toks, [7, 8, 9])
    assert (r.cached_before, r.inserted, r.unused_block_ids) == (0, 2, [9])
    m = c.match_prefix([*toks, 55, 56])
    assert m.num_blocks == 2 and m.block_ids.tolist() == [7, 8] and m.full_blocks == 3
    # A second prompt sharing block 0 only.
    r2 = c.insert([0, 1, 2, 3, 9, 9, 9, 9], [1, 2])
    assert (r2.cached_before, r2.inserted, r2.unused_block_ids) == (1, 1, [1])
    pin = c.pin(c.match_prefix(toks))
    assert c.evictable_blocks == 1  # block 0 and 8 protected by the pin on block 8's node
    assert c.evict(10) == [2]  # only the unpinned leaf goes
    assert len(c) == 2
    c.unpin(pin)
    assert c.evict(10) == [8, 7]  # leaf first, then its parent
    assert len(c) == 0
    with pytest.raises(LocalProtocolError):
        c.unpin(pin)
    log = c.take_changes()
    assert [op for op, _ in log] == [CacheOp.INSERT, CacheOp.EVICT]
    assert len(log[0][1]) == 3 and len(log[1][1]) == 3
    s = c.statistics()
    assert s.inserted_blocks == 3 and s.evicted_blocks == 3 and s.lookups == 2


def test_pin_of_an_evicted_match_is_refused() -> None:
    c = RadixCache(2)
    c.insert([1, 2, 3, 4], [0, 1])
    m = c.match_prefix([1, 2, 3, 4])
    c.evict(5)
    with pytest.raises(LocalProtocolError):
        c.pin(m)


def test_lru_order_follows_use() -> None:
    c = RadixCache(1)
    c.insert([1], [10])
    c.insert([2], [20])
    c.insert([3], [30])
    c.match_prefix([1])  # 1 is now the most recent
    assert c.evict(2) == [20, 30]
    assert c.evict(1) == [10]


def test_lru_recency_of_a_parent_is_its_newest_descendant() -> None:
    c = RadixCache(1)
    c.insert([1, 2], [1, 2])  # A=1 -> B=2
    c.insert([9], [9])
    pin = c.pin(c.match_prefix([9]))
    c.match_prefix([1, 2])  # A-B used after 9
    assert c.evict(1) == [2]  # 9 is pinned, so B goes although newer
    c.unpin(pin)
    # A inherits B's use, which is newer than 9's: 9 goes first.
    assert c.evict(1) == [9]
    assert c.evict(1) == [1]


def test_a_run_is_matched_block_by_block() -> None:
    # One insert is one run; a match takes its agreeing blocks at once, so check
    # where a run ends, is cut by eviction, branches, or agrees on keys only.
    c = RadixCache(2)
    a = list(range(12))  # 6 blocks
    ids = np.arange(100, 106)
    keys = np.arange(1, 7, dtype=np.uint64)  # caller-given keys, one per block
    assert c.insert(a, ids, keys=keys).inserted == 6
    ids[:] = 0  # the cache kept its own copy of the ids
    m = c.match_prefix(a, keys=keys)
    assert m.block_ids.tolist() == list(range(100, 106))
    m.block_ids[:] = 0  # and hands out a copy
    forged = a.copy()
    forged[7] = 99  # block 3's tokens differ, its key does not: a collision
    assert c.match_prefix(forged, keys=keys).block_ids.tolist() == [100, 101, 102]
    assert c.statistics().collisions == 1
    other = np.array([1, 2, 3, 70, 71, 72], dtype=np.uint64)  # block 3's key differs
    assert c.match_prefix(a, keys=other).num_blocks == 3
    # A branch off block 1: the walk goes from A's run into the new one.
    b = [*a[:4], 50, 51, 52, 53]
    r = c.insert(b, [7, 8, 200, 201], keys=np.array([1, 2, 30, 31], dtype=np.uint64))
    assert (r.cached_before, r.inserted, r.unused_block_ids) == (2, 2, [7, 8])
    got = c.match_prefix(b, keys=np.array([1, 2, 30, 31], dtype=np.uint64))
    assert got.block_ids.tolist() == [100, 101, 200, 201]
    assert c.evict(2) == [105, 104]  # A's tail (older than B's use), leaf first
    assert c.match_prefix(a, keys=keys).block_ids.tolist() == [100, 101, 102, 103]
    r = c.insert(a, [0, 0, 0, 0, 300, 301], keys=keys)  # re-cache the evicted tail
    assert (r.cached_before, r.inserted) == (4, 2)
    assert c.match_prefix(a, keys=keys).block_ids.tolist() == [100, 101, 102, 103, 300, 301]
    # The next turn continues where that run ends: the run grows.
    longer = np.arange(1, 9, dtype=np.uint64)
    r = c.insert([*a, 60, 61, 62, 63], [0] * 6 + [400, 401], keys=longer)
    assert (r.cached_before, r.inserted) == (6, 2)
    want = [100, 101, 102, 103, 300, 301, 400, 401]
    assert c.match_prefix([*a, 60, 61, 62, 63], keys=longer).block_ids.tolist() == want
    assert c.match_prefix([*a, 60, 61, 62, 9], keys=longer).num_blocks == 7
    assert c.statistics().collisions == 2


def _weak(blocks: list[bytes], seed: int) -> list[int]:
    # A terrible hash: collides all the time. The cache must stay exact anyway.
    out, h = [], seed
    for b in blocks:
        h = (h + sum(b)) % 3
        out.append(h)
    return out


@pytest.fixture
def weak_algo() -> Iterator[str]:
    K_HASH_ALGOS["weak3"] = _weak
    yield "weak3"
    del K_HASH_ALGOS["weak3"]


@given(prompts=st.lists(st.lists(st.integers(0, 3), max_size=10), min_size=1, max_size=12))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_collisions_never_yield_a_wrong_prefix(weak_algo: str, prompts: list[list[int]]) -> None:
    c = RadixCache(BS, algo=weak_algo)
    owner: dict[int, tuple[int, ...]] = {}  # block id -> the prefix its KV belongs to
    next_id = 0
    for p in prompts:
        m = c.match_prefix(p)
        # Every matched block holds the KV of exactly the prompt's prefix up to it.
        for j, bid in enumerate(m.block_ids.tolist()):
            assert owner[bid] == tuple(p[: (j + 1) * BS])
        ids = list(range(next_id, next_id + len(p) // BS))
        next_id += len(ids)
        for j, bid in enumerate(ids):
            owner[bid] = tuple(p[: (j + 1) * BS])
        c.insert(p, ids)


def test_weak_hash_does_collide_and_is_caught(weak_algo: str) -> None:
    c = RadixCache(BS, algo=weak_algo)
    c.insert([0, 1], [5])
    m = c.match_prefix([1, 0])  # same weak key, other tokens
    assert m.num_blocks == 0
    r = c.insert([1, 0], [6])
    assert r.inserted == 0 and r.unused_block_ids == [6]
    assert c.statistics().collisions == 2
    assert c.match_prefix([0, 1]).block_ids.tolist() == [5]


# ------------------------------------------------------------------ reference model
class NaiveCache:
    """The obvious implementation: prefixes as tuples, full scans everywhere."""

    def __init__(self) -> None:
        self.nodes: dict[tuple[tuple[int, ...], ...], list[int]] = {}  # path -> [block, tick]
        self.pins: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.tick = 0

    @staticmethod
    def path(tokens: list[int]) -> tuple[tuple[int, ...], ...]:
        n = len(tokens) // BS
        return tuple(tuple(tokens[i * BS : (i + 1) * BS]) for i in range(n))

    def _touch(self, path: tuple[tuple[int, ...], ...]) -> None:
        if path:
            self.tick += 1
            for j in range(1, len(path) + 1):
                self.nodes[path[:j]][1] = self.tick

    def match(self, tokens: list[int]) -> list[int]:
        path = self.path(tokens)
        i = 0
        while i < len(path) and path[: i + 1] in self.nodes:
            i += 1
        self._touch(path[:i])
        return [self.nodes[path[: j + 1]][0] for j in range(i)]

    def insert(self, tokens: list[int], ids: list[int]) -> tuple[int, list[int]]:
        path = self.path(tokens)
        cached = 0
        while cached < len(path) and path[: cached + 1] in self.nodes:
            cached += 1
        for j in range(cached, len(path)):
            self.nodes[path[: j + 1]] = [ids[j], 0]
        self._touch(path)
        return cached, ids[:cached] + ids[len(path) :]

    def evict(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            protected = {p[:j] for p in self.pins.values() for j in range(1, len(p) + 1)}
            parents = {p[:-1] for p in self.nodes}
            leaves = [p for p in self.nodes if p not in parents and p not in protected]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: self.nodes[p][1])
            out.append(self.nodes.pop(victim)[0])
        return out


DOCS = [[0, 1, 0, 1, 2, 2, 1, 0, 3, 3, 0, 0], [0, 1, 2, 2, 1, 1, 0, 3, 1, 2, 0, 1], [3, 3, 3]]
prompts = st.builds(
    lambda d, cut, tail: DOCS[d][:cut] + tail,
    st.integers(0, len(DOCS) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 3), max_size=5),
)


class RadixVsNaive(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fast = RadixCache(BS)
        self.ref = NaiveCache()
        self.free = list(range(10_000))
        self.pins: list[int] = []

    def _alloc(self, n: int) -> list[int]:
        ids, self.free = self.free[:n], self.free[n:]
        return ids

    @rule(p=prompts)
    def insert(self, p: list[int]) -> None:
        ids = self._alloc(len(p) // BS + 1)
        r = self.fast.insert(p, ids)
        cached, unused = self.ref.insert(p, ids)
        assert r.cached_before == cached
        assert r.unused_block_ids == unused
        self.free += unused

    @rule(p=prompts)
    def match(self, p: list[int]) -> None:
        m = self.fast.match_prefix(p)
        assert m.block_ids.tolist() == self.ref.match(p)

    @rule(p=prompts)
    def match_and_pin(self, p: list[int]) -> None:
        m = self.fast.match_prefix(p)
        assert m.block_ids.tolist() == self.ref.match(p)
        pin = self.fast.pin(m)
        self.ref.pins[pin] = NaiveCache.path(p)[: m.num_blocks]
        self.pins.append(pin)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def unpin(self, i: int) -> None:
        pin = self.pins.pop(i % len(self.pins))
        self.fast.unpin(pin)
        del self.ref.pins[pin]

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        got = self.fast.evict(n)
        assert got == self.ref.evict(n)
        self.free += got

    @invariant()
    def same_contents(self) -> None:
        assert len(self.fast) == len(self.ref.nodes)
        assert self.fast.pinned == len(self.ref.pins)
        protected = {p[:j] for p in self.ref.pins.values() for j in range(1, len(p) + 1)}
        assert self.fast.evictable_blocks == len(self.ref.nodes) - len(protected)

    @invariant()
    def no_block_lost_or_shared(self) -> None:
        cached = [v[0] for v in self.ref.nodes.values()]
        assert len(set(cached)) == len(cached)
        assert not set(cached) & set(self.free)
        assert len(cached) + len(self.free) == 10_000


RadixVsNaive.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixVsNaive = RadixVsNaive.TestCase
