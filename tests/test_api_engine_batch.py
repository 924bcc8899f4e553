"""The engine contract on the reference engine: continue a request, consume its
tokens, stop it; every running request steps in one batch tick, off the event loop."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import trio

from pddnet import LocalProtocolError
from pddnet.api import DecodeRequest, ReferenceEngine
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.control import ControlNode
from pddnet.handoff import FinishReason
from pddnet.recompute import TINY, PagedSequence, ReferenceModel, greedy

KEY = b"an-engine-batch-test-secret-0123456789"
PROMPTS = {1: list(range(5, 45)), 2: list(range(100, 131))}


def landed(engine: ReferenceEngine, prompt: list[int], n: int) -> tuple[tuple[int, ...], int]:
    """Blocks for ``prompt`` + ``n`` tokens with the prompt's KV in them (as a
    transfer from P leaves them), and P's first token."""
    table = engine.allocate(engine.model.pool.layout.blocks_for_tokens(len(prompt) + n))
    first = greedy(engine.model.prefill(PagedSequence(np.asarray(table, np.int32)), prompt))
    return tuple(table), first


class Collect:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: list[FinishReason | None] = []

    def __call__(self, token: int, finish: FinishReason | None) -> None:
        self.tokens.append(token)
        self.finish.append(finish)


async def test_two_requests_step_in_the_same_tick_and_decode_greedily() -> None:
    engine = ReferenceEngine(ReferenceModel.create(TINY, num_blocks=64))
    n = 12
    got: dict[int, Collect] = {}
    async with trio.open_nursery() as nursery:
        for rid, prompt in PROMPTS.items():
            table, first = landed(engine, prompt, n)
            got[rid] = Collect()
            req = DecodeRequest(rid, (*prompt, first), len(prompt), table, n - 1)
            nursery.start_soon(engine.run, req, got[rid])
    for rid, prompt in PROMPTS.items():
        assert [reference(prompt, 1)[0], *got[rid].tokens] == reference(prompt, n)
        assert got[rid].finish == [None] * (n - 2) + [FinishReason.MAX_TOKENS]
    batches = list(engine.tick_log)
    assert sum(1 for b in batches if sorted(b) == [1, 2]) >= n - 2, batches
    assert len(batches) <= n + 1  # one tick per token, for both at once


async def test_stop_ends_a_request_and_no_token_follows() -> None:
    model = SlowModel.create(TINY, num_blocks=64)
    engine = ReferenceEngine(model)
    prompt = PROMPTS[1]
    table, first = landed(engine, prompt, 200)
    model.slow_s = 0.05  # the stop below lands while a tick computes
    got = Collect()
    req = DecodeRequest(1, (*prompt, first), len(prompt), table, 199)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run, req, got)
            while len(got.tokens) < 3:
                await trio.sleep(0.005)
            engine.stop(1)
            at_stop = len(got.tokens)
    assert len(got.tokens) == at_stop < 199  # the tick in flight delivers nothing
    assert got.finish[-1] is None
    # stopped, the request runs again from where its KV ends (a restart)
    again = Collect()
    toks = (*prompt, first, *got.tokens)
    await engine.run(DecodeRequest(1, toks, len(toks) - 1, table, 3), again)
    assert [first, *got.tokens, *again.tokens] == reference(prompt, len(got.tokens) + 4)


@pytest.mark.parametrize("eager", [1, 17, 40])
async def test_an_extend_sized_continue_equals_single_instance_greedy(eager: int) -> None:
    """MD's recompute: continue prompt + RLD's eager tokens with only the
    prompt's KV; the engine computes the rest in one pass."""
    engine = ReferenceEngine(ReferenceModel.create(TINY, num_blocks=64))
    prompt, n = PROMPTS[2], 60
    want = reference(prompt, n)
    table, first = landed(engine, prompt, n)
    assert first == want[0]
    got = Collect()
    req = DecodeRequest(7, (*prompt, *want[:eager]), len(prompt), table, n - eager)
    await engine.run(req, got)
    assert got.tokens == want[eager:]
    assert engine.tick_log[0] == (7,) and len(engine.tick_log) == n - eager  # one pass first


async def test_a_continue_the_engine_cannot_serve_is_refused() -> None:
    engine = ReferenceEngine(ReferenceModel.create(TINY, num_blocks=64))
    prompt = PROMPTS[1]
    table, first = landed(engine, prompt, 4)
    with pytest.raises(LocalProtocolError, match="KV for"):  # no token left to compute
        DecodeRequest(1, tuple(prompt), len(prompt), table, 4)
    with pytest.raises(LocalProtocolError, match="cannot hold"):
        await engine.run(DecodeRequest(1, (*prompt, first), len(prompt), table, 500), Collect())


class SlowModel(ReferenceModel):
    """A model whose every forward pass takes ``slow_s`` more (blocking, as a
    real model's kernel launch and sync would)."""

    slow_s = 0.0

    def extend(self, *args: Any, **kw: Any) -> Any:
        time.sleep(self.slow_s)
        return super().extend(*args, **kw)


async def ping_times_while_busy(engine: ReferenceEngine, slow_s: float) -> list[float]:
    """Round trips of real control pings between two nodes while the engine
    runs ticks of ``slow_s`` each."""
    prompt = PROMPTS[1]
    table, first = landed(engine, prompt, 8)
    assert isinstance(engine.model, SlowModel)
    engine.model.slow_s = slow_s
    rtts: list[float] = []
    async with (
        ControlNode("a", secret=KEY) as a,
        ControlNode("b", secret=KEY) as b,
        trio.open_nursery() as nursery,
    ):
        await a.connect("b", b.address)
        await a.ping("b", timeout=5)
        req = DecodeRequest(1, (*prompt, first), len(prompt), table, 4)
        nursery.start_soon(engine.run, req, Collect())
        await trio.sleep(slow_s / 4)  # the first tick is running
        for _ in range(5):
            t0 = trio.current_time()
            await a.ping("b", timeout=10)
            rtts.append(trio.current_time() - t0)
            await trio.sleep(slow_s / 5)
    return rtts


async def test_a_slow_tick_does_not_stall_control_traffic() -> None:
    """Ticks run on a worker thread: control pings between two other nodes of
    the same process answer at once while a 1 s tick runs (on the event loop,
    each would wait for the tick: see the worker_thread=False run below)."""
    model = SlowModel.create(TINY, num_blocks=64)
    # (1 s ticks: a wide margin between the two cases on a loaded 2-core machine)
    rtts = await ping_times_while_busy(ReferenceEngine(model), 1.0)
    assert max(rtts) < 0.4, rtts
    on_loop = await ping_times_while_busy(ReferenceEngine(model, worker_thread=False), 1.0)
    assert max(on_loop) > 0.6, on_loop  # the check above can fail: this is what it catches


async def test_cancelling_the_run_that_ticks_loses_no_token_of_the_others() -> None:
    """The run that computes a tick is cancelled mid-tick: the batch's other
    requests still get that tick's tokens (their KV advanced with it)."""
    model = SlowModel.create(TINY, num_blocks=64)
    engine = ReferenceEngine(model)
    n = 8
    (ta, fa), (tb, fb) = (landed(engine, PROMPTS[rid], n) for rid in (1, 2))
    model.slow_s = 0.1
    got_b = Collect()
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope_a:
            nursery.start_soon(
                engine.run,
                DecodeRequest(2, (*PROMPTS[2], fb), len(PROMPTS[2]), tb, n - 1),
                got_b,
            )

            async def cancel_mid_tick() -> None:
                await trio.sleep(0.25)  # inside the third tick
                scope_a.cancel()

            nursery.start_soon(cancel_mid_tick)
            req_a = DecodeRequest(1, (*PROMPTS[1], fa), len(PROMPTS[1]), ta, n - 1)
            await engine.run(req_a, Collect())  # first to tick: it computes every tick
    assert scope_a.cancelled_caught
    assert [fb, *got_b.tokens] == reference(PROMPTS[2], n)
