"""pddnet inside vLLM 0.32 (the ``vllm`` extra).

This package imports without vLLM installed; only what runs an engine needs it.

* :func:`build_tiny_llama` writes a small Llama checkpoint and BPE tokenizer in
  code, so vLLM can load a model with no model hub;
* :func:`reference_config` reads such a checkpoint's config as pddnet's
  reference-model config (the two models' greedy streams agree);
* :func:`tail_period` checks that a greedy token stream has not fallen into a
  short cycle (which would hide off-by-n handoff bugs);
* :func:`kv_pool_from_vllm` wraps vLLM CPU's KV cache tensors as a
  :class:`~pddnet.kv.KVPool` (interior ``"hptd"``), without a copy;
* :func:`apply_cpu_env`, :func:`cpu_engine_kwargs` and :func:`run_greedy` start
  and drive an in-process vLLM engine on a CPU, step by step.

docs/vllm.md describes vLLM's KV connector interface and how pddnet's roles map
onto it.
"""

from ._engine import K_CPU_BLOCK_SIZE, K_CPU_ENV, apply_cpu_env, cpu_engine_kwargs, run_greedy
from ._kv import K_VLLM_CPU_INTERIOR, kv_pool_from_vllm, layer_index
from ._tiny import K_TINY_SEED, build_tiny_llama, reference_config, tail_period

__all__ = [
    "K_CPU_BLOCK_SIZE",
    "K_CPU_ENV",
    "K_TINY_SEED",
    "K_VLLM_CPU_INTERIOR",
    "apply_cpu_env",
    "build_tiny_llama",
    "cpu_engine_kwargs",
    "kv_pool_from_vllm",
    "layer_index",
    "reference_config",
    "run_greedy",
    "tail_period",
]
