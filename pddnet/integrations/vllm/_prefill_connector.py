"""P's vLLM 0.32 KV connector: a vLLM instance prefills, pddnet ships the KV.

The driver adds each request with ``max_tokens=1`` (the token vLLM samples is
P's first token) and names it for pddnet in ``SamplingParams(extra_args=
{"kv_transfer_params": {"pddnet": {"request_id": <int>, "max_tokens": <int>,
"sink": <node>, "route": "P_MD" | "P_RLD_MD" | None, "deadline_s": <float>}}})``
(``sink``, ``route`` and ``deadline_s`` optional). vLLM renames its requests
internally, so everything keys on that pddnet id.

1. Scheduler side, ``request_finished``: a request that finished with its
   token names its prompt, first token and blocks in a hand-off and returns
   ``(True, {"pddnet": ...})``: vLLM keeps the blocks allocated.
2. ``build_connector_meta`` carries the step's hand-offs to the worker side
   (the documented scheduler -> worker channel).
3. Worker side: ``register_kv_caches`` wraps vLLM's KV tensors as a
   :class:`~pddnet.kv.KVPool` (:func:`kv_pool_from_vllm`, no copy) and starts
   a :class:`~pddnet.api.PrefillEndpoint` over it on a thread of its own
   (:class:`~pddnet.api.SyncEndpoint`); ``start_load_kv`` submits each hand-off
   to it, which never blocks the step.
4. ``get_finished`` (the worker -> scheduler channel) reports a request in
   ``finished_sending`` once pddnet released its blocks
   (:class:`~pddnet.api.BlocksReleased`) or its submission failed; vLLM frees
   them then. The driver keeps calling ``step()`` until
   ``scheduler.has_requests()`` is false.

The driver reaches the endpoint, to exchange :class:`~pddnet.api.EndpointInfo`
and connect the decoders, through the worker-side instance, a process-wide
singleton (``vllm.distributed.kv_transfer.get_kv_transfer_group()``): that is
the one object shared outside vLLM's channels, and it needs
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (docs/vllm.md).

``kv_connector_extra_config`` (checked when the connector is built,
:class:`~pddnet.integrations.vllm.PrefillConnectorConfig`): ``name`` (node name,
required), ``secret`` (else ``$PDDNET_SECRET``), ``model_id``,
``control_bind``, ``lease_s``, ``timeout``, ``sink`` (the default sink node),
``deadline_s`` (each request's, for ``submit``), ``router`` (RoutePolicy
fields), ``link`` (the router's LinkEstimate) and ``wan_options`` (WanSender
options, JSON values).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..._errors import LocalProtocolError
from ..._optional import require
from ...api import BlocksReleased, PrefillEndpoint, Submission, SyncEndpoint
from ...route import Route
from ._kv import kv_pool_from_vllm
from ._prefill_config import PrefillConnectorConfig

__all__ = ["PrefillConnectorStatistics", "PrefillKVConnector"]

log = logging.getLogger("pddnet.vllm")

# Bound to Any on purpose: vLLM is an optional extra (see _copy_connector).
_v1: Any = require("vllm.distributed.kv_transfer.kv_connector.v1.base")
_RequestStatus: Any = require("vllm.v1.request").RequestStatus

# A prefill that ran to its one token; an aborted request has no first token.
K_HANDOFF_STATUSES = frozenset(
    {_RequestStatus.FINISHED_LENGTH_CAPPED, _RequestStatus.FINISHED_STOPPED}
)


@dataclass(frozen=True, slots=True)
class _Handoff:
    vllm_id: str  # vLLM's internal (renamed) id, what get_finished reports
    request_id: int  # pddnet's
    prompt: tuple[int, ...]
    first_token: int
    block_ids: tuple[int, ...]
    max_tokens: int
    sink: str
    route: Route | None
    deadline_s: float | None
    finished_at: float  # time.perf_counter() in request_finished


@dataclass(slots=True)
class _Meta(_v1.KVConnectorMetadata):
    handoffs: list[_Handoff] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PrefillConnectorStatistics:
    """Counters of one side of :class:`PrefillKVConnector` (the other side's stay 0).

    Scheduler side: ``handoffs`` and ``scheduler_s``, the time spent in its
    hooks. Worker side: ``submitted``, ``released``, ``failed``, and
    ``submit_s`` / ``release_s``, summed from ``request_finished`` to
    ``submit`` returning (the decoders accepted and the transfers started) /
    to the worker seeing the blocks released.
    """

    handoffs: int = 0
    scheduler_s: float = 0.0
    submitted: int = 0
    released: int = 0
    failed: int = 0
    submit_s: float = 0.0
    release_s: float = 0.0


class PrefillKVConnector(_v1.KVConnectorBase_V1):
    """pddnet's P role as a vLLM KV connector (``kv_role="kv_producer"``).

    Configure with ``KVTransferConfig(kv_connector="PrefillKVConnector",
    kv_connector_module_path="pddnet.integrations.vllm.connectors",
    kv_role="kv_producer", kv_connector_extra_config={"name": "p0", ...})``;
    the keys are :class:`~pddnet.integrations.vllm.PrefillConnectorConfig`'s. A bad
    key raises :class:`~pddnet.LocalProtocolError` when vLLM builds it.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        if not cfg.is_kv_producer or cfg.is_kv_consumer:
            raise LocalProtocolError(f"PrefillKVConnector is P's: kv_role {cfg.kv_role!r}")
        self.config = PrefillConnectorConfig.from_extra(cfg.kv_connector_extra_config)
        self._stats: dict[str, Any] = dict.fromkeys(PrefillConnectorStatistics.__slots__, 0)
        # scheduler side
        self._handoffs: list[_Handoff] = []
        # worker side
        self.endpoint: SyncEndpoint | None = None
        self._tickets: dict[int, _Handoff] = {}  # submit ticket -> its hand-off
        self._live: dict[int, _Handoff] = {}  # pddnet id -> hand-off, until released
        self._done: set[str] = set()  # vLLM ids whose blocks vLLM may free
        self._named: set[str] = set()  # vLLM ids seen in finished_req_ids

    def statistics(self) -> PrefillConnectorStatistics:
        return PrefillConnectorStatistics(**self._stats)

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """P loads nothing: every token is computed here."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to note: P's hand-off starts when the request finishes."""

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hand a prefilled pddnet request to the worker side and hold its blocks."""
        started = time.perf_counter()
        params = (request.kv_transfer_params or {}).get("pddnet")
        if params is None or request.status not in K_HANDOFF_STATUSES:
            return False, None
        if not request.output_token_ids:
            raise LocalProtocolError(
                "a finished prefill has no sampled token", request_id=request.request_id
            )
        route, deadline = params.get("route"), params.get("deadline_s")
        rid = int(params["request_id"])
        self._handoffs.append(
            _Handoff(
                request.request_id,
                rid,
                tuple(int(t) for t in request.prompt_token_ids),
                int(request.output_token_ids[0]),
                tuple(int(b) for b in block_ids),
                int(params["max_tokens"]),
                str(params.get("sink") or self.config.sink),
                Route[route] if route else None,
                float(deadline) if deadline is not None else self.config.deadline_s,
                started,
            )
        )
        self._stats["handoffs"] += 1
        self._stats["scheduler_s"] += time.perf_counter() - started
        return True, {"pddnet": {"request_id": rid, "held_blocks": len(block_ids)}}

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's hand-offs, for the worker side."""
        started = time.perf_counter()
        meta = _Meta(self._handoffs)
        self._handoffs = []
        self._stats["scheduler_s"] += time.perf_counter() - started
        return meta

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Wrap vLLM's KV cache as a pool and start P's endpoint over it."""
        pool = kv_pool_from_vllm(kv_caches)
        self.endpoint = SyncEndpoint(lambda: self.config.open_endpoint(pool)).start()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submit the hand-offs of requests that finished last step (never blocks)."""
        if self.endpoint is None:
            raise LocalProtocolError("PrefillKVConnector: no KV cache was registered")
        for h in self._get_connector_metadata().handoffs:
            ticket = self.endpoint.submit(_submit, h)
            self._tickets[ticket] = h
            self._live[h.request_id] = h

    def wait_for_layer_load(self, layer_name: str) -> None:
        """P loads nothing."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """pddnet reads the finished blocks in place; nothing to save per layer."""

    def wait_for_save(self) -> None:
        """Transfers run on the endpoint's thread; a held request keeps its blocks."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report requests whose blocks pddnet released (or never leased: a failed submit).

        vLLM accepts a finished send only for a request it named in
        ``finished_req_ids``, in this call or an earlier one.
        """
        self._named |= finished_req_ids
        if self.endpoint is not None:
            for c in self.endpoint.poll():
                self._on_completion(c.ticket, c.result, c.error)
        sent = self._done & self._named
        self._done -= sent
        self._named -= sent
        return sent or None, None

    def _on_completion(self, ticket: int | None, result: Any, error: BaseException | None) -> None:
        now = time.perf_counter()
        if ticket is None:  # an endpoint event
            if not isinstance(result, BlocksReleased):
                return
            h = self._live.pop(result.request_id, None)
            if h is None:
                log.warning("blocks of unknown pddnet request %s released", result.request_id)
                return
            if result.error is not None:
                log.info("pddnet request %s: lease ended early: %s", h.request_id, result.error)
            self._stats["released"] += 1
            self._stats["release_s"] += now - h.finished_at
            self._done.add(h.vllm_id)
            return
        h = self._tickets.pop(ticket)
        if error is not None:  # nothing is leased: vLLM may free the blocks now
            log.warning("pddnet request %s: submit failed: %r", h.request_id, error)
            self._live.pop(h.request_id, None)
            self._stats["failed"] += 1
            self._done.add(h.vllm_id)
            return
        submission, returned_at = result
        assert isinstance(submission, Submission)
        self._stats["submitted"] += 1
        self._stats["submit_s"] += returned_at - h.finished_at

    def shutdown(self) -> None:
        """Stop P's endpoint (its transfers are cancelled)."""
        if self.endpoint is not None:
            self.endpoint.close()


async def _submit(endpoint: PrefillEndpoint, h: _Handoff) -> tuple[Submission, float]:
    # on the endpoint's thread; the time is taken there, not when polled
    sub = await endpoint.submit(
        h.request_id,
        h.prompt,
        h.block_ids,
        h.first_token,
        h.max_tokens,
        sink=h.sink,
        route=h.route,
        deadline_s=h.deadline_s,
    )
    return sub, time.perf_counter()
