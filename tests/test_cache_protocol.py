"""The DRC protocol: events, mirror, snapshots, the plan handshake, and eviction races."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pddnet import LayoutMismatch, LocalProtocolError, RemoteProtocolError
from pddnet.cache import (
    CacheMirror,
    CacheServer,
    DrcEvicted,
    DrcInserted,
    DrcPlanAbort,
    DrcPlanReply,
    DrcSnapshot,
    DrcSnapshotRequest,
    RadixCache,
)
from pddnet.wire import decode_frame, encode_frame, registered_messages

BS = 2


def roundtrip(msg):  # type: ignore[no-untyped-def]
    """Through the real control-frame codec, as the control plane would carry it."""
    frame = encode_frame(msg, key=b"k", src="md", dst="p", seq=1)
    return decode_frame(frame, key=b"k", src="md", dst="p").message


def test_type_ids_are_in_the_drc_range() -> None:
    ids = [
        tid
        for tid, cls in registered_messages().items()
        if cls.__module__.startswith("pddnet.cache")
    ]
    assert ids and all(48 <= t <= 63 for t in ids)


def test_events_feed_the_mirror_and_predict_the_delta() -> None:
    cache = RadixCache(4)
    server = CacheServer(cache, epoch=7)
    mirror = CacheMirror(4, bytes_per_token=10)
    prompt = list(range(100, 130))  # 7 full blocks + 2 tokens
    cache.insert(prompt[:20], list(range(5)))
    for ev in server.events():
        mirror.apply(roundtrip(ev))
    assert len(mirror) == 5 and mirror.epoch == 7 and mirror.seq == 1
    assert not mirror.needs_snapshot
    plan, req = mirror.plan("r1", prompt)
    assert plan.predicted_blocks == 5 and plan.num_blocks == 8 and plan.full_blocks == 7
    reply = server.handle_plan(roundtrip(req), now=0.0)
    assert isinstance(reply, DrcPlanReply) and reply.hit_blocks == 5
    plan = mirror.confirm(plan, roundtrip(reply))
    assert plan.send_blocks().tolist() == [5, 6, 7] and plan.send_tokens == (20, 30)
    s = mirror.statistics()
    assert (s.bytes_saved, s.bytes_sent) == (200, 100)
    assert s.md_hit_rate == pytest.approx(5 / 7) and s.overpredicted_blocks == 0
    # MD keeps the pinned prefix through a full eviction, then caches the delta.
    assert cache.evict(100) == []
    assert plan.plan_id is not None
    result = server.complete(plan.plan_id, [50, 51, 52])
    assert result.inserted == 2 and result.unused_block_ids == [52]
    assert server.open_plans == 0
    for ev in server.events():
        mirror.apply(ev)
    assert len(mirror) == 7


def test_stale_mirror_gets_the_true_missing_set() -> None:
    cache = RadixCache(BS)
    server = CacheServer(cache, epoch=1)
    mirror = CacheMirror(BS)
    prompt = list(range(12))
    cache.insert(prompt, list(range(6)))
    for ev in server.events():
        mirror.apply(ev)
    cache.evict(4)  # MD evicts; the event has not reached P yet
    plan, req = mirror.plan("r", prompt)
    assert plan.predicted_blocks == 6
    reply = server.handle_plan(req, now=0.0)
    plan = mirror.confirm(plan, reply)
    assert plan.hit_blocks == 2 and plan.send_from == 2
    assert mirror.statistics().overpredicted_blocks == 4


def test_gap_and_restart_ask_for_a_snapshot() -> None:
    cache = RadixCache(BS)
    server = CacheServer(cache, epoch=3)
    mirror = CacheMirror(BS)
    for i in range(4):
        cache.insert([i, i], [i])
    cache.evict(1)
    events = server.events()
    assert [type(e) for e in events] == [DrcInserted, DrcEvicted]
    # Events are coalesced: four inserts in one message.
    assert len(events[0].keys) == 4
    cache.insert([9, 9], [9])
    later = server.events()
    mirror.apply(events[0])
    mirror.apply(later[0])  # events[1] lost
    assert mirror.needs_snapshot and mirror.statistics().gaps == 1
    req = mirror.snapshot_request()
    assert isinstance(req, DrcSnapshotRequest)
    parts = server.handle(req, now=0.0)
    assert isinstance(parts, list)
    mirror.apply(parts[0])
    assert not mirror.needs_snapshot
    md_keys = cache.keys()
    assert all(k in mirror for k in md_keys)
    assert len(mirror) == len(cache)
    # MD restarts: a new epoch starting at seq 1 resets the mirror without a snapshot.
    cache2 = RadixCache(BS)
    server2 = CacheServer(cache2, epoch=4)
    cache2.insert([5, 5], [0])
    mirror.apply(server2.events()[0])
    assert len(mirror) == 1 and mirror.epoch == 4 and not mirror.needs_snapshot


def test_snapshot_in_parts_with_events_in_between(monkeypatch: pytest.MonkeyPatch) -> None:
    import pddnet.cache._server as srv

    monkeypatch.setattr(srv, "K_MAX_KEYS", 3)
    cache = RadixCache(1)
    server = CacheServer(cache, epoch=9)
    cache.insert(list(range(8)), list(range(8)))
    server.events()  # lost
    mirror = CacheMirror(1)
    parts = server.snapshot()
    assert len(parts) == 3 and [p.final for p in parts] == [False, False, True]
    cache.evict(1)
    ev = server.events()
    mirror.apply(parts[0])
    mirror.apply(ev[0])  # arrives mid-snapshot: must survive the install
    mirror.apply(parts[1])
    mirror.apply(parts[2])
    assert len(mirror) == 7 and mirror.seq == ev[0].seq
    with pytest.raises(LayoutMismatch):
        mirror.apply(DrcSnapshot(9, 1, 0, True, 4, "xxh3_64", []))


def test_bad_replies_and_requests_are_rejected() -> None:
    cache = RadixCache(BS)
    server = CacheServer(cache, epoch=1)
    mirror = CacheMirror(BS)
    plan, req = mirror.plan("r", [1, 2, 3, 4])
    with pytest.raises(RemoteProtocolError):
        mirror.confirm(plan, DrcPlanReply("r", 1, 3, 2, 1, 0))  # 3 of 2 blocks
    with pytest.raises(RemoteProtocolError):
        mirror.confirm(plan, DrcPlanReply("other", 1, 0, 2, 1, 0))
    with pytest.raises(RemoteProtocolError):
        server.handle_plan(type(req)("r", req.tokens, 5, BS, 0), now=0.0)
    with pytest.raises(RemoteProtocolError):
        server.handle_plan(type(req)("r", req.tokens, 4, 8, 0), now=0.0)
    with pytest.raises(RemoteProtocolError):
        mirror.apply(DrcPlanAbort(1))


def test_plan_lease_expires_and_abort_unpins() -> None:
    cache = RadixCache(BS)
    server = CacheServer(cache, epoch=1, lease_s=5.0)
    cache.insert([1, 2, 3, 4], [0, 1])
    mirror = CacheMirror(BS)
    _, req = mirror.plan("a", [1, 2, 3, 4])
    r1 = server.handle_plan(req, now=100.0)
    r2 = server.handle_plan(req, now=102.0)
    assert cache.evict(10) == [] and server.get_timer() == 105.0
    assert server.expire(104.0) == [] and server.expire(105.0) == [r1.plan_id]
    assert cache.evict(10) == []  # r2 still holds the prefix
    assert server.handle(DrcPlanAbort(r2.plan_id), now=106.0) is None
    assert not server.abort(r2.plan_id)
    with pytest.raises(LocalProtocolError):
        server.plan(r2.plan_id)
    assert cache.evict(10) == [1, 0]


# ------------------------------------------------------------------ eviction races
DOCS = [[1, 2, 1, 2, 3, 3, 0, 0, 2, 1, 1, 1, 3, 0], [1, 2, 1, 2, 0, 0, 3, 3, 1, 1], [2, 2, 2, 2, 2]]
prompts = st.builds(
    lambda d, cut, tail: DOCS[d][:cut] + tail,
    st.integers(0, len(DOCS) - 1),
    st.integers(0, 14),
    st.lists(st.integers(0, 3), max_size=4),
)
GARBAGE = 0xEE
POOL = 400


def truth(prompt: list[int], j: int) -> bytes:
    """The KV of block ``j`` of ``prompt``: a function of the whole prefix up to it."""
    return hashlib.sha256(repr(prompt[: (j + 1) * BS]).encode()).digest()[:16]


class EvictionRace(RuleBasedStateMachine):
    """P plans with a mirror that lags, drops events and resyncs; MD evicts at any
    time, even between the handshake and the transfer. Freed blocks are overwritten
    at once, so a block reused wrongly shows up as garbage in MD's assembled KV."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(BS)
        self.server = CacheServer(self.cache, epoch=11)
        self.mirror = CacheMirror(BS, bytes_per_token=1)
        self.pool = np.full((POOL, 16), GARBAGE, np.uint8)
        self.free = list(range(POOL))
        self.wire: list = []  # events MD -> P, in flight
        self.open: list = []  # (prompt, P plan) confirmed but not yet transferred
        self.lossy = False

    def _release(self, ids: list[int]) -> None:
        self.pool[ids] = GARBAGE
        self.free += ids

    def _pump(self) -> None:
        self.wire += self.server.events()

    @precondition(lambda self: len(self.free) > 20)
    @rule(p=prompts)
    def plan(self, p: list[int]) -> None:
        plan, req = self.mirror.plan(f"r{len(self.open)}", p)
        reply = self.server.handle_plan(roundtrip(req), now=0.0)
        plan = self.mirror.confirm(plan, roundtrip(reply))
        assert plan.hit_blocks == reply.hit_blocks
        if not self.lossy and not self.wire and not self.mirror.needs_snapshot:
            # An up-to-date mirror predicts exactly.
            assert plan.predicted_blocks == plan.hit_blocks
        self._pump()
        self.open.append((p, plan))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 50))
    def transfer(self, i: int) -> None:
        p, plan = self.open.pop(i % len(self.open))
        srv_plan = self.server.plan(plan.plan_id)
        # P sends exactly blocks [send_from, num_blocks) into freshly allocated MD blocks.
        new = self.free[: plan.num_blocks - plan.send_from]
        self.free = self.free[len(new) :]
        for k, j in enumerate(plan.send_blocks().tolist()):
            self.pool[new[k]] = np.frombuffer(truth(p, j), np.uint8)
        # MD's view of the prompt's KV: its pinned cached blocks, then the delta.
        ids = srv_plan.hit_block_ids.tolist() + new
        assert len(ids) == plan.num_blocks
        for j, bid in enumerate(ids):
            assert self.pool[bid].tobytes() == truth(p, j), f"block {j} of {p} is wrong"
        result = self.server.complete(plan.plan_id, new)
        self._release(result.unused_block_ids)
        self._pump()

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 50))
    def abort(self, i: int) -> None:
        _, plan = self.open.pop(i % len(self.open))
        self.server.handle(roundtrip(self.mirror.abort(plan)), now=0.0)

    @rule(n=st.integers(1, 30))
    def evict(self, n: int) -> None:
        self._release(self.cache.evict(n))
        self._pump()

    @precondition(lambda self: self.wire)
    @rule(n=st.integers(1, 4))
    def deliver(self, n: int) -> None:
        for ev in self.wire[:n]:
            self.mirror.apply(roundtrip(ev))
        self.wire = self.wire[n:]

    @precondition(lambda self: self.wire)
    @rule()
    def lose_one(self) -> None:
        self.wire.pop(0)
        self.lossy = True

    @precondition(lambda self: self.mirror.needs_snapshot)
    @rule()
    def resync(self) -> None:
        for ev in self.wire:
            self.mirror.apply(ev)
        self.wire = []
        for part in self.server.snapshot():
            self.mirror.apply(roundtrip(part))
        self.lossy = False

    @invariant()
    def in_sync_mirror_equals_md(self) -> None:
        if not self.wire and not self.lossy and not self.mirror.needs_snapshot:
            md_keys = self.cache.keys()
            assert all(k in self.mirror for k in md_keys)
            assert len(self.mirror) == len(self.cache)

    @invariant()
    def pinned_blocks_intact(self) -> None:
        for p, plan in self.open:
            for j, bid in enumerate(self.server.plan(plan.plan_id).hit_block_ids.tolist()):
                assert self.pool[bid].tobytes() == truth(p, j)


EvictionRace.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEvictionRace = EvictionRace.TestCase
