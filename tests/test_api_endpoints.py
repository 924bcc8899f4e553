"""The engine-facing API with real sockets: P, RLD and MD in one trio loop."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from pddnet.api import (
    Abort,
    Emitted,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    RelayEndpoint,
    SyncEndpoint,
)
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.control import ControlNode
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire

KEY = b"an-api-test-secret-0123456789abcdef"
NB = 512


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[int, dict[int, tuple[int, str]]] = {}
        self.ended: dict[int, str] = {}

    def on_emit(self, peer: str, msg: Emitted) -> None:
        pos = self.tokens.setdefault(msg.request_id, {})
        assert msg.position not in pos, "a position was emitted twice"
        pos[msg.position] = (msg.token, peer)
        if msg.finished:
            self.ended[msg.request_id] = "finished"

    def on_abort(self, peer: str, msg: Abort) -> None:
        self.ended.setdefault(msg.request_id, f"aborted: {msg.reason}")


async def test_both_routes_match_greedy_and_release_everything() -> None:
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    sink = Sink()
    async with (
        ControlNode("user", secret=KEY) as user,
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        RelayEndpoint("rld", rm.pool, ReferenceEngine(rm, step_time_s=0.005), secret=KEY) as rld,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        user.route(Emitted, sink.on_emit)
        user.route(Abort, sink.on_abort)
        await wire(p, rld, md, user)
        rng = np.random.default_rng(1)
        base = rng.integers(0, TINY.vocab_size, 150).tolist()
        cases = []
        # a cold request on each route, then a warm one that extends the first prompt
        for rid, (prompt, route) in enumerate(
            [(base, Route.P_RLD_MD), (base[:77], Route.P_MD), (base + [5] * 20, Route.P_MD)], 1
        ):
            seq = pm.new_sequence()
            pm.reserve(seq, len(prompt))
            first = greedy(pm.prefill(seq, prompt))
            sub = await p.submit(
                rid, prompt, seq.block_table.tolist(), first, 40, sink="user", route=route
            )
            assert sub.decision.route is route
            cases.append((rid, prompt, sub))
            with trio.fail_after(20):
                while rid not in sink.ended:
                    await trio.sleep(0.01)
        for rid, prompt, _ in cases:
            assert sink.ended[rid] == "finished"
            got = sink.tokens[rid]
            assert sorted(got) == list(range(40))
            assert [got[k][0] for k in range(40)] == reference(prompt, 40)
        # RLD first (on loopback MD's KV may land before RLD emitted anything; the
        # demo test shows eager tokens over an emulated WAN), then MD, one switch
        sources = [sink.tokens[1][k][1] for k in range(40)]
        switch = sources.index("md")
        assert set(sources[:switch]) <= {"rld"} and set(sources[switch:]) == {"md"}
        # the third prompt extends the first: MD's cache held its 9 full blocks
        assert cases[2][2].hit_blocks == 150 // 16
        with trio.fail_after(5):
            while p.statistics().held_blocks:
                await trio.sleep(0.01)
        released = p.poll_events()
        assert sorted(ev.request_id for ev in released) == [1, 2, 3]
        assert all(ev.error is None for ev in released)
        assert rld.statistics().active == md.statistics().active == 0
        assert rld.statistics().free_blocks == NB  # RLD keeps nothing
        assert md.statistics().free_blocks == NB - len(md.cache)  # MD keeps its cache only


async def test_refused_offer_is_a_typed_error_and_leaks_nothing() -> None:
    pm = ReferenceModel.create(TINY, num_blocks=NB)
    mm = ReferenceModel.create(TINY, num_blocks=8)  # far too small
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        prompt = list(range(200))
        seq = pm.new_sequence()
        pm.reserve(seq, 200)
        from pddnet import RemoteCallError

        with pytest.raises(RemoteCallError, match="ResourceLimitError"):
            await p.submit(1, prompt, seq.block_table.tolist(), 3, 10, sink="p", route=Route.P_MD)
        assert p.statistics().held_blocks == 0
        assert md.statistics().free_blocks == 8 and md.drc.open_plans == 0


async def test_request_bounds_refuse_with_a_typed_error_and_leak_nothing() -> None:
    from pddnet import RemoteCallError, ResourceLimitError

    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY, max_requests=3) as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY, max_requests=2) as md,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        seqs = []
        for _ in range(4):
            seq = pm.new_sequence()
            pm.reserve(seq, 40)
            seqs.append(seq)
        submit = [
            lambda rid, s=s: p.submit(
                rid,
                list(range(40)),
                s.block_table.tolist(),
                3,
                200,
                sink="p",
                route=Route.P_MD,
                ready=False,  # the KV stays at P: both ends hold the request
            )
            for s in seqs
        ]
        await submit[0](1)
        await submit[1](2)
        # MD holds two requests: the third offer is refused, and P keeps nothing for it
        with pytest.raises(RemoteCallError, match="max_requests=2") as info:
            await submit[2](3)
        assert info.value.code == "ResourceLimitError"
        assert md.statistics().active == 2 and md.statistics().rejected == 1
        # P's own bound: the two accepted requests are in flight
        p.max_requests = 2
        with pytest.raises(ResourceLimitError, match="max_requests=2"):
            await submit[3](4)
        assert len(p.leases) == 2 and 1 in p.leases and 2 in p.leases
        for rid in (1, 2):
            await p.abort(rid)
        with trio.fail_after(10):
            while md.statistics().active or p.statistics().held_blocks:
                await trio.sleep(0.02)
        assert md.statistics().free_blocks == NB - len(md.cache)


async def test_a_grant_the_wan_receiver_refuses_leaks_nothing() -> None:
    from pddnet import RemoteCallError
    from pddnet.transport.wan import WanLimits

    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint(
            "md", mm.pool, ReferenceEngine(mm), secret=KEY, wan_limits=WanLimits(max_transfers=1)
        ) as md,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        free0 = md.statistics().free_blocks
        for rid in (1, 2):
            seq = pm.new_sequence()
            pm.reserve(seq, 100)
            prompt = [rid] * 100  # different prompts: no cache hit
            call = p.submit(
                rid,
                prompt,
                seq.block_table.tolist(),
                3,
                20,
                sink="p",
                route=Route.P_MD,
                ready=False,
            )
            if rid == 1:
                await call
                continue
            with pytest.raises(RemoteCallError, match="max_transfers") as info:
                await call
            assert info.value.code == "WanLimitExceeded"
        assert md.statistics().active == 1 and md.statistics().rejected == 1
        used = free0 - md.statistics().free_blocks  # request 1's blocks only
        assert used == -(-(100 + 20) // mm.pool.layout.block_size)
        assert md.drc.open_plans == 1
        await p.abort(1)
        with trio.fail_after(10):
            while md.statistics().active or p.statistics().held_blocks:
                await trio.sleep(0.02)
        assert md.statistics().free_blocks == free0 and md.drc.open_plans == 0


def test_sync_facade_submits_and_polls() -> None:
    pm = ReferenceModel.create(TINY, num_blocks=NB)
    ep = SyncEndpoint(lambda: PrefillEndpoint("p", pm.pool, secret=KEY)).start()
    try:
        t1 = ep.submit("statistics_async")
        t2 = ep.submit(lambda e: _stats(e))
        import select

        got = {}
        for _ in range(50):
            select.select([ep.wakeup_fd], [], [], 0.1)
            for c in ep.poll():
                got[c.ticket] = c
            if len(got) == 2:
                break
        assert isinstance(got[t1].error, AttributeError)  # no such method: a typed failure
        assert got[t2].error is None and got[t2].result.requests == 0
        assert ep.call(lambda e: _stats(e)).held_blocks == 0
    finally:
        ep.close()


async def _stats(endpoint: PrefillEndpoint):  # type: ignore[no-untyped-def]
    await trio.lowlevel.checkpoint()
    return endpoint.statistics()


@pytest.mark.parametrize("keep", [False, True])
async def test_strange_traffic_cuts_off_or_feeds_the_cache(keep: bool) -> None:
    """RLD finishes before MD's KV lands: the WAN transfer is cancelled and MD
    frees its blocks, or (keep) the transfer completes into MD's cache."""
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    sink = Sink()
    async with (
        ControlNode("user", secret=KEY) as user,
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        RelayEndpoint("rld", rm.pool, ReferenceEngine(rm), secret=KEY, cut_off_wan=not keep) as rld,
        MainEndpoint(
            "md", mm.pool, ReferenceEngine(mm), secret=KEY, keep_strange_traffic=keep
        ) as md,
    ):
        user.route(Emitted, sink.on_emit)
        user.route(Abort, sink.on_abort)
        await wire(p, rld, md, user)
        prompt = np.random.default_rng(2).integers(0, TINY.vocab_size, 1000).tolist()
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))
        first = greedy(pm.prefill(seq, prompt))
        # layer-wise: RLD gets every layer now, MD none until RLD has finished
        await p.submit(
            7,
            prompt,
            seq.block_table.tolist(),
            first,
            4,
            sink="user",
            route=Route.P_RLD_MD,
            ready=False,
        )
        for layer in range(TINY.num_layers):
            p.mark_layer_ready(7, layer, dest="rld")
        with trio.fail_after(20):
            while 7 not in sink.ended:
                await trio.sleep(0.01)
            if keep:  # MD still waits for its KV: send it now
                for layer in range(TINY.num_layers):
                    p.mark_layer_ready(7, layer, dest="md")
            released = await p.next_event()
            while md.statistics().active:
                await trio.sleep(0.01)
        assert sink.ended[7] == "finished"
        assert {src for _, src in sink.tokens[7].values()} == {"rld"}, sink.tokens[7]
        assert [sink.tokens[7][k][0] for k in range(4)] == reference(prompt, 4)
        assert p.statistics().held_blocks == 0
        if keep:
            assert released.error is None  # the transfer completed
            assert len(md.cache) == 1000 // 16  # the prompt's full blocks are cached
            assert md.statistics().free_blocks == NB - 1000 // 16
        else:
            assert released.error is not None  # cancelled at the source
            assert len(md.cache) == 0 and md.statistics().free_blocks == NB


async def test_request_deadline_bounds_the_wait_for_kv() -> None:
    """MD never gets its KV: the request fails with an Abort to the sink within
    its deadline, MD frees its blocks and P's lease ends with an error."""
    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    sink = Sink()
    async with (
        ControlNode("user", secret=KEY) as user,
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        user.route(Emitted, sink.on_emit)
        user.route(Abort, sink.on_abort)
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        await md.node.connect("user", user.address)
        prompt = list(range(200))
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))
        t0 = trio.current_time()
        # ready=False and no layer ever marked: the KV never leaves P
        await p.submit(
            3,
            prompt,
            seq.block_table.tolist(),
            1,
            8,
            sink="user",
            route=Route.P_MD,
            ready=False,
            deadline_s=1.0,
        )
        with trio.fail_after(10):
            while 3 not in sink.ended:
                await trio.sleep(0.01)
            released = await p.next_event()
            while md.statistics().active:
                await trio.sleep(0.01)
        assert sink.ended[3].startswith("aborted")
        assert trio.current_time() - t0 < 5  # the deadline, not the 30 s default
        assert released.error is not None and p.statistics().held_blocks == 0
        assert md.statistics().free_blocks == NB and md.drc.open_plans == 0


def _tasks_named(suffix: str) -> int:
    """Tasks of this trio run whose name ends with ``suffix`` (trio's public task tree)."""
    todo, n = [trio.lowlevel.current_root_task()], 0
    while todo:
        task = todo.pop()
        n += task.name.endswith(suffix)
        todo.extend(c for nursery in task.child_nurseries for c in nursery.child_tasks)
    return n


async def test_reconnecting_a_decoder_keeps_one_watch_task() -> None:
    """connect_peer again (a restarted peer, the directory's retry) does not add
    a second task pinging the same decoder: one per peer name."""
    rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    async with (
        RelayEndpoint("rld", rm.pool, ReferenceEngine(rm), secret=KEY) as rld,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        before = _tasks_named("_DecodeEndpoint._watch")
        for _ in range(3):
            await rld.connect_peer(md.info())
            await md.connect_peer(rld.info())
        assert _tasks_named("_DecodeEndpoint._watch") - before == 2  # one each way
