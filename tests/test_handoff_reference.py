"""Drivers with the reference model on both sides: RLD decodes eagerly, MD
recomputes by extend and takes over; the user stream equals single-instance
greedy decoding of the same model exactly."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
from handoff_proc import ModelEngine, reference  # tests/ is on sys.path under pytest

from pddnet.handoff import (
    HandoffMode,
    HandoffParams,
    MainDriver,
    MainState,
    RelayDriver,
    RelayState,
)
from pddnet.recompute import TINY
from pddnet.wire import Message

RID = 5


class Pipe:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery, self.peer = nursery, None

    async def send(self, message: Message) -> None:
        async def later() -> None:
            await trio.sleep(0.015)
            self.peer.deliver(message)  # type: ignore[attr-defined]

        self.nursery.start_soon(later)

    async def cancel_transfer(self, request_id: int, reason: object) -> None:
        pass

    async def free_blocks(self, request_id: int) -> None:
        pass


@pytest.mark.parametrize("mode", [HandoffMode.CATCH_UP, HandoffMode.ONE_SHOT])
async def test_reference_model_stream_equals_greedy(
    mode: HandoffMode, autojump_clock: trio.testing.MockClock
) -> None:
    n = 160
    prompt = np.random.default_rng(1).integers(0, TINY.vocab_size, 37).tolist()
    rld_eng, md_eng = ModelEngine(n), ModelEngine(n)
    rld_eng.start(prompt)
    params = HandoffParams(mode=mode, rtt_s=0.03)
    async with trio.open_nursery() as nursery:
        to_md, to_rld = Pipe(nursery), Pipe(nursery)
        rld = RelayDriver(rld_eng, to_md, rld_eng, rld_eng.request(prompt), params)
        md = MainDriver(md_eng, to_rld, md_eng, md_eng.request(prompt), params)
        to_md.peer, to_rld.peer = md, rld  # type: ignore[assignment]

        async def wan() -> None:
            await trio.sleep(1.6)  # ~80 eager tokens at 20 ms
            md_eng.start(prompt)
            md.kv_landed()

        nursery.start_soon(wan)
        async with trio.open_nursery() as sides:
            sides.start_soon(rld.run)
            sides.start_soon(md.run)
        nursery.cancel_scope.cancel()
    stream = sorted(rld_eng.emitted + md_eng.emitted)
    assert [p for p, _ in stream] == list(range(n))
    assert [t for _, t in stream] == reference(prompt, n)
    assert rld.machine.state is RelayState.RELEASED and md.machine.state is MainState.FINISHED
    assert 60 < len(rld_eng.emitted) < 100 and md_eng.emitted
