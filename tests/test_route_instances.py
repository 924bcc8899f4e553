"""Routing across MD and RLD instances (sans-IO, explicit time): prefix
affinity, the WAN queue ahead of a delta, MD load and capacity, RLD admission
and load, per-MD link estimates, and the candidates each decision records."""

from __future__ import annotations

import random

import pytest

from pddnet import LocalProtocolError
from pddnet.route import (
    LinkEstimate,
    MainCandidate,
    RelayCandidate,
    Route,
    RoutePolicy,
    Router,
    RouteReason,
    RouteRequest,
    Verdict,
)
from pddnet.transport.wan._scheduler import Scheduler

KB = 1 << 10
LINK = LinkEstimate(bandwidth_bytes_s=3e6, rtt_s=0.03)  # the demo's 25 Mbit/s, 30 ms
# the demo's policy: P->MD when the delta lands within 0.15 - 0.05 s
POLICY = RoutePolicy(ttft_target_s=0.15, md_first_token_s=0.05, rld_decode_rate=50.0)
RELAYS = (RelayCandidate("rld0"), RelayCandidate("rld1"))


def req(rid: int, *mains: MainCandidate, relays=RELAYS, max_tokens: int = 32, **kw) -> RouteRequest:  # type: ignore[no-untyped-def]
    return RouteRequest(rid, 0, max_tokens, mains=mains, relays=relays, **kw)


def verdicts(d) -> dict[str, Verdict]:  # type: ignore[no-untyped-def]
    return {c.name: c.verdict for c in d.candidates}


def test_the_md_holding_most_of_the_prompt_wins_and_the_decision_says_why() -> None:
    r = Router(POLICY, LINK)
    d = r.decide(req(1, MainCandidate("md0", 600 * KB), MainCandidate("md1", 24 * KB)), now=5.0)
    assert (d.main, d.route, d.reason) == ("md1", Route.P_MD, RouteReason.FITS_TTFT)
    assert d.delta_bytes == 24 * KB and d.relay == "" and d.at == 5.0
    assert d.transfer_s == pytest.approx(0.03 + 24 * KB / 3e6)
    assert verdicts(d) == {
        "md0": Verdict.LANDS_LATER,
        "md1": Verdict.CHOSEN,
        "rld0": Verdict.NOT_NEEDED,
        "rld1": Verdict.NOT_NEEDED,
    }
    md0 = d.candidates[0]
    assert (md0.role, md0.delta_bytes) == ("main", 600 * KB)
    assert md0.transfer_s == pytest.approx(0.03 + 600 * KB / 3e6)
    assert r.statistics().by_main == {"md1": 1}


def test_bytes_queued_ahead_push_a_small_delta_onto_the_relay() -> None:
    """The issue's diagnosis: a high-hit delta behind the first turns' KV on
    the WAN does not reach MD in time; the queue-aware estimate sees it."""
    r = Router(POLICY, LINK)
    alone = r.decide(req(1, MainCandidate("md", 24 * KB)), 0.0)
    assert alone.route is Route.P_MD
    behind = r.decide(req(2, MainCandidate("md", 24 * KB, bytes_ahead=900 * KB)), 0.0)
    assert (behind.route, behind.reason) == (Route.P_RLD_MD, RouteReason.MASK_TRANSFER)
    assert behind.transfer_s == pytest.approx(0.03 + 924 * KB / 3e6)
    assert behind.bytes_ahead == 900 * KB and behind.relay == "rld0"
    # the single-MD form of the estimate
    assert LINK.transfer_s(24 * KB, 900 * KB) == pytest.approx(behind.transfer_s)


def test_a_long_queue_outweighs_affinity_and_near_ties_go_to_the_least_loaded() -> None:
    r = Router(POLICY, LINK)
    # md0 holds the prefix, but 2 MB wait at its sender: md1's whole prompt lands first
    d = r.decide(
        req(
            1, MainCandidate("md0", 24 * KB, bytes_ahead=2048 * KB), MainCandidate("md1", 600 * KB)
        ),
        0.0,
    )
    assert d.main == "md1"
    assert verdicts(d)["md0"] is Verdict.LANDS_LATER
    # a new prompt (no MD holds it), empty queues: the less loaded MD, whose
    # batch adds md_load_s * 3/16 against md0's 9/16
    d = r.decide(
        req(
            2,
            MainCandidate("md0", 600 * KB, active=9, capacity=16),
            MainCandidate("md1", 600 * KB, active=3, capacity=16),
        ),
        0.0,
    )
    assert d.main == "md1" and verdicts(d)["md0"] is Verdict.LANDS_LATER
    # equal loads within tie_s (1 ms = 3 KB here): the one holding more wins
    near = MainCandidate("md0", 600 * KB + 2 * KB, active=1, capacity=16)
    even = MainCandidate("md1", 600 * KB, active=1, capacity=16)
    d = r.decide(req(3, near, even), 0.0)
    assert d.main == "md1" and verdicts(d)["md0"] is Verdict.MORE_LOADED


def test_load_is_weighed_against_landing_time_not_only_within_a_tie() -> None:
    """The simulator's finding 1: an MD that cached the shared system prompt
    must not take every cold session. Its smaller delta lands 40 ms sooner;
    a batch 7/8 full costs 0.05 * 7/8 = 44 ms more, so the idle MD wins;
    at 6/8 (37.5 ms) the cached one still does."""
    r = Router(POLICY, LINK)
    cached = 600 * KB - 120_000  # 40 ms less at 3 MB/s
    for active, want in ((7, "md1"), (6, "md0")):
        d = r.decide(
            req(
                active,
                MainCandidate("md0", cached, active=active, capacity=8),
                MainCandidate("md1", 600 * KB, active=0, capacity=8),
            ),
            0.0,
        )
        assert d.main == want, active
    # a stream of cold sessions spreads: each one P sends raises that MD's load
    load = {"md0": 0, "md1": 0}
    for rid in range(100, 116):
        d = r.decide(
            req(
                rid,
                MainCandidate("md0", cached, active=load["md0"], capacity=8),
                MainCandidate("md1", 600 * KB, active=load["md1"], capacity=8),
            ),
            0.0,
        )
        load[d.main] += 1
    assert load["md0"] < 12 and load["md1"] >= 4, load


def test_an_md_at_capacity_is_passed_over_unless_all_are() -> None:
    r = Router(POLICY, LINK)
    full = MainCandidate("md0", 0, active=4, capacity=4)
    free = MainCandidate("md1", 600 * KB, active=1, capacity=4)
    d = r.decide(req(1, full, free), 0.0)
    assert d.main == "md1" and verdicts(d)["md0"] is Verdict.AT_CAPACITY
    both = MainCandidate("md1", 600 * KB, active=4, capacity=4)
    d = r.decide(req(2, full, both), 0.0)
    assert d.main == "md0"  # all full: the one whose delta lands first


def test_relays_spread_by_load_and_each_keeps_its_own_limits() -> None:
    policy = RoutePolicy(ttft_target_s=0.15, max_concurrent_relays=3, max_eager_tokens=10_000)
    r = Router(policy, LINK)
    relays = tuple(RelayCandidate(f"rld{i}") for i in range(4))
    big = MainCandidate("md", 600 * KB)
    got = [r.decide(req(i, big, relays=relays), 0.0) for i in range(12)]
    assert all(d.route is Route.P_RLD_MD for d in got)
    assert [d.relay for d in got[:4]] == ["rld0", "rld1", "rld2", "rld3"]
    assert r.statistics().by_relay == dict.fromkeys(("rld0", "rld1", "rld2", "rld3"), 3)
    shed = r.decide(req(12, big, relays=relays), 0.0)
    assert (shed.route, shed.reason, shed.relay) == (Route.P_MD, RouteReason.RELAY_FULL, "")
    assert set(verdicts(shed).values()) == {Verdict.CHOSEN, Verdict.RELAY_LIMIT}
    r.release(got[2].request_id)  # rld2 frees a slot
    again = r.decide(req(13, big, relays=relays), 1.0)
    assert again.relay == "rld2"
    st = r.statistics()
    assert st.active_relays == 12 and st.by_relay["rld2"] == 3
    for d in [*got, again]:
        r.release(d.request_id)
    assert r.statistics().by_relay == {} and r.statistics().eager_reserved == 0


def test_relays_held_for_other_prefill_instances_count_against_the_limit() -> None:
    policy = RoutePolicy(ttft_target_s=0.15, max_concurrent_relays=4)
    r = Router(policy, LINK)
    relays = (RelayCandidate("rld0", active=4), RelayCandidate("rld1", active=2))
    d = r.decide(req(1, MainCandidate("md", 600 * KB), relays=relays), 0.0)
    assert d.relay == "rld1"
    assert {c.name: c.active for c in d.candidates if c.role == "relay"} == {
        "rld0": 4,
        "rld1": 2,  # the other instances' 2 (this one came after)
    }
    assert verdicts(d)["rld0"] is Verdict.RELAY_LIMIT


def test_eager_budget_and_no_relay_shed_to_p_md() -> None:
    policy = RoutePolicy(ttft_target_s=0.15, max_eager_tokens=100, catchup_slack=64)
    r = Router(policy, LINK)
    big = MainCandidate("md", 600 * KB)  # ~0.23 s: ceil(0.23 * 50) + 64 = 76 eager tokens
    first = r.decide(req(1, big, relays=RELAYS[:1], max_tokens=500), 0.0)
    assert first.relay == "rld0" and first.eager_tokens == 76
    second = r.decide(req(2, big, relays=RELAYS[:1], max_tokens=500), 0.0)
    assert (second.route, second.reason) == (Route.P_MD, RouteReason.EAGER_BUDGET)
    assert verdicts(second)["rld0"] is Verdict.EAGER_LIMIT
    none = r.decide(req(3, big, relays=()), 0.0)
    assert (none.route, none.reason, none.eager_tokens) == (Route.P_MD, RouteReason.NO_RELAY, 0)


def test_per_md_link_estimates() -> None:
    r = Router(POLICY, LINK)
    r.update_link(bandwidth_bytes_s=30e6, main="md1")  # md1's path is 10x faster
    assert r.link_for("md1").bandwidth_bytes_s == 30e6
    assert r.link_for("md0") == LINK and r.link == LINK
    d = r.decide(req(1, MainCandidate("md0", 600 * KB), MainCandidate("md1", 600 * KB)), 0.0)
    assert d.main == "md1" and d.route is Route.P_MD
    r.update_link(rtt_s=0.05, weight=0.5, main="md0")  # from the default
    assert r.link_for("md0") == LinkEstimate(3e6, 0.04)
    assert r.statistics().links == {"md1": LinkEstimate(30e6, 0.03), "md0": LinkEstimate(3e6, 0.04)}
    r.forget("md1")
    assert r.link_for("md1") == LINK


def test_an_unsampled_md_shares_the_link_with_the_flows_on_it() -> None:
    """The simulator's finding 2: an MD without a measured transfer does not
    get the full link while P's senders to other MDs are busy."""
    r = Router(POLICY, LINK)
    r.update_link(bandwidth_bytes_s=2e6, main="md0")  # measured: its own, undivided
    busy = MainCandidate("md0", 24 * KB, bytes_ahead=300 * KB)
    fresh = MainCandidate("md1", 300 * KB)  # the whole link: 0.1 s, sooner than md0
    d = r.decide(req(1, busy, fresh), 0.0)
    # md1 shares the 3 MB/s with md0's flow: 1.5 MB/s, not the whole link
    assert d.candidates[1].transfer_s == pytest.approx(0.03 + 300 * KB / 1.5e6)
    assert d.main == "md0" and d.transfer_s == pytest.approx(0.03 + 324 * KB / 2e6)
    assert r.link_for("md2", flows=3) == LinkEstimate(1e6, 0.03)
    assert r.link_for("md0", flows=3) == LinkEstimate(2e6, 0.03)


def test_a_forced_route_still_picks_instances_and_holds_no_slot() -> None:
    r = Router(POLICY, LINK)
    mains = (MainCandidate("md0", 600 * KB), MainCandidate("md1", 24 * KB))
    d = r.decide(req(1, *mains, route=Route.P_RLD_MD), 0.0)
    assert (d.route, d.reason, d.main, d.relay) == (
        Route.P_RLD_MD,
        RouteReason.FORCED,
        "md1",
        "rld0",
    )
    assert r.active_relays == 0
    d = r.decide(req(2, MainCandidate("md0", 600 * KB), route=Route.P_MD), 0.0)
    assert (d.route, d.reason) == (Route.P_MD, RouteReason.FORCED)
    with pytest.raises(LocalProtocolError, match="no RLD candidate"):
        r.decide(req(3, *mains, relays=(), route=Route.P_RLD_MD), 0.0)
    with pytest.raises(LocalProtocolError, match="no MD candidate"):
        r.decide(RouteRequest(4, 0, 32, mains=()), 0.0)


def test_a_session_sticks_to_its_md_while_sessions_spread() -> None:
    """4 RLD x 8 MD, a P-side model of each MD's cache: every first turn
    lands on a different MD (the one with the least queued), every later
    turn of a session on the MD that holds it, and the relays share the
    first turns evenly."""
    r = Router(POLICY, LINK)
    relays = tuple(RelayCandidate(f"rld{i}") for i in range(4))
    names = [f"md{i}" for i in range(8)]
    queued = dict.fromkeys(names, 0)
    holds: dict[str, set[int]] = {n: set() for n in names}
    home: dict[int, str] = {}
    rid = 0
    for turn in range(3):
        for session in range(8):
            rid += 1
            mains = tuple(
                MainCandidate(n, 24 * KB if session in holds[n] else 600 * KB, queued[n])
                for n in names
            )
            d = r.decide(req(rid, *mains, relays=relays), float(turn))
            if turn == 0:
                assert d.route is Route.P_RLD_MD
                home[session] = d.main
            else:
                assert d.main == home[session] and d.route is Route.P_MD
            holds[d.main].add(session)
            queued[d.main] += d.delta_bytes
        for n in names:
            queued[n] = 0  # the link drained between turns
    assert sorted(home.values()) == names
    assert r.statistics().by_relay == dict.fromkeys(("rld0", "rld1", "rld2", "rld3"), 2)


# -- the queue the estimate reads: the WAN scheduler's bytes ahead -------------


def test_scheduler_bytes_ahead_follow_its_priorities() -> None:
    s = Scheduler(chunk_size=64 * KB, min_chunk=16 * KB)
    s.add_transfer(1, 800 * KB)
    s.mark_ready(1, 0, 800 * KB)
    s.add_transfer(2, 100 * KB, priority=1)  # urgent: ahead of any bulk
    # fewest bytes first: a 10 KB delta jumps the bulk transfer, not the urgent one
    assert s.bytes_ahead(10 * KB) == 100 * KB
    assert s.bytes_ahead(900 * KB) == 900 * KB
    ch = s.next_chunk(0, now=0.0)
    assert ch is not None and ch.transfer_id == 1  # tx 2 has nothing ready yet
    # but what is already on a socket goes first whatever its rank
    assert s.bytes_ahead(10 * KB) == 100 * KB + ch.length
    assert s.bytes_ahead(900 * KB) == 900 * KB  # a larger transfer queues behind both
    assert s.bytes_ahead(10 * KB, priority=2) == ch.length
    s.on_ack(0, 1, ch.lo, ch.hi, now=0.01)
    assert s.bytes_ahead(10 * KB) == 100 * KB
    fifo = Scheduler(policy="fifo")
    fifo.add_transfer(1, 800 * KB)
    assert fifo.bytes_ahead(1) == 800 * KB


def test_decisions_are_deterministic_functions_of_their_inputs() -> None:
    """Two routers fed the same requests and times decide the same (the
    simulator and a cluster test drive the router this way)."""
    rng = random.Random(3)
    reqs = []
    for i in range(500):
        mains = tuple(
            MainCandidate(f"md{j}", rng.choice([24, 600]) * KB, rng.randrange(0, 2048) * KB)
            for j in range(3)
        )
        reqs.append(req(i, *mains, max_tokens=rng.randint(8, 512)))
    a, b = Router(POLICY, LINK), Router(POLICY, LINK)
    for i, rq in enumerate(reqs):
        da, db = a.decide(rq, i * 0.01), b.decide(rq, i * 0.01)
        assert da == db
        if i % 3 == 0:
            a.release(i)
            b.release(i)
    assert a.statistics() == b.statistics()
