"""P's dual send (``PrefillEndpoint.submit``): every block to RLD over the local
path, only the DRC delta to MD over the WAN, layer by layer, bit for bit.

The strange-traffic cut-off (MD's transfer cancelled while RLD's completes) is
tested in tests/test_api_endpoints.py (``test_strange_traffic_cuts_off_or_feeds_the_cache``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import trio

from pddnet.api import (
    DecodeRequest,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    RelayEndpoint,
    TokenCallback,
)
from pddnet.kv import KVPool
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route
from pddnet.transport.local import local_available
from pddnet.transport.wan import WanReceiver

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire

KEY = b"a-dual-send-test-secret-0123456789abcdef"
NB = 256


def per_block(pool: KVPool, ids: Sequence[int]) -> list[bytes]:
    return [pool.read(pool.ranges([int(b)])) for b in ids]


class Recording(ReferenceEngine):
    """Keeps a copy of each request's prompt blocks as they are when decoding
    starts: the KV exactly as the transfers left it."""

    def __init__(self, model: ReferenceModel, step_time_s: float = 0.0) -> None:
        super().__init__(model, step_time_s=step_time_s)
        self.kv: dict[int, tuple[list[int], list[bytes]]] = {}

    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        if request.request_id not in self.kv:  # the first run starts from the prompt's KV
            n = self.pool.layout.blocks_for_tokens(request.kv_tokens)
            ids = [int(b) for b in request.block_table[:n]]
            self.kv[request.request_id] = (ids, per_block(self.pool, ids))
        await super().run(request, on_token)


async def test_dual_send_rld_all_md_delta_layer_by_layer_bit_for_bit() -> None:
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    rld_engine, md_engine = Recording(rm, step_time_s=0.005), Recording(mm)
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        RelayEndpoint("rld", rm.pool, rld_engine, secret=KEY) as rld,
        MainEndpoint("md", mm.pool, md_engine, secret=KEY) as md,
    ):
        await wire(p, rld, md)
        # the local path is UCX where ucxx is installed, TCP otherwise
        assert isinstance(rld.receiver, WanReceiver) != local_available()
        base = np.random.default_rng(3).integers(0, TINY.vocab_size, 150).tolist()
        bs = pm.pool.layout.block_size
        sent: dict[int, list[int]] = {}
        for rid, prompt in ((1, base), (2, base + [7] * 60)):  # 2 extends 1: a DRC hit
            seq = pm.new_sequence()
            pm.reserve(seq, len(prompt))
            first = greedy(pm.prefill(seq, prompt))
            nblocks = -(-len(prompt) // bs)
            sent[rid] = seq.block_table.tolist()[:nblocks]
            sub = await p.submit(
                rid, prompt, seq.block_table.tolist(), first, 30, sink="p",
                route=Route.P_RLD_MD, ready=False,
            )  # fmt: skip
            hit = 0 if rid == 1 else len(base) // bs  # MD caches request 1's full blocks
            assert (sub.hit_blocks, sub.sent_blocks_wan) == (hit, nblocks - hit)
            assert sub.sent_blocks_local == nblocks  # RLD gets every block
            for layer in range(TINY.num_layers):  # prefill hands over layers in order
                assert rid not in rld_engine.kv and rid not in md_engine.kv
                p.mark_layer_ready(rid, layer)
                await trio.sleep(0.01)  # computing the next layer
            with trio.fail_after(30):
                released = await p.next_event()
                while md.statistics().active or rld.statistics().active:
                    await trio.sleep(0.01)
            assert released.request_id == rid and released.error is None
    want = {rid: per_block(pm.pool, ids) for rid, ids in sent.items()}
    # RLD: every block of both prompts, bit for bit
    assert rld_engine.kv[1][1] == want[1] and rld_engine.kv[2][1] == want[2]
    assert md_engine.kv[1][1] == want[1]
    # MD, request 2: the 9 cached blocks are the very blocks request 1 filled,
    # and the delta blocks equal P's
    hit = len(base) // bs
    md_ids, md_kv = md_engine.kv[2]
    assert md_ids[:hit] == md_engine.kv[1][0][:hit]
    assert md_kv[:hit] == want[1][:hit] and md_kv[hit:] == want[2][hit:]
