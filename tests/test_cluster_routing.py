"""Routing across instances with real endpoints over loopback sockets (one P,
two RLD, two MD in one trio loop): a session's later turns go to the MD
holding its prefix, relays share the load, a prefix still in flight to an MD
does not count as cached there and its bytes count as queued ahead, and with
no relay connected the router sheds to P->MD."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import numpy as np
import pytest
import trio

from pddnet import LocalProtocolError, PddnetError
from pddnet.api import MainEndpoint, PrefillEndpoint, ReferenceEngine, RelayEndpoint
from pddnet.demo import reference_streams
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import LinkEstimate, Route, RoutePolicy, Router, RouteReason, Verdict

KEY = b"a-cluster-routing-test-secret-0123456789"
NB = 512
MAX_TOKENS = 24
# TINY's KV is 8 KiB a block: at 100 kB/s a 200-token first turn (13 blocks)
# takes ~1 s to land, over the 0.5 s target (RLD masks it); a later turn's
# 2-block delta lands in 0.16 s (P->MD). Transfers this small never update the
# estimate (only those of 1 MiB or more do).
POLICY = RoutePolicy(ttft_target_s=0.5, md_first_token_s=0.05)
SLOW = LinkEstimate(bandwidth_bytes_s=1e5, rtt_s=0.001)


def _model() -> ReferenceModel:
    return ReferenceModel.create(TINY, num_blocks=NB)


@contextlib.asynccontextmanager
async def cluster(relays: int, mains: int) -> Any:
    """P and the decoders, all connected: P to each, each RLD to each MD."""
    pm = _model()
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(
            PrefillEndpoint("p", pm.pool, secret=KEY, router=Router(POLICY, SLOW))
        )
        rlds, mds = [], []
        for i in range(relays):
            m = _model()
            rlds.append(
                await stack.enter_async_context(
                    RelayEndpoint(
                        f"rld{i}", m.pool, ReferenceEngine(m, step_time_s=0.01), secret=KEY
                    )
                )
            )
        for i in range(mains):
            m = _model()
            mds.append(
                await stack.enter_async_context(
                    MainEndpoint(f"md{i}", m.pool, ReferenceEngine(m), secret=KEY)
                )
            )
        for dec in (*rlds, *mds):
            await p.connect_peer(dec.info())
            await dec.connect_peer(p.info())
        for rld in rlds:
            for md in mds:
                await rld.connect_peer(md.info())
                await md.connect_peer(rld.info())
        yield pm, p, rlds, mds


async def wait_cached(p: PrefillEndpoint, md: str, prompt: list[int]) -> None:
    """Until P's mirror of ``md``'s cache holds the prompt's full blocks (MD
    caches a prompt when its request ends, then tells P)."""
    from pddnet.cache import block_hashes

    keys = block_hashes(prompt, p.pool.layout.block_size)
    while p.mirrors[md].predict(keys) < len(keys):
        await trio.sleep(0.01)


async def test_a_session_stays_on_the_md_holding_its_prefix_and_relays_share_the_load() -> None:
    rng = np.random.default_rng(5)
    sessions = []
    for _ in range(4):
        prompt = rng.integers(0, TINY.vocab_size, 200).tolist()
        sessions.append([prompt, prompt + rng.integers(0, TINY.vocab_size, 20).tolist()])
    subs: dict[tuple[int, int], Any] = {}
    records: list[dict[str, Any]] = []
    got: dict[int, list[int]] = {}
    async with cluster(2, 2) as (pm, p, _rlds, _mds):
        released: dict[int, trio.Event] = {}
        # Later turns are routed only once every first turn has landed: a first
        # turn still queued to an MD is (rightly) bytes ahead of a later turn's
        # delta there, and could tip it onto a relay (seen in CI under load).
        firsts_landed: list[int] = []
        all_firsts_landed = trio.Event()

        async def releases() -> None:
            while True:
                ev = await p.next_event()
                assert ev.error is None, ev
                released.setdefault(ev.request_id, trio.Event()).set()

        async def session(s: int, turns: list[list[int]]) -> None:
            seq = pm.new_sequence()
            done = 0
            for t, prompt in enumerate(turns):
                rid = 100 * (s + 1) + t
                released.setdefault(rid, trio.Event())
                if t:
                    await all_firsts_landed.wait()
                    await wait_cached(p, subs[s, 0].main, turns[t - 1])
                pm.reserve(seq, len(prompt))
                seq.length = done
                first = greedy(pm.extend(seq, prompt[done:]))
                done = len(prompt)
                blocks = seq.block_table[: pm.pool.layout.blocks_for_tokens(len(prompt))]
                stream = p.sink.open(rid, deadline_s=30, max_tokens=MAX_TOKENS)
                subs[s, t] = await p.submit(
                    rid, prompt, blocks.tolist(), first, MAX_TOKENS, sink="p"
                )
                got[rid] = await stream.result()
                await released[rid].wait()
                if not t:
                    firsts_landed.append(s)
                    if len(firsts_landed) == len(sessions):
                        all_firsts_landed.set()
                records.append(
                    {
                        "request_id": rid,
                        "phase": "x",
                        "session": s,
                        "turn": t,
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                    }
                )

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(releases)
                async with trio.open_nursery() as group:
                    for s, turns in enumerate(sessions):
                        group.start_soon(session, s, turns)
                nursery.cancel_scope.cancel()
    ref = reference_streams(records)
    assert all(got[rid] == ref[rid] for rid in got), "a stream differs from greedy"
    firsts = [subs[s, 0] for s in range(4)]
    assert all(sub.decision.route is Route.P_RLD_MD for sub in firsts)
    # the router held each relay's slots itself: the first turns alternate
    assert Counter(sub.relay for sub in firsts) == {"rld0": 2, "rld1": 2}
    for s in range(4):
        later = subs[s, 1]
        # the MD that served the first turn holds 12 of the 14 blocks: P->MD there
        assert later.main == firsts[s].main and later.hit_blocks == 12, (s, later)
        assert later.decision.route is Route.P_MD and later.relay == ""
        verdicts = {c.name: c.verdict for c in later.decision.candidates if c.role == "main"}
        other = "md1" if later.main == "md0" else "md0"
        assert verdicts == {later.main: Verdict.CHOSEN, other: Verdict.LANDS_LATER}


async def test_a_prefix_in_flight_counts_as_missing_and_as_queued_ahead() -> None:
    """A's KV is still on its way to md0 (held back: layer by layer, nothing
    ready) when B, which extends A, is routed: md0's mirror does not count
    A's blocks, and A's bytes are ahead of B's at md0's sender, so md1 (the
    same delta, nothing queued) gets B. Both links are measured (as after a
    first large transfer to each): an unmeasured md1 would share the link
    with A's flow, and B would land no sooner there."""
    async with cluster(0, 2) as (pm, p, _, _mds):
        for md in ("md0", "md1"):
            p.router.update_link(bandwidth_bytes_s=SLOW.bandwidth_bytes_s, main=md)
        rng = np.random.default_rng(9)
        a = rng.integers(0, TINY.vocab_size, 400).tolist()
        b = a + rng.integers(0, TINY.vocab_size, 20).tolist()
        seq = pm.new_sequence()
        pm.reserve(seq, len(b))
        first_a = greedy(pm.extend(seq, a))
        blocks = seq.block_table.tolist()
        bb = pm.pool.layout.block_bytes
        with trio.fail_after(30):
            stream_a = p.sink.open(1, deadline_s=30, max_tokens=4)
            sub_a = await p.submit(
                1, a, blocks, first_a, 4, sink="p", route=Route.P_MD, main="md0", ready=False
            )
            assert sub_a.sent_blocks_wan == 25
            first_b = greedy(pm.extend(seq, b[len(a) :]))
            stream_b = p.sink.open(2, deadline_s=30, max_tokens=4)
            sub_b = await p.submit(2, b, blocks, first_b, 4, sink="p")
            assert sub_b.main == "md1" and sub_b.hit_blocks == 0
            md0, md1 = (c for c in sub_b.decision.candidates if c.role == "main")
            assert (md0.name, md0.verdict) == ("md0", Verdict.LANDS_LATER)
            assert md0.delta_bytes == md1.delta_bytes == 27 * bb  # A's blocks not there yet
            assert md0.bytes_ahead == 25 * bb and md1.bytes_ahead == 0
            assert md0.transfer_s > md1.transfer_s
            for layer in range(TINY.num_layers):
                p.mark_layer_ready(1, layer)
            await stream_a.result()
            await stream_b.result()
            for _ in range(2):
                assert (await p.next_event()).error is None


async def test_with_no_relay_connected_the_router_sheds_to_p_md() -> None:
    async with cluster(0, 1) as (pm, p, _, _mds):
        prompt = list(range(200))  # 13 blocks: ~1 s at 100 kB/s, over the target
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))
        first = greedy(pm.prefill(seq, prompt))
        with trio.fail_after(30):
            stream = p.sink.open(1, deadline_s=30, max_tokens=MAX_TOKENS)
            sub = await p.submit(1, prompt, seq.block_table.tolist(), first, MAX_TOKENS, sink="p")
            assert (sub.decision.route, sub.decision.reason) == (Route.P_MD, RouteReason.NO_RELAY)
            assert sub.relay == "" and sub.main == "md0" and p.router.active_relays == 0
            assert len(await stream.result()) == MAX_TOKENS
            assert (await p.next_event()).error is None


async def test_the_relay_slot_is_held_until_rld_lets_go_and_every_end_gives_it_back() -> None:
    """The simulator's finding 3: P held a request's RLD slot only until its
    P->RLD transfer ended, before RLD decoded a token. It must hold it while
    RLD serves the stream, until MD's first token (the handover) or the end,
    and give it back on an abort too."""
    async with cluster(1, 1) as (pm, p, _rlds, _mds):
        rng = np.random.default_rng(11)
        with trio.fail_after(30):
            for rid in (1, 2):
                prompt = rng.integers(0, TINY.vocab_size, 200).tolist()
                seq = pm.new_sequence()
                pm.reserve(seq, len(prompt))
                first = greedy(pm.extend(seq, prompt))
                stream = p.sink.open(rid, deadline_s=30, max_tokens=MAX_TOKENS)
                sub = await p.submit(
                    rid, prompt, seq.block_table.tolist(), first, MAX_TOKENS, sink="p", ready=False
                )
                assert sub.decision.route is Route.P_RLD_MD and sub.relay == "rld0"
                # loopback is no WAN: hold MD's KV back until RLD decoded a few
                for layer in range(TINY.num_layers):
                    p.mark_layer_ready(rid, layer, dest="rld0")
                if rid == 2:
                    await p.abort(rid)
                    assert p.router.active_relays == 0
                    break
                # each eager token RLD decoded (its KV had landed: the P->RLD
                # transfer was over) before MD's first one reached the sink
                held = []
                async for token in stream:
                    if token.source == "rld0" and token.position > 0:
                        held.append(p.router.active_relays)
                        if len(held) == 3:  # now let MD's KV go: the handover follows
                            for layer in range(TINY.num_layers):
                                p.mark_layer_ready(rid, layer, dest="md0")
                assert len(held) >= 3 and held[:3] == [1, 1, 1], held
                assert "md0" in {t.source for t in stream.received}  # handed over
                assert p.router.active_relays == 0
                assert p.router.statistics().by_relay == {}


async def test_p_passes_each_mds_load_and_the_router_weighs_it() -> None:
    """The simulator's finding 1 at the endpoint: P states each MD's load
    (its own requests open there, or the cluster's through set_main_load)
    and its capacity, and a busy MD that holds the prefix loses a new
    request to an idle one when its batch costs more than the bytes saved."""
    async with cluster(0, 2) as (pm, p, _, _mds):
        fast = LinkEstimate(bandwidth_bytes_s=1e9, rtt_s=0.001)
        for md in ("md0", "md1"):
            p.router.update_link(bandwidth_bytes_s=fast.bandwidth_bytes_s, rtt_s=0.001, main=md)
        rng = np.random.default_rng(12)
        a = rng.integers(0, TINY.vocab_size, 200).tolist()
        b = a + rng.integers(0, TINY.vocab_size, 20).tolist()
        with trio.fail_after(30):
            seq = pm.new_sequence()
            pm.reserve(seq, len(b))
            first = greedy(pm.extend(seq, a))
            stream_a = p.sink.open(1, deadline_s=30, max_tokens=MAX_TOKENS)
            await p.submit(1, a, seq.block_table.tolist(), first, MAX_TOKENS, sink="p", main="md0")
            # while request 1 is open at md0, P counts it there
            other = rng.integers(0, TINY.vocab_size, 200).tolist()
            probe, _ = p._candidates(np.asarray(other), 13, None)
            assert [(c.name, c.active, c.capacity) for c in probe] == [
                ("md0", 1, 32),
                ("md1", 0, 32),
            ]
            await stream_a.result()
            await wait_cached(p, "md0", a)
            while [c.active for c in p._candidates(np.asarray(other), 13, None)[0]] != [0, 0]:
                await trio.sleep(0.001)  # its stream ended: P's follower lets go
            # the directory says md0 is nearly full with other P's requests
            p.set_main_load("md0", 30, 32)
            first_b = greedy(pm.extend(seq, b[len(a) :]))
            stream_b = p.sink.open(2, deadline_s=30, max_tokens=MAX_TOKENS)
            sub = await p.submit(2, b, seq.block_table.tolist(), first_b, MAX_TOKENS, sink="p")
            # md0 lacks 2 blocks, md1 all 14: 0.2 ms more on this link, against
            # 0.05 * 30/32 = 47 ms of md0's batch
            assert sub.main == "md1" and sub.hit_blocks == 0
            md0 = next(c for c in sub.decision.candidates if c.name == "md0")
            assert (md0.active, md0.verdict) == (30, Verdict.LANDS_LATER)
            await stream_b.result()


async def test_an_md_back_under_its_name_with_new_addresses_is_a_new_incarnation() -> None:
    """md0 restarts (a new process: new addresses) and registers again before
    its old lease ran out, so the directory reports a MemberUpdated, not a
    leave and a join. P must drop everything of the old md0 (its control
    connection, sender, cache mirror, link estimate, in-flight transfers) and
    connect the new one. (It used to keep the old one: only a name it did not
    know was connected.)"""
    from pddnet.cache import block_hashes
    from pddnet.directory import MemoryDirectory

    pm = _model()
    d = MemoryDirectory("incarnations")
    rng = np.random.default_rng(13)
    a = rng.integers(0, TINY.vocab_size, 200).tolist()
    keys = block_hashes(a, pm.pool.layout.block_size)
    m_old, m_new = _model(), _model()
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY, router=Router(POLICY, SLOW)) as p,
        MainEndpoint("md0", m_old.pool, ReferenceEngine(m_old), secret=KEY) as old,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(p.follow, d)
        with trio.fail_after(30):
            await old.connect_peer(p.info())
            await d.register(old.info())
            while "md0" not in p.mirrors:
                await trio.sleep(0.01)
            seq = pm.new_sequence()
            pm.reserve(seq, len(a))
            first = greedy(pm.extend(seq, a))
            blocks = seq.block_table.tolist()
            stream = p.sink.open(1, deadline_s=30, max_tokens=4)
            await p.submit(1, a, blocks, first, 4, sink="p")
            await stream.result()
            await wait_cached(p, "md0", a)  # the old md0 holds A
            p.router.update_link(bandwidth_bytes_s=1e6, main="md0")  # the old one's link
            # a request in flight to the old md0 (its KV held back)
            held = p.sink.open(2, deadline_s=30, max_tokens=4)
            await p.submit(2, a, blocks, first, 4, sink="p", main="md0", ready=False)
            async with MainEndpoint("md0", m_new.pool, ReferenceEngine(m_new), secret=KEY) as new:
                await new.connect_peer(p.info())
                assert new.info() != old.info()
                await d.register(new.info())  # the same key, not yet expired: an update
                while p.mirrors["md0"].predict(keys) == len(keys):
                    await trio.sleep(0.01)
                # nothing of the old one: its mirror, link and transfer are gone
                assert p.mirrors["md0"].predict(keys) == 0
                assert "md0" not in p.router.statistics().links
                events = [await p.next_event() for _ in range(2)]
                assert [(e.request_id, e.error is None) for e in events] == [(1, True), (2, False)]
                with trio.move_on_after(15), contextlib.suppress(Exception):
                    await held.result()
                assert held.done and held.error is not None
                # the next request goes to the new md0, over the new connections
                stream = p.sink.open(3, deadline_s=30, max_tokens=4)
                sub = await p.submit(3, a, blocks, first, 4, sink="p")
                assert sub.main == "md0" and sub.hit_blocks == 0
                assert len(await stream.result()) == 4
                assert (await p.next_event()).error is None
                assert (new.statistics().offers, old.statistics().offers) == (1, 2)
                assert p.statistics().held_blocks == 0
        nursery.cancel_scope.cancel()


async def test_a_decoder_that_could_not_be_connected_stays_unknown_and_is_retried() -> None:
    """An MD that joins but fails P's cache snapshot (here: it refuses it)
    is removed again rather than left half connected, so its next event (a
    load update) connects it. (It used to stay known, without its snapshot,
    and no later event tried again.)"""
    from pddnet import RemoteCallError
    from pddnet.cache import DrcSnapshotRequest
    from pddnet.directory import Load, Member, MemberJoined, MemberUpdated

    pm, m = _model(), _model()
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY, router=Router(POLICY, SLOW)) as p,
        MainEndpoint("md0", m.pool, ReferenceEngine(m), secret=KEY) as md,
    ):
        await md.connect_peer(p.info())
        real = md.publisher.on_snapshot_request

        def refuse(peer: str, msg: DrcSnapshotRequest) -> None:
            raise PddnetError("not ready")

        md.node.route(DrcSnapshotRequest, refuse)
        with trio.fail_after(30):
            with pytest.raises(RemoteCallError, match="not ready"):
                await p.apply_member(MemberJoined(Member(md.info(), Load(capacity=8), 1)))
            assert "md0" not in p.mirrors and p.node.peers() == set()
            with pytest.raises(LocalProtocolError):
                p._candidates(np.arange(20), 2, None)  # no MD to route to
            md.node.route(DrcSnapshotRequest, real)
            await p.apply_member(MemberUpdated(Member(md.info(), Load(active=1, capacity=8), 2)))
            assert "md0" in p.mirrors and p.node.peers() == {"md0"}
            seq = pm.new_sequence()
            prompt = list(range(40))
            pm.reserve(seq, len(prompt))
            first = greedy(pm.extend(seq, prompt))
            stream = p.sink.open(1, deadline_s=30, max_tokens=4)
            sub = await p.submit(1, prompt, seq.block_table.tolist(), first, 4, sink="p")
            assert sub.main == "md0" and len(await stream.result()) == 4
            assert (await p.next_event()).error is None
