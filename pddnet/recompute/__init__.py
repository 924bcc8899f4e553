"""Eager-token recompute: a reference Llama-style model over a paged KV cache.

MD rebuilds the KV of RLD's eager tokens from their ids with one multi-token
forward pass (an *extend*). This package provides that step for engines that
lack one, and for the demo and benchmarks:

* :class:`ModelConfig` (:data:`TINY` for tests and the demo,
  :data:`MISTRAL_7B_LIKE` for GPU benchmarks) and :class:`Weights` (seeded, or
  loaded from ``.npz`` / ``.safetensors``);
* :class:`ReferenceModel` with ``prefill``, ``decode_step`` and ``extend`` on
  :class:`PagedSequence` block tables over a :class:`~pddnet.kv.KVPool`;
* kernels: a float32 NumPy path and CuPy RawKernels (paged KV write, extend
  attention, RoPE, RMSNorm) with identical signatures, chosen by
  :func:`kernels_for`;
* :class:`Recomputer`, the engine hook, whose contract is in
  :mod:`pddnet.recompute._recomputer` and docs/kernels.md.

Example::

    model = ReferenceModel.create(TINY, num_blocks=256)
    seq = model.new_sequence()
    token = greedy(model.prefill(seq, prompt_ids))
"""

from ._config import MISTRAL_7B_LIKE, TINY, ModelConfig
from ._model import BlockAllocator, PagedSequence, ReferenceModel, greedy
from ._ops import array_module, kernels_for
from ._recomputer import ModelRecomputer, Recomputer
from ._threads import limit_blas_threads
from ._weights import LayerWeights, Weights

__all__ = [
    "MISTRAL_7B_LIKE",
    "TINY",
    "BlockAllocator",
    "LayerWeights",
    "ModelConfig",
    "ModelRecomputer",
    "PagedSequence",
    "Recomputer",
    "ReferenceModel",
    "Weights",
    "array_module",
    "greedy",
    "kernels_for",
    "limit_blas_threads",
]
