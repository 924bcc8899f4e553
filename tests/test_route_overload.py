"""Router + handoff machines under overload: every request finishes, RLD stays
inside its limits, and the user stream of each request is the model's."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pddnet.handoff import (
    CancelTransfer,
    Emit,
    FinishReason,
    HandoffParams,
    KvLanded,
    MainHandoff,
    MainState,
    Output,
    RecomputeDone,
    RelayHandoff,
    RelayState,
    SendMessage,
    StartRecompute,
    Timer,
    TokenGenerated,
    combine_metrics,
    event_for_message,
)
from pddnet.route import LinkEstimate, Route, RoutePolicy, Router, RouteRequest

STEP = 0.02  # one decode step on either side
MB = 1 << 20


def model(rid: int, i: int) -> int:
    return (rid * 7919 + i * 2654435761) % 131072


@dataclass
class Req:
    rid: int
    length: int
    kv_at: float
    route: Route
    rld: RelayHandoff | None = None
    md: MainHandoff | None = None
    stream: list[int] = field(default_factory=list)
    inbox: dict[str, list[object]] = field(default_factory=lambda: {"rld": [], "md": []})
    recompute_end: int | None = None
    cancelled_transfer: bool = False
    done: bool = False


def pump(req: Req, who: str, outs: list[Output]) -> None:
    peer = "md" if who == "rld" else "rld"
    for o in outs:
        if isinstance(o, Emit):
            assert o.position == len(req.stream) and o.token == model(req.rid, o.position)
            req.stream.append(o.token)
        elif isinstance(o, SendMessage):
            req.inbox[peer].append(o.message)
        elif isinstance(o, StartRecompute):
            req.recompute_end = o.start + len(o.tokens)
        elif isinstance(o, CancelTransfer):
            req.cancelled_transfer = True


def tick(req: Req, now: float) -> None:
    """One 20 ms step of one request: deliver, recompute, decode, timers."""
    rld, md = req.rld, req.md
    fin = lambda pos: FinishReason.MAX_TOKENS if pos == req.length - 1 else None  # noqa: E731
    for who, m in (("rld", rld), ("md", md)):
        msgs, req.inbox[who] = req.inbox[who], []
        for msg in msgs:
            if m is not None:
                pump(req, who, m.handle(event_for_message(msg), now))  # type: ignore[arg-type]
    if md is not None:
        if md.state is MainState.WAITING_KV and now >= req.kv_at and not req.cancelled_transfer:
            pump(req, "md", md.handle(KvLanded(), now))
        if req.recompute_end is not None:
            end, req.recompute_end = req.recompute_end, None
            pump(req, "md", md.handle(RecomputeDone(end), now))
        if md.may_decode:
            pos = md.position
            assert pos is not None
            pump(req, "md", md.handle(TokenGenerated(model(req.rid, pos), fin(pos)), now))
    if rld is not None and rld.may_decode:
        pos = len(rld.tokens)
        pump(req, "rld", rld.handle(TokenGenerated(model(req.rid, pos), fin(pos)), now))
    for who, m in (("rld", rld), ("md", md)):
        if m is not None and (t := m.get_timer()) is not None and t <= now:
            pump(req, who, m.handle(Timer(), now))


def test_overload_sheds_and_loses_no_request() -> None:
    policy = RoutePolicy(
        ttft_target_s=0.3, rld_decode_rate=1 / STEP, max_concurrent_relays=8, max_eager_tokens=800
    )
    router = Router(policy, LinkEstimate(bandwidth_bytes_s=2e9, rtt_s=0.03))
    params = HandoffParams(rtt_s=STEP, recompute_rate=5000.0)
    rng = random.Random(3)
    reqs: list[Req] = []
    now = 0.0
    peak = 0
    for step in range(1500):
        now = step * STEP
        if step < 400:  # 5 arrivals per step for 8 s: far beyond 8 relays
            for _ in range(5):
                rid = len(reqs)
                size = rng.choice([2, 2, 2, 600, 2000, 4000]) * MB
                length = rng.randint(1, 120)
                d = router.decide(RouteRequest(rid, size, length), now)
                req = Req(rid, length, now + d.transfer_s, d.route)
                if d.uses_rld:
                    req.rld = RelayHandoff(rid, params, now=now)
                # P->MD: no relay; MD owns from position 0 once the KV lands.
                req.md = MainHandoff(rid, params, now=now, relayed=d.uses_rld)
                reqs.append(req)
        for req in reqs:
            if req.done:
                continue
            tick(req, now)
            live = [m for m in (req.rld, req.md) if m is not None]
            if req.rld is not None and req.rld.done:
                router.release(req.rid)
            if all(m.done or m.state is MainState.ABORTED for m in live):
                req.done = True
        peak = max(peak, router.active_relays)
        assert router.active_relays <= policy.max_concurrent_relays
    assert all(r.done for r in reqs), [
        (r.rid, r.rld and r.rld.state, r.md and r.md.state) for r in reqs if not r.done
    ][:5]
    for r in reqs:
        assert r.stream == [model(r.rid, i) for i in range(r.length)], r.rid
    st = router.statistics()
    assert st.peak_relays <= policy.max_concurrent_relays
    assert st.by_reason.get("RELAY_FULL", 0) + st.by_reason.get("EAGER_BUDGET", 0) > 0
    relayed = [r for r in reqs if r.rld is not None]
    assert relayed and peak == policy.max_concurrent_relays
    m = []
    for r in relayed:
        assert r.rld is not None and r.md is not None
        m.append(combine_metrics(r.rld.statistics(now), r.md.statistics(now)))
    assert sum(x.tokens_rld + x.tokens_md for x in m) == sum(r.length for r in relayed)
    assert all(x.rounds <= params.max_rounds for x in m)
    states = {r.rld.state for r in relayed if r.rld is not None}
    # Both handed-over requests and strange traffic (RLD finished first) occur.
    assert {RelayState.RELEASED, RelayState.FINISHED} <= states
    assert st.by_route["p-md"] > len(relayed)  # the excess went straight to MD
