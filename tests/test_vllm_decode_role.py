"""RLD and MD as real vLLM instances: VllmDecodeEngine behind pddnet's endpoints.

RLD and MD each run in a child process of their own (vLLM's worker-side
connector is a process-wide singleton; this file re-runs itself as the
child): a :class:`~pddnet.integrations.vllm.VllmDecodeEngine` over the tiny
checkpoint behind a RelayEndpoint / MainEndpoint, whose receivers land the
KV in the engine's staging pool. The test process runs P (the NumPy
reference model on the same checkpoint, which decodes it exactly like vLLM,
over a pool of vLLM's layout) and the user's token sink; EndpointInfo blobs
go over pipes.

For prompts of 1, 64 (two whole blocks), 100 and 200 tokens, on P->MD and on
P->RLD->MD:

* the user's stream equals MD's vLLM's own greedy output (computed in the MD
  child before serving, its prefix cache reset afterwards), every position once;
* a request whose KV P zeroes before the transfer streams something else, on
  each route, so vLLM's attention reads the KV the connector loaded;
* afterwards every block is back: RLD's staging pool is all free, MD's holds
  only its prefix cache, and vLLM's free block count is its start value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

K_SECRET = "a-vllm-decode-role-test-secret-0123456789"
K_MODEL_ID = "tiny-llama-7"
K_TOKENS = 40  # the user's stream, P's first token included
K_PROMPT_LENS = (1, 64, 100, 200)
K_STAGING = 256
K_P_BLOCKS = 256


# ---------------------------------------------------------- the decoder child
async def _child(role: str, model: str, rfd: int, wfd: int) -> None:
    """RLD or MD: a vLLM engine behind a pddnet endpoint, driven over the pipes."""
    import trio

    from pddnet.api import EndpointInfo, MainEndpoint, RelayEndpoint
    from pddnet.integrations.vllm import VllmDecodeEngine, run_greedy

    inbox, outbox = os.fdopen(rfd, "r"), os.fdopen(wfd, "w")

    def send(obj: dict[str, Any]) -> None:
        outbox.write(json.dumps(obj) + "\n")
        outbox.flush()

    async def receive() -> Any:
        return json.loads(await trio.to_thread.run_sync(inbox.readline))

    def free_vllm_blocks(e: Any) -> int:
        manager = e.engine_core.engine_core.scheduler.kv_cache_manager
        return int(manager.block_pool.get_num_free_blocks())

    async with VllmDecodeEngine(model, staging_blocks=K_STAGING) as engine:
        job = await receive()
        oracle: dict[str, list[int]] = {}
        if role == "md":  # vLLM's own greedy streams, then forget their KV

            def greedy(e: Any) -> dict[str, list[list[int]]]:
                steps = run_greedy(e, {str(i): p for i, p in enumerate(job["prompts"])}, K_TOKENS)
                assert e.reset_prefix_cache()
                return steps

            steps = await engine.call(greedy)
            oracle = {k: [t for s in v for t in s] for k, v in steps.items()}
        vllm_free = await engine.call(free_vllm_blocks)
        kind = MainEndpoint if role == "md" else RelayEndpoint
        async with kind(role, engine.pool, engine, secret=K_SECRET, model_id=K_MODEL_ID) as ep:
            send({"info": ep.info().blob().hex(), "oracle": oracle})
            peers = await receive()
            for blob in peers["peers"]:
                await ep.connect_peer(EndpointInfo.from_blob(bytes.fromhex(blob)))
            await ep.node.connect(peers["user"], peers["user_address"])
            send({"connected": True})
            await receive()  # every stream ended
            with trio.fail_after(10):
                while ep.statistics().active:
                    await trio.sleep(0.05)
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            loads = await engine.call(lambda e: get_kv_transfer_group().statistics())
            send(
                {
                    "free_blocks": ep.statistics().free_blocks,
                    "cached": len(ep.cache) if isinstance(ep, MainEndpoint) else 0,
                    "vllm_free": [vllm_free, await engine.call(free_vllm_blocks)],
                    "loads": [loads.loads, loads.blocks, loads.bytes, loads.load_s],
                    "handoffs": [repr(s) for s in ep.handoff_stats],
                }
            )
            await receive()


# -------------------------------------------------------------------- the test
def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    lens = [*K_PROMPT_LENS, 90, 90]  # the last two are zeroed in flight, one per route
    return [[int(t) for t in rng.integers(2, 512, size=n)] for n in lens]


class _Child:
    def __init__(self, role: str, model: Path, log: Path) -> None:
        to_child, self._w = os.pipe()
        self._r, to_test = os.pipe()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role, str(model), str(to_child), str(to_test)],
            pass_fds=(to_child, to_test),
            stdout=subprocess.DEVNULL,
            stderr=open(log, "w"),  # noqa: SIM115 - the child's whole life
        )
        os.close(to_child)
        os.close(to_test)
        self.inbox, self.outbox = os.fdopen(self._r, "r"), os.fdopen(self._w, "w")

    def send(self, obj: dict[str, Any]) -> None:
        self.outbox.write(json.dumps(obj) + "\n")
        self.outbox.flush()

    async def receive(self) -> Any:
        import trio

        line = await trio.to_thread.run_sync(self.inbox.readline)
        if not line:
            raise AssertionError(f"child died: {self.log.read_text()[-4000:]}")
        return json.loads(line)

    def close(self) -> None:
        self.outbox.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()


@pytest.mark.slow  # two vLLM engine processes: ~30-90 s on 2 cores
async def test_vllm_decoders_stream_vllm_greedy(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    import trio

    from pddnet import KVLayout, KVPool
    from pddnet.api import Abort, Emitted, EndpointInfo, PrefillEndpoint
    from pddnet.control import ControlNode
    from pddnet.integrations.vllm import build_tiny_llama, reference_config
    from pddnet.recompute import BlockAllocator, ReferenceModel, Weights, greedy
    from pddnet.route import Route

    sys.path.insert(0, str(Path(__file__).parent))
    from test_api_endpoints import Sink

    model = build_tiny_llama(tmp_path / "model")
    config = reference_config(model)
    layout = KVLayout(  # vLLM CPU's (vec ISA), as the staging pools are
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        32,
        "float32",
        interior="hptd",
        key_order="dt",
        fused=True,
    )
    weights = Weights.load(config, model / "model.safetensors")
    pm = ReferenceModel(
        config,
        weights,
        KVPool.allocate(layout, K_P_BLOCKS),
        allocator=BlockAllocator(K_P_BLOCKS),
    )
    prompts = _prompts()
    requests = [
        (10 * i + j, i, route, i >= len(K_PROMPT_LENS))
        for i in range(len(prompts))
        for j, route in enumerate((Route.P_MD, Route.P_RLD_MD))
        if i < len(K_PROMPT_LENS) or j == i - len(K_PROMPT_LENS)
    ]
    children = {r: _Child(r, model, tmp_path / f"{r}.log") for r in ("rld", "md")}
    sink = Sink()
    try:
        async with (
            ControlNode("user", secret=K_SECRET) as user,
            PrefillEndpoint("p", pm.pool, secret=K_SECRET, model_id=K_MODEL_ID) as p,
        ):
            user.route(Emitted, sink.on_emit)
            user.route(Abort, sink.on_abort)
            with trio.fail_after(300):
                for c in children.values():
                    c.send({"prompts": prompts})
                hello = {r: await c.receive() for r, c in children.items()}
                infos = {
                    r: EndpointInfo.from_blob(bytes.fromhex(h["info"])) for r, h in hello.items()
                }
                assert infos["md"].layout == layout
                for r, c in children.items():
                    other = "md" if r == "rld" else "rld"
                    c.send(
                        {
                            "peers": [p.info().blob().hex(), hello[other]["info"]],
                            "user": user.name,
                            "user_address": user.address,
                        }
                    )
                for c in children.values():
                    assert (await c.receive())["connected"]
                for info in infos.values():
                    await p.connect_peer(info)
                oracle = hello["md"]["oracle"]
                for rid, i, route, zero in requests:
                    seq = pm.new_sequence()
                    pm.reserve(seq, len(prompts[i]))
                    first = greedy(pm.prefill(seq, prompts[i]))
                    assert first == oracle[str(i)][0]
                    blocks = seq.block_table.tolist()
                    if zero:  # P's KV zeroed in flight: the decoders must read it
                        ranges = pm.pool.ranges(blocks)
                        pm.pool.write(ranges, bytes(ranges.total))
                    await p.submit(
                        rid, prompts[i], blocks, first, K_TOKENS, sink="user", route=route
                    )
                while len(sink.ended) < len(requests):
                    await trio.sleep(0.05)
                for c in children.values():
                    c.send({"ended": True})
                reports = {r: await c.receive() for r, c in children.items()}
                for c in children.values():
                    c.send({"bye": True})
            for rid, i, route, zero in requests:
                want = oracle[str(i)]
                assert sink.ended[rid] == "finished", (rid, route, sink.ended[rid])
                got = sink.tokens[rid]
                assert sorted(got) == list(range(K_TOKENS)), rid  # every position once
                stream = [got[k][0] for k in range(K_TOKENS)]
                if zero:
                    assert stream != want, (rid, route)
                else:
                    assert stream == want, (rid, route, stream, want)
            rld, md = reports["rld"], reports["md"]
            assert rld["free_blocks"] == K_STAGING, rld
            assert md["free_blocks"] == K_STAGING - md["cached"], md
            for r in (rld, md):
                start, end = r["vllm_free"]
                assert start == end, r
                assert r["loads"][0] > 0, r  # the connector loaded KV into vLLM's blocks
            print(json.dumps(reports, indent=1))
    finally:
        for c in children.values():
            c.close()
    for r, c in children.items():
        assert c.proc.returncode == 0, (r, c.log.read_text()[-4000:])


if __name__ == "__main__":
    import trio

    trio.run(_child, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
