"""MD's KV blocks: never freed while a transfer can still write into them.

Real endpoints (P, RLD, MD) in one trio loop over loopback, as in
tests/test_api_endpoints.py.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import trio

from pddnet import LocalProtocolError
from pddnet.api import MainEndpoint, PrefillEndpoint, ReferenceEngine, RelayEndpoint
from pddnet.handoff import AbortReason, HandoffAbort, TokenBatch
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire

KEY = b"a-block-lifetime-test-secret-0123456789ab"
NB = 256
SENTINEL = -7.0  # no KV value the reference model writes


async def test_md_failing_before_its_kv_landed_revokes_the_grant_before_freeing() -> None:
    """RLD breaks the protocol while MD still waits for the WAN transfer: MD
    fails the request and frees its blocks, and the transfer that arrives
    afterwards must not land in them (they may be another request's by then)."""
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        # cut_off_wan=False: RLD finishing does not cancel MD's transfer at P
        RelayEndpoint("rld", rm.pool, ReferenceEngine(rm), secret=KEY, cut_off_wan=False) as rld,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        await wire(p, rld, md)
        prompt = np.random.default_rng(5).integers(0, TINY.vocab_size, 300).tolist()
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))
        first = greedy(pm.prefill(seq, prompt))
        await p.submit(
            9, prompt, seq.block_table.tolist(), first, 8, sink="p",
            route=Route.P_RLD_MD, ready=False,
        )  # fmt: skip
        for layer in range(TINY.num_layers):  # RLD's KV now, MD's later
            p.mark_layer_ready(9, layer, dest="rld")
        granted = list(md._reqs[9].owned)
        assert md.receiver.statistics().grants == 1  # MD waits for its KV
        # RLD sends two batches that contradict each other: a RemoteProtocolError
        await rld.node.send("md", TokenBatch.build(9, 0, [1, 2], False))
        await rld.node.send("md", TokenBatch.build(9, 0, [3, 4], False))
        with trio.fail_after(10):
            while md.statistics().active:
                await trio.sleep(0.01)
        assert md.statistics().failed == 1 and md.statistics().free_blocks == NB
        # the freed blocks now hold someone else's data (here: a sentinel)
        for layer in range(TINY.num_layers):
            for view in mm.kv_views(layer):
                view[granted] = SENTINEL
        # P sends MD's KV after all (unless P already let the request go: its
        # transfer to MD was cancelled)
        with contextlib.suppress(LocalProtocolError):
            for layer in range(TINY.num_layers):
                p.mark_layer_ready(9, layer, dest="md")
        with trio.fail_after(20):
            released = await p.next_event()
            while rld.statistics().active:
                await trio.sleep(0.01)
        for layer in range(TINY.num_layers):
            for view in mm.kv_views(layer):
                assert (view[granted] == SENTINEL).all(), "a transfer wrote into freed blocks"
        assert released.request_id == 9
        assert md.receiver.statistics().grants == 0  # revoked, not left live


async def test_md_caches_a_landed_prompt_when_rld_keeps_the_request() -> None:
    """MD's KV landed, then RLD ends the handoff (it finished the answer, or
    falls back) before MD took over: MD frees its blocks but caches the
    prompt's full blocks, which hold P's KV, for the session's next turn."""
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        RelayEndpoint("rld", rm.pool, ReferenceEngine(rm), secret=KEY) as rld,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        await wire(p, rld, md)
        prompt = np.random.default_rng(6).integers(0, TINY.vocab_size, 300).tolist()
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))
        first = greedy(pm.prefill(seq, prompt))
        await p.submit(
            11, prompt, seq.block_table.tolist(), first, 8, sink="p",
            route=Route.P_RLD_MD, ready=False,
        )  # fmt: skip
        for layer in range(TINY.num_layers):  # MD's KV now; RLD's never
            p.mark_layer_ready(11, layer, dest="md")
        with trio.fail_after(10):
            while not md._reqs[11].landed.is_set():
                await trio.sleep(0.01)
        # what RLD sends when it keeps the request to the end
        await rld.node.send("md", HandoffAbort(11, int(AbortReason.RLD_FINISHED)))
        with trio.fail_after(10):
            while md.statistics().active:
                await trio.sleep(0.01)
        full = len(prompt) // mm.block_size
        assert len(md.cache) == full
        assert md.statistics().free_blocks == NB - full
        match = md.cache.match_prefix(prompt, touch=False)
        assert match.num_blocks == full  # and they hold P's KV, bit for bit
        p_blocks = seq.block_table[:full].tolist()
        for md_block, p_block in zip(match.block_ids.tolist(), p_blocks, strict=True):
            assert mm.pool.read(mm.pool.ranges([md_block])) == pm.pool.read(
                pm.pool.ranges([p_block])
            )
        await p.abort(11)
