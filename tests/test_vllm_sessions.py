"""Sessions and catch-up with RLD and MD as real vLLM instances.

The decoders are vLLM child processes behind pddnet's endpoints
(tests/vllm_roles.py); the test process runs P (the reference model on the
same tiny checkpoint) and the user's sink. One pair of children serves, one
request at a time:

* a two-turn session on P->MD: turn 2's prompt is turn 1's prompt, turn 1's
  answer and new tokens. Turn 2 hits MD's prefix cache (``hit_blocks > 0``)
  and P ships fewer WAN blocks and bytes for it than for a cold request of
  the same length, served just before it. MD's vLLM prefix cache is reset
  before turn 2 (else vLLM itself would serve turn 2's prefix), so turn 2's
  stream shows that the blocks pddnet's cache kept are the ones vLLM read;
* a P->RLD->MD request whose KV P holds back from MD until RLD has emitted
  ``K_EAGER`` tokens: with RLD's ``catchup_threshold`` below that, RLD hands
  over in at least 2 rounds.

Every stream equals MD's vLLM's own greedy output for its prompt (computed in
the MD child before serving, its prefix cache reset afterwards).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_api_endpoints import Sink
from vllm_roles import K_MODEL_ID, K_SECRET, Child, finish_children, p_model, start_children

K_TOKENS = 48  # each stream, P's first token included
K_TURN1, K_NEW = 150, 20  # turn 1's prompt, turn 2's new tokens
K_EAGER = 16  # tokens RLD emits before MD's KV leaves P
# catch-up from K_EAGER pending tokens, the final switch at 8: with a small
# RTT estimate RLD predicts convergence for any decode rate below ~800 tokens/s
K_PARAMS = {"catchup_threshold": 8, "final_switch_size": 8, "min_batch": 4, "rtt_s": 0.001}


@pytest.mark.slow  # two vLLM engine processes: ~30-90 s on 2 cores
async def test_vllm_session_hits_md_cache_and_a_handoff_catches_up(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    import trio

    from pddnet.api import Abort, Emitted, PrefillEndpoint, Submission
    from pddnet.control import ControlNode
    from pddnet.integrations.vllm import build_tiny_llama
    from pddnet.recompute import greedy
    from pddnet.route import Route

    model = build_tiny_llama(tmp_path / "model")
    pm = p_model(model)
    layout = pm.pool.layout
    rng = np.random.default_rng(5)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(2, 512, size=n)]

    # turn 1's answer, from P's reference model (checked against the stream below)
    turn1 = tokens(K_TURN1)
    seq = pm.new_sequence()
    pm.reserve(seq, K_TURN1 + K_TOKENS)
    answer = [greedy(pm.prefill(seq, turn1))]
    while len(answer) < K_TOKENS:
        answer.append(greedy(pm.extend(seq, answer[-1:])))
    pm.release(seq)
    turn2 = turn1 + answer + tokens(K_NEW)
    prompts = {"turn1": turn1, "cold": tokens(len(turn2)), "turn2": turn2, "catchup": tokens(90)}
    index = {name: str(i) for i, name in enumerate(prompts)}
    children = {r: Child(r, model, tmp_path / f"{r}.log") for r in ("rld", "md")}
    sink = Sink()
    subs: dict[str, Submission] = {}
    wan_bytes: dict[str, int] = {}
    try:
        async with (
            ControlNode("user", secret=K_SECRET) as user,
            PrefillEndpoint("p", pm.pool, secret=K_SECRET, model_id=K_MODEL_ID) as p,
        ):
            user.route(Emitted, sink.on_emit)
            user.route(Abort, sink.on_abort)

            async def serve(rid: int, name: str, route: Route, eager: int = 0) -> None:
                """One request, alone; with ``eager``, MD's KV waits until RLD
                has emitted that many tokens."""
                prompt = prompts[name]
                seq = pm.new_sequence()
                pm.reserve(seq, len(prompt))
                first = greedy(pm.prefill(seq, prompt))
                before = p.statistics().wan_bytes
                sub = await p.submit(
                    rid, prompt, seq.block_table.tolist(), first, K_TOKENS,
                    sink="user", route=route, ready=not eager,
                )  # fmt: skip
                subs[name] = sub
                wan_bytes[name] = p.statistics().wan_bytes - before
                if eager:
                    for layer in range(layout.num_layers):
                        p.mark_layer_ready(rid, layer, sub.relay)
                    while len(sink.tokens.get(rid, ())) < eager:
                        await trio.sleep(0.005)
                    for layer in range(layout.num_layers):
                        p.mark_layer_ready(rid, layer, sub.main)
                while rid not in sink.ended:
                    await trio.sleep(0.02)
                while p.statistics().held_blocks:  # MD let go of P's blocks
                    await trio.sleep(0.02)
                pm.release(seq)

            async def reset_md() -> int:
                """Reset MD's vLLM prefix cache; the blocks its connector loaded so far."""
                children["md"].send({"reset": True})
                reply = await children["md"].receive()
                assert reply["reset"], reply
                return int(reply["loaded_blocks"])

            with trio.fail_after(300):
                job = {"prompts": list(prompts.values()), "tokens": K_TOKENS, "params": K_PARAMS}
                hello = await start_children(children, p, user, job)
                oracle = hello["md"]["oracle"]
                await serve(1, "turn1", Route.P_MD)
                await serve(2, "cold", Route.P_MD)
                # vLLM's own prefix cache would serve turn 2's prefix: forget
                # it, so that turn 2 reads the blocks pddnet's cache kept
                resets = [await reset_md()]
                await serve(3, "turn2", Route.P_MD)
                resets.append(await reset_md())
                await serve(4, "catchup", Route.P_RLD_MD, eager=K_EAGER)
                reports = await finish_children(children)
            print(json.dumps({"subs": [repr(s) for s in subs.values()], **reports}, indent=1))
            streams = {}
            for rid, name in enumerate(prompts, start=1):
                assert sink.ended[rid] == "finished", (name, sink.ended[rid])
                got = sink.tokens[rid]
                assert sorted(got) == list(range(K_TOKENS)), name  # every position once
                streams[name] = [got[k][0] for k in range(K_TOKENS)]
                assert streams[name] == oracle[index[name]], (name, streams[name])
            assert streams["turn1"] == answer  # turn 2 extends the answer the user saw
            # turn 2 hits MD's cache; P ships only the rest, less than a cold request's
            blocks = layout.blocks_for_tokens(len(turn2))
            cold, warm = subs["cold"], subs["turn2"]
            assert cold.hit_blocks == 0 and cold.sent_blocks_wan == blocks, cold
            assert warm.hit_blocks >= K_TURN1 // layout.block_size, warm
            assert warm.sent_blocks_wan == blocks - warm.hit_blocks, warm
            assert wan_bytes["cold"] == blocks * layout.block_bytes, wan_bytes
            assert wan_bytes["turn2"] == warm.sent_blocks_wan * layout.block_bytes, wan_bytes
            # MD's vLLM loaded all of turn 2's prompt through the connector,
            # the cached blocks included (it had no prefix cache of its own)
            assert resets[1] - resets[0] == blocks, resets
            # RLD handed over in rounds while it kept decoding, and MD finished it
            relay = reports["rld"]["relay"]["4"]
            assert relay["handoff"] == "catch-up" and relay["rounds"] >= 2, relay
            sources = [sink.tokens[4][k][1] for k in range(K_TOKENS)]
            assert sources[:K_EAGER] == ["rld"] * K_EAGER and sources[-1] == "md", sources
    finally:
        for c in children.values():
            c.close()
    for r, c in children.items():
        assert c.proc.returncode == 0, (r, c.log.read_text()[-4000:])
