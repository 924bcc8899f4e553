"""pddnet's decode contract over a vLLM 0.32 engine: RLD or MD as a real batching engine.

:class:`VllmDecodeEngine` implements :class:`~pddnet.handoff.DecodeEngine`
over an in-process ``vllm.LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
one OS process per role: vLLM's worker-side connector is a process-wide
singleton).

Theory of operation:

* **One thread owns vLLM.** The engine is built and stepped on a thread of
  its own; nothing else touches it. Requests reach it through a thread-safe
  queue (add, abort, call), and each step's tokens come back to the trio
  loop with ``TrioToken.run_sync_soon``, so ``on_token`` runs on the event
  loop and a step never waits for pddnet (nor pddnet for a step). The step
  loop batches every running request, as vLLM does.
* **Two pools.** pddnet's receivers land KV in the *staging* pool
  (:attr:`VllmDecodeEngine.pool`, vLLM's layout; :meth:`allocate`,
  :meth:`free` and :meth:`free_blocks` manage it synchronously on the event
  loop). vLLM's paged cache stays vLLM's: :class:`DecodeKVConnector` copies a
  request's staged blocks into the blocks vLLM allocated for it, in the step
  that admits it, and vLLM computes the rest.
* **A run is a vLLM request.** :meth:`run` adds one whose prompt is
  ``request.tokens`` (greedy, ``max_tokens=max_new_tokens``) and whose
  ``kv_transfer_params`` name the staged blocks and how many tokens they
  hold. :meth:`stop` aborts it. MD's recompute is that request's prefill:
  vLLM computes the eager tokens past the loaded prompt in one extend pass.
* **Restarts use vLLM's prefix cache.** Only the first run of a request
  loads what pddnet landed; a later run (a catch-up round, or RLD resuming)
  continues a longer prefix whose extra KV an earlier run wrote into vLLM's
  own blocks. Those blocks, freed and cached by vLLM when the earlier run
  was aborted, are vLLM's local prefix-cache hit; the staged KV fills what
  lies past the hit and below the landed length, and vLLM recomputes the
  rest (at worst the part of a block the cache does not hold).
* **The blocks are pddnet's again when run returns.** vLLM reads staged
  blocks only inside a step, on its thread; ``run`` returns once that thread
  has seen the request finish or has aborted it (between two steps).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np
import trio

from ..._errors import LocalProtocolError, PddnetError
from ..._optional import require
from ...handoff import FinishReason
from ...handoff._engine import DecodeRequest, TokenCallback
from ...kv import KVPool
from ...recompute import BlockAllocator
from ._engine import apply_cpu_env, cpu_engine_kwargs
from ._staging import open_staging

__all__ = ["K_STAGING_BLOCKS", "VllmDecodeEngine", "VllmEngineError"]

K_STAGING_BLOCKS = 1024  # staging pool blocks by default (64 MiB for the tiny model)
T = TypeVar("T")


class VllmEngineError(PddnetError):
    """vLLM refused a request or failed a step (the vLLM error is the cause)."""


@dataclass(eq=False)
class _Run:
    request: DecodeRequest
    on_token: TokenCallback
    vllm_id: str
    ended: trio.Event = field(default_factory=trio.Event)
    stopped: bool = False
    done: bool = False
    error: BaseException | None = None


class VllmDecodeEngine:
    """:class:`~pddnet.handoff.DecodeEngine` over an in-process vLLM engine.

    Use ``async with VllmDecodeEngine(model) as engine:`` (building vLLM
    takes seconds), then give ``engine.pool`` and ``engine`` to a
    :class:`~pddnet.api.RelayEndpoint` or :class:`~pddnet.api.MainEndpoint`.

    Args:
        model: the checkpoint directory (or name) vLLM loads.
        staging_blocks: blocks of the staging pool pddnet lands KV in.
        eos_token_id: token that ends a request (vLLM stops on it), or None.
        engine_kwargs: ``vllm.EngineArgs`` keywords over :func:`cpu_engine_kwargs`'s.
        staging_dir: where the staging file is created (``/dev/shm`` when
            present); it is unlinked once mapped.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        staging_blocks: int = K_STAGING_BLOCKS,
        eos_token_id: int | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        staging_dir: str | Path | None = None,
    ) -> None:
        self.model = str(model)
        self.eos_token_id = eos_token_id
        self.staging_blocks = staging_blocks
        self._engine_kwargs = dict(engine_kwargs or {})
        shm = Path("/dev/shm")
        self._staging_dir = Path(staging_dir) if staging_dir else (shm if shm.is_dir() else None)
        self._pool: KVPool | None = None
        self.allocator = BlockAllocator(staging_blocks)
        self.block_size = 0
        self.max_model_len = 0
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._runs: dict[int, _Run] = {}
        self._by_vllm_id: dict[str, _Run] = {}
        self._landed: dict[int, tuple[int, frozenset[int]]] = {}  # id -> (tokens, blocks)
        self._ids = itertools.count()
        self._fatal: BaseException | None = None

    # ------------------------------------------------------------- lifecycle
    @property
    def pool(self) -> KVPool:
        """The staging pool (vLLM's KV layout) pddnet lands KV in."""
        if self._pool is None:
            raise LocalProtocolError("the vLLM engine is not started")
        return self._pool

    async def start(self) -> None:
        """Build vLLM on the engine thread and map the staging pool.

        Raises:
            VllmEngineError: if vLLM could not be built (the cause attached).
        """
        if self._thread is not None:
            raise LocalProtocolError("the vLLM engine is already started")
        self._token = trio.lowlevel.current_trio_token()
        tmp = Path(tempfile.mkdtemp(prefix="pddnet-staging-", dir=self._staging_dir))
        path = tmp / "staging"
        ready = trio.Event()
        box: list[BaseException | None] = []

        def on_ready(error: BaseException | None) -> None:
            box.append(error)
            ready.set()

        self._thread = threading.Thread(
            target=self._loop, args=(str(path), on_ready), name="vllm-engine", daemon=True
        )
        self._thread.start()
        try:
            await ready.wait()
            if box[0] is not None:
                raise VllmEngineError(f"vLLM engine for {self.model}: {box[0]!r}") from box[0]
            self._pool = open_staging(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the mappings outlive the files

    async def aclose(self) -> None:
        """Stop every run and the engine thread (vLLM is dropped with it)."""
        for rid in list(self._runs):
            self.stop(rid)
        if self._thread is not None:
            self._inbox.put(("close",))
            await trio.to_thread.run_sync(self._thread.join)
            self._thread = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- blocks
    def allocate(self, num_blocks: int) -> Sequence[int]:
        return [int(b) for b in self.allocator.allocate(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        freed = {int(b) for b in block_ids}
        self.allocator.free(np.asarray(block_ids, dtype=np.int32))
        for rid, (_, blocks) in list(self._landed.items()):
            if rid not in self._runs and blocks & freed:
                del self._landed[rid]  # the request is over: its blocks go back

    def free_blocks(self) -> int:
        return int(self.allocator.free_blocks)

    # ------------------------------------------------------------------ runs
    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        """See :meth:`~pddnet.handoff.DecodeEngine.run`.

        Cancellation aborts the vLLM request and waits (shielded) until the
        engine thread has done so.

        Raises:
            LocalProtocolError: the request is already running, holds no token
                without KV, asks for no tokens, does not fit vLLM's
                ``max_model_len``, or its blocks cannot hold its landed KV.
            VllmEngineError: vLLM refused the request or a step failed.
        """
        rid, toks = request.request_id, request.tokens
        if self._token is None:
            raise LocalProtocolError("the vLLM engine is not started", request_id=rid)
        if rid in self._runs:
            raise LocalProtocolError("the request is already running", request_id=rid)
        if len(toks) + request.max_new_tokens > self.max_model_len:
            raise LocalProtocolError(
                f"{len(toks)} + {request.max_new_tokens} tokens exceed vLLM's"
                f" max_model_len {self.max_model_len}",
                request_id=rid,
            )
        landed, _ = self._landed.setdefault(
            rid, (request.kv_tokens, frozenset(request.block_table))
        )
        staged = min(request.kv_tokens, landed)
        blocks = -(-staged // self.block_size)
        if len(request.block_table) < blocks:
            raise LocalProtocolError(
                f"{len(request.block_table)} blocks cannot hold {staged} landed tokens",
                request_id=rid,
            )
        if self._fatal is not None:
            raise VllmEngineError("the vLLM engine failed") from self._fatal
        run = _Run(request, on_token, f"{rid}.{next(self._ids)}")
        self._runs[rid] = run
        self._by_vllm_id[run.vllm_id] = run
        table = [int(b) for b in request.block_table[:blocks]]
        kv = {"pddnet": {"blocks": table, "tokens": staged}}
        self._inbox.put(("add", run.vllm_id, list(toks), self._params(request, kv)))
        try:
            await run.ended.wait()
        finally:
            if not run.ended.is_set():  # cancelled: abort, then wait for the thread
                self.stop(rid)
                with trio.CancelScope(shield=True):
                    await run.ended.wait()
            del self._runs[rid]
            self._by_vllm_id.pop(run.vllm_id, None)
        if run.error is not None:
            raise VllmEngineError(f"vLLM request {run.vllm_id}: {run.error!r}") from run.error

    def stop(self, request_id: int) -> None:
        run = self._runs.get(request_id)
        if run is not None and not (run.stopped or run.ended.is_set()):
            run.stopped = True
            self._inbox.put(("abort", run.vllm_id))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(llm_engine)`` on the engine thread between two steps.

        For inspection (vLLM's block pool, the connector's statistics) and
        for driving vLLM directly while no pddnet request runs.
        """
        done = trio.Event()
        box: list[Any] = []
        self._inbox.put(("call", fn, box, done))
        await done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _params(self, request: DecodeRequest, kv: dict[str, Any]) -> Any:
        vllm = require("vllm")
        return vllm.SamplingParams(
            temperature=0.0,
            max_tokens=request.max_new_tokens,
            ignore_eos=True,  # ends on eos_token_id only, through stop_token_ids
            stop_token_ids=None if self.eos_token_id is None else [self.eos_token_id],
            output_kind=require("vllm.sampling_params").RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv},
        )

    # ------------------------------------------------- event loop, from vLLM
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):  # the loop is gone: nobody waits
            self._token.run_sync_soon(fn, *args)

    def _deliver(self, outputs: list[tuple[str, list[int], str | None, bool]]) -> None:
        """(event loop) one step's tokens, and the runs the engine thread ended."""
        for vllm_id, tokens, reason, ended in outputs:
            run = self._by_vllm_id.get(vllm_id)
            if run is None:
                continue
            for i, tok in enumerate(tokens):
                if run.stopped or run.done:
                    break
                finish: FinishReason | None = None
                if ended and reason is not None and i == len(tokens) - 1:
                    finish = FinishReason.EOS if reason == "stop" else FinishReason.MAX_TOKENS
                    run.done = True
                run.on_token(tok, finish)
            if ended:
                run.ended.set()

    def _failed(self, vllm_id: str | None, error: BaseException) -> None:
        """(event loop) vLLM refused one request (``vllm_id``) or failed (None: every run)."""
        if vllm_id is None:
            self._fatal = error
            runs = list(self._by_vllm_id.values())
        else:
            runs = [self._by_vllm_id[vllm_id]] if vllm_id in self._by_vllm_id else []
        for run in runs:
            run.error = error
            run.ended.set()

    # ---------------------------------------------------------- engine thread
    def _build(self, staging_path: str) -> Any:
        apply_cpu_env()
        vllm = require("vllm")
        config = require("vllm.config")
        kv = config.KVTransferConfig(
            kv_connector="DecodeKVConnector",
            kv_connector_module_path="pddnet.integrations.vllm.connectors",
            kv_role="kv_consumer",
            kv_connector_extra_config={
                "staging_path": staging_path,
                "staging_blocks": self.staging_blocks,
            },
        )
        kwargs = cpu_engine_kwargs(self.model, **self._engine_kwargs)
        kwargs["kv_transfer_config"] = kv
        engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**kwargs))
        self.block_size = int(engine.vllm_config.cache_config.block_size)
        self.max_model_len = int(engine.vllm_config.model_config.max_model_len)
        return engine

    def _loop(self, staging_path: str, on_ready: Callable[[BaseException | None], None]) -> None:
        try:
            engine = self._build(staging_path)
        except BaseException as exc:  # reported to start(), which raises it
            self._post(on_ready, exc)
            return
        self._post(on_ready, None)
        try:
            while True:
                busy = engine.has_unfinished_requests()
                try:
                    cmd = self._inbox.get(block=not busy)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd[0] == "close":
                        return
                    self._command(engine, cmd)
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if engine.has_unfinished_requests():
                    outputs = [
                        (
                            out.request_id,
                            [int(t) for t in out.outputs[0].token_ids],
                            out.outputs[0].finish_reason,
                            bool(out.finished),
                        )
                        for out in engine.step()
                    ]
                    if outputs:
                        self._post(self._deliver, outputs)
        except BaseException as exc:  # a failed step: every run ends with it
            self._post(self._failed, None, exc)

    def _command(self, engine: Any, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            _, vllm_id, tokens, params = cmd
            try:
                engine.add_request(vllm_id, {"prompt_token_ids": tokens}, params)
            except Exception as exc:  # vLLM refused it: that run ends with the error
                self._post(self._failed, vllm_id, exc)
        elif kind == "abort":
            engine.abort_request([cmd[1]])
            # between steps: vLLM never reads this request's staged blocks again
            self._post(self._deliver, [(cmd[1], [], None, True)])
        elif kind == "call":
            _, fn, box, done = cmd
            try:
                box.append(fn(engine))
            except Exception as exc:
                box.append(exc)
            self._post(done.set)
