"""Prompt KV copied from one vLLM instance into another gives the same greedy tokens.

The first step of pddnet's vLLM connector (``FileCopyConnector``): instance A
(``kv_producer``, the role of P) prefills and decodes alone, saves its prompt's
KV blocks, and holds each finished request's blocks until they are released
(as P will until pddnet's receivers are done); instance B (``kv_consumer``) is
given that KV for:

* the prompt (RLD's case): B's stream must equal A's;
* the prompt plus A's first 12 tokens (MD's case: B computes those 12 itself,
  which is MD's recompute): B must continue with A's token 13 onwards;
* the same prompt with the KV zeroed: B's stream must differ, which shows B's
  attention reads the copied blocks rather than recomputing the prompt;
* the same three through an asynchronous load (``WAITING_FOR_REMOTE_KVS``, the
  path pddnet's receivers will take), where RLD's prompt is P's prompt plus P's
  first token, so vLLM computes that token's KV as a decode step would; and an
  asynchronous load of the whole prompt, after which vLLM recomputes the last
  prompt token itself.

vLLM keeps its worker-side connector in a process-wide global, so each engine
runs in an OS process of its own: this file re-runs itself as the child.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

K_NEW = 48  # tokens A generates
K_EAGER = 12  # tokens MD is given beyond the prompt
K_PROMPT_LENS = (40, 75)  # one ends inside a block, one covers two full blocks and more


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(2, 512, size=n)] for n in K_PROMPT_LENS]


def _child(spec_path: str) -> None:
    """Run one engine: ``spec`` names the role, the KV directory and the requests."""
    spec = json.loads(Path(spec_path).read_text())
    from pddnet.integrations.vllm import apply_cpu_env, cpu_engine_kwargs, run_greedy

    apply_cpu_env()
    import vllm
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector="FileCopyConnector",
        kv_connector_module_path="pddnet.integrations.vllm._copy_connector",
        kv_role=spec["role"],
        kv_connector_extra_config={"dir": spec["dir"]},
    )
    args = cpu_engine_kwargs(spec["model"], kv_transfer_config=kv, enable_prefix_caching=False)
    engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    free = {"start": pool.get_num_free_blocks()}
    steps = run_greedy(engine, spec["prompts"], K_NEW, kv_transfer_params=spec["kv"])
    streams = {rid: [t for s in per_step for t in s] for rid, per_step in steps.items()}
    if spec["role"] == "kv_producer":  # held blocks stay allocated until released
        free["finished"] = pool.get_num_free_blocks()
        for _ in range(3):
            engine.step()
        free["idle"] = pool.get_num_free_blocks()
        for kv in spec["kv"].values():
            (Path(spec["dir"]) / f"{kv['pddnet_key']}.release").touch()
        for _ in range(100):
            if not scheduler.has_requests():
                break
            engine.step()
        free["released"] = pool.get_num_free_blocks()
    Path(spec["out"]).write_text(json.dumps({"streams": streams, "free_blocks": free}))


def _run(tmp: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}))
    proc = subprocess.run(
        [sys.executable, __file__, str(spec_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


@pytest.mark.slow  # two engine processes: 24-70 s on 2 cores
def test_prompt_kv_copied_from_a_gives_a_s_tokens(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    from pddnet.integrations.vllm import build_tiny_llama, tail_period

    model = str(build_tiny_llama(tmp_path / "model"))
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    prompts = {f"p{i}": p for i, p in enumerate(_prompts())}
    a_run = _run(
        tmp_path,
        "a",
        {
            "role": "kv_producer",
            "dir": str(kv_dir),
            "model": model,
            "prompts": prompts,
            "kv": {rid: {"pddnet_key": rid, "pddnet_hold": True} for rid in prompts},
        },
    )
    a: dict[str, list[int]] = a_run["streams"]
    # P's finished requests hold their blocks (prompt and all but the last token)
    # through idle steps, until released; then vLLM frees every one.
    free = a_run["free_blocks"]
    held = sum(-(-(len(p) + K_NEW - 1) // 32) for p in prompts.values())
    assert free["start"] - free["finished"] == held
    assert free["idle"] == free["finished"]
    assert free["released"] == free["start"]
    b_prompts: dict[str, list[int]] = {}
    b_kv: dict[str, dict[str, Any]] = {}
    for rid, p in prompts.items():
        assert len(a[rid]) == K_NEW and tail_period(a[rid]) is None
        saved = np.load(kv_dir / f"{rid}.npy")
        assert saved.shape[:2] == (2, -(-len(p) // 32))  # layers, blocks
        assert np.abs(saved).max() > 0
        np.save(kv_dir / f"zero-{rid}.npy", np.zeros_like(saved))
        for mode in ("sync", "async"):
            is_async = mode == "async"
            first = a[rid][:1] if is_async else []  # RLD's prompt: P's prompt + P's first token
            b_prompts |= {
                f"{mode}-rld-{rid}": p + first,
                f"{mode}-md-{rid}": p + a[rid][:K_EAGER],
                f"{mode}-zero-{rid}": p + first,
            }
            b_kv |= {  # only the prompt's KV: B computes the tokens after it
                f"{mode}-rld-{rid}": _kv(rid, len(p), is_async),
                f"{mode}-md-{rid}": _kv(rid, len(p), is_async),
                f"{mode}-zero-{rid}": _kv(f"zero-{rid}", len(p), is_async),
            }
        # An asynchronous load may cover the whole request: vLLM recomputes its last token.
        b_prompts[f"async-full-{rid}"] = p
        b_kv[f"async-full-{rid}"] = _kv(rid, len(p), True)
    b: dict[str, list[int]] = _run(
        tmp_path,
        "b",
        {
            "role": "kv_consumer",
            "dir": str(kv_dir),
            "model": model,
            "prompts": b_prompts,
            "kv": b_kv,
        },
    )["streams"]
    for rid in prompts:
        assert b[f"sync-rld-{rid}"] == a[rid]
        assert b[f"async-rld-{rid}"][: K_NEW - 1] == a[rid][1:]
        assert b[f"async-full-{rid}"] == a[rid]
        for mode in ("sync", "async"):
            assert b[f"{mode}-md-{rid}"][: K_NEW - K_EAGER] == a[rid][K_EAGER:], mode
            assert b[f"{mode}-zero-{rid}"] != b[f"{mode}-rld-{rid}"], mode


def _kv(key: str, tokens: int, is_async: bool) -> dict[str, Any]:
    return {"pddnet_key": key, "pddnet_tokens": tokens, "pddnet_async": is_async}


def test_block_copier_reused_across_loads_copies_the_right_bytes() -> None:
    """The decoder connector's load (a ``BlockCopier`` built once in
    ``register_kv_caches``, then one call per load), on vLLM CPU's layout:
    every destination block holds its source block's bytes after each load,
    and nothing else changes. No vLLM needed."""
    from pddnet.integrations.vllm import vllm_cpu_layout
    from pddnet.integrations.vllm._staging import BlockCopier
    from pddnet.kv import KVPool

    layout = vllm_cpu_layout(2, 2, 64, "float32")
    rng = np.random.default_rng(5)
    staging, cache = KVPool.allocate(layout, 16), KVPool.allocate(layout, 64)
    staging.buffers[0][...] = rng.standard_normal(staging.buffers[0].shape)
    want = cache.buffers[0].copy()
    copy = BlockCopier(staging, cache)
    loads: list[tuple[Any, Any]] = [
        ((3,), (40,)),  # one block
        ((0, 1, 2, 3), (10, 11, 12, 13)),  # one run both sides
        ((4, 5, 6), (63, 7, 30)),  # scattered destination
        ((9, 2, 10), (1, 2, 3)),  # two source runs
        (np.array([11, 12]), np.array([20, 21], dtype=np.int32)),  # arrays
    ]
    for src, dst in loads:
        assert copy(src, dst) == len(src) * layout.block_bytes
        for s, d in zip(src, dst, strict=True):
            want[:, int(d)] = staging.buffers[0][:, int(s)]
        np.testing.assert_array_equal(cache.buffers[0], want)


if __name__ == "__main__":
    _child(sys.argv[1])
