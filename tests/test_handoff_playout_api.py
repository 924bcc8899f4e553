"""RLD's playout buffer on real endpoints (loopback): RLD dies holding tokens.

RLD has sent its final batch but not yet shown the tokens it holds (the
playout buffer, ``HandoffParams.playout_s``) when it dies. MD owns the
request from the batch's end; the user's stream has a hole below it that
only MD can fill: MD keeps the final batch's tokens for the sink's re-sends
(``SinkEmitter``), so the stream still ends complete and exact.
"""

from __future__ import annotations

import numpy as np
import trio
from api_wiring import wire
from test_api_takeover import KEY, NB, release_main, start, tcp

from pddnet.api import MainEndpoint, PrefillEndpoint, ReferenceEngine, RelayEndpoint
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.handoff import HandoffParams, MainDriver, RelayDriver
from pddnet.recompute import TINY, ReferenceModel


async def test_rld_dies_holding_tokens_after_the_final_batch_md_fills_the_hole() -> None:
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    # a long playout (5 decode steps): RLD holds several tokens when it sends the final batch
    held = HandoffParams(playout_s=0.1, rtt_s=0.05)
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint(
            "md", mm.pool, ReferenceEngine(mm, step_time_s=0.02), secret=KEY, params=held
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
                    params=held,
                ) as rld:
                    box.append(rld)
                    await wire(p, rld, md)
                    ready.set()
                    await trio.sleep_forever()

        nursery.start_soon(run_rld)
        await ready.wait()
        rld = box[0]
        n, rid = 60, 31
        prompt = np.random.default_rng(13).integers(0, TINY.vocab_size, 60).tolist()
        stream, relay, main = await start(p, pm, rid, prompt, n)
        with trio.fail_after(20):
            async for tok in stream:
                if tok.position == 12:
                    break
            release_main(p, pm, rid, main)  # MD's KV lands: a one-shot final batch
            holding = 0
            while True:  # MD has the final batch, RLD still holds tokens: RLD dies now
                rr, mr = rld._reqs, md._reqs
                r = rr[rid].driver if rid in rr else None
                m = mr[rid].driver if rid in mr else None
                if isinstance(m, MainDriver) and m.machine.final_end is not None:
                    assert isinstance(r, RelayDriver)
                    holding = r.machine.holding
                    kill.cancel()
                    break
                await trio.sleep(0.001)
            tokens = await stream.result()
        assert holding >= 2  # a real hole: tokens below MD's first that the user had not seen
        assert tokens == reference(prompt, n)
        got = stream.received
        assert sorted(t.position for t in got) == list(range(n))  # each position once
        cut = next(i for i, t in enumerate(got) if t.source == main)
        assert {t.source for t in got[:cut]} == {relay}
        nursery.cancel_scope.cancel()
