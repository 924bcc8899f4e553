"""The engine contract pddnet drives, and the reference engine behind it.

pddnet never runs a model itself. A decode instance (RLD or MD) implements
:class:`DecodeEngine`: pddnet hands it a request to continue
(:class:`DecodeRequest`: the tokens so far and the blocks holding their KV),
consumes the tokens it produces, and stops it when the handoff says so.
:class:`ReferenceEngine` implements the contract with
:class:`~pddnet.recompute.ReferenceModel`, stepping every running request
together, and is the worked example of docs/embedding.md.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from .._errors import LocalProtocolError, PddnetError
from ..handoff import FinishReason
from ..handoff._engine import DecodeEngine, DecodeRequest, TokenCallback
from ..recompute import PagedSequence, ReferenceModel, greedy

__all__ = ["DecodeEngine", "DecodeRequest", "ReferenceEngine", "TokenCallback"]

K_TICK_LOG = 1024  # batches the reference engine remembers (ReferenceEngine.tick_log)


@dataclass(eq=False)
class _Run:
    """One request in the reference engine's batch."""

    request: DecodeRequest
    on_token: TokenCallback
    seq: PagedSequence
    feed: list[int]  # tokens whose KV the next step computes (then the last token only)
    produced: int = 0
    stopped: bool = False
    done: bool = False
    in_tick: bool = False
    error: PddnetError | None = None
    next_token: int = field(default=-1)


class ReferenceEngine:
    """:class:`DecodeEngine` over the reference model (greedy decoding).

    Every running request steps in one batch tick: one forward pass each
    (the first one an extend over the tokens without KV), run off the event
    loop on a worker thread, so a long tick never stalls pddnet's control
    traffic. The run that finds no tick in progress runs the next one; the
    others wait for it.

    Args:
        model: the model; its pool is the endpoint's pool.
        eos_token_id: token that ends a request, or None.
        step_time_s: sleep this long before each tick, to emulate a real
            model's speed with a small one (demo, benchmarks); 0 in production.
        worker_thread: run each tick on a worker thread (False: on the event
            loop, for tests under a virtual clock, which jumps ahead while a
            thread computes).
    """

    def __init__(
        self,
        model: ReferenceModel,
        eos_token_id: int | None = None,
        *,
        step_time_s: float = 0.0,
        worker_thread: bool = True,
    ) -> None:
        if model.allocator is None:
            raise LocalProtocolError("the reference engine needs a model with a block allocator")
        self.model = model
        self.allocator = model.allocator
        self.eos_token_id = eos_token_id
        self.step_time_s = step_time_s
        self.worker_thread = worker_thread
        self.tick_log: collections.deque[tuple[int, ...]] = collections.deque(maxlen=K_TICK_LOG)
        self._runs: dict[int, _Run] = {}
        self._ticking = False
        self._tick_over: trio.Event | None = None

    @property
    def pool(self) -> Any:
        return self.model.pool

    def allocate(self, num_blocks: int) -> Sequence[int]:
        return [int(b) for b in self.allocator.allocate(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        self.allocator.free(np.asarray(block_ids, dtype=np.int32))

    def free_blocks(self) -> int:
        return int(self.allocator.free_blocks)

    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        """See :meth:`DecodeEngine.run`.

        Raises:
            LocalProtocolError: the request is already running, holds no token
                without KV, asks for no tokens, or its blocks cannot hold them.
        """
        rid, toks = request.request_id, request.tokens
        if rid in self._runs:
            raise LocalProtocolError("the request is already running", request_id=rid)
        seq = PagedSequence(np.asarray(request.block_table, np.int32), request.kv_tokens)
        if seq.capacity(self.model.block_size) < len(toks) + request.max_new_tokens - 1:
            raise LocalProtocolError("the block table cannot hold the request", request_id=rid)
        run = _Run(request, on_token, seq, list(toks[request.kv_tokens :]))
        self._runs[rid] = run
        try:
            while not (run.done or run.stopped):
                if self._ticking and self._tick_over is not None:
                    await self._tick_over.wait()
                else:
                    await self._tick()
        finally:
            if run.in_tick and self._tick_over is not None:
                # cancelled while a worker writes this request's KV: wait for it
                with trio.CancelScope(shield=True):
                    await self._tick_over.wait()
            del self._runs[rid]
        if run.error is not None:
            raise run.error

    def stop(self, request_id: int) -> None:
        run = self._runs.get(request_id)
        if run is not None:
            run.stopped = True

    async def _tick(self) -> None:
        self._ticking, self._tick_over = True, trio.Event()
        batch: list[_Run] = []
        try:
            if self.step_time_s:
                await trio.sleep(self.step_time_s)  # emulate a real model's step time
            else:
                await trio.lowlevel.checkpoint()
            batch = [r for r in self._runs.values() if not (r.done or r.stopped)]
            for r in batch:
                r.in_tick = True
            self.tick_log.append(tuple(r.request.request_id for r in batch))
            # Not abandoned on cancel: the pass writes the batch's KV, so its tokens
            # are delivered below before a cancel of this run lands (the next await).
            if self.worker_thread:
                await trio.to_thread.run_sync(self._step_batch, batch)
            else:
                self._step_batch(batch)
        finally:
            for r in batch:
                r.in_tick = False
            self._ticking = False
            self._tick_over.set()
        for r in batch:
            if r.error is not None:
                r.done = True
            elif not r.stopped:
                self._deliver(r)

    def _step_batch(self, batch: list[_Run]) -> None:
        """(worker thread) one forward pass per request of the batch."""
        for r in batch:
            try:
                r.next_token = greedy(self.model.extend(r.seq, r.feed))
            except PddnetError as exc:
                r.error = exc

    def _deliver(self, r: _Run) -> None:
        tok = r.next_token
        r.produced += 1
        r.feed = [tok]
        finish: FinishReason | None = None
        if self.eos_token_id is not None and tok == self.eos_token_id:
            finish = FinishReason.EOS
        elif r.produced >= r.request.max_new_tokens:
            finish = FinishReason.MAX_TOKENS
        r.done = finish is not None
        r.on_token(tok, finish)
