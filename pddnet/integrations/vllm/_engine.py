"""Running vLLM 0.32 on a CPU from pddnet's own code: settings and a greedy step loop.

vLLM reads its environment lazily, so :func:`apply_cpu_env` works as long as it
runs before the engine is built. With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the
engine core (scheduler, worker and KV connector) lives in the calling process,
which is what pddnet's roles want: one OS process per role, its connector beside
the scheduler. docs/vllm.md explains each setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._errors import LocalProtocolError
from ..._optional import require

__all__ = ["K_CPU_BLOCK_SIZE", "K_CPU_ENV", "apply_cpu_env", "cpu_engine_kwargs", "run_greedy"]

# vLLM's CPU attention asks for block sizes that are a multiple of 32
# (CPUAttentionBackend.get_supported_kernel_block_sizes, v1/attention/backends/cpu_attn.py).
K_CPU_BLOCK_SIZE = 32

K_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "HF_HUB_OFFLINE": "1",  # no model hub is reachable
}


def apply_cpu_env(env: Mapping[str, str] = K_CPU_ENV) -> None:
    """Set vLLM's environment for an in-process CPU engine (values already set win)."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


def cpu_engine_kwargs(model: str | Path, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` that run ``model`` on a CPU.

    float32 and eager mode keep runs reproducible and start-up short; greedy
    streams then do not depend on batching. ``overrides`` replace any default.
    """
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": K_CPU_BLOCK_SIZE,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "seed": 0,
        "disable_log_stats": True,
    }
    kwargs.update(overrides)
    return kwargs


def run_greedy(
    engine: Any,
    prompts: Mapping[str, Sequence[int]],
    max_tokens: int,
    *,
    kv_transfer_params: Mapping[str, Mapping[str, Any]] | None = None,
    max_steps: int = 10_000,
) -> dict[str, list[list[int]]]:
    """Drive ``engine`` (a ``vllm.LLMEngine``) step by step, greedily, until all finish.

    Args:
        engine: the engine; no other request may be in flight.
        prompts: request id -> prompt token ids.
        max_tokens: tokens to generate per request (EOS is ignored).
        kv_transfer_params: request id -> the ``kv_transfer_params`` its KV
            connector reads (``request.kv_transfer_params`` on the scheduler side).
        max_steps: bound on ``engine.step()`` calls.

    Returns:
        Request id -> the new tokens of each step that produced any, in order; the
        flattened lists are the generated streams.

    Raises:
        LocalProtocolError: if the requests do not finish within ``max_steps``.
    """
    vllm = require("vllm")
    kind = require("vllm.sampling_params").RequestOutputKind.DELTA
    kv = kv_transfer_params or {}
    steps: dict[str, list[list[int]]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        params = vllm.SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            output_kind=kind,
            extra_args={"kv_transfer_params": dict(kv[rid])} if rid in kv else None,
        )
        engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return steps
        for out in engine.step():
            new = list(out.outputs[0].token_ids)
            if new:
                steps[out.request_id].append(new)
    raise LocalProtocolError(f"vLLM did not finish {sorted(prompts)} in {max_steps} steps")
