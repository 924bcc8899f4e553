"""PrefillEndpoint with real sockets: the RLD slot on every failure path, one
clock, and the dual send (every block to RLD, the DRC delta to MD, layer by layer)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pddnet import LayoutMismatch, LocalProtocolError, RemoteCallError
from pddnet.api import MainEndpoint, PrefillEndpoint, ReferenceEngine, RelayEndpoint, Submission
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import LinkEstimate, Route, RoutePolicy, Router

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire

KEY = b"a-prefill-test-secret-0123456789abcdef"
NB = 512


def prefilled(model: ReferenceModel, prompt: list[int]) -> tuple[list[int], int]:
    seq = model.new_sequence()
    model.reserve(seq, len(prompt))
    first = greedy(model.prefill(seq, prompt))
    return seq.block_table.tolist(), first


async def test_every_failing_step_of_submit_gives_the_relay_slot_back() -> None:
    """The router admits each request to RLD (one slot in all); each way
    ``submit`` can fail after that must give the slot back, or the last,
    healthy request is shed with RELAY_FULL."""
    policy = RoutePolicy(ttft_target_s=0.001, max_concurrent_relays=1, skip_wan_short_output=True)
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    small_r, small_m = (ReferenceModel.create(TINY, num_blocks=8) for _ in range(2))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY, router=Router(policy)) as p,
        RelayEndpoint("rld", rm.pool, ReferenceEngine(rm), secret=KEY) as rld,
        RelayEndpoint("rld-small", small_r.pool, ReferenceEngine(small_r), secret=KEY) as rld_s,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
        MainEndpoint("md-small", small_m.pool, ReferenceEngine(small_m), secret=KEY) as md_s,
    ):
        prompt = list(range(200))
        blocks, first = prefilled(pm, prompt)

        async def submit(rid: int, max_tokens: int = 40, **kw: Any) -> Submission:
            return await p.submit(rid, prompt, blocks, first, max_tokens, sink="p", **kw)

        def nothing_held() -> None:
            assert p.router.active_relays == 0
            assert p.statistics().held_blocks == 0 and len(p.leases) == 0

        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        for dec in (rld, rld_s, md_s):
            await p.connect_peer(dec.info())
            await dec.connect_peer(p.info())
        await wire(p, rld, md)
        # (with no relay connected the router sheds to P->MD: tests/test_cluster.py)
        # 2. the router chose P->RLD only (a short output): not served here
        with pytest.raises(LocalProtocolError, match="P->RLD-only"):
            await submit(2, max_tokens=1)
        nothing_held()
        # 3. a relay by a name that is not one
        with pytest.raises(LocalProtocolError, match="not a connected relay"):
            await submit(3, relay="md-small")
        nothing_held()
        # 4. RLD refuses the offer (too few blocks)
        with pytest.raises(RemoteCallError, match="ResourceLimitError"):
            await submit(4, relay="rld-small")
        nothing_held()
        # 5. MD refuses the offer
        with pytest.raises(RemoteCallError, match="ResourceLimitError"):
            await submit(5, main="md-small")
        nothing_held()
        # 6. the caller cancels while the offers are out
        with trio.move_on_after(0):
            await submit(6)
        nothing_held()
        # the one slot is free: a healthy request gets it, and gives it back
        sub = await submit(7, relay="rld", main="md")
        assert sub.decision.route is Route.P_RLD_MD
        with trio.fail_after(20):
            released = await p.next_event()
        assert released.request_id == 7 and released.error is None
        with trio.fail_after(5):
            while p.router.active_relays:
                await trio.sleep(0.01)
        assert p.router.statistics().peak_relays == 1


async def test_the_bandwidth_sample_uses_trio_time(mock_clock: trio.testing.MockClock) -> None:
    """The router's WAN estimate comes from the transfer's time on trio's
    clock, the clock everything else in the endpoint uses: with 3 s of virtual
    time between start and completion the sample is ~bytes / 3 s."""
    clock = mock_clock
    clock.rate = 1.0  # real time flows; the test adds 3 s at once below
    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    bw0 = 1e9
    router = Router(RoutePolicy(), LinkEstimate(bandwidth_bytes_s=bw0, rtt_s=0.0))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY, router=router) as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        prompt = [t % TINY.vocab_size for t in range(2100)]  # 132 blocks, > 1 MiB
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))  # what the KV holds does not matter here
        blocks, first = seq.block_table.tolist(), 1
        sub = await p.submit(1, prompt, blocks, first, 4, sink="p", route=Route.P_MD, ready=False)
        nbytes = sub.sent_blocks_wan * pm.pool.layout.block_bytes
        assert nbytes >= 1 << 20
        clock.jump(3.0)
        for layer in range(TINY.num_layers):
            p.mark_layer_ready(1, layer)
        with trio.fail_after(20):
            released = await p.next_event()
        assert released.error is None
    sample = (p.router.link_for("md").bandwidth_bytes_s - 0.8 * bw0) / 0.2
    # 3 s of virtual time plus the real transfer (well under 3 s on loopback)
    assert nbytes / 6.0 < sample <= nbytes / 3.0


async def test_endpoints_refuse_a_peer_with_another_model_or_kv_meaning() -> None:
    """Both sides check the handshake: a different model fingerprint, or the
    same block bytes in another dtype, is refused before any KV moves."""
    pm, mm = (ReferenceModel.create(TINY, num_blocks=64) for _ in range(2))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY, model_id="tiny@1") as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY, model_id="tiny@2") as md,
    ):
        with pytest.raises(LayoutMismatch, match=r"'tiny@1' at p \(prefill\) vs 'tiny@2' at md"):
            await p.connect_peer(md.info())
        with pytest.raises(LayoutMismatch, match=r"'tiny@2' at md \(main\) vs 'tiny@1' at p"):
            await md.connect_peer(p.info())
        md.model_id = "tiny@1"
        await p.connect_peer(md.info())  # the same model: accepted
        int32 = dataclasses.replace(
            md.info(), layout=dataclasses.replace(md.pool.layout, dtype="int32")
        )
        with pytest.raises(LayoutMismatch, match="dtype 'float32' at p"):
            await p.connect_peer(int32)
