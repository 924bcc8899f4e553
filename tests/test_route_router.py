"""Route choice, the strange-traffic policy and RLD admission control."""

from __future__ import annotations

import math
import random

import pytest

import pddnet.route as route_pkg
from pddnet import LocalProtocolError
from pddnet.route import (
    LinkEstimate,
    Route,
    RouteDecision,
    RoutePolicy,
    Router,
    RouteReason,
    RouteRequest,
)

LINK = LinkEstimate(bandwidth_bytes_s=1e9, rtt_s=0.03)  # ~8 Gbit/s, 30 ms
MB = 1 << 20


def test_small_delta_goes_straight_to_md() -> None:
    r = Router(RoutePolicy(ttft_target_s=1.0), LINK)
    d = r.decide(RouteRequest(1, 50 * MB, 500), now=0.0)
    assert (d.route, d.reason) == (Route.P_MD, RouteReason.FITS_TTFT)
    assert d.transfer_s == pytest.approx(0.03 + 50 * MB / 1e9)
    assert d.eager_tokens == 0 and r.active_relays == 0


def test_large_delta_is_masked_by_rld() -> None:
    p = RoutePolicy(ttft_target_s=1.0, rld_decode_rate=40.0, catchup_slack=64)
    r = Router(p, LINK)
    d = r.decide(RouteRequest(2, 4000 * MB, 2000), now=0.0)
    assert (d.route, d.reason) == (Route.P_RLD_MD, RouteReason.MASK_TRANSFER)
    assert d.eager_tokens == math.ceil(d.transfer_s * 40.0) + 64
    assert d.uses_rld and d.uses_wan and r.active_relays == 1
    # A per-request TTFT target overrides the policy's.
    d2 = r.decide(RouteRequest(3, 4000 * MB, 2000, ttft_target_s=10.0), now=0.0)
    assert d2.route is Route.P_MD


def test_eager_reservation_is_capped_by_max_tokens() -> None:
    r = Router(RoutePolicy(ttft_target_s=0.1), LINK)
    d = r.decide(RouteRequest(4, 4000 * MB, 7), now=0.0)
    assert d.route is Route.P_RLD_MD and d.eager_tokens == 7


def test_strange_traffic_policy_skips_the_wan() -> None:
    on = RoutePolicy(ttft_target_s=0.5, rld_decode_rate=50.0, skip_wan_short_output=True)
    # 4 GB at 1 GB/s is ~4.2 s; 20 tokens take 0.4 s on RLD: the KV would land too late.
    d = Router(on, LINK).decide(RouteRequest(5, 4000 * MB, 20), now=0.0)
    assert (d.route, d.reason) == (Route.P_RLD, RouteReason.SHORT_OUTPUT)
    assert not d.uses_wan and d.eager_tokens == 20
    # Long outputs still hand over; and without the option nothing is skipped.
    assert Router(on, LINK).decide(RouteRequest(6, 4000 * MB, 5000), 0.0).route is Route.P_RLD_MD
    off = RoutePolicy(ttft_target_s=0.5, rld_decode_rate=50.0)
    assert Router(off, LINK).decide(RouteRequest(7, 4000 * MB, 20), 0.0).route is Route.P_RLD_MD


def test_admission_sheds_to_md_and_recovers() -> None:
    p = RoutePolicy(ttft_target_s=0.1, max_concurrent_relays=2, max_eager_tokens=10_000)
    r = Router(p, LINK)
    got = [r.decide(RouteRequest(i, 1000 * MB, 100), 0.0) for i in range(3)]
    assert [g.route for g in got] == [Route.P_RLD_MD, Route.P_RLD_MD, Route.P_MD]
    assert got[2].reason is RouteReason.RELAY_FULL and got[2].eager_tokens == 0
    r.release(0)
    r.release(0)  # idempotent
    assert r.decide(RouteRequest(9, 1000 * MB, 100), 0.0).route is Route.P_RLD_MD


def test_eager_budget_sheds() -> None:
    p = RoutePolicy(ttft_target_s=0.1, max_concurrent_relays=100, max_eager_tokens=250)
    r = Router(p, LINK)
    routes = [r.decide(RouteRequest(i, 1000 * MB, 100), 0.0) for i in range(3)]
    assert [d.route for d in routes] == [Route.P_RLD_MD, Route.P_RLD_MD, Route.P_MD]
    assert routes[2].reason is RouteReason.EAGER_BUDGET
    assert r.statistics().eager_reserved == 200


def test_link_updates_change_decisions() -> None:
    r = Router(RoutePolicy(ttft_target_s=1.0), LINK)
    assert r.decide(RouteRequest(1, 500 * MB, 100), 0.0).route is Route.P_MD
    r.update_link(bandwidth_bytes_s=1e8)  # the WAN slowed down ten-fold
    assert r.decide(RouteRequest(2, 500 * MB, 100), 0.0).route is Route.P_RLD_MD
    r.update_link(rtt_s=0.2, weight=0.5)
    assert r.link.rtt_s == pytest.approx(0.115)


def test_decisions_are_observable() -> None:
    seen: list[RouteDecision] = []
    r = Router(RoutePolicy(ttft_target_s=1.0, history=2), LINK, on_decision=seen.append)
    for i, size in enumerate([1 * MB, 4000 * MB, 2 * MB]):
        r.decide(RouteRequest(i, size, 100), float(i))
    assert [d.request_id for d in seen] == [0, 1, 2]
    assert [d.request_id for d in r.decisions()] == [1, 2]
    st = r.statistics()
    assert st.by_route == {"p-md": 2, "p-rld-md": 1}
    assert st.by_reason == {"FITS_TTFT": 2, "MASK_TRANSFER": 1}
    assert st.active_relays == 1 and st.peak_relays == 1


def test_double_admission_is_a_local_error() -> None:
    r = Router(RoutePolicy(ttft_target_s=0.1), LINK)
    r.decide(RouteRequest(1, 1000 * MB, 100), 0.0)
    with pytest.raises(LocalProtocolError):
        r.decide(RouteRequest(1, 1000 * MB, 100), 0.0)


def test_overload_stays_inside_limits_and_loses_nothing() -> None:
    """A burst far above RLD's capacity: limits hold, every request is routed
    exactly once, the excess is shed to P->MD, and RLD is used again after."""
    p = RoutePolicy(
        ttft_target_s=0.5, rld_decode_rate=50.0, max_concurrent_relays=16, max_eager_tokens=3000
    )
    r = Router(p, LINK)
    rng = random.Random(1)
    releases: list[tuple[float, int]] = []
    decided: dict[int, RouteDecision] = {}
    now = 0.0
    for rid in range(5000):
        now += rng.expovariate(200.0 if rid < 4000 else 5.0)  # burst, then a trickle
        releases.sort()
        while releases and releases[0][0] <= now:
            r.release(releases.pop(0)[1])
        size = rng.choice([1, 1, 1, 50, 800, 3000]) * MB  # skewed prefix hits
        d = r.decide(RouteRequest(rid, size, rng.randint(16, 1024)), now)
        decided[rid] = d
        if d.uses_rld:
            releases.append((now + d.transfer_s + 0.3, rid))  # RLD holds it until handoff
        st = r.statistics()
        assert st.active_relays <= p.max_concurrent_relays
        assert st.eager_reserved <= p.max_eager_tokens
    assert sorted(decided) == list(range(5000))
    st = r.statistics()
    assert st.peak_relays <= p.max_concurrent_relays and st.peak_eager <= p.max_eager_tokens
    assert sum(st.by_route.values()) == 5000
    shed = st.by_reason.get("RELAY_FULL", 0) + st.by_reason.get("EAGER_BUDGET", 0)
    assert shed > 100  # the burst overloaded RLD
    tail = [decided[i] for i in range(4500, 5000) if decided[i].reason is RouteReason.MASK_TRANSFER]
    assert tail, "after the burst RLD admits relays again"


def test_exports() -> None:
    for name in route_pkg.__all__:
        assert hasattr(route_pkg, name)
