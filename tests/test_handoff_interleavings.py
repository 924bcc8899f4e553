"""RLD and MD machines joined by a simulated network, under random interleavings.

Hypothesis drives both machines through delays, reordered, duplicated and
lost messages, slow recomputes, crashes, cancels and early finishes, and
checks the invariants after every step:

* the user's stream is the model's sequence: each position once, in order,
  with the model's token (with RLD's playout buffer, MD's first tokens may
  come before the last ones RLD held, as a sink sees them: they wait there
  for the hole to fill; nothing else may come early);
* at most one live owner emits (RLD in an emitting state and MD in OWNER
  never coincide);
* rounds never exceed ``max_rounds`` and non-final batches never go below
  ``min_batch``;
* RLD never moves backwards through its states (no oscillation);
* no machine enters ERROR.

At the end the run is settled (messages delivered, timers fired, engines
run) and must terminate, with a complete stream unless a crash, a cancel or
message loss explains why not.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pddnet import PddnetError
from pddnet.handoff import Cancel as CancelEvent
from pddnet.handoff import (
    CancelTransfer,
    Done,
    Emit,
    Fallback,
    FinishReason,
    FreeBlocks,
    HandoffMode,
    HandoffParams,
    KvLanded,
    MainHandoff,
    MainState,
    Output,
    PeerFailed,
    RecomputeDone,
    RelayHandoff,
    RelayState,
    SendMessage,
    StartRecompute,
    Timer,
    TokenGenerated,
    event_for_message,
)
from pddnet.wire import Message

R, M = RelayState, MainState
RANK = {R.DECODING: 0, R.CATCHING_UP: 1, R.SWITCHING: 2, R.SOLO: 3}
EMITTING = (R.DECODING, R.CATCHING_UP, R.SOLO)


def model(i: int) -> int:
    """The reference model's greedy token at position ``i`` (a stand-in)."""
    return (i * 2654435761 + 12345) % 131072


class HandoffNet(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.net: list[tuple[str, Message]] = []
        self.stream: list[int] = []
        self.early: dict[int, int] = {}  # (playout) MD's tokens past a hole RLD will fill
        self.held_lost = False  # RLD died holding tokens (playout): a hole nobody fills
        self.violations: list[str] = []
        self.recompute: int | None = None
        self.alive = {"rld": True, "md": True}
        self.kv_landed = False
        self.kv_cancelled = False
        self.md_freed = False
        self.md_owned = False
        self.lost = self.cancelled = False
        self.crashed: str | None = None
        self.orphaned = False
        self.errors: list[PddnetError] = []

    @initialize(
        mode=st.sampled_from([HandoffMode.CATCH_UP, HandoffMode.CATCH_UP, HandoffMode.ONE_SHOT]),
        fallback=st.sampled_from(Fallback),
        threshold=st.integers(8, 48),
        final=st.integers(0, 16),
        min_batch=st.integers(1, 16),
        max_rounds=st.sampled_from([1, 2, 3, 4, 4, 6, 6]),
        rate=st.sampled_from([50.0, 400.0, 2000.0, 2000.0]),
        length=st.integers(-20, 200),
        kv_never=st.sampled_from([False, False, False, False, True]),
        kv_after=st.integers(-30, 120),
        split=st.sampled_from([4096, 4096, 5]),
        chaos_after=st.sampled_from(["start", "handoff", "switch", "owner"]),
        playout=st.sampled_from([0.0, 0.0, 0.025]),
    )
    def setup(
        self,
        mode: HandoffMode,
        fallback: Fallback,
        threshold: int,
        final: int,
        min_batch: int,
        max_rounds: int,
        rate: float,
        length: int,
        kv_never: bool,
        kv_after: int,
        split: int,
        chaos_after: str,
        playout: float,
    ) -> None:
        self.params = HandoffParams(
            mode=mode,
            fallback=fallback,
            catchup_threshold=max(threshold, final, min_batch),
            final_switch_size=final,
            min_batch=min_batch,
            max_rounds=max_rounds,
            recompute_rate=rate,
            rtt_s=0.01,
            kv_timeout_s=20.0,
            ack_timeout_s=0.5,
            idle_timeout_s=5.0,
            recompute_timeout_s=2.0,
            max_message_tokens=split,
            playout_s=playout,
        )
        self.kv_never = kv_never
        # The KV lands once RLD has generated kv_after tokens (or stopped), and
        # crashes, cancels and long pauses wait for a milestone: this puts them
        # deep into catch-up and the switch instead of mostly at the start.
        self.kv_after = self.params.catchup_threshold + kv_after
        # Mostly longer than the eager phase; sometimes shorter (strange traffic).
        self.length = max(1, self.kv_after + length)
        self.chaos_after = chaos_after
        self.rld = RelayHandoff(1, self.params, now=0.0)
        self.md = MainHandoff(1, self.params, now=0.0)
        # The eager phase until shortly before the KV lands has only one actor
        # (RLD decoding) and nothing to interleave: run it up front.
        self.rld_decodes(min(self.kv_after - 5, self.length - 1))

    # ------------------------------------------------------------ plumbing
    def feed(self, who: str, event: Any) -> None:
        machine = self.rld if who == "rld" else self.md
        try:
            outs = machine.handle(event, self.now)
        except PddnetError as exc:
            self.violations.append(f"{who} raised {exc!r} on {event!r}")
            return
        self.act(who, outs)

    def act(self, who: str, outs: list[Output]) -> None:
        peer = "md" if who == "rld" else "rld"
        for o in outs:
            if isinstance(o, Emit):
                if o.token != model(o.position):
                    self.violations.append(f"{who} emitted a wrong token at {o.position}")
                if o.position < len(self.stream) or o.position in self.early:
                    self.violations.append(f"{who} emitted position {o.position} twice")
                elif o.position > len(self.stream):
                    if not (who == "md" and self.params.playout_s and self.rld.holding):
                        self.violations.append(
                            f"{who} emitted position {o.position}, stream at {len(self.stream)}"
                        )
                    event("md ahead of the tokens rld holds")
                    self.early[o.position] = o.token
                else:
                    self.stream.append(o.token)
                    while len(self.stream) in self.early:
                        self.stream.append(self.early.pop(len(self.stream)))
            elif isinstance(o, SendMessage):
                self.net.append((peer, o.message))
            elif isinstance(o, StartRecompute):
                assert self.recompute is None, "one extend at a time"
                if o.tokens != tuple(model(o.start + i) for i in range(len(o.tokens))):
                    self.violations.append("MD recomputes tokens that are not the model's")
                self.recompute = o.start + len(o.tokens)
            elif isinstance(o, CancelTransfer):
                self.kv_cancelled = True
            elif isinstance(o, FreeBlocks):
                self.md_freed = True
            elif isinstance(o, Done) and o.error is not None:
                self.errors.append(o.error)
        if who == "md" and self.md.state is M.OWNER:
            self.md_owned = True

    def next_token(self, position: int) -> TokenGenerated:
        fin = FinishReason.EOS if position == self.length - 1 else None
        return TokenGenerated(model(position), fin)

    def rld_can_decode(self) -> bool:
        return self.alive["rld"] and self.rld.may_decode

    def md_can_decode(self) -> bool:
        return self.alive["md"] and self.md.may_decode

    def md_can_land(self) -> bool:
        return (
            self.alive["md"]
            and not self.kv_landed
            and not self.kv_cancelled
            and not self.kv_never
            and self.md.state is M.WAITING_KV
            and (len(self.rld.tokens) >= self.kv_after or not self.rld_can_decode())
        )

    def chaos_allowed(self) -> bool:
        return {
            "start": True,
            "handoff": self.rld.rounds > 0,
            "switch": self.rld.final_end is not None,
            "owner": self.md_owned,
        }[self.chaos_after] or not self.rld_can_decode()

    def md_can_finish_recompute(self) -> bool:
        return self.alive["md"] and self.recompute is not None

    def fire_timers(self) -> None:
        for who, machine in (("rld", self.rld), ("md", self.md)):
            t = machine.get_timer()
            if self.alive[who] and t is not None and t <= self.now:
                self.feed(who, Timer())

    def deliver(self, i: int) -> None:
        dest, msg = self.net.pop(i % len(self.net))
        if self.alive[dest]:
            self.feed(dest, event_for_message(msg))

    # --------------------------------------------------------------- rules
    # Rules check their own applicability instead of using preconditions:
    # filtered rule draws make Hypothesis give up on many runs.
    @rule(n=st.integers(1, 8))
    def rld_decodes(self, n: int = 1) -> None:
        for _ in range(n):
            if not self.rld_can_decode():
                return
            self.now += 0.01
            self.feed("rld", self.next_token(len(self.rld.tokens)))

    @rule(n=st.integers(1, 4))
    def md_decodes(self, n: int = 1) -> None:
        for _ in range(n):
            if not self.md_can_decode():
                return
            self.now += 0.01
            assert self.md.position is not None
            self.feed("md", self.next_token(self.md.position))

    @rule()
    def kv_lands(self) -> None:
        if self.md_can_land():
            self.kv_landed = True
            self.feed("md", KvLanded())

    @rule()
    def recompute_finishes(self) -> None:
        if self.md_can_finish_recompute():
            end, self.recompute = self.recompute, None
            self.feed("md", RecomputeDone(end))  # type: ignore[arg-type]

    @rule(i=st.integers(0, 100))
    def deliver_one(self, i: int) -> None:
        if self.net:
            self.deliver(i)

    @rule(order=st.randoms(use_true_random=False))
    def deliver_all(self, order: Any) -> None:
        batch, self.net = self.net, []
        order.shuffle(batch)
        for dest, msg in batch:
            if self.alive[dest]:
                self.feed(dest, event_for_message(msg))

    @rule(i=st.integers(0, 100))
    def duplicate(self, i: int) -> None:
        if self.net:
            self.net.append(self.net[i % len(self.net)])

    # Disruptions take a ``roll`` and act on 0 only: rare enough that runs
    # usually reach the deep states (catch-up rounds, the switch, MD owning)
    # before something breaks, yet any step may be the one that breaks.
    @rule(i=st.integers(0, 100), roll=st.integers(0, 3))
    def lose(self, i: int, roll: int) -> None:
        if roll == 0 and self.net:
            self.lost = True
            self.net.pop(i % len(self.net))

    @rule(dt=st.sampled_from([0.02, 0.05, 0.2, 0.5, 2.0, 30.0]), roll=st.integers(0, 3))
    def time_passes(self, dt: float, roll: int) -> None:
        if dt > 1.0 and (roll or not self.chaos_allowed()):
            dt = 0.1  # long pauses (past deadlines) are disruptions too
        self.now += dt
        self.fire_timers()

    @rule(who=st.sampled_from(["rld", "md", "emitter"]), roll=st.integers(0, 1))
    def crash(self, who: str, roll: int) -> None:
        if roll or self.crashed is not None or not self.chaos_allowed():
            return
        if who == "emitter":
            who = "md" if self.md.state is M.OWNER else "rld"
        self.crashed = who
        event(f"crash {who} in {self.md.state.name}/{self.rld.state.name}")
        if who == "rld" and self.rld.holding:
            self.held_lost = True
            event("rld crashed holding tokens")
        self.alive[who] = False
        if who == "md":
            self.recompute = None
        survivor = "md" if who == "rld" else "rld"
        # A survivor that already let go leaves the request with the dead owner.
        self.orphaned = (self.md if who == "rld" else self.rld).done
        self.feed(survivor, PeerFailed(user_position=len(self.stream)))

    @rule(roll=st.integers(0, 7))
    def cancel(self, roll: int) -> None:
        if roll or self.cancelled or not self.chaos_allowed():
            return
        self.cancelled = True
        for who in ("rld", "md"):
            if self.alive[who]:
                self.feed(who, CancelEvent())

    # ---------------------------------------------------------- invariants
    @invariant()
    def no_violation(self) -> None:
        assert not self.violations, self.violations

    @invariant()
    def one_owner(self) -> None:
        rld_emits = self.alive["rld"] and self.rld.state in EMITTING
        md_emits = self.alive["md"] and self.md.state is M.OWNER
        if self.rld.state is R.SWITCHING and md_emits:
            event("md owns before rld released")
        if self.rld.rounds >= 2:
            event("catch-up rounds")
        assert not (rld_emits and md_emits)

    @invariant()
    def bounded_rounds_and_batches(self) -> None:
        r = self.rld
        assert r.rounds <= self.params.max_rounds
        non_final = r.batch_sizes[:-1] if r.final_end is not None else r.batch_sizes
        assert all(n >= self.params.min_batch for n in non_final), r.batch_sizes

    @invariant()
    def no_oscillation(self) -> None:
        ranks = [RANK.get(new, 9) for _, _, new in self.rld.history]  # type: ignore[call-overload]
        assert ranks == sorted(ranks), self.rld.history

    @invariant()
    def no_error_state(self) -> None:
        assert self.rld.state is not R.ERROR and self.md.state is not M.ERROR

    # ------------------------------------------------------------- settle
    def teardown(self) -> None:
        if not hasattr(self, "rld"):
            return
        for _ in range(5000):
            if self.net:
                self.deliver(0)
            elif self.md_can_finish_recompute():
                self.recompute_finishes()
            elif self.md_can_land():
                self.kv_lands()
            elif self.rld_can_decode():
                self.rld_decodes()
            elif self.md_can_decode():
                self.md_decodes()
            else:
                timers = [
                    t
                    for who, m in (("rld", self.rld), ("md", self.md))
                    if self.alive[who] and (t := m.get_timer()) is not None
                ]
                if not timers:
                    break
                self.now = max(self.now, min(timers))
                self.fire_timers()
            self.no_violation()
            self.one_owner()
        live = [m for who, m in (("rld", self.rld), ("md", self.md)) if self.alive[who]]
        assert all(m.done for m in live), (self.rld.state, self.md.state, "hung")
        self.no_violation()
        self.no_oscillation()
        if self.md.state in (M.ABORTED, M.CANCELLED, M.FAILED) and not self.md_owned:
            assert self.md_freed, "MD left without freeing its blocks"
        if (self.crashed == "md" and self.md_owned) or self.orphaned:
            return  # the sole owner died: the request is lost with it
        if self.held_lost:
            # RLD died holding tokens it had not shown (playout): the user's
            # stream keeps that hole and its sink fails it (docs/handoff.md).
            return
        if self.cancelled:
            return
        timed_out = any(
            "timeout" in label for m in (self.rld, self.md) for _, label, _ in m.history
        )
        if self.lost or self.crashed or timed_out:
            # A message lost, or delayed past a deadline, or a crash.
            # Either the answer is complete or a typed error says why not.
            assert len(self.stream) == self.length or self.errors, (self.rld.state, self.md.state)
            return
        assert len(self.stream) == self.length, (
            len(self.stream),
            self.length,
            self.rld.state,
            self.md.state,
        )
        assert self.rld.state in (R.RELEASED, R.FINISHED)
        assert self.md.state in (M.FINISHED, M.ABORTED)
        if self.rld.state is R.FINISHED and not self.kv_landed:
            assert self.kv_cancelled  # strange traffic: the WAN transfer is cut off


# CI runs 1000 examples (about 15 s); PDDNET_HANDOFF_EXAMPLES=5000 digs deeper.
HandoffNet.TestCase.settings = settings(
    max_examples=int(os.environ.get("PDDNET_HANDOFF_EXAMPLES", "1000")),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_handoff_interleavings = HandoffNet.TestCase
