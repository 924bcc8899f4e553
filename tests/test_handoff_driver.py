"""Trio drivers with the stand-in engine over in-memory links (virtual time)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import trio
import trio.testing

from pddnet import PeerUnavailable
from pddnet.handoff import (
    AbortReason,
    HandoffParams,
    MainDriver,
    MainState,
    RelayDriver,
    RelayHandoff,
    RelayState,
    StandInEngine,
    combine_metrics,
    greedy_reference,
    standin_request,
)
from pddnet.wire import Message

RID, SEED = 42, 7


class MemLink:
    """Delivers to the peer driver after ``delay_s``; records the other hooks."""

    def __init__(self, nursery: trio.Nursery, delay_s: float = 0.015) -> None:
        self.nursery = nursery
        self.delay_s = delay_s
        self.peer: RelayDriver | MainDriver | None = None
        self.cut = False  # the peer died: drop everything
        self.cancelled: list[AbortReason] = []
        self.freed = 0
        self.sent: list[Message] = []

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        self.nursery.start_soon(self._later, message)

    async def _later(self, message: Message) -> None:
        await trio.sleep(self.delay_s)
        if not self.cut and self.peer is not None:
            self.peer.deliver(message)

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        self.cancelled.append(reason)

    async def free_blocks(self, request_id: int) -> None:
        self.freed += 1


def merged_stream(*engines: StandInEngine) -> list[int]:
    """The user's stream: both sides' emits, checked for one emit per position."""
    emits = sorted(e for eng in engines for e in eng.emitted.get(RID, []))
    assert [p for p, _ in emits] == list(range(len(emits))), "a gap or a duplicate"
    return [t for _, t in emits]


async def run_pair(
    *,
    kv_after: float,
    max_tokens: int,
    params: HandoffParams | None = None,
    kill_md_at: float | None = None,
    kill_rld_when: Callable[[RelayHandoff], bool] | None = None,
    extend_rate: float = 5000.0,
) -> tuple[RelayDriver, MainDriver, StandInEngine, StandInEngine, MemLink, MemLink]:
    """Run RLD and MD drivers against each other until both are done (or dead).

    ``kill_md_at`` kills MD at that time; ``kill_rld_when`` kills RLD as soon
    as its machine satisfies the predicate. The failure detector then tells
    the survivor, with the user's stream position.
    """
    params = params or HandoffParams(rtt_s=0.03)
    rld_eng = StandInEngine(step_s=0.02)
    md_eng = StandInEngine(step_s=0.02, extend_rate=extend_rate)
    rld_eng.start(RID, SEED)
    req = standin_request(RID, SEED, max_tokens)
    async with trio.open_nursery() as nursery:
        to_md, to_rld = MemLink(nursery), MemLink(nursery)
        rld = RelayDriver(rld_eng, to_md, rld_eng, req, params)
        md = MainDriver(md_eng, to_rld, md_eng, req, params)
        to_md.peer, to_rld.peer = md, rld
        scopes = {"rld": trio.CancelScope(), "md": trio.CancelScope()}

        async def wan() -> None:
            await trio.sleep(kv_after)
            if md.machine.state is MainState.WAITING_KV and not to_rld.cancelled:
                md_eng.start(RID, SEED)
                md.kv_landed()

        async def side(name: str, driver: RelayDriver | MainDriver) -> None:
            with scopes[name]:
                await driver.run()

        async def kill(name: str) -> None:
            # The dead side stops; messages it sent before dying still arrive,
            # messages to it are lost; the failure detector needs a while.
            scopes[name].cancel()
            (to_rld if name == "rld" else to_md).cut = True
            await trio.sleep(0.5)
            survivor = md if name == "rld" else rld
            survivor.peer_failed(len(merged_stream(rld_eng, md_eng)))

        async def killers() -> None:
            if kill_md_at is not None:
                await trio.sleep(kill_md_at)
                await kill("md")
            if kill_rld_when is not None:
                while not kill_rld_when(rld.machine):
                    await trio.sleep(0.001)
                await kill("rld")

        nursery.start_soon(wan)
        nursery.start_soon(killers)
        async with trio.open_nursery() as sides:
            sides.start_soon(side, "rld", rld)
            sides.start_soon(side, "md", md)
        nursery.cancel_scope.cancel()
    return rld, md, rld_eng, md_eng, to_md, to_rld


async def test_catch_up_stream_equals_greedy(autojump_clock: trio.testing.MockClock) -> None:
    rld, md, rld_eng, md_eng, _, _ = await run_pair(kv_after=3.0, max_tokens=400)
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 400)
    assert rld.machine.state is RelayState.RELEASED and md.machine.state is MainState.FINISHED
    now = trio.current_time()
    m = combine_metrics(rld.machine.statistics(now), md.machine.statistics(now))
    assert m.tokens_rld + m.tokens_md == 400 and m.tokens_md > m.tokens_rld > 140
    assert 2 <= m.rounds <= 4 and rld.machine.handoff == "catch-up"
    assert md_eng.extended == m.tokens_rld  # MD recomputed exactly RLD's tokens
    # Each round continues a longer prefix from the KV the previous one wrote
    # (the prompt's first): no token is recomputed twice.
    runs = [(n, kv) for _, n, kv in md_eng.runs]
    assert len(runs) >= m.rounds and runs[0][1] == 1
    assert all(kv == prev_n for (prev_n, _), (_, kv) in itertools.pairwise(runs))
    # The stall: the switch costs about a recompute of the last batch plus an RTT.
    assert m.max_gap_s < 0.2
    assert m.rld_occupancy_s < 4.0


async def test_one_shot_stream_equals_greedy(autojump_clock: trio.testing.MockClock) -> None:
    from pddnet.handoff import HandoffMode

    params = HandoffParams(mode=HandoffMode.ONE_SHOT, rtt_s=0.03)
    rld, _md, rld_eng, md_eng, _, _ = await run_pair(kv_after=2.0, max_tokens=300, params=params)
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 300)
    assert rld.machine.rounds == 1 and rld.machine.state is RelayState.RELEASED


async def test_strange_traffic_cancels_transfer_and_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rld, md, rld_eng, md_eng, to_md, to_rld = await run_pair(kv_after=5.0, max_tokens=30)
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 30)
    assert rld.machine.state is RelayState.FINISHED
    assert to_md.cancelled == [AbortReason.RLD_FINISHED]  # RLD's driver cancels the WAN send
    assert md.machine.state is MainState.ABORTED
    assert to_rld.cancelled == [AbortReason.RLD_FINISHED] and to_rld.freed == 1
    assert md_eng.emitted == {} and md_eng.extended == 0


async def test_md_dies_mid_catch_up_rld_completes(autojump_clock: trio.testing.MockClock) -> None:
    rld, _, rld_eng, md_eng, _, _ = await run_pair(
        kv_after=3.0, max_tokens=400, kill_md_at=3.05, extend_rate=1000.0
    )
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 400)
    assert rld.machine.state is RelayState.FINISHED and rld.machine.fallback == "md failed"


async def test_slow_recompute_falls_back_without_oscillating(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """MD recomputes slower than RLD decodes: fall back, never catch up forever."""
    params = HandoffParams(rtt_s=0.03, recompute_rate=40.0)
    rld, _md, rld_eng, md_eng, _, _ = await run_pair(
        kv_after=3.0, max_tokens=300, params=params, extend_rate=40.0
    )
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 300)
    assert rld.machine.fallback is not None and rld.machine.rounds <= 1


async def test_rld_dies_after_final_switch_md_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rld, md, rld_eng, md_eng, _, _ = await run_pair(
        kv_after=3.0, max_tokens=400, kill_rld_when=lambda r: r.state is RelayState.SWITCHING
    )
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 400)
    assert md.machine.state is MainState.FINISHED and rld.machine.state is RelayState.SWITCHING


async def test_rld_dies_when_md_holds_all_the_user_saw(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """RLD dies right after sending everything it emitted: MD completes the switch."""
    _, md, rld_eng, md_eng, _, _ = await run_pair(
        kv_after=3.0,
        max_tokens=400,
        kill_rld_when=lambda r: r.state is RelayState.CATCHING_UP,
        extend_rate=1000.0,
    )
    assert merged_stream(rld_eng, md_eng) == greedy_reference(SEED, 400)
    assert md.machine.state is MainState.FINISHED


async def test_rld_dies_mid_catch_up_md_fails_typed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The user saw tokens MD never received: MD cannot continue, and says so."""
    _, md, rld_eng, md_eng, _, to_rld = await run_pair(
        kv_after=3.0,
        max_tokens=400,
        kill_rld_when=lambda r: r.state is RelayState.CATCHING_UP and len(r.tokens) > r.sent_end,
        extend_rate=1000.0,
    )
    stream = merged_stream(rld_eng, md_eng)
    assert stream == greedy_reference(SEED, len(stream)) and len(stream) < 400
    assert md.machine.state is MainState.FAILED
    assert isinstance(md.result.error if md.result else None, PeerUnavailable)
    assert to_rld.freed == 1 and md_eng.emitted == {}


async def test_misbehaving_peer_fails_the_request_after_the_extend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A batch contradicting held tokens fails the request with a typed error;
    MD frees its blocks, but only once the running extend has finished."""
    from pddnet import RemoteProtocolError
    from pddnet.handoff import TokenBatch

    eng = StandInEngine(extend_rate=100.0)  # 50 tokens take 0.5 s
    async with trio.open_nursery() as nursery:
        link = MemLink(nursery)
        md = MainDriver(eng, link, eng, standin_request(RID, SEED, 256), HandoffParams())
        freed_at: list[float] = []

        async def free(request_id: int) -> None:
            freed_at.append(trio.current_time())

        link.free_blocks = free  # type: ignore[method-assign]
        eng.start(RID, SEED)
        md.kv_landed()
        ref = greedy_reference(SEED, 50)
        md.deliver(TokenBatch.build(RID, 0, ref, False))

        async def liar() -> None:
            await trio.sleep(0.1)
            md.deliver(TokenBatch.build(RID, 10, [ref[10] ^ 1], False))

        nursery.start_soon(liar)
        t0 = trio.current_time()
        done = await md.run()
    assert isinstance(done.error, RemoteProtocolError) and done.state is MainState.ERROR
    assert eng.extended == 50 and freed_at and freed_at[0] - t0 >= 0.5


async def test_a_flooding_peer_is_bounded_and_the_handoff_still_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Peer messages queued for one request are bounded (the driver keeps at
    most K_MAX_PEER_BACKLOG; the rest are dropped and counted), and a flood of
    duplicates does not stop the handoff."""
    from pddnet.handoff import TokenBatch
    from pddnet.handoff._driver import K_MAX_PEER_BACKLOG

    eng = StandInEngine(extend_rate=1000.0)
    async with trio.open_nursery() as nursery:
        md = MainDriver(
            eng, MemLink(nursery), eng, standin_request(RID, SEED, 256), HandoffParams()
        )
        eng.start(RID, SEED)
        md.kv_landed()
        ref = greedy_reference(SEED, 20)
        batch = TokenBatch.build(RID, 0, ref, True)
        for _ in range(K_MAX_PEER_BACKLOG + 500):  # queued before the driver runs
            md.deliver(batch)
        assert md.dropped == 500
        with trio.fail_after(30):
            done = await md.run()
    assert done.error is None and eng.extended == 20


async def test_a_cancel_does_not_wait_behind_the_engines_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine runs far ahead of a sink that takes 1 s per token: the
    user's cancel is acted on after the emit in progress, not after every
    token the engine produced meanwhile (before: ~one second per queued token)."""

    class StuckSink:
        emits = 0

        async def emit(self, request_id: int, position: int, token: int, final: bool) -> None:
            await trio.sleep(1.0)
            self.emits += 1

    eng, sink = StandInEngine(step_s=0.001), StuckSink()
    eng.start(RID, SEED)
    async with trio.open_nursery() as nursery:
        rld = RelayDriver(eng, MemLink(nursery), sink, standin_request(RID, SEED, 2000))

        async def cancel_soon() -> None:
            await trio.sleep(0.5)
            rld.cancel()

        nursery.start_soon(cancel_soon)
        t0 = trio.current_time()
        done = await rld.run()
    assert done.state is RelayState.CANCELLED and done.error is None
    assert trio.current_time() - t0 < 2.5 and sink.emits <= 2


async def test_eager_tokens_up_to_max_tokens_fail_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """RLD sends max_tokens eager tokens without finishing: MD has nothing left
    to decode, so it fails the request with a typed error and frees its blocks
    (the engine would refuse a continue with no new token)."""
    from pddnet import RemoteProtocolError
    from pddnet.handoff import TokenBatch

    eng = StandInEngine()
    async with trio.open_nursery() as nursery:
        link = MemLink(nursery)
        md = MainDriver(eng, link, eng, standin_request(RID, SEED, 20), HandoffParams())
        eng.start(RID, SEED)
        md.kv_landed()
        md.deliver(TokenBatch.build(RID, 0, greedy_reference(SEED, 20), False))
        with trio.fail_after(5):
            done = await md.run()
    assert isinstance(done.error, RemoteProtocolError) and link.freed == 1
    assert eng.runs == [] and eng.emitted == {}
