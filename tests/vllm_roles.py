"""RLD and MD as vLLM child processes, for the tests that run them (test_vllm_*.py).

vLLM's worker-side connector is a process-wide singleton, so each decoder
runs in a child of its own (this module re-runs itself as the child): a
:class:`~pddnet.integrations.vllm.VllmDecodeEngine` over the tiny checkpoint
behind a RelayEndpoint / MainEndpoint. The test process runs P (the NumPy
reference model on the same checkpoint, over a pool of vLLM's layout) and the
user's token sink; JSON lines go over pipes.

The child's conversation: the test sends the job (``prompts``, ``tokens``,
optional ``params``, HandoffParams' fields); MD answers with vLLM's own greedy
stream of each prompt (its prefix cache reset afterwards) and both with their
EndpointInfo; the test sends the peers; the child connects and says so; the
test may ask it, between requests, to reset vLLM's prefix cache (``reset``:
it answers with the blocks the connector loaded into vLLM so far); the test
says every stream ended; the child reports its statistics; the test says bye.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

K_SECRET = "a-vllm-decode-role-test-secret-0123456789"
K_MODEL_ID = "tiny-llama-7"
K_STAGING = 256
K_P_BLOCKS = 256


async def child_main(role: str, model: str, rfd: int, wfd: int) -> None:
    """RLD or MD: a vLLM engine behind a pddnet endpoint, driven over the pipes."""
    import trio

    from pddnet.api import EndpointInfo, MainEndpoint, RelayEndpoint
    from pddnet.handoff import HandoffParams, RelayStats
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
                prompts = {str(i): p for i, p in enumerate(job["prompts"])}
                steps = run_greedy(e, prompts, job["tokens"])
                assert e.reset_prefix_cache()
                return steps

            steps = await engine.call(greedy)
            oracle = {k: [t for s in v for t in s] for k, v in steps.items()}
        vllm_free = await engine.call(free_vllm_blocks)
        kind = MainEndpoint if role == "md" else RelayEndpoint
        params = HandoffParams(**job.get("params", {}))
        async with kind(
            role, engine.pool, engine, secret=K_SECRET, model_id=K_MODEL_ID, params=params
        ) as ep:
            send({"info": ep.info().blob().hex(), "oracle": oracle})
            peers = await receive()
            for blob in peers["peers"]:
                await ep.connect_peer(EndpointInfo.from_blob(bytes.fromhex(blob)))
            await ep.node.connect(peers["user"], peers["user_address"])
            send({"connected": True})
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            def loads_now(e: Any) -> Any:
                return get_kv_transfer_group().statistics()

            while (await receive()).get("reset"):  # until every stream ended
                with trio.fail_after(10):
                    while ep.statistics().active:
                        await trio.sleep(0.05)
                reset = await engine.call(lambda e: e.reset_prefix_cache())
                loaded = (await engine.call(loads_now)).blocks
                send({"reset": reset, "loaded_blocks": loaded})
            with trio.fail_after(10):
                while ep.statistics().active:
                    await trio.sleep(0.05)
            loads = await engine.call(loads_now)
            send(
                {
                    "free_blocks": ep.statistics().free_blocks,
                    "cached": len(ep.cache) if isinstance(ep, MainEndpoint) else 0,
                    "vllm_free": [vllm_free, await engine.call(free_vllm_blocks)],
                    "loads": [loads.loads, loads.blocks, loads.bytes, loads.load_s],
                    "handoffs": [repr(s) for s in ep.handoff_stats],
                    "relay": {  # request id -> what RLD's handoff did
                        str(s.request_id): {
                            "rounds": s.rounds,
                            "handoff": s.handoff,
                            "fallback": s.fallback,
                            "tokens": s.tokens,
                        }
                        for s in ep.handoff_stats
                        if isinstance(s, RelayStats)
                    },
                }
            )
            await receive()


class Child:
    """One decoder child (``role`` "rld" or "md"), its pipes and its log."""

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


async def start_children(
    children: dict[str, Child], p: Any, user: Any, job: dict[str, Any]
) -> dict[str, Any]:
    """Give both children ``job``, connect them to each other, to ``p`` and to
    the ``user`` node; returns their hello messages (info blobs, MD's oracle)."""
    from pddnet.api import EndpointInfo

    for c in children.values():
        c.send(job)
    hello = {r: await c.receive() for r, c in children.items()}
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
    for h in hello.values():
        await p.connect_peer(EndpointInfo.from_blob(bytes.fromhex(h["info"])))
    return hello


async def finish_children(children: dict[str, Child]) -> dict[str, Any]:
    """Tell both children every stream ended; returns their reports and says bye."""
    for c in children.values():
        c.send({"ended": True})
    reports = {r: await c.receive() for r, c in children.items()}
    for c in children.values():
        c.send({"bye": True})
    return reports


def p_model(model: Path) -> Any:
    """P: the reference model on ``model``'s checkpoint over a pool of vLLM
    CPU's layout (vec ISA), as the decoders' staging pools are."""
    from pddnet import KVPool
    from pddnet.integrations.vllm import reference_config, vllm_cpu_layout
    from pddnet.recompute import BlockAllocator, ReferenceModel, Weights

    config = reference_config(model)
    layout = vllm_cpu_layout(config.num_layers, config.num_kv_heads, config.head_dim)
    weights = Weights.load(config, model / "model.safetensors")
    return ReferenceModel(
        config,
        weights,
        KVPool.allocate(layout, K_P_BLOCKS),
        allocator=BlockAllocator(K_P_BLOCKS),
    )


if __name__ == "__main__":
    import trio

    trio.run(child_main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
