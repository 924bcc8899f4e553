"""MD's radix cache works with any engine that keeps the DecodeEngine contract,
not only with the reference engine's internals."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from pddnet.api import (
    DecodeRequest,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    TokenCallback,
)
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route

KEY = b"an-engine-contract-secret-0123456789"
NB = 256


class OpaqueEngine:
    """The contract's methods and nothing else (no ``.model``, no ``.allocator``)."""

    def __init__(self, model: ReferenceModel) -> None:
        self._inner = ReferenceEngine(model)
        self.eos_token_id = None

    def allocate(self, num_blocks: int) -> Sequence[int]:
        return self._inner.allocate(num_blocks)

    def free(self, block_ids: Sequence[int]) -> None:
        self._inner.free(block_ids)

    def free_blocks(self) -> int:
        return self._inner.free_blocks()

    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        await self._inner.run(request, on_token)

    def stop(self, request_id: int) -> None:
        self._inner.stop(request_id)


async def test_a_second_turn_hits_the_cache_with_an_opaque_engine() -> None:
    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint("md", mm.pool, OpaqueEngine(mm), secret=KEY) as md,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        assert md.statistics().free_blocks == NB
        a0 = list(range(1, 97))  # session A, 6 full blocks
        b0 = list(range(300, 396))  # session B, nothing in common with A
        a1 = [*a0, *range(200, 240)]  # A's next turn
        for rid, prompt in ((1, a0), (2, b0), (3, a1)):
            seq = pm.new_sequence()
            pm.reserve(seq, len(prompt))
            first = greedy(pm.prefill(seq, prompt))
            stream = p.sink.open(rid, max_tokens=12, deadline_s=20)
            sub = await p.submit(
                rid, prompt, seq.block_table.tolist(), first, 12, sink="p", route=Route.P_MD
            )
            with trio.fail_after(20):
                assert await stream.result() == reference(prompt, 12)
            if rid == 3:  # before: B's offer evicted A's blocks (the free count was -1)
                assert sub.hit_blocks == len(a0) // mm.pool.layout.block_size
        with trio.fail_after(10):
            while md.statistics().active or p.statistics().held_blocks:
                await trio.sleep(0.02)
        assert md.statistics().free_blocks == NB - len(md.cache)
