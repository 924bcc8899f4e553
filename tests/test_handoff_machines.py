"""Table-driven transition tests of the RLD and MD handoff machines."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest

from pddnet import LocalProtocolError, PeerUnavailable, RemoteProtocolError, TransferTimeout
from pddnet.handoff import (
    MAIN_TABLE,
    RELAY_TABLE,
    AbortReason,
    BatchAcked,
    BatchReceived,
    Cancel,
    Done,
    Event,
    Fallback,
    FinishReason,
    FreeBlocks,
    HandoffAbort,
    HandoffAck,
    HandoffMode,
    HandoffParams,
    KvLanded,
    KvReady,
    MainHandoff,
    MainState,
    Output,
    PeerAborted,
    PeerFailed,
    RecomputeDone,
    RelayHandoff,
    RelayState,
    SendMessage,
    StartRecompute,
    TakeOver,
    Timer,
    TokenBatch,
    TokenGenerated,
    event_for_message,
)
from pddnet.wire import Message

R, M = RelayState, MainState
P = HandoffParams()
DT = 0.01  # RLD decodes 100 tok/s in these fixtures; MD recomputes 2000 tok/s


def tok(i: int) -> int:
    return (i * 2654435761 + 7) % 131072


def relay_at(state: RelayState, n: int = 100, params: HandoffParams = P) -> RelayHandoff:
    """A relay machine driven into ``state`` after generating ``n`` tokens."""
    r = RelayHandoff(7, params, now=0.0)
    for i in range(n):
        r.handle(TokenGenerated(tok(i)), i * DT)
    now = n * DT
    if state is R.DECODING:
        return r
    if state is R.CATCHING_UP:
        r.handle(KvLanded(), now)
    elif state is R.SWITCHING:
        r.handle(KvLanded(), now)
        if r.state is R.CATCHING_UP:
            r.handle(BatchAcked(r.sent_end, False), now)
    elif state is R.SOLO:
        r.handle(PeerFailed(), now)
    assert r.state is state
    return r


def main_at(state: MainState, n: int = 50, final: bool = False) -> MainHandoff:
    """An MD machine in ``state``, holding batch [0, n) (final if asked)."""
    m = MainHandoff(7, P, now=0.0)
    if state is M.WAITING_KV:
        return m
    m.handle(KvLanded(), 1.0)
    if state is M.READY:
        return m
    m.handle(BatchReceived(0, tuple(tok(i) for i in range(n)), final), 1.0)
    if state is M.OWNER:
        m.handle(RecomputeDone(n), 1.1)
    assert m.state is state
    return m


def kinds(outs: list[Output]) -> list[str]:
    """Output kinds, with the message type for SendMessage."""
    return [
        f"Send:{type(o.message).__name__}" if isinstance(o, SendMessage) else type(o).__name__
        for o in outs
    ]


Case = tuple[str, Callable[[], RelayHandoff | MainHandoff], Event, float, object, list[str]]

CASES: list[Case] = [
    # ---- RLD
    ("rld emits", lambda: relay_at(R.DECODING), TokenGenerated(5), 1.0, R.DECODING, ["Emit"]),
    (
        "strange traffic: RLD finishes first",
        lambda: relay_at(R.DECODING),
        TokenGenerated(5, FinishReason.EOS),
        1.0,
        R.FINISHED,
        ["Emit", "CancelTransfer", "Send:HandoffAbort", "Done"],
    ),
    (
        "few pending: one-shot",
        lambda: relay_at(R.DECODING, n=40),
        KvLanded(),
        1.0,
        R.SWITCHING,
        ["Send:TokenBatch"],
    ),
    (
        "many pending: catch-up",
        lambda: relay_at(R.DECODING, n=100),
        KvLanded(),
        1.0,
        R.CATCHING_UP,
        ["Send:TokenBatch"],
    ),
    (
        "one-shot mode ignores the threshold",
        lambda: relay_at(R.DECODING, params=HandoffParams(mode=HandoffMode.ONE_SHOT)),
        KvLanded(),
        1.0,
        R.SWITCHING,
        ["Send:TokenBatch"],
    ),
    ("kv not due", lambda: relay_at(R.DECODING), Timer(), 5.0, R.DECODING, []),
    (
        "kv deadline",
        lambda: relay_at(R.DECODING),
        Timer(),
        P.kv_timeout_s,
        R.SOLO,
        ["CancelTransfer", "Send:HandoffAbort"],
    ),
    ("md dies early", lambda: relay_at(R.DECODING), PeerFailed(), 1.0, R.SOLO, ["CancelTransfer"]),
    (
        "cancel while decoding",
        lambda: relay_at(R.DECODING),
        Cancel(),
        1.0,
        R.CANCELLED,
        ["CancelTransfer", "Send:HandoffAbort", "Done"],
    ),
    (
        "ack of the whole backlog: final switch",
        lambda: relay_at(R.CATCHING_UP),
        BatchAcked(100, False),
        1.1,
        R.SWITCHING,
        ["Send:TokenBatch"],
    ),
    ("stale ack", lambda: relay_at(R.CATCHING_UP), BatchAcked(0, False), 1.1, R.CATCHING_UP, []),
    (
        "ack timeout: retransmit",
        lambda: relay_at(R.CATCHING_UP),
        Timer(),
        5.0,
        R.CATCHING_UP,
        ["Send:TokenBatch"],
    ),
    ("md dies mid catch-up", lambda: relay_at(R.CATCHING_UP), PeerFailed(), 1.1, R.SOLO, []),
    (
        "RLD finishes mid catch-up",
        lambda: relay_at(R.CATCHING_UP),
        TokenGenerated(9, FinishReason.MAX_TOKENS),
        1.1,
        R.FINISHED,
        ["Emit", "Send:HandoffAbort", "Done"],
    ),
    (
        "owner ack releases RLD",
        lambda: relay_at(R.SWITCHING, n=40),
        BatchAcked(40, True),
        1.0,
        R.RELEASED,
        ["Done"],
    ),
    (
        "MD refuses: RLD resumes",
        lambda: relay_at(R.SWITCHING, n=40),
        PeerAborted(AbortReason.MD_FAILED),
        1.0,
        R.SOLO,
        [],
    ),
    (
        "MD dies, user saw nothing of it: resume",
        lambda: relay_at(R.SWITCHING, n=40),
        PeerFailed(user_position=40),
        1.0,
        R.SOLO,
        [],
    ),
    (
        "MD dies after it may have emitted: fail",
        lambda: relay_at(R.SWITCHING, n=40),
        PeerFailed(user_position=None),
        1.0,
        R.FAILED,
        ["Done"],
    ),
    (
        "cancel while switching",
        lambda: relay_at(R.SWITCHING, n=40),
        Cancel(),
        1.0,
        R.CANCELLED,
        ["Send:HandoffAbort", "Done"],
    ),
    ("solo emits", lambda: relay_at(R.SOLO), TokenGenerated(3), 2.0, R.SOLO, ["Emit"]),
    ("solo ignores acks", lambda: relay_at(R.SOLO), BatchAcked(0, False), 2.0, R.SOLO, []),
    # ---- MD
    ("kv lands", lambda: main_at(M.WAITING_KV), KvLanded(), 1.0, M.READY, ["Send:KvReady"]),
    (
        "early batch is buffered",
        lambda: main_at(M.WAITING_KV),
        BatchReceived(0, (1, 2, 3), False),
        1.0,
        M.WAITING_KV,
        [],
    ),
    (
        "strange traffic at MD: cancel and free",
        lambda: main_at(M.WAITING_KV),
        PeerAborted(AbortReason.RLD_FINISHED),
        1.0,
        M.ABORTED,
        ["CancelTransfer", "FreeBlocks", "Done"],
    ),
    (
        "kv deadline at MD",
        lambda: main_at(M.WAITING_KV),
        Timer(),
        P.kv_timeout_s,
        M.ABORTED,
        ["CancelTransfer", "FreeBlocks", "Send:HandoffAbort", "Done"],
    ),
    (
        "batch starts a recompute",
        lambda: main_at(M.READY),
        BatchReceived(0, (1, 2, 3), False),
        1.0,
        M.RECOMPUTING,
        ["StartRecompute"],
    ),
    (
        "empty final batch: take over at once",
        lambda: main_at(M.READY),
        BatchReceived(0, (), True),
        1.0,
        M.OWNER,
        ["Send:HandoffAck", "TakeOver"],
    ),
    (
        "recompute done, not final",
        lambda: main_at(M.RECOMPUTING),
        RecomputeDone(50),
        1.1,
        M.READY,
        ["Send:HandoffAck"],
    ),
    (
        "recompute of the final batch: take over",
        lambda: main_at(M.RECOMPUTING, final=True),
        RecomputeDone(50),
        1.1,
        M.OWNER,
        ["Send:HandoffAck", "TakeOver"],
    ),
    (
        "recompute hangs",
        lambda: main_at(M.RECOMPUTING),
        Timer(),
        100.0,
        M.ABORTED,
        ["FreeBlocks", "Send:HandoffAbort", "Done"],
    ),
    (
        "RLD dies, position unknown",
        lambda: main_at(M.RECOMPUTING),
        PeerFailed(),
        1.1,
        M.FAILED,
        ["FreeBlocks", "Done"],
    ),
    (
        "RLD dies after the final batch",
        lambda: main_at(M.RECOMPUTING, final=True),
        PeerFailed(),
        1.1,
        M.RECOMPUTING,
        [],
    ),
    (
        "owner emits",
        lambda: main_at(M.OWNER, final=True),
        TokenGenerated(1),
        2.0,
        M.OWNER,
        ["Emit"],
    ),
    (
        "owner re-acks a duplicate final",
        lambda: main_at(M.OWNER, final=True),
        BatchReceived(0, (), True),
        2.0,
        M.OWNER,
        ["Send:HandoffAck"],
    ),
    (
        "idle RLD",
        lambda: main_at(M.READY),
        Timer(),
        12.0,
        M.ABORTED,
        ["FreeBlocks", "Send:HandoffAbort", "Done"],
    ),
]


@pytest.mark.parametrize(
    ("name", "make", "event", "now", "expect", "outs"), CASES, ids=[c[0] for c in CASES]
)
def test_transition(
    name: str,
    make: Callable[[], RelayHandoff | MainHandoff],
    event: Event,
    now: float,
    expect: object,
    outs: list[str],
) -> None:
    machine = make()
    before = machine.state
    got = machine.handle(event, now)
    assert machine.state is expect
    assert kinds(got) == outs
    table = RELAY_TABLE if isinstance(machine, RelayHandoff) else MAIN_TABLE
    assert expect in table[before, type(event)].values()


DISALLOWED: list[tuple[str, Callable[[], RelayHandoff | MainHandoff], Event]] = [
    ("rld decodes after the final switch", lambda: relay_at(R.SWITCHING, n=40), TokenGenerated(1)),
    ("md told of KV twice", lambda: main_at(M.READY), KvLanded()),
    ("md decodes before owning", lambda: main_at(M.READY), TokenGenerated(1)),
    ("recompute done with none running", lambda: main_at(M.READY), RecomputeDone(3)),
]


@pytest.mark.parametrize(("name", "make", "event"), DISALLOWED, ids=[d[0] for d in DISALLOWED])
def test_disallowed_event_is_local_error_and_sticky(
    name: str, make: Callable[[], RelayHandoff | MainHandoff], event: Event
) -> None:
    machine = make()
    with pytest.raises(LocalProtocolError, match="can't handle") as info:
        machine.handle(event, 3.0)
    assert info.value.request_id == 7
    assert machine.state.name == "ERROR"
    with pytest.raises(LocalProtocolError, match="in ERROR"):
        machine.handle(Timer(), 4.0)


def test_owner_ack_before_final_is_remote_error() -> None:
    r = relay_at(R.CATCHING_UP)
    with pytest.raises(RemoteProtocolError):
        r.handle(BatchAcked(100, True), 1.1)
    assert r.state is R.ERROR


def test_ack_beyond_sent_is_remote_error() -> None:
    r = relay_at(R.CATCHING_UP)
    with pytest.raises(RemoteProtocolError, match="beyond"):
        r.handle(BatchAcked(101, False), 1.1)


def test_contradicting_batch_is_remote_error() -> None:
    m = main_at(M.RECOMPUTING, n=5)
    with pytest.raises(RemoteProtocolError, match="contradicts"):
        m.handle(BatchReceived(2, (99999, 1), False), 1.1)


def test_failure_errors_are_typed() -> None:
    r = relay_at(R.SWITCHING, n=40)
    outs = r.handle(PeerFailed(user_position=41), 1.0)
    done = outs[-1]
    assert isinstance(done, Done) and isinstance(done.error, PeerUnavailable)
    assert done.error.request_id == 7 and done.error.peer == "md"

    r = relay_at(R.SWITCHING, n=40)
    t, kinds_seen = 1.0, []
    while not r.done:
        timer = r.get_timer()
        assert timer is not None, "every wait has a deadline"
        t = timer
        kinds_seen.append(kinds(r.handle(Timer(), t)))
    # retransmissions, then a grace period for MD's abort, then the typed error
    assert kinds_seen[:-1] == [["Send:TokenBatch"]] * P.max_retries + [[]]
    assert t >= P.max_retries * P.ack_timeout_s + P.idle_timeout_s
    assert isinstance(r.error, TransferTimeout)


def test_md_continues_after_rld_death_only_at_the_user_position() -> None:
    m = main_at(M.READY)
    m.handle(BatchReceived(0, (1, 2, 3), False), 1.0)
    m.handle(RecomputeDone(3), 1.1)
    assert m.state is M.READY
    # The user saw 3 tokens and MD holds exactly 3: MD can finish the switch.
    outs = m.handle(PeerFailed(user_position=3), 1.2)
    assert m.state is M.OWNER
    assert TakeOver(3) in outs
    m2 = main_at(M.READY)
    m2.handle(BatchReceived(0, (1, 2, 3), False), 1.0)
    m2.handle(RecomputeDone(3), 1.1)
    outs = m2.handle(PeerFailed(user_position=5), 1.2)
    assert m2.state is M.FAILED and FreeBlocks() in outs
    assert isinstance(m2.error, PeerUnavailable)


def test_out_of_order_batches_are_stashed_and_joined() -> None:
    m = main_at(M.READY)
    early = m.handle(BatchReceived(3, (4, 5), True), 1.0)
    assert early == [SendMessage(HandoffAck(7, 0, False))]  # a duplicate ack, as TCP does
    outs = m.handle(BatchReceived(0, (1, 2, 3), False), 1.0)
    assert outs == [StartRecompute(0, (1, 2, 3, 4, 5))]
    outs = m.handle(RecomputeDone(5), 1.1)
    assert m.state is M.OWNER and m.position == 5
    assert [o for o in outs if isinstance(o, TakeOver)] == [TakeOver(5)]


def test_catch_up_rounds_shrink_and_respect_limits() -> None:
    """RLD at 100 tok/s, MD at 2000 tok/s: the backlog shrinks round by round."""
    params = HandoffParams(final_switch_size=4, min_batch=4, max_rounds=6, rtt_s=0.02)
    r = relay_at(R.DECODING, n=400, params=params)
    t = 4.0
    outs = r.handle(KvLanded(), t)
    sizes = []
    while r.state is R.CATCHING_UP:
        batch = [o.message for o in outs if isinstance(o, SendMessage)]
        assert len(batch) <= 1
        inflight = r.sent_end - r.acked
        # MD needs inflight/2000 s plus an RTT; RLD decodes meanwhile.
        done_at = t + inflight / 2000 + 0.02
        while t + DT < done_at:
            t += DT
            outs = r.handle(TokenGenerated(tok(len(r.tokens))), t)
            assert not any(isinstance(o, SendMessage) for o in outs)
        t = done_at
        sizes.append(inflight)
        outs = r.handle(BatchAcked(r.sent_end, False, 2000.0), t)
    assert r.state is R.SWITCHING and r.fallback is None
    assert sizes[0] == 400 and all(b < a for a, b in itertools.pairwise(sizes))
    assert r.batch_sizes[-1] <= params.final_switch_size
    assert all(b >= params.min_batch for b in r.batch_sizes[:-1])
    assert r.rounds <= params.max_rounds


@pytest.mark.parametrize(
    ("fallback", "expect"),
    [(Fallback.KEEP_RLD, R.SOLO), (Fallback.ONE_SHOT, R.SWITCHING)],
)
def test_divergent_catch_up_falls_back(fallback: Fallback, expect: RelayState) -> None:
    """MD recomputes slower than RLD decodes: no catch-up round at all."""
    params = HandoffParams(recompute_rate=50.0, fallback=fallback)
    r = relay_at(R.DECODING, n=100, params=params)
    outs = r.handle(KvLanded(), 1.0)
    assert r.state is expect
    assert r.fallback == "recompute slower than decode"
    sent = [o.message for o in outs if isinstance(o, SendMessage)]
    if expect is R.SOLO:
        assert sent == [HandoffAbort(7, int(AbortReason.FALLBACK))]
    else:
        assert len(sent) == 1 and isinstance(sent[0], TokenBatch) and sent[0].final


def test_not_shrinking_round_falls_back_and_never_returns() -> None:
    params = HandoffParams(fallback=Fallback.KEEP_RLD)
    r = relay_at(R.CATCHING_UP, n=100, params=params)
    t = 1.0
    for _ in range(100):  # MD took as long as RLD needed for 100 more tokens
        t += DT
        r.handle(TokenGenerated(tok(len(r.tokens))), t)
    r.handle(BatchAcked(100, False), t)
    assert r.state is R.SOLO and r.fallback in ("not shrinking", "recompute slower than decode")
    for _ in range(20):
        t += DT
        r.handle(TokenGenerated(tok(len(r.tokens))), t)
        r.handle(BatchAcked(100, False), t)
        r.handle(KvLanded(), t)
    assert r.state is R.SOLO
    states = [new for _, _, new in r.history]
    assert R.CATCHING_UP not in states[states.index(R.SOLO) :]


def test_small_remainders_are_merged() -> None:
    """A remainder between final_switch_size and min_batch waits for more tokens."""
    params = HandoffParams(final_switch_size=4, min_batch=20, min_shrink=1.0, rtt_s=0.0)
    r = relay_at(R.CATCHING_UP, n=100, params=params)
    t = 1.0
    for _ in range(10):
        t += 0.0001  # a burst: 10 tokens during the ack wait
        r.handle(TokenGenerated(tok(len(r.tokens))), t)
    outs = r.handle(BatchAcked(100, False, 1e6), t)
    assert outs == [] and r.state is R.CATCHING_UP  # 10 < min_batch: wait
    sent: list[Message] = []
    while not sent:
        t += 0.0001
        outs = r.handle(TokenGenerated(tok(len(r.tokens))), t)
        sent = [o.message for o in outs if isinstance(o, SendMessage)]
    assert isinstance(sent[0], TokenBatch)
    assert len(event_for_message(sent[0]).tokens) == params.min_batch  # type: ignore[attr-defined]


def test_acks_carry_position_and_rate() -> None:
    m = main_at(M.RECOMPUTING, n=50)
    outs = m.handle(RecomputeDone(50), 1.05)
    (ack,) = [o.message for o in outs if isinstance(o, SendMessage)]
    assert isinstance(ack, HandoffAck) and ack.position == 50 and not ack.owner
    assert 990 <= ack.recompute_rate <= 1000  # 50 tokens in 0.05 s
    ev = event_for_message(ack)
    assert ev == BatchAcked(50, False, float(ack.recompute_rate))


def test_md_resends_kv_ready_then_gives_up() -> None:
    m = main_at(M.READY)
    sent = []
    t = 1.0
    while not m.done:
        timer = m.get_timer()
        assert timer is not None
        t = timer
        sent += [type(o.message) for o in m.handle(Timer(), t) if isinstance(o, SendMessage)]
    assert sent == [KvReady] * P.max_retries + [HandoffAbort]
    assert m.state is M.ABORTED


def test_every_table_state_has_an_exit_or_is_terminal() -> None:
    """No non-terminal state is a trap: each has an edge to another state."""
    for table in (RELAY_TABLE, MAIN_TABLE):
        states = {s for s, _ in table}
        for s in states:
            targets = {d for (src, _), edges in table.items() if src is s for d in edges.values()}
            terminal = targets == {s}
            assert not terminal or s.name in (
                "RELEASED",
                "FINISHED",
                "CANCELLED",
                "FAILED",
                "ABORTED",
            )


def test_params_are_validated() -> None:
    with pytest.raises(ValueError):
        HandoffParams(catchup_threshold=8, final_switch_size=16)
    with pytest.raises(ValueError):
        HandoffParams(max_rounds=0)
    assert dataclasses.replace(P, max_rounds=2).max_rounds == 2


def test_large_backlog_is_split_into_messages_md_can_decode() -> None:
    """10 000 eager tokens exceed one message's token limit: several messages,
    one logical final batch, reassembled by MD."""
    params = HandoffParams(mode=HandoffMode.ONE_SHOT)
    r = relay_at(R.DECODING, n=10_000, params=params)
    outs = r.handle(KvLanded(), 200.0)
    msgs = [o.message for o in outs if isinstance(o, SendMessage)]
    assert len(msgs) == 3 and [m.final for m in msgs] == [False, False, True]  # type: ignore[attr-defined]
    assert r.rounds == 1 and r.final_end == 10_000
    m = main_at(M.READY)
    for msg in reversed(msgs):  # even out of order
        outs = m.handle(event_for_message(msg), 200.1)
    assert outs == [StartRecompute(0, tuple(tok(i) for i in range(10_000)))]
    outs = m.handle(RecomputeDone(10_000), 201.0)
    assert TakeOver(10_000) in outs
