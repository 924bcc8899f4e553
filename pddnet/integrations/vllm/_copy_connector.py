"""A first, minimal vLLM 0.32 KV connector: prompt KV copied between instances through files.

This is the first step of pddnet's vLLM connector, not the connector itself. It
proves the parts of vLLM's ``KVConnectorBase_V1`` contract that the real one
relies on (docs/vllm.md): which hooks run when, where the block ids of a
request come from on each side, and that KV bytes written into another
instance's paged cache in ``start_load_kv`` are what its attention reads. The
transport is a directory; pddnet's local and WAN paths replace it later.

Roles, from ``KVTransferConfig.kv_role``:

* ``kv_producer`` (P): after the forward pass that completes a request's prompt,
  ``wait_for_save`` writes the prompt's whole blocks, every layer, to
  ``<dir>/<key>.npy`` (an array ``[layers, blocks, *block_shape]``). With
  ``"pddnet_hold": True`` the finished request keeps its blocks
  (``request_finished`` returns True) until ``<dir>/<key>.release`` exists,
  when ``get_finished`` reports it sent and vLLM frees them: a stand-in for
  pddnet telling P that its receivers are done with the blocks.
* ``kv_consumer`` (RLD / MD): a request whose ``kv_transfer_params`` carry
  ``pddnet_key`` and ``pddnet_tokens`` reports that many tokens as externally
  computed, and ``start_load_kv`` copies the file's blocks into the blocks vLLM
  allocated for them. MD passes prompt + eager tokens as the prompt and only
  the prompt's KV: vLLM computes the rest, which is MD's recompute.

  - Synchronous (the default): the load runs before the forward pass that
    computes the rest; at most all but the last token of the request count,
    since vLLM must compute one to sample from.
  - Asynchronous (``"pddnet_async": True``, the path pddnet's receivers will
    take): the request waits in ``WAITING_FOR_REMOTE_KVS`` until ``get_finished``
    reports it received; every token may count, and vLLM recomputes the last
    one itself when the load covers the whole request.

Requests name their KV with ``SamplingParams(extra_args={"kv_transfer_params":
{"pddnet_key": ..., "pddnet_tokens": ...}})``; vLLM's own request ids get a
random suffix, so they cannot be the key.

vLLM creates one scheduler-side and one worker-side instance of this class; the
worker-side one is a process-wide singleton (``kv_transfer_state``), so each
engine that uses a connector needs an OS process of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import LocalProtocolError
from ..._optional import require
from ._kv import layer_index

__all__ = ["FileCopyConnector"]

# Bound to Any on purpose: vLLM is an optional extra, and typing this module
# against it would make mypy need vLLM wherever pddnet is checked.
_v1: Any = require("vllm.distributed.kv_transfer.kv_connector.v1.base")
_torch: Any = require("torch")


@dataclass(frozen=True, slots=True)
class _Transfer:
    key: str
    block_ids: tuple[int, ...]
    request_id: str  # vLLM's (internal) id
    report: bool  # owed a get_finished report: an async load once done, a held save once released


@dataclass(slots=True)
class _Meta(_v1.KVConnectorMetadata):
    saves: list[_Transfer] = field(default_factory=list)
    loads: list[_Transfer] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Params:
    key: str
    tokens: int
    is_async: bool
    hold: bool


def _params(request: Any) -> _Params | None:
    params = request.kv_transfer_params or {}
    if "pddnet_key" not in params:
        return None
    return _Params(
        str(params["pddnet_key"]),
        int(params.get("pddnet_tokens", 0)),
        bool(params.get("pddnet_async", False)),
        bool(params.get("pddnet_hold", False)),
    )


class FileCopyConnector(_v1.KVConnectorBase_V1):
    """Copies a request's prompt KV blocks through a directory (prototype).

    Configure with ``KVTransferConfig(kv_connector="FileCopyConnector",
    kv_connector_module_path="pddnet.integrations.vllm._copy_connector",
    kv_role="kv_producer" | "kv_consumer", kv_connector_extra_config={"dir": ...})``.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        self._dir = Path(cfg.kv_connector_extra_config["dir"])
        self._producer = bool(cfg.is_kv_producer)
        self._block_size = int(vllm_config.cache_config.block_size)
        # scheduler side
        self._to_save: dict[str, _Params] = {}  # vLLM request id -> its params
        self._to_load: list[_Transfer] = []
        # worker side
        self._layers: list[Any] = []
        self._received: set[str] = set()  # asynchronous loads done, not yet reported
        self._held: dict[str, str] = {}  # held request id -> key, until released
        self._finished: set[str] = set()  # held requests vLLM has finished

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The prompt tokens whose KV the file holds, beyond ``num_computed_tokens``."""
        found = _params(request)
        if self._producer or found is None:
            return 0, False
        if num_computed_tokens:
            # The real connector loads past a local hit, into the blocks vLLM has
            # no hash for (KVCacheBlocks.get_unhashed_block_ids): MD's DRC delta.
            raise LocalProtocolError(
                "FileCopyConnector loads from a request's first block: turn prefix caching off",
                request_id=request.request_id,
            )
        # A synchronous load must leave at least one token for vLLM to compute
        # (the scheduler asserts it); after an asynchronous one vLLM backs off
        # one token itself (Scheduler._update_waiting_for_remote_kv).
        limit = request.num_tokens if found.is_async else request.num_tokens - 1
        count = max(min(found.tokens, limit) - num_computed_tokens, 0)
        return count, found.is_async and count > 0

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """The load fills the request's own blocks in every group: skip their zeroing."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Note the blocks a load fills (consumer) or a request to save (producer)."""
        found = _params(request)
        if found is None:
            return
        if self._producer:
            self._to_save[request.request_id] = found
        elif num_external_tokens > 0:
            ids = blocks.get_block_ids()[0][: math.ceil(num_external_tokens / self._block_size)]
            self._to_load.append(
                _Transfer(found.key, tuple(int(b) for b in ids), request.request_id, found.is_async)
            )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's loads, and the saves of prompts that this step completes."""
        meta = _Meta(loads=self._to_load)
        self._to_load = []
        for req in scheduler_output.scheduled_new_reqs:
            found = self._to_save.pop(req.req_id, None)
            if found is None:
                continue
            scheduled = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.req_id]
            if scheduled < len(req.prompt_token_ids):
                raise LocalProtocolError(
                    "FileCopyConnector needs the whole prompt in one step (chunked prefill)",
                    request_id=req.req_id,
                )
            blocks = math.ceil(len(req.prompt_token_ids) / self._block_size)
            ids = tuple(req.block_ids[0][:blocks])
            meta.saves.append(_Transfer(found.key, ids, req.req_id, found.hold))
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold a producer's blocks if the request asked to; otherwise free them now."""
        self._to_save.pop(request.request_id, None)
        found = _params(request)
        if self._producer and found is not None and found.hold:
            return True, {"pddnet_key": found.key, "pddnet_held_blocks": len(block_ids)}
        return False, None

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Keep the per-layer cache tensors, in layer order."""
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=layer_index)]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Copy each pending load's blocks from its file into the paged cache."""
        meta = self._get_connector_metadata()
        for t in meta.loads:
            data = np.load(self._dir / f"{t.key}.npy")
            ids = _torch.tensor(t.block_ids, dtype=_torch.long)
            for layer, saved in zip(self._layers, data, strict=True):
                layer[ids] = _torch.from_numpy(saved[: len(t.block_ids)])
            if t.report:
                self._received.add(t.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv`; nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves happen once per step, in :meth:`wait_for_save`."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report held requests now released, and asynchronous loads done since the last call.

        vLLM accepts a finished send only for a request it has named in
        ``finished_req_ids``, in this call or an earlier one.
        """
        self._finished |= finished_req_ids & self._held.keys()
        sent = {r for r in self._finished if (self._dir / f"{self._held[r]}.release").exists()}
        for r in sent:
            del self._held[r]
        self._finished -= sent
        done, self._received = self._received, set()
        return sent or None, done or None

    def wait_for_save(self) -> None:
        """Write the blocks of every prompt completed in this step's forward pass."""
        meta = self._get_connector_metadata()
        for t in meta.saves:
            ids = _torch.tensor(t.block_ids, dtype=_torch.long)
            data = np.stack([layer[ids].numpy() for layer in self._layers])
            np.save(self._dir / f"{t.key}.npy", data)
            if t.report:
                self._held[t.request_id] = t.key
