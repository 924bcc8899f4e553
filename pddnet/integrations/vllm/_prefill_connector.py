"""P's vLLM 0.32 KV connector: a vLLM instance prefills, pddnet ships the KV.

The driver adds each request with ``max_tokens=1`` (the token vLLM samples is
P's first token) and names it for pddnet in ``SamplingParams(extra_args=
{"kv_transfer_params": {"pddnet": {"request_id": <int>, "max_tokens": <int>,
"sink": <node>, "route": "P_MD" | "P_RLD_MD" | None, "deadline_s": <float>}}})``
(``sink``, ``route`` and ``deadline_s`` optional). vLLM renames its requests
internally, so everything keys on that pddnet id.

Layer by layer (``layerwise``, the default):

1. Scheduler side: ``update_state_after_alloc`` notes a pddnet request and
   its blocks (``build_connector_meta`` follows the blocks later chunks add,
   from ``scheduled_cached_reqs``). The step whose ``num_scheduled_tokens``
   complete the prompt (``num_computed_tokens``, not yet advanced then, plus
   the step's tokens) makes a hand-off without a first token, carried to the
   worker by that step's ``build_connector_meta`` (the documented scheduler
   -> worker channel).
2. Worker side, ``bind_connector_metadata`` (before the forward pass; vLLM
   calls ``start_load_kv`` only after it on P): submit the hand-off with
   ``first_token=None, ready=False`` to a :class:`~pddnet.api.PrefillEndpoint`
   on a thread of its own (:class:`~pddnet.api.SyncEndpoint`, which never
   blocks the step): the offers go out and the transfers start.
3. ``save_kv_layer(layer_name, ...)``, which vLLM calls after each attention
   layer wrote its KV (``maybe_transfer_kv_layer``), marks that layer ready
   for the step's hand-offs: it crosses the wire while the next layers
   compute. vLLM layer names map to pool layers by their layer number, in the
   order :func:`kv_pool_from_vllm` stacks them. ``wait_for_save`` marks any
   layer the forward did not report (with a warning).
4. ``request_finished`` (same step, after sampling) returns ``(True, ...)``
   and queues the first token (an aborted request: an abort) for the next
   step's metadata; that step's ``bind_connector_metadata`` sends it
   (:meth:`~pddnet.api.PrefillEndpoint.set_first_token`; the SyncEndpoint
   starts calls in order, so it follows the submit).

Whole request (``layerwise: false``):

1. Scheduler side, ``request_finished``: a request that finished with its
   token names its prompt, first token and blocks in a hand-off and returns
   ``(True, {"pddnet": ...})``: vLLM keeps the blocks allocated.
2. ``build_connector_meta`` carries the step's hand-offs to the worker side.
3. Worker side: ``start_load_kv`` submits each hand-off (every layer ready).

Both:

* ``register_kv_caches`` wraps vLLM's KV tensors as a
  :class:`~pddnet.kv.KVPool` (:func:`kv_pool_from_vllm`, no copy) and starts
  P's endpoint over it.
* ``get_finished`` (the worker -> scheduler channel) reports a request in
  ``finished_sending`` once pddnet released its blocks
  (:class:`~pddnet.api.BlocksReleased`) or its submission failed, and vLLM
  named it finished; vLLM frees them then. The driver keeps calling
  ``step()`` until ``scheduler.has_requests()`` is false.

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
fields), ``link`` (the router's LinkEstimate), ``wan_options`` (WanSender
options, JSON values) and ``layerwise``.
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
from ._kv import kv_pool_from_vllm, layer_index
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
    first_token: int | None  # None: layer by layer, the token follows (_Sampled)
    block_ids: tuple[int, ...]
    max_tokens: int
    sink: str
    route: Route | None
    deadline_s: float | None
    finished_at: float  # time.perf_counter() of the hand-off (scheduler side)


@dataclass(frozen=True, slots=True)
class _Sampled:
    """A layer-by-layer request finished on P: its first token, or None (aborted)."""

    request_id: int
    token: int | None


@dataclass(slots=True)
class _Prefilling:
    """(layerwise) a pddnet request vLLM is prefilling, and its blocks so far."""

    request: Any  # vllm.v1.request.Request
    block_ids: list[int]


@dataclass(slots=True)
class _Meta(_v1.KVConnectorMetadata):
    handoffs: list[_Handoff] = field(default_factory=list)  # whole requests
    streams: list[_Handoff] = field(default_factory=list)  # last prefill chunk this step
    sampled: list[_Sampled] = field(default_factory=list)  # first tokens of streams


@dataclass(frozen=True, slots=True)
class PrefillConnectorStatistics:
    """Counters of one side of :class:`PrefillKVConnector` (the other side's stay 0).

    Scheduler side: ``handoffs`` (``streamed`` of them layer by layer) and
    ``scheduler_s``, the time spent in its hooks. Worker side: ``submitted``,
    ``released``, ``failed``, ``layers_marked`` (request-layers marked ready
    from ``save_kv_layer``), ``layers_unreported`` (marked by
    ``wait_for_save`` instead), and ``submit_s`` / ``release_s``, summed from
    the hand-off (``request_finished``; layer by layer, the scheduling of the
    last prefill chunk) to ``submit`` returning (the decoders accepted and the
    transfers started) / to the worker seeing the blocks released.
    """

    handoffs: int = 0
    streamed: int = 0
    scheduler_s: float = 0.0
    submitted: int = 0
    released: int = 0
    failed: int = 0
    layers_marked: int = 0
    layers_unreported: int = 0
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
        self._prefilling: dict[str, _Prefilling] = {}  # vLLM id -> (layerwise) not yet streamed
        self._streamed: dict[str, int] = {}  # vLLM id -> pddnet id, streamed, not yet finished
        self._streams: list[_Handoff] = []
        self._sampled: list[_Sampled] = []
        # worker side
        self.endpoint: SyncEndpoint | None = None
        self._layers: dict[str, int] = {}  # vLLM layer name -> pool layer
        self._step: list[int] = []  # pddnet ids streamed in this step's forward
        self._marked: set[int] = set()  # layers save_kv_layer marked this step
        self._tickets: dict[int, _Handoff] = {}  # submit ticket -> its hand-off
        self._calls: dict[int, str] = {}  # other tickets -> what the call was, for the log
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
        """(layerwise) Note a pddnet request and every block it holds now."""
        if self.config.layerwise and _params(request) is not None:
            self._prefilling[request.request_id] = _Prefilling(
                request, [int(b) for b in blocks.get_block_ids()[0]]
            )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold a pddnet request's blocks: hand it to the worker side (whole
        request), or send its first token after its streamed KV (layerwise)."""
        started = time.perf_counter()
        params = _params(request)
        if params is None:
            return False, None
        self._prefilling.pop(request.request_id, None)
        rid = int(params["request_id"])
        sampled = request.status in K_HANDOFF_STATUSES
        if sampled and not request.output_token_ids:
            raise LocalProtocolError(
                "a finished prefill has no sampled token", request_id=request.request_id
            )
        if self._streamed.pop(request.request_id, None) is not None:
            # its transfers read these blocks already; an aborted one is aborted
            token = int(request.output_token_ids[0]) if sampled else None
            self._sampled.append(_Sampled(rid, token))
        elif sampled:
            self._handoffs.append(
                self._handoff(request, int(request.output_token_ids[0]), block_ids, started)
            )
        else:
            return False, None
        self._stats["scheduler_s"] += time.perf_counter() - started
        return True, {"pddnet": {"request_id": rid, "held_blocks": len(block_ids)}}

    def _handoff(
        self, request: Any, first_token: int | None, block_ids: Any, started: float
    ) -> _Handoff:
        params = _params(request)
        assert params is not None
        route, deadline = params.get("route"), params.get("deadline_s")
        self._stats["handoffs"] += 1
        return _Handoff(
            request.request_id,
            int(params["request_id"]),
            tuple(int(t) for t in request.prompt_token_ids),
            first_token,
            tuple(int(b) for b in block_ids),
            int(params["max_tokens"]),
            str(params.get("sink") or self.config.sink),
            Route[route] if route else None,
            float(deadline) if deadline is not None else self.config.deadline_s,
            started,
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """This step's hand-offs, for the worker side; (layerwise) the requests
        whose last prefill chunk this step computes."""
        started = time.perf_counter()
        if self._prefilling:
            cached = scheduler_output.scheduled_cached_reqs
            for vid, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
                p = self._prefilling.get(vid)
                if p is not None and new is not None:
                    if vid in cached.resumed_req_ids:  # vLLM's own rule for its block table
                        p.block_ids[:] = new[0]
                    else:
                        p.block_ids.extend(new[0])
            scheduled = scheduler_output.num_scheduled_tokens
            for vid, p in list(self._prefilling.items()):
                n = scheduled.get(vid, 0)
                # num_computed_tokens advances only after this hook
                if n and p.request.num_computed_tokens + n >= p.request.num_prompt_tokens:
                    del self._prefilling[vid]
                    self._streams.append(self._handoff(p.request, None, p.block_ids, started))
                    self._streamed[vid] = self._streams[-1].request_id
                    self._stats["streamed"] += 1
        meta = _Meta(self._handoffs, self._streams, self._sampled)
        self._handoffs, self._streams, self._sampled = [], [], []
        self._stats["scheduler_s"] += time.perf_counter() - started
        return meta

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Wrap vLLM's KV cache as a pool and start P's endpoint over it."""
        pool = kv_pool_from_vllm(kv_caches)
        # the pool's layer i is the i-th name in layer-number order
        self._layers = {name: i for i, name in enumerate(sorted(kv_caches, key=layer_index))}
        self.endpoint = SyncEndpoint(lambda: self.config.open_endpoint(pool)).start()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """(layerwise, before the forward) Submit the requests whose last
        prefill chunk this step computes; send the first tokens sampled last step."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        self._step, self._marked = [], set()
        if not (meta.streams or meta.sampled):
            return
        ep = self._endpoint()
        for h in meta.streams:
            self._tickets[ep.submit(_submit, h, False)] = h
            self._live[h.request_id] = h
            self._step.append(h.request_id)
        for s in meta.sampled:
            if s.token is None:
                ticket = ep.submit("abort", s.request_id, "vLLM aborted the request")
            else:
                ticket = ep.submit("set_first_token", s.request_id, s.token)
            self._calls[ticket] = f"pddnet request {s.request_id}: first token"

    def _endpoint(self) -> SyncEndpoint:
        if self.endpoint is None:
            raise LocalProtocolError("PrefillKVConnector: no KV cache was registered")
        return self.endpoint

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submit the whole-request hand-offs of requests that finished last step
        (never blocks)."""
        ep = self._endpoint()
        for h in self._get_connector_metadata().handoffs:
            ticket = ep.submit(_submit, h, True)
            self._tickets[ticket] = h
            self._live[h.request_id] = h

    def wait_for_layer_load(self, layer_name: str) -> None:
        """P loads nothing."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """(layerwise) This layer's KV is written: send it for this step's streams."""
        if not self._step:
            return
        layer = self._layers.get(layer_name)
        if layer is None:
            raise LocalProtocolError(f"PrefillKVConnector: unknown KV layer {layer_name!r}")
        self._mark(layer)
        self._marked.add(layer)
        self._stats["layers_marked"] += len(self._step)

    def _mark(self, layer: int) -> None:
        ticket = self._endpoint().submit(_mark_layer, tuple(self._step), layer)
        self._calls[ticket] = f"layer {layer} of pddnet requests {self._step}"

    def wait_for_save(self) -> None:
        """(layerwise) The forward is over: every layer of this step's streams
        is final; mark those ``save_kv_layer`` did not report."""
        if self._step:
            missing = sorted(set(self._layers.values()) - self._marked)
            if missing:
                log.warning("vLLM reported no save_kv_layer for layers %s: sent now", missing)
                for layer in missing:
                    self._mark(layer)
                self._stats["layers_unreported"] += len(missing) * len(self._step)
        self._step = []

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
        what = self._calls.pop(ticket, None)
        if what is not None:  # a layer mark, a first token, an abort
            if error is not None:
                log.warning("%s: %r", what, error)
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


def _params(request: Any) -> dict[str, Any] | None:
    """The request's pddnet parameters, or None for a request pddnet does not serve."""
    return (request.kv_transfer_params or {}).get("pddnet")


async def _submit(endpoint: PrefillEndpoint, h: _Handoff, ready: bool) -> tuple[Submission, float]:
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
        ready=ready,
    )
    return sub, time.perf_counter()


async def _mark_layer(endpoint: PrefillEndpoint, request_ids: tuple[int, ...], layer: int) -> None:
    # each request on its own: one whose submit failed must not hold up the others
    errors = []
    for rid in request_ids:
        try:
            endpoint.mark_layer_ready(rid, layer)
        except LocalProtocolError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
