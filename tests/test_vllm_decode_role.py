"""RLD and MD as real vLLM instances: VllmDecodeEngine behind pddnet's endpoints.

RLD and MD each run in a child process of their own (tests/vllm_roles.py):
a :class:`~pddnet.integrations.vllm.VllmDecodeEngine` over the tiny
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
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from vllm_roles import (
    K_MODEL_ID,
    K_SECRET,
    K_STAGING,
    Child,
    finish_children,
    p_model,
    start_children,
)

K_TOKENS = 40  # the user's stream, P's first token included
K_PROMPT_LENS = (1, 64, 100, 200)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    lens = [*K_PROMPT_LENS, 90, 90]  # the last two are zeroed in flight, one per route
    return [[int(t) for t in rng.integers(2, 512, size=n)] for n in lens]


@pytest.mark.slow  # two vLLM engine processes: ~30-90 s on 2 cores
async def test_vllm_decoders_stream_vllm_greedy(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    import trio
    from test_api_endpoints import Sink

    from pddnet.api import Abort, Emitted, EndpointInfo, PrefillEndpoint
    from pddnet.control import ControlNode
    from pddnet.integrations.vllm import build_tiny_llama
    from pddnet.recompute import greedy
    from pddnet.route import Route

    model = build_tiny_llama(tmp_path / "model")
    pm = p_model(model)
    layout = pm.pool.layout
    prompts = _prompts()
    requests = [
        (10 * i + j, i, route, i >= len(K_PROMPT_LENS))
        for i in range(len(prompts))
        for j, route in enumerate((Route.P_MD, Route.P_RLD_MD))
        if i < len(K_PROMPT_LENS) or j == i - len(K_PROMPT_LENS)
    ]
    children = {r: Child(r, model, tmp_path / f"{r}.log") for r in ("rld", "md")}
    sink = Sink()
    try:
        async with (
            ControlNode("user", secret=K_SECRET) as user,
            PrefillEndpoint("p", pm.pool, secret=K_SECRET, model_id=K_MODEL_ID) as p,
        ):
            user.route(Emitted, sink.on_emit)
            user.route(Abort, sink.on_abort)
            with trio.fail_after(300):
                job = {"prompts": prompts, "tokens": K_TOKENS}
                hello = await start_children(children, p, user, job)
                info = EndpointInfo.from_blob(bytes.fromhex(hello["md"]["info"]))
                assert info.layout == layout
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
                reports = await finish_children(children)
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
            # RLD decodes (and so loads KV into vLLM) only where MD has not taken
            # over first; on loopback MD may win every race. MD serves P_MD itself.
            rld_emitted = sum(
                peer == "rld" for got in sink.tokens.values() for _, peer in got.values()
            )
            for r, decoded in ((rld, rld_emitted > 0), (md, True)):
                start, end = r["vllm_free"]
                assert start == end, r
                if decoded:
                    assert r["loads"][0] > 0, r  # the connector loaded KV into vLLM's blocks
            print(json.dumps(reports, indent=1))
    finally:
        for c in children.values():
            c.close()
    for r, c in children.items():
        assert c.proc.returncode == 0, (r, c.log.read_text()[-4000:])
