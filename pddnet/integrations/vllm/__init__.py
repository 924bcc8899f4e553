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
  and drive an in-process vLLM engine on a CPU, step by step;
* :class:`VllmDecodeEngine` is pddnet's decode contract (RLD or MD) over an
  in-process vLLM engine, whose :class:`DecodeKVConnector` loads the KV pddnet
  landed into vLLM's blocks (:func:`copy_blocks`).

* :class:`PrefillConnectorConfig` reads and checks P's connector's
  ``kv_connector_extra_config`` (router, link estimate, WAN options, deadline).

The connectors themselves (:mod:`pddnet.integrations.vllm.connectors`:
``PrefillKVConnector``, ``DecodeKVConnector``) import vLLM, so they are not
imported here; vLLM loads them by module path,
``kv_connector_module_path="pddnet.integrations.vllm.connectors"``.

docs/vllm.md describes vLLM's KV connector interface and how pddnet's roles map
onto it.
"""

from ._decode_engine import K_STAGING_BLOCKS, VllmDecodeEngine, VllmEngineError
from ._engine import K_CPU_BLOCK_SIZE, K_CPU_ENV, apply_cpu_env, cpu_engine_kwargs, run_greedy
from ._kv import K_VLLM_CPU_INTERIOR, kv_pool_from_vllm, layer_index, vllm_cpu_layout
from ._prefill_config import PrefillConnectorConfig
from ._staging import copy_blocks, open_staging
from ._tiny import K_TINY_SEED, build_tiny_llama, reference_config, tail_period

__all__ = [
    "K_CPU_BLOCK_SIZE",
    "K_CPU_ENV",
    "K_STAGING_BLOCKS",
    "K_TINY_SEED",
    "K_VLLM_CPU_INTERIOR",
    "PrefillConnectorConfig",
    "VllmDecodeEngine",
    "VllmEngineError",
    "apply_cpu_env",
    "build_tiny_llama",
    "copy_blocks",
    "cpu_engine_kwargs",
    "kv_pool_from_vllm",
    "layer_index",
    "vllm_cpu_layout",
    "open_staging",
    "reference_config",
    "run_greedy",
    "tail_period",
]
