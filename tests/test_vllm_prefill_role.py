"""P as a real vLLM instance: its connector hands the prefilled KV to pddnet.

P is vLLM 0.32 (CPU) with :class:`PrefillKVConnector`, in a child process of
its own (vLLM's worker-side connector is a process-wide singleton); this file
re-runs itself as that child. The test process runs pddnet's RelayEndpoint
and MainEndpoint, each a reference engine over the same tiny checkpoint and a
pool of vLLM's layout (block interior ``'hptd'`` with K transposed, 32-token
blocks), and the
user's token sink. The two processes exchange EndpointInfo blobs over pipes.

For prompts of 1, 64 (two whole blocks), 100 and 200 tokens, on P->MD and on
P->RLD->MD, with the connector's two paths (``layerwise`` true: submitted
when the last prefill chunk is scheduled, each layer sent from
``save_kv_layer``, the first token following; false: the whole request from
``request_finished``):

* the user's stream (P's first token, then the decoders' tokens) equals vLLM's
  own greedy output from the same engine without pddnet, every position once;
* a request whose blocks the child zeroes after the prefill and before the
  transfer (layer by layer: one layer, in ``save_kv_layer``, after the
  forward wrote it) streams something else, so the decoders read P's real KV;
* layer by layer, every layer of every request was marked ready during the
  forward, before vLLM called ``request_finished`` (sampled); P prefills in
  chunks of 96 tokens, so the connector follows the blocks a request gains
  from chunk to chunk and sends them from the last chunk's forward;
* afterwards every block is back: vLLM's free block count is its start value,
  RLD's pool is all free and MD's holds only its prefix cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

K_SECRET = "a-vllm-prefill-role-test-secret-0123456789"
K_MODEL_ID = "tiny-llama-7"
K_TOKENS = 40  # the user's stream, P's first token included
K_PROMPT_LENS = (1, 64, 100, 200)
K_DECODER_BLOCKS = 256
K_CHUNK = 96  # P's max_num_batched_tokens
K_ZERO_LAYER = 1  # layer by layer: the layer zeroed in flight
ZERO_IDS: set[int] = set()  # in the child: pddnet ids whose KV is zeroed before the transfer
MARKS: dict[int, list[float]] = {}  # in the child: pddnet id -> when save_kv_layer marked a layer
FINISHED: dict[int, float] = {}  # in the child: pddnet id -> when request_finished ran
CHUNKS: dict[int, int] = {}  # in the child, layer by layer: pddnet id -> prefill steps


# ----------------------------------------------------------------- the P child
def _child_connector() -> Any:
    """PrefillKVConnector that zeroes the KV of the requests in ZERO_IDS before
    it goes out (whole request: every block; layer by layer: layer
    K_ZERO_LAYER), and notes when layers were marked and requests finished."""
    import time

    import torch

    from pddnet.integrations.vllm.connectors import PrefillKVConnector

    class ZeroingConnector(PrefillKVConnector):
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            assert self.endpoint is not None
            pool = self.endpoint.endpoint.pool
            for h in self._get_connector_metadata().handoffs:
                if h.request_id in ZERO_IDS:
                    ranges = pool.ranges(list(h.block_ids))
                    pool.write(ranges, bytes(ranges.total))
            super().start_load_kv(forward_context, **kwargs)

        def save_kv_layer(
            self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
        ) -> None:
            for h in self._get_connector_metadata().streams:
                MARKS.setdefault(h.request_id, []).append(time.perf_counter())
                if h.request_id in ZERO_IDS and self._layers[layer_name] == K_ZERO_LAYER:
                    kv_layer[torch.tensor(h.block_ids)] = 0  # after the forward wrote it
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            for vid, p in self._prefilling.items():
                if scheduler_output.num_scheduled_tokens.get(vid):
                    rid = p.request.kv_transfer_params["pddnet"]["request_id"]
                    CHUNKS[rid] = CHUNKS.get(rid, 0) + 1
            return super().build_connector_meta(scheduler_output)

        def request_finished(self, request: Any, block_ids: list[int]) -> Any:
            params = (request.kv_transfer_params or {}).get("pddnet")
            if params is not None:
                FINISHED[params["request_id"]] = time.perf_counter()
            return super().request_finished(request, block_ids)

    return ZeroingConnector


def _child(model: str, rfd: int, wfd: int, layerwise: bool) -> None:
    """P: a vLLM engine with the connector, driven over the pipes ``rfd`` / ``wfd``."""
    from pddnet.api import EndpointInfo
    from pddnet.integrations.vllm import apply_cpu_env, cpu_engine_kwargs, run_greedy

    apply_cpu_env()
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    inbox, outbox = os.fdopen(rfd, "r"), os.fdopen(wfd, "w")

    def send(obj: dict[str, Any]) -> None:
        outbox.write(json.dumps(obj) + "\n")
        outbox.flush()

    def receive() -> Any:
        return json.loads(inbox.readline())

    globals()["ZeroingConnector"] = _child_connector()
    kv = KVTransferConfig(
        kv_connector="ZeroingConnector",
        kv_connector_module_path="__main__",  # this script: ZERO_IDS is its global
        kv_role="kv_producer",
        kv_connector_extra_config={
            "name": "p",
            "secret": K_SECRET,
            "model_id": K_MODEL_ID,
            "layerwise": layerwise,
        },
    )
    engine = vllm.LLMEngine.from_engine_args(
        vllm.EngineArgs(
            # chunked prefill: the 100- and 200-token prompts take 2 and 3
            # steps, so the connector follows a request's blocks across chunks
            **cpu_engine_kwargs(
                model,
                kv_transfer_config=kv,
                enable_chunked_prefill=True,
                max_num_batched_tokens=K_CHUNK,
            )
        )
    )
    scheduler = engine.engine_core.engine_core.scheduler
    block_pool = scheduler.kv_cache_manager.block_pool
    worker = get_kv_transfer_group()
    assert worker is not scheduler.connector  # the two halves
    p = worker.endpoint
    free_start = block_pool.get_num_free_blocks()
    send({"info": p.endpoint.info().blob().hex(), "free_start": free_start})
    for blob in receive()["peers"]:
        p.call("connect_peer", EndpointInfo.from_blob(bytes.fromhex(blob)))
    send({"connected": True})
    job = receive()
    # vLLM's own greedy streams, the oracle: no kv_transfer_params, so the
    # connector leaves these requests alone
    oracle = run_greedy(engine, {str(i): p for i, p in enumerate(job["prompts"])}, K_TOKENS)
    want = {k: [t for s in steps for t in s] for k, steps in oracle.items()}
    assert engine.reset_prefix_cache()  # cold prompts: each prefill takes its chunks
    ZERO_IDS.update(r["request_id"] for r in job["requests"] if r["zero"])
    params = {
        str(r["request_id"]): {
            "pddnet": {
                "request_id": r["request_id"],
                "max_tokens": K_TOKENS,
                "sink": "user",
                "route": r["route"],
            }
        }
        for r in job["requests"]
    }
    prompts = {str(r["request_id"]): job["prompts"][r["prompt"]] for r in job["requests"]}
    firsts = run_greedy(engine, prompts, 1, kv_transfer_params=params)
    held = block_pool.get_num_free_blocks()
    steps, deadline = 0, time.monotonic() + 120
    while scheduler.has_requests():  # held requests: step until pddnet releases them
        engine.step()
        steps += 1
        if time.monotonic() > deadline:
            raise RuntimeError(f"P's blocks were not released: {worker.statistics()}")
    send(
        {
            "oracle": want,
            "firsts": {k: v[0][0] for k, v in firsts.items()},
            "free": {"start": free_start, "held": held, "end": block_pool.get_num_free_blocks()},
            "scheduler": scheduler.connector.statistics().__repr__(),
            "worker": worker.statistics().__repr__(),
            "steps_until_released": steps,
            "marks": {str(rid): len(t) for rid, t in MARKS.items()},
            "chunks": {str(rid): n for rid, n in CHUNKS.items()},
            "marked_before_finished": {
                str(rid): max(t) < FINISHED[rid] for rid, t in MARKS.items()
            },
            "stats": {
                "streamed": scheduler.connector.statistics().streamed,
                "layers_marked": worker.statistics().layers_marked,
                "layers_unreported": worker.statistics().layers_unreported,
            },
        }
    )
    receive()  # the test is done with P's endpoint
    p.close()


# -------------------------------------------------------------------- the test
def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    lens = [*K_PROMPT_LENS, 90, 90]  # the last two are zeroed in flight, one per route
    return [[int(t) for t in rng.integers(2, 512, size=n)] for n in lens]


@pytest.mark.slow  # a vLLM engine process: ~20-60 s on 2 cores
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
async def test_vllm_prefill_feeds_pddnet_decoders(tmp_path: Path, layerwise: bool) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    import trio

    from pddnet import KVLayout, KVPool
    from pddnet.api import (
        Abort,
        Emitted,
        EndpointInfo,
        MainEndpoint,
        ReferenceEngine,
        RelayEndpoint,
    )
    from pddnet.control import ControlNode
    from pddnet.integrations.vllm import build_tiny_llama, reference_config, vllm_cpu_layout
    from pddnet.recompute import BlockAllocator, ReferenceModel, Weights

    sys.path.insert(0, str(Path(__file__).parent))
    from test_api_endpoints import Sink

    model = build_tiny_llama(tmp_path / "model")
    config = reference_config(model)
    weights = Weights.load(config, model / "model.safetensors")
    # vLLM CPU's (vec ISA): per head K as [head_dim, 32], then V as [32, head_dim]
    layout = vllm_cpu_layout(config.num_layers, config.num_kv_heads, config.head_dim, fused=False)

    def decoder_model() -> ReferenceModel:
        pool = KVPool.allocate(layout, K_DECODER_BLOCKS, fill=0xFF)
        return ReferenceModel(config, weights, pool, allocator=BlockAllocator(K_DECODER_BLOCKS))

    to_child, from_test = os.pipe()
    from_child, to_test = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, __file__, str(model), str(to_child), str(to_test), str(int(layerwise))],
        pass_fds=(to_child, to_test),
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "p.log", "w"),  # noqa: SIM115 - the child's whole life
    )
    os.close(to_child)
    os.close(to_test)
    inbox, outbox = os.fdopen(from_child, "r"), os.fdopen(from_test, "w")

    async def receive() -> Any:
        line = await trio.to_thread.run_sync(inbox.readline)
        if not line:
            raise AssertionError(f"P died: {(tmp_path / 'p.log').read_text()[-4000:]}")
        return json.loads(line)

    def send(obj: dict[str, Any]) -> None:
        outbox.write(json.dumps(obj) + "\n")
        outbox.flush()

    prompts = _prompts()
    routes = ("P_MD", "P_RLD_MD")
    requests: list[dict[str, Any]] = [
        {"request_id": 10 * i + j, "prompt": i, "route": route, "zero": i >= len(K_PROMPT_LENS)}
        for i in range(len(prompts))
        for j, route in enumerate(routes)
        if i < len(K_PROMPT_LENS) or j == i - len(K_PROMPT_LENS)
    ]
    rm, mm = decoder_model(), decoder_model()
    sink = Sink()
    try:
        async with (
            ControlNode("user", secret=K_SECRET) as user,
            RelayEndpoint(
                "rld", rm.pool, ReferenceEngine(rm), secret=K_SECRET, model_id=K_MODEL_ID
            ) as rld,
            MainEndpoint(
                "md", mm.pool, ReferenceEngine(mm), secret=K_SECRET, model_id=K_MODEL_ID
            ) as md,
        ):
            user.route(Emitted, sink.on_emit)
            user.route(Abort, sink.on_abort)
            with trio.fail_after(300):
                hello = await receive()
                p_info = EndpointInfo.from_blob(bytes.fromhex(hello["info"]))
                assert p_info.layout == KVLayout(**{**layout.to_dict(), "fused": True})
                send({"peers": [rld.info().blob().hex(), md.info().blob().hex()]})
                assert (await receive())["connected"]
                for ep in (rld, md):
                    await ep.connect_peer(p_info)
                    await ep.node.connect(user.name, user.address)
                await rld.connect_peer(md.info())
                await md.connect_peer(rld.info())
                send({"prompts": prompts, "requests": requests})
                report = await receive()
                while len(sink.ended) < len(requests):
                    await trio.sleep(0.05)
            send({"bye": True})
            oracle, firsts = report["oracle"], report["firsts"]
            for r in requests:
                rid, want = r["request_id"], oracle[str(r["prompt"])]
                assert sink.ended[rid] == "finished", (r, sink.ended[rid])
                got = sink.tokens[rid]
                assert sorted(got) == list(range(K_TOKENS)), r  # every position once
                stream = [got[k][0] for k in range(K_TOKENS)]
                assert stream[0] == firsts[str(rid)] == want[0]
                if r["zero"]:
                    assert stream != want, r  # the decoders read P's KV
                else:
                    assert stream == want, (r, stream, want)
            stats = report["stats"]
            if layerwise:  # every layer of every request went out from save_kv_layer
                assert stats["streamed"] == len(requests), stats
                assert report["marks"] == {
                    str(r["request_id"]): config.num_layers for r in requests
                }, report["marks"]
                assert all(report["marked_before_finished"].values()), report
                assert stats["layers_marked"] == config.num_layers * len(requests), stats
                assert stats["layers_unreported"] == 0, stats
                for i, prompt in enumerate(prompts):
                    # the first request of a prompt takes ceil(len / K_CHUNK)
                    # steps at least (a second one may hit P's prefix cache)
                    chunks = max(
                        report["chunks"][str(r["request_id"])] for r in requests if r["prompt"] == i
                    )
                    assert chunks >= -(-len(prompt) // K_CHUNK), (i, len(prompt), chunks)
            else:
                assert stats["streamed"] == 0 and report["marks"] == {}, report
            free = report["free"]
            assert free["held"] < free["start"] and free["end"] == free["start"], free
            with trio.fail_after(10):
                while rld.statistics().active or md.statistics().active:
                    await trio.sleep(0.05)
            assert rld.statistics().free_blocks == K_DECODER_BLOCKS
            assert md.statistics().free_blocks == K_DECODER_BLOCKS - len(md.cache)
            print(report["scheduler"], report["worker"], report["steps_until_released"])
    finally:
        outbox.close()
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, (tmp_path / "p.log").read_text()[-4000:]


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
