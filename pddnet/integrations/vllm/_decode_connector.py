"""RLD's and MD's vLLM 0.32 KV connector: load the KV pddnet landed into vLLM's blocks.

pddnet's receivers land a request's prompt KV in a *staging* pool, a
:class:`~pddnet.kv.KVPool` of vLLM's own layout that pddnet allocates from
(:class:`~pddnet.integrations.vllm.VllmDecodeEngine`); vLLM's paged cache
stays vLLM's. The engine then adds a vLLM request whose prompt is the
request's tokens so far and names the staged KV in ``SamplingParams(
extra_args={"kv_transfer_params": {"pddnet": {"blocks": [...], "tokens": n}}})``:
the first ``n`` tokens' KV is in those staged blocks.

1. Scheduler side, ``get_num_new_matched_tokens``: the staged tokens beyond
   vLLM's own block-aligned prefix-cache hit are externally matched, at most
   all but the last token of the request (vLLM computes one to sample from;
   the scheduler asserts it). A synchronous load: no waiting state.
2. ``update_state_after_alloc``: the blocks vLLM allocated for them, matched
   to the staged blocks by position (block ``j`` holds tokens ``[32j, 32j+32)``
   on both sides), go to the worker side in ``build_connector_meta``.
3. Worker side, ``start_load_kv`` (before the step's forward pass, as vLLM
   runs synchronous loads): copy them with a ``BlockCopier`` (``copy_blocks``
   between the two pools, checked once in ``register_kv_caches``; fused pools: one
   assignment over all layers per run of consecutive source blocks, an index
   array for scattered destinations). vLLM's forward pass then computes every
   token past the load (MD's recompute of RLD's eager tokens is that extend),
   overwriting the tail slots of the last loaded block with the same values.

The staging pool is a file-backed mapping (``extra_config["staging_path"]``,
``staging_blocks`` blocks) that the worker side creates in
``register_kv_caches`` with the layout of vLLM's cache, and writes that
layout beside it (``<path>.json``); the engine maps the same file. So the two
halves and the engine share only the documented channels and that file, which
would also work with vLLM's engine core in another process.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import LocalProtocolError
from ..._optional import require
from ...kv import KVLayout, KVPool
from ._kv import kv_pool_from_vllm
from ._staging import BlockCopier, open_staging

__all__ = ["DecodeConnectorStatistics", "DecodeKVConnector"]

# Bound to Any on purpose: vLLM is an optional extra (see _copy_connector).
_v1: Any = require("vllm.distributed.kv_transfer.kv_connector.v1.base")


@dataclass(frozen=True, slots=True)
class _Load:
    vllm_id: str
    src: tuple[int, ...]  # staged blocks
    dst: tuple[int, ...]  # vLLM's blocks, the same positions


@dataclass(slots=True)
class _Meta(_v1.KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecodeConnectorStatistics:
    """Counters of the worker side of :class:`DecodeKVConnector`.

    ``loads`` requests loaded, ``blocks`` and ``bytes`` copied into vLLM's
    cache, ``load_s`` the time spent copying (``start_load_kv``), and
    ``largest_load_bytes``.
    """

    loads: int = 0
    blocks: int = 0
    bytes: int = 0
    load_s: float = 0.0
    largest_load_bytes: int = 0


class DecodeKVConnector(_v1.KVConnectorBase_V1):
    """pddnet's RLD / MD role as a vLLM KV connector (``kv_role="kv_consumer"``).

    Configure with ``KVTransferConfig(kv_connector="DecodeKVConnector",
    kv_connector_module_path="pddnet.integrations.vllm.connectors",
    kv_role="kv_consumer", kv_connector_extra_config={"staging_path": ...,
    "staging_blocks": ...})``; :class:`VllmDecodeEngine` does.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        if not cfg.is_kv_consumer or cfg.is_kv_producer:
            raise LocalProtocolError(f"DecodeKVConnector loads only: kv_role {cfg.kv_role!r}")
        extra = dict(cfg.kv_connector_extra_config)
        self._path = str(extra["staging_path"])
        self._staging_blocks = int(extra["staging_blocks"])
        self._block_size = int(vllm_config.cache_config.block_size)
        # scheduler side
        self._hits: dict[str, int] = {}  # vLLM id -> the local hit it was asked about
        self._loads: list[_Load] = []
        # worker side
        self.staging: KVPool | None = None
        self.cache: KVPool | None = None
        self._copy: BlockCopier | None = None
        self._stats: dict[str, Any] = dict.fromkeys(DecodeConnectorStatistics.__slots__, 0)

    def statistics(self) -> DecodeConnectorStatistics:
        return DecodeConnectorStatistics(**self._stats)

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The staged tokens past vLLM's own (block-aligned) hit, all but the last at most."""
        params = (request.kv_transfer_params or {}).get("pddnet")
        if params is None:
            return 0, False
        # remembered (not a side effect on vLLM): update_state_after_alloc
        # needs where the load starts, and request.num_computed_tokens is set
        # only after it
        self._hits[request.request_id] = num_computed_tokens
        staged = min(int(params["tokens"]), request.num_tokens - 1)
        return max(staged - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Match the blocks vLLM allocated for the load to the staged ones, by position."""
        start = self._hits.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params["pddnet"]
        if start % self._block_size:
            raise LocalProtocolError(
                f"a load starting at token {start}, inside a block", request_id=request.request_id
            )
        first = start // self._block_size
        last = math.ceil((start + num_external_tokens) / self._block_size)
        dst = blocks.get_block_ids()[0][first:last]
        src = params["blocks"][first:last]
        if len(src) != last - first or len(dst) != last - first:
            raise LocalProtocolError(
                f"load of blocks {first}..{last - 1}: {len(src)} staged, {len(dst)} in vLLM",
                request_id=request.request_id,
            )
        self._loads.append(
            _Load(request.request_id, tuple(int(b) for b in src), tuple(int(b) for b in dst))
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's loads, for the worker side."""
        meta = _Meta(self._loads)
        self._loads = []
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A decoder keeps nothing: vLLM frees (or caches) the blocks at once."""
        self._hits.pop(request.request_id, None)
        return False, None

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Wrap vLLM's cache and create the staging pool of its layout."""
        self.cache = kv_pool_from_vllm(kv_caches)
        layout = KVLayout(**{**self.cache.layout.to_dict(), "fused": True})
        shape = layout.buffer_shape(self._staging_blocks)
        np.memmap(self._path, dtype=layout.np_dtype, mode="w+", shape=shape).flush()
        Path(f"{self._path}.json").write_text(
            json.dumps({"layout": layout.to_dict(), "num_blocks": self._staging_blocks})
        )
        self.staging = open_staging(self._path)
        self._copy = BlockCopier(self.staging, self.cache)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Copy each of this step's loads from the staging pool into vLLM's blocks."""
        loads = self._get_connector_metadata().loads
        if not loads:
            return
        if self._copy is None:
            raise LocalProtocolError("DecodeKVConnector: no KV cache was registered")
        for load in loads:
            started = time.perf_counter()
            n = self._copy(load.src, load.dst)
            s = self._stats
            s["load_s"] += time.perf_counter() - started
            s["loads"] += 1
            s["blocks"] += len(load.src)
            s["bytes"] += n
            s["largest_load_bytes"] = max(s["largest_load_bytes"], n)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv`."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """A decoder saves nothing."""

    def wait_for_save(self) -> None:
        """A decoder saves nothing."""
