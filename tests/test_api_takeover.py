"""MD takes over at once when RLD dies mid-stream (the sink's ``StreamTakeover``).

Three layers: the sink's decision (sans-IO, explicit time), MD's handoff
machine acting on a takeover-only failure report, and real endpoints over
loopback with RLD killed mid-request.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from pddnet import RemoteCallError
from pddnet.api import (
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    RelayEndpoint,
    SourceState,
    StreamAssembler,
    StreamReport,
    StreamStatus,
    StreamTakeover,
    TokenStream,
)
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.control import ControlNode
from pddnet.handoff import (
    BatchReceived,
    HandoffAck,
    HandoffParams,
    KvLanded,
    KvReady,
    MainHandoff,
    MainState,
    PeerFailed,
    RecomputeDone,
    SendMessage,
    StartRecompute,
    TakeOver,
)
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route
from pddnet.transport.wan import WanReceiver
from pddnet.wire import encode_tokens

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire

KEY = b"a-takeover-test-secret-0123456789ab"
NB = 256
M = MainState


# ----------------------------------------------------------- the sink's rule
def fed(n: int, *, relay: str = "rld", main: str = "md") -> StreamAssembler:
    """A stream that got positions 0..n-1 from ``relay`` at t = 0.00, 0.01, ..."""
    asm = StreamAssembler(1, 0.0, deadline=8.0)
    asm.set_handoff(relay, main)
    for i in range(n):
        asm.receive(i, 100 + i, False, relay, i * 0.01)
    return asm


def active(first: int = -1, last: int = -1) -> StreamReport:
    return StreamReport(SourceState.ACTIVE, first, last)


def test_a_silent_relay_while_md_waits_proposes_a_takeover_once() -> None:
    asm = fed(5)
    assert asm.sources == ["md", "rld"]
    # RLD stops: after a poll interval of silence the sink runs a round
    t = asm.next_timer()
    assert math.isclose(t, 0.04 + asm.poll_interval_s)
    assert not asm.poll(t - 0.001) and asm.poll(t)
    # RLD does not answer within the round; MD is ACTIVE and has emitted nothing
    asm.round_result({"md": active(), "rld": None}, t + 1.0)
    assert asm.failed_rounds == 0  # MD still serves it: a healthy round
    assert asm.takeover() == ("md", 5)
    assert asm.takeover() is None  # one report per round
    # the next round, still stuck: proposed again (MD may have refused the first)
    t2 = asm.next_timer()
    assert asm.poll(t2)
    asm.round_result({"md": active(), "rld": None}, t2 + 1.0)
    assert asm.takeover() == ("md", 5) and asm.takeovers == 2


def test_a_relay_that_forgot_the_request_also_proposes_a_takeover() -> None:
    asm = fed(3)
    assert asm.poll(asm.next_timer())
    asm.round_result({"md": active(), "rld": StreamReport(SourceState.UNKNOWN, -1, -1)}, 2.0)
    assert asm.takeover() == ("md", 3)


@pytest.mark.parametrize(
    ("why", "reports"),
    [
        ("RLD answers", {"md": active(), "rld": active(0, 4)}),
        ("RLD handed over (DONE)", {"md": active(), "rld": StreamReport(SourceState.DONE, 0, 4)}),
        ("MD emitted already: it owns the request", {"md": active(5, 6), "rld": None}),
        ("MD does not answer either", {"md": None, "rld": None}),
        ("MD no longer serves it", {"md": StreamReport(SourceState.DONE, -1, -1), "rld": None}),
    ],
)
def test_no_takeover_unless_relay_is_gone_and_md_waits(
    why: str, reports: dict[str, StreamReport | None]
) -> None:
    asm = fed(5)
    assert asm.poll(asm.next_timer())
    asm.round_result(reports, 2.0)
    assert asm.takeover() is None, why


def test_no_takeover_without_known_roles_or_after_progress() -> None:
    # P->MD route (no relay named): nothing to take over
    plain = StreamAssembler(1, 0.0)
    plain.add_sources(["md", "rld"])
    plain.receive(0, 7, False, "rld", 0.0)
    assert plain.poll(plain.next_timer())
    plain.round_result({"md": active(), "rld": None}, 2.0)
    assert plain.takeover() is None
    # a token arrives between the round and the report: the position is stale
    asm = fed(5)
    assert asm.poll(asm.next_timer())
    asm.round_result({"md": active(), "rld": None}, 2.0)
    asm.receive(5, 105, False, "rld", 2.0)
    assert asm.takeover() is None
    # a token arrived while the round ran: the answers are stale, no report
    moving = fed(5)
    assert moving.poll(moving.next_timer())
    moving.receive(5, 105, False, "md", 1.5)
    moving.round_result({"md": active(), "rld": None}, 2.0)
    assert moving.takeover() is None
    # the stream failed in the round (a decoder gave up): no report
    failed = fed(5)
    assert failed.poll(failed.next_timer())
    failed.round_result({"md": active(), "rld": StreamReport(SourceState.FAILED, 0, 4)}, 2.0)
    assert failed.takeover() is None and failed.error is not None


# -------------------------------------------- MD's machine: takeover-only reports
def md(state: MainState, held: tuple[int, ...] = (), final: bool = False) -> MainHandoff:
    m = MainHandoff(7, HandoffParams(), now=0.0)
    if state is not M.WAITING_KV:
        m.handle(KvLanded(), 0.5)
    if held:
        m.handle(BatchReceived(0, held, final), 0.6)
        if state is M.READY:
            m.handle(RecomputeDone(len(held)), 0.7)
    assert m.state is state
    return m


def sends(outs: list[object]) -> list[object]:
    return [o for o in outs if isinstance(o, SendMessage)]


def test_md_takes_the_users_tokens_and_takes_over_before_its_kv_landed() -> None:
    m = md(M.WAITING_KV)
    outs = m.handle(PeerFailed(3, (5, 6, 7), takeover_only=True), 1.0)
    assert outs == [] and m.state is M.WAITING_KV and m.final_end == 3
    outs = m.handle(KvLanded(), 1.5)  # no KvReady to the dead RLD
    assert outs == [StartRecompute(0, (5, 6, 7))]
    outs = m.handle(RecomputeDone(3), 1.6)  # no owner ack to the dead RLD either
    assert outs == [TakeOver(3)] and m.state is M.OWNER and m.position == 3


def test_md_completes_a_partial_handover_from_the_users_tokens() -> None:
    m = md(M.READY, held=(5, 6))  # RLD's first batch; then RLD emitted 2 more and died
    outs = m.handle(PeerFailed(4, (5, 6, 7, 8), takeover_only=True), 1.0)
    assert outs == [StartRecompute(2, (7, 8))] and m.state is M.RECOMPUTING
    assert m.handle(RecomputeDone(4), 1.1) == [TakeOver(4)]


def test_md_takes_over_at_zero_when_the_user_has_nothing() -> None:
    m = md(M.READY)
    outs = m.handle(PeerFailed(0, (), takeover_only=True), 1.0)
    assert outs == [TakeOver(0)] and m.state is M.OWNER


@pytest.mark.parametrize(
    ("why", "make", "report"),
    [
        ("tokens contradict RLD's batch", lambda: md(M.READY, (5, 6)), PeerFailed(3, (5, 9, 7))),
        ("MD holds more than the user", lambda: md(M.READY, (5, 6, 7)), PeerFailed(2, (5, 6))),
        (
            "final switch elsewhere",
            lambda: md(M.RECOMPUTING, (5, 6, 7), True),
            PeerFailed(2, (5, 6)),
        ),
        ("position without tokens, MD holds fewer", lambda: md(M.READY, (5,)), PeerFailed(3)),
        ("token count disagrees", lambda: md(M.WAITING_KV), PeerFailed(3, (5, 6))),
        ("no position", lambda: md(M.WAITING_KV), PeerFailed(None)),
    ],
)
def test_an_inexact_suspicion_is_ignored_and_rld_can_still_hand_over(
    why: str, make: object, report: PeerFailed
) -> None:
    assert callable(make)
    m: MainHandoff = make()
    before = (m.state, list(m.received), m.final_end)
    suspicion = PeerFailed(report.user_position, report.user_tokens, takeover_only=True)
    assert m.handle(suspicion, 1.0) == [], why
    assert (m.state, list(m.received), m.final_end) == before, why
    # nothing was given up: RLD's own final batch still completes the handover
    if m.state is M.WAITING_KV:
        m.handle(KvLanded(), 1.1)
    if m.state is M.RECOMPUTING:
        m.handle(RecomputeDone(len(m.received)), 1.2)
    if m.state is M.READY:
        held = tuple(m.received)
        outs = m.handle(BatchReceived(len(held), (40, 41), True), 1.3)
        m.handle(RecomputeDone(len(held) + 2), 1.4)
        assert sends(outs) == [] or isinstance(sends(outs)[0].message, HandoffAck | KvReady)
    assert m.state is M.OWNER, why


def test_a_suspicion_after_md_owns_the_request_is_ignored() -> None:
    m = md(M.RECOMPUTING, (5, 6), final=True)
    m.handle(RecomputeDone(2), 1.0)
    assert m.state is M.OWNER
    assert m.handle(PeerFailed(2, (5, 6), takeover_only=True), 1.1) == []
    assert m.state is M.OWNER and m.position == 2


# ------------------------------------------------------- real endpoints, loopback
def tcp() -> WanReceiver:
    return WanReceiver(host="127.0.0.1", secret=KEY)  # the local path's TCP form


async def start(
    p: PrefillEndpoint, pm: ReferenceModel, rid: int, prompt: list[int], n: int
) -> tuple[TokenStream, str, str]:
    """Open and submit a P->RLD->MD request; only RLD's KV is marked ready."""
    stream = p.sink.open(rid, max_tokens=n, deadline_s=60)
    seq = pm.new_sequence()
    pm.reserve(seq, len(prompt))
    first = greedy(pm.prefill(seq, prompt))
    sub = await p.submit(
        rid,
        prompt,
        seq.block_table.tolist(),
        first,
        n,
        sink=p.name,
        route=Route.P_RLD_MD,
        ready=False,
    )
    assert sub.relay
    for layer in range(pm.pool.layout.num_layers):
        p.mark_layer_ready(rid, layer, sub.relay)
    return stream, sub.relay, sub.main


def release_main(p: PrefillEndpoint, pm: ReferenceModel, rid: int, main: str) -> None:
    for layer in range(pm.pool.layout.num_layers):
        p.mark_layer_ready(rid, layer, main)


async def test_rld_killed_mid_stream_md_takes_over_and_the_stream_is_exact() -> None:
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    # MD's own failure detector would need 3 x 30 s: only the sink's report can save the stream
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint(
            "md", mm.pool, ReferenceEngine(mm, step_time_s=0.005), secret=KEY, watch_interval_s=30
        ) as md,
        trio.open_nursery() as nursery,
    ):
        p.sink.poll_interval_s = 0.3
        kill = trio.CancelScope()
        ready = trio.Event()
        box: list[RelayEndpoint] = []

        async def run_rld() -> None:
            with kill:
                async with RelayEndpoint(
                    "rld",
                    rm.pool,
                    ReferenceEngine(rm, step_time_s=0.02),
                    secret=KEY,
                    receiver=tcp(),
                ) as rld:
                    box.append(rld)
                    await wire(p, rld, md)
                    ready.set()
                    await trio.sleep_forever()

        nursery.start_soon(run_rld)
        await ready.wait()
        n = 40
        prompt = np.random.default_rng(11).integers(0, TINY.vocab_size, 60).tolist()
        stream, relay, main = await start(p, pm, 21, prompt, n)
        with trio.fail_after(20):
            async for tok in stream:
                if tok.position == 7:
                    kill.cancel()  # RLD dies before MD's KV even landed: no handover at all
                    break
            release_main(p, pm, 21, main)  # now P's KV crawls to MD
            tokens = await stream.result()
        assert tokens == reference(prompt, n)
        got = stream.received
        assert [t.position for t in got] == list(range(n))  # each position once, in order
        cut = next(i for i, t in enumerate(got) if t.source == main)
        assert cut >= 8 and {t.source for t in got[:cut]} == {relay}
        assert {t.source for t in got[cut:]} == {main}
        assert p.sink.statistics().takeovers >= 1
        assert md.statistics().takeover_reports == 1
        with trio.fail_after(10):  # MD frees what it does not cache
            while md.statistics().active:
                await trio.sleep(0.01)
        assert md.statistics().free_blocks == NB - len(md.cache)
        [stats] = [s for s in md.handoff_stats if s.request_id == 21]
        assert stats.takeover_position == cut and stats.state is M.FINISHED
        nursery.cancel_scope.cancel()


async def test_a_report_while_rld_is_alive_is_ignored_and_reports_are_authenticated() -> None:
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        RelayEndpoint(
            "rld", rm.pool, ReferenceEngine(rm, step_time_s=0.02), secret=KEY, receiver=tcp()
        ) as rld,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm, step_time_s=0.005), secret=KEY) as md,
        ControlNode("mallory", secret=KEY) as stranger,
    ):
        await wire(p, rld, md)
        await stranger.connect("md", md.node.address)
        n = 150  # RLD alone would need 3 s: it is still decoding when MD's KV lands
        prompt = np.random.default_rng(12).integers(0, TINY.vocab_size, 60).tolist()
        stream, _, main = await start(p, pm, 22, prompt, n)
        with trio.fail_after(20):
            async for tok in stream:
                if tok.position == 5:
                    break
            have = stream.tokens
            report = StreamTakeover(22, len(have), encode_tokens(have))
            # a node other than the request's sink: refused with a typed error
            with pytest.raises(RemoteCallError, match=r"RemoteProtocolError.*not the sink"):
                await stranger.request("md", report, timeout=5)
            # malformed reports from the sink itself
            bad = [
                StreamTakeover(22, len(have) + 1, encode_tokens(have)),  # count mismatch
                StreamTakeover(22, 5, b"\xff"),  # truncated varint
                StreamTakeover(22, n + 3, encode_tokens(list(range(n + 3)))),
            ]
            for msg in bad:
                with pytest.raises(RemoteCallError, match="RemoteProtocolError"):
                    await p.node.request("md", msg, timeout=5)
            unknown = await p.node.request("md", StreamTakeover(999, 0, b""), timeout=5)
            assert unknown == StreamStatus(999, int(SourceState.UNKNOWN), -1, -1)
            # RLD does not take takeover reports at all
            with pytest.raises(RemoteCallError, match="no handler"):
                await p.node.request("rld", report, timeout=5)
            # a genuine-looking report while RLD is alive: MD pings RLD, RLD
            # answers, MD ignores it; RLD still hands over normally
            status = await p.node.request("md", report, timeout=5)
            assert isinstance(status, StreamStatus) and status.state == int(SourceState.ACTIVE)
            await trio.sleep(md.takeover_confirm_s + 0.3)
            assert md.statistics().takeover_reports == 0
            release_main(p, pm, 22, main)
            tokens = await stream.result()
        assert tokens == reference(prompt, n)
        assert [t.position for t in stream.received] == list(range(n))
        assert stream.received[0].source == "rld" and stream.received[-1].source == "md"
        with trio.fail_after(10):
            while md.statistics().active:
                await trio.sleep(0.01)
        [stats] = [s for s in md.handoff_stats if s.request_id == 22]
        # MD took over where RLD's final batch ended, not at the reported position
        assert stats.takeover_position is not None and stats.takeover_position > len(have)
