"""The sink's sans-IO stream assembler, with explicit time and no network."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import PeerUnavailable, RemoteProtocolError, RequestAborted, TransferTimeout
from pddnet.api import SourceState, StreamAssembler, StreamPhase, StreamReport

TOKENS = [11, 12, 13, 14, 15, 16]


def feed(asm: StreamAssembler, positions: list[int], now: float = 0.0) -> list[int]:
    out = []
    for pos in positions:
        src = "rld" if pos < 3 else "md"
        got = asm.receive(pos, TOKENS[pos], pos == len(TOKENS) - 1, src, now)
        out += [tok for _, tok, _ in got]
    return out


def test_in_order_stream_finishes() -> None:
    asm = StreamAssembler(1, 0.0)
    assert feed(asm, list(range(6))) == TOKENS
    assert asm.phase is StreamPhase.FINISHED
    assert asm.sources == ["rld", "md"]
    assert asm.next_timer() == math.inf


def test_reordered_and_duplicated_tokens_are_delivered_once_in_order() -> None:
    asm = StreamAssembler(1, 0.0)
    assert feed(asm, [0, 2, 1, 1, 5, 0]) == TOKENS[:3]
    assert asm.phase is StreamPhase.OPEN  # 3 and 4 are missing; 5 is the final one
    assert feed(asm, [4, 3]) == TOKENS[3:]
    assert asm.phase is StreamPhase.FINISHED
    assert asm.duplicates == 2


@pytest.mark.parametrize(
    ("events", "what"),
    [
        ([(0, 11, False), (0, 99, False)], "two different tokens"),
        ([(2, 13, True), (3, 14, False)], "ends at 2"),
        ([(2, 13, True), (1, 12, True)], "ends at 2"),
        ([(3, 14, False), (2, 13, True)], "after position 3"),
        ([(10, 1, False)], "out of range"),
        ([(-1, 1, False)], "out of range"),
    ],
)
def test_malformed_streams_fail_with_a_protocol_error(
    events: list[tuple[int, int, bool]], what: str
) -> None:
    asm = StreamAssembler(1, 0.0, max_tokens=10)
    for pos, tok, fin in events:
        asm.receive(pos, tok, fin, "md", 0.0)
    assert asm.phase is StreamPhase.FAILED
    assert isinstance(asm.error, RemoteProtocolError)
    assert what in str(asm.error)
    assert asm.receive(0, 11, False, "md", 0.0) == []  # nothing after the end


def test_a_hole_asks_for_a_round_after_the_gap_delay() -> None:
    asm = StreamAssembler(1, 0.0, gap_delay_s=0.05, poll_interval_s=1.0)
    feed(asm, [0, 2], now=0.10)
    assert asm.next_timer() == pytest.approx(0.15)
    assert not asm.poll(0.14)
    assert asm.poll(asm.next_timer())
    assert asm.next_timer() == math.inf  # no second round while one is out
    asm.round_result({"rld": StreamReport(SourceState.ACTIVE, 0, 2)}, 0.2)
    assert asm.failed_rounds == 0
    # the hole is still open: the next round waits a poll interval
    assert asm.next_timer() == pytest.approx(1.15)


def test_silence_asks_for_a_round_and_progress_postpones_it() -> None:
    asm = StreamAssembler(1, 0.0, poll_interval_s=1.0, deadline=9.0)
    assert asm.next_timer() == 9.0  # nobody to ask: only the deadline
    asm.add_sources(["rld"])
    assert asm.next_timer() == 1.0
    feed(asm, [0], now=0.7)
    assert not asm.poll(1.0)
    assert asm.next_timer() == pytest.approx(1.7)
    assert asm.poll(1.7)
    assert asm.rounds == 1


def test_rounds_nobody_can_serve_fail_the_stream_as_peer_unavailable() -> None:
    asm = StreamAssembler(7, 0.0, poll_interval_s=1.0, max_failed_rounds=3)
    asm.add_sources(["rld", "md"])
    feed(asm, [0, 1, 2, 3])
    now = 0.0
    # RLD handed over at 2 and holds 0..2; MD (serving from 3) stopped answering
    for _ in range(3):
        now = asm.next_timer()
        assert asm.poll(now)
        assert asm.phase is StreamPhase.OPEN
        asm.round_result({"rld": StreamReport(SourceState.DONE, 0, 2), "md": None}, now)
    assert asm.phase is StreamPhase.FAILED
    assert isinstance(asm.error, PeerUnavailable)
    assert "position 4" in str(asm.error) and "md: no answer" in str(asm.error)


def test_a_source_holding_the_missing_position_keeps_the_stream_alive() -> None:
    asm = StreamAssembler(1, 0.0, max_failed_rounds=1)
    feed(asm, [0, 3])
    assert asm.poll(asm.next_timer())
    asm.round_result({"rld": StreamReport(SourceState.DONE, 0, 2), "md": None}, 1.0)
    assert asm.phase is StreamPhase.OPEN  # RLD holds 1 and re-sends it


def test_re_sends_that_never_arrive_fail_the_stream_as_peer_unavailable() -> None:
    """A decoder that says, round after round, that it holds the next position
    while nothing arrives (its re-sends are lost on the way) fails the stream
    after max_failed_rounds such rounds, not only at the deadline; tokens that
    do arrive, even late, keep it alive."""
    asm = StreamAssembler(7, 0.0, deadline=60.0, poll_interval_s=1.0, max_failed_rounds=3)
    asm.add_sources(["md"])
    feed(asm, [0, 1, 2, 3])
    held = {"md": StreamReport(SourceState.ACTIVE, 0, 5)}
    for _ in range(3):  # the first round asks; two more find nothing came
        now = asm.next_timer()
        assert asm.poll(now)
        asm.round_result(held, now)
        assert asm.phase is StreamPhase.OPEN
    now = asm.next_timer()
    assert now < 10.0
    assert asm.poll(now)
    asm.round_result(held, now)
    assert asm.phase is StreamPhase.FAILED
    assert isinstance(asm.error, PeerUnavailable)
    assert asm.error.peer == "md" and "holds position 4" in str(asm.error)

    late = StreamAssembler(8, 0.0, deadline=60.0, poll_interval_s=1.0, max_failed_rounds=3)
    late.add_sources(["md"])
    feed(late, [0, 1, 2, 3])
    for pos in (4, 5):  # each re-send arrives after the answer, before the next round
        for _ in range(2):
            now = late.next_timer()
            assert late.poll(now)
            late.round_result(held, now)
        late.receive(pos, TOKENS[pos], pos == 5, "md", now + 0.5)
    assert late.phase is StreamPhase.FINISHED


def test_a_failed_source_or_an_abort_fails_the_stream_as_request_aborted() -> None:
    asm = StreamAssembler(1, 0.0)
    asm.add_sources(["md"])
    assert asm.poll(asm.next_timer())
    asm.round_result({"md": StreamReport(SourceState.FAILED, -1, -1, "KV timed out")}, 1.0)
    assert isinstance(asm.error, RequestAborted)
    assert "KV timed out" in str(asm.error) and asm.error.peer == "md"
    asm2 = StreamAssembler(2, 0.0)
    asm2.abort("relay lost the KV", "rld")
    assert isinstance(asm2.error, RequestAborted)
    asm2.abort("again", "md")  # the first reason stays
    assert "relay lost" in str(asm2.error)


def test_the_deadline_fails_the_stream_as_a_timeout() -> None:
    asm = StreamAssembler(1, 0.0, deadline=5.0, poll_interval_s=10.0)
    feed(asm, [0, 1])
    assert asm.next_timer() == 5.0
    assert not asm.poll(5.0)
    assert isinstance(asm.error, TransferTimeout)
    assert "position 2" in str(asm.error)


def test_unknown_reports_count_as_failed_rounds() -> None:
    # a decoder that restarted has no record of the request
    asm = StreamAssembler(1, 0.0, max_failed_rounds=2)
    asm.add_sources(["md"])
    for t in (1.0, 2.0):
        assert asm.poll(t)
        asm.round_result({"md": StreamReport(SourceState.UNKNOWN, -1, -1)}, t)
    assert isinstance(asm.error, PeerUnavailable)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_arrival_order_with_duplicates_yields_the_stream_once(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 40))
    toks = data.draw(st.lists(st.integers(0, 1 << 17), min_size=n, max_size=n))
    arrivals = data.draw(st.permutations(list(range(n)) * 2))  # every token twice
    asm = StreamAssembler(1, 0.0)
    got: list[tuple[int, int]] = []
    seen: set[int] = set()
    dups = 0
    for i, pos in enumerate(arrivals):
        if asm.phase is StreamPhase.OPEN:
            dups += pos in seen
            seen.add(pos)
        got += [(p, t) for p, t, _ in asm.receive(pos, toks[pos], pos == n - 1, "d", float(i))]
    assert got == list(enumerate(toks))
    assert asm.phase is StreamPhase.FINISHED
    assert asm.duplicates == dups
