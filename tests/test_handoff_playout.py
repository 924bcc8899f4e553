"""RLD's playout buffer (``HandoffParams.playout_s``), sans-IO with explicit time.

RLD decodes every 20 ms in these tests. With a playout, it shows each token
(after P's first) a little after decoding it, the delay ramping up by half an
interval per token to ``playout_s``; at the final switch it spreads what it
holds up to MD's predicted first token, and it flushes what it holds when it
leaves the switch (released, resumed, finished) or drops it (cancelled).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import pytest

from pddnet.handoff import (
    AbortReason,
    BatchAcked,
    Cancel,
    Done,
    Emit,
    FinishReason,
    HandoffParams,
    KvLanded,
    MainHandoff,
    Output,
    PeerAborted,
    RecomputeDone,
    RelayHandoff,
    RelayState,
    SendMessage,
    StartRecompute,
    Timer,
    TokenBatch,
    TokenGenerated,
    event_for_message,
)

R = RelayState
STEP = 0.02  # RLD's (and MD's) decode interval
PLAYOUT = HandoffParams(rtt_s=0.03, playout_s=0.04)


def tok(i: int) -> int:
    return (i * 2654435761 + 7) % 131072


class Clocked:
    """An RLD machine fed at explicit times; records when each position is shown."""

    def __init__(self, params: HandoffParams) -> None:
        self.r = RelayHandoff(1, params, now=0.0)
        self.shown: dict[int, float] = {}
        self.outs: list[Output] = []

    def feed(self, event: Any, now: float) -> list[Output]:
        outs = self.r.handle(event, now)
        for o in outs:
            if isinstance(o, Emit):
                assert o.position not in self.shown, "a position shown twice"
                assert o.position == len(self.shown), "shown out of order"
                assert o.token == tok(o.position)
                self.shown[o.position] = now
        self.outs.extend(outs)
        return outs

    def until(self, t: float) -> None:
        """Fire the machine's timers due by ``t``, each at its own time."""
        while (due := self.r.get_timer()) is not None and due <= t:
            self.feed(Timer(), due)

    def decode(self, n: int, start: float = 0.0) -> float:
        """RLD decodes ``n`` tokens, one every STEP from ``start``; the last one's time."""
        t = start
        for i in range(n):
            t = start + i * STEP
            self.until(t)
            self.feed(TokenGenerated(tok(len(self.r.tokens))), t)
        return t


def test_delay_ramps_by_half_an_interval_up_to_playout_s() -> None:
    c = Clocked(PLAYOUT)
    last = c.decode(12)
    c.until(last + 1.0)
    delays = [round(c.shown[i] - i * STEP, 6) for i in range(12)]
    assert delays == [0.0, 0.01, 0.02, 0.03] + [0.04] * 8
    gaps = [c.shown[i + 1] - c.shown[i] for i in range(11)]
    assert max(gaps) == pytest.approx(1.5 * STEP)  # the ramp; then the cadence
    st = c.r.statistics(1.0)
    assert st.playout_tokens == 11
    assert st.playout_max_s == pytest.approx(0.04)
    assert st.playout_total_s == pytest.approx(0.01 + 0.02 + 0.03 + 8 * 0.04)
    assert c.r.state is R.DECODING


def test_timer_shows_a_held_token_at_its_time() -> None:
    c = Clocked(PLAYOUT)
    c.decode(2)  # P's token at 0 shown at once; token 1 decoded at 0.02
    assert set(c.shown) == {0}
    assert c.r.get_timer() == pytest.approx(0.03)  # before the 30 s KV deadline
    outs = c.feed(Timer(), 0.03)
    assert [o for o in outs if isinstance(o, Emit)] == [Emit(1, tok(1))]
    assert c.r.history[-1] == (R.DECODING, "show", R.DECODING)


def test_off_shows_every_token_when_decoded() -> None:
    c = Clocked(HandoffParams(rtt_s=0.03))
    c.decode(10)
    assert c.shown == {i: pytest.approx(i * STEP) for i in range(10)}
    assert c.r.statistics(1.0).playout_tokens == 0


def switching() -> tuple[Clocked, float]:
    """10 tokens decoded (the last at 0.18), MD's KV lands at 0.185: one-shot."""
    c = Clocked(PLAYOUT)
    c.decode(10)
    c.until(0.185)
    assert sorted(c.shown) == list(range(8))  # 8 and 9 are held (due at 0.20, 0.22)
    c.feed(KvLanded(), 0.185)
    assert c.r.state is R.SWITCHING
    return c, 0.185


def test_final_batch_carries_held_tokens_and_spreads_them_before_md() -> None:
    c, t = switching()
    batches = [o.message for o in c.outs if isinstance(o, SendMessage)]
    assert len(batches) == 1 and isinstance(batches[0], TokenBatch)
    assert batches[0].final and batches[0].start == 0
    assert c.r.final_end == 10  # every decoded token, held or not: MD's timing is unchanged
    md_first = t + 0.03 + STEP  # rtt_s plus one decode interval after the batch
    gap = (md_first - c.shown[7]) / 3  # the last shown token, two held, then MD
    c.until(md_first)
    assert c.shown[8] == pytest.approx(c.shown[7] + gap)
    assert c.shown[9] == pytest.approx(c.shown[7] + 2 * gap)
    assert c.shown[9] < md_first
    assert all(label == "show" for _, label, _ in c.r.history[-2:])
    c.feed(BatchAcked(10, True), md_first + 0.005)
    assert c.r.state is R.RELEASED
    assert len(c.shown) == 10


def test_owner_ack_flushes_what_is_held_before_done() -> None:
    c, t = switching()
    outs = c.feed(BatchAcked(10, True), t + 0.01)
    assert [type(o).__name__ for o in outs] == ["Emit", "Emit", "Done"]
    assert [o.position for o in outs if isinstance(o, Emit)] == [8, 9]
    assert c.r.state is R.RELEASED


def test_md_abort_resumes_with_the_held_tokens_first() -> None:
    c, t = switching()
    outs = c.feed(PeerAborted(AbortReason.TIMEOUT), t + 0.01)
    assert [o.position for o in outs if isinstance(o, Emit)] == [8, 9]
    assert c.r.state is R.SOLO
    c.feed(TokenGenerated(tok(10)), t + 0.02)
    assert c.shown[10] == pytest.approx(t + 0.02)  # no hold once no switch can come


def test_last_token_flushes_so_a_request_rld_finishes_ends_on_time() -> None:
    c = Clocked(PLAYOUT)
    c.decode(9)
    outs = c.feed(TokenGenerated(tok(9), FinishReason.EOS), 9 * STEP)
    assert [o.position for o in outs if isinstance(o, Emit)] == [7, 8, 9]
    assert c.shown[9] == pytest.approx(9 * STEP)
    assert c.r.state is R.FINISHED
    assert isinstance(outs[-1], Done)


def test_cancel_drops_what_is_held() -> None:
    c = Clocked(PLAYOUT)
    c.decode(6)
    outs = c.feed(Cancel(), 0.105)
    assert not [o for o in outs if isinstance(o, Emit)]
    assert c.r.state is R.CANCELLED
    assert c.r.get_timer() is None


def test_negative_playout_is_rejected() -> None:
    with pytest.raises(ValueError, match="playout_s"):
        HandoffParams(playout_s=-0.01)


def user_gaps(params: HandoffParams, kv_at: float, length: int = 40) -> list[float]:
    """RLD and MD joined by a 15 ms one-way WAN; the user sits by RLD (P's
    sink, in RLD's datacenter), so MD's tokens reach it 15 ms after MD emits
    them. RLD decodes every 20 ms; MD's recompute pass (its first token
    included) and each decode step take 20 ms. MD's KV lands at ``kv_at``.
    Returns the gaps between consecutive tokens as the user sees them."""
    one_way = 0.015
    rld = RelayHandoff(1, params, now=0.0)
    md = MainHandoff(1, params, now=0.0)
    seen: dict[int, float] = {}
    queue: list[tuple[float, int, str, Any]] = []
    order = itertools.count()

    def at(t: float, who: str, ev: Any) -> None:
        heapq.heappush(queue, (t, next(order), who, ev))

    def act(who: str, outs: list[Output], now: float) -> None:
        for o in outs:
            if isinstance(o, Emit):
                seen.setdefault(o.position, now + (0.0 if who == "rld" else one_way))
            elif isinstance(o, SendMessage):
                at(now + one_way, "md" if who == "rld" else "rld", event_for_message(o.message))
            elif isinstance(o, StartRecompute):
                at(now + STEP, "md", RecomputeDone(o.start + len(o.tokens)))

    at(kv_at, "md", KvLanded())
    at(0.0, "rld", TokenGenerated(tok(0)))
    timers: dict[str, float | None] = {"rld": None, "md": None}
    while queue:
        now, _, who, ev = heapq.heappop(queue)
        m = rld if who == "rld" else md
        if isinstance(ev, Timer) and timers[who] != now:
            continue  # superseded
        if isinstance(ev, TokenGenerated) and not m.may_decode:
            continue  # RLD stopped (the final batch is out)
        act(who, m.handle(ev, now), now)
        if isinstance(ev, RecomputeDone) and md.may_decode:
            at(now, "md", TokenGenerated(tok(md.final_end or 0)))  # the pass's token
        if isinstance(ev, TokenGenerated):
            nxt = len(rld.tokens) if who == "rld" else md.position
            if nxt is not None and nxt < length and m.may_decode:
                fin = FinishReason.MAX_TOKENS if nxt == length - 1 else None
                at(now + STEP, who, TokenGenerated(tok(nxt), fin))
        for name, mach in (("rld", rld), ("md", md)):
            t = mach.get_timer()
            if t is not None and t != timers[name] and not mach.done:
                timers[name] = t
                at(max(t, now), name, Timer())
    assert sorted(seen) == list(range(length))
    times = [seen[i] for i in range(length)]
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.parametrize("kv_at", [0.301, 0.31, 0.319])
def test_playout_spreads_the_switch_stall_over_the_held_tokens(kv_at: float) -> None:
    off = user_gaps(HandoffParams(rtt_s=0.03), kv_at)
    on = user_gaps(PLAYOUT, kv_at)
    # Off: one stall of a one-way trip, MD's pass, the way back (and RLD's phase).
    assert max(off) >= 0.05
    # On: no gap above the ramp's 1.5 intervals, the switch included.
    assert max(on) <= 1.5 * STEP + 1e-9
    # MD's tokens come when they would have without the playout: the end is unchanged.
    assert sum(on) == pytest.approx(sum(off))
