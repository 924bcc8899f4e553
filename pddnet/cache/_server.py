"""MD's side of the DRC protocol: events for P's mirror and the plan handshake.

Sans-IO: :class:`CacheServer` takes messages and ``now`` and returns
messages; a driver moves them over the control plane. The protocol is in
docs/drc.md. In short:

* every change of the tree becomes an event (:class:`DrcInserted` or
  :class:`DrcEvicted`) numbered ``seq = 1, 2, ...`` within an ``epoch``
  (a random id per server instance, so P notices a restart);
* :meth:`CacheServer.handle_plan` matches the prompt against what MD *really*
  holds, verifying tokens, pins that prefix and answers with its length. P
  sends exactly the blocks after it. A stale mirror can make P predict the
  wrong length, never make MD use a wrong block: the answer comes from the
  tree, not from P;
* the pin lasts until :meth:`complete` (transfer landed; the new blocks are
  inserted), :meth:`abort`, or the plan's lease runs out (:meth:`expire`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LocalProtocolError, RemoteProtocolError
from ..wire import Message, decode_tokens
from ._messages import (
    DrcEvicted,
    DrcInserted,
    DrcPlanAbort,
    DrcPlanReply,
    DrcPlanRequest,
    DrcSnapshot,
    DrcSnapshotRequest,
)
from ._radix import CacheOp, InsertResult, Match, RadixCache

__all__ = ["CacheServer", "ServerPlan"]

K_MAX_KEYS = 8192  # 8192 uint64 keys are ~74 KB of msgpack
K_MAX_PROMPT_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerPlan:
    """A pinned plan on MD.

    Attributes:
        plan_id: the id sent to P.
        request_id: P's request id.
        tokens: the prompt.
        hit_blocks: leading blocks MD holds and pinned.
        hit_block_ids: their MD pool block ids.
        deadline: when the pin lapses unless completed or aborted.
    """

    plan_id: int
    request_id: str
    tokens: npt.NDArray[np.int64]
    match: Match
    deadline: float

    @property
    def hit_blocks(self) -> int:
        return self.match.num_blocks

    @property
    def hit_block_ids(self) -> npt.NDArray[np.int64]:
        return self.match.block_ids


class CacheServer:
    """MD's DRC endpoint: wraps a :class:`RadixCache`.

    Args:
        cache: the tree.
        epoch: id of this server instance (random if omitted).
        lease_s: how long a plan stays pinned without completion.
        max_prompt_tokens: longest prompt a plan request may carry.
    """

    def __init__(
        self,
        cache: RadixCache,
        *,
        epoch: int | None = None,
        lease_s: float = 60.0,
        max_prompt_tokens: int = K_MAX_PROMPT_TOKENS,
    ) -> None:
        self.cache = cache
        self.epoch = secrets.randbits(62) if epoch is None else epoch
        self.lease_s = lease_s
        self.max_prompt_tokens = max_prompt_tokens
        self._seq = 0
        self._outbox: list[DrcInserted | DrcEvicted] = []
        self._plans: dict[int, ServerPlan] = {}

    # --------------------------------------------------------------- events
    @property
    def seq(self) -> int:
        """Number of the last event produced."""
        return self._seq

    def events(self) -> list[DrcInserted | DrcEvicted]:
        """The events for P's mirrors since the last call, in order."""
        self._flush()
        out, self._outbox = self._outbox, []
        return out

    def snapshot(self) -> list[DrcSnapshot]:
        """The full key set as of the latest event, in parts.

        Pending changes are turned into events first (still returned by
        :meth:`events`), so the snapshot's ``seq`` covers them.
        """
        self._flush()
        keys = self.cache.keys()
        parts = [keys[i : i + K_MAX_KEYS] for i in range(0, len(keys), K_MAX_KEYS)] or [[]]
        return [
            DrcSnapshot(
                self.epoch,
                self._seq,
                i,
                i == len(parts) - 1,
                self.cache.block_size,
                self.cache.algo,
                part,
            )
            for i, part in enumerate(parts)
        ]

    def _flush(self) -> None:
        for op, keys in self.cache.take_changes():
            cls = DrcInserted if op is CacheOp.INSERT else DrcEvicted
            for i in range(0, len(keys), K_MAX_KEYS):
                self._seq += 1
                self._outbox.append(cls(self.epoch, self._seq, keys[i : i + K_MAX_KEYS]))

    # ---------------------------------------------------------------- plans
    def handle(self, msg: Message, now: float) -> Message | list[DrcSnapshot] | None:
        """Dispatch one message from P; returns the reply (if any).

        Raises:
            RemoteProtocolError: for a malformed request or a message the
                server does not take.
        """
        if isinstance(msg, DrcPlanRequest):
            return self.handle_plan(msg, now)
        if isinstance(msg, DrcPlanAbort):
            self.abort(msg.plan_id)
            return None
        if isinstance(msg, DrcSnapshotRequest):
            return self.snapshot()
        raise RemoteProtocolError(f"DRC server can't handle {type(msg).__name__}")

    def handle_plan(self, req: DrcPlanRequest, now: float) -> DrcPlanReply:
        """Match, verify and pin the prompt's cached prefix.

        Raises:
            RemoteProtocolError: if the block size differs from MD's, or the
                tokens do not decode to ``num_tokens`` ids.
        """
        if req.block_size != self.cache.block_size:
            raise RemoteProtocolError(
                f"plan for block size {req.block_size}, MD caches {self.cache.block_size}",
                request_id=req.request_id,
            )
        tokens = decode_tokens(req.tokens, self.max_prompt_tokens)
        if tokens.size != req.num_tokens:
            raise RemoteProtocolError(
                f"plan carries {tokens.size} tokens, says {req.num_tokens}",
                request_id=req.request_id,
            )
        match = self.cache.match_prefix(tokens)
        plan_id = self.cache.pin(match)
        self._plans[plan_id] = ServerPlan(
            plan_id, req.request_id, tokens, match, now + self.lease_s
        )
        self._flush()
        return DrcPlanReply(
            req.request_id, plan_id, match.num_blocks, match.full_blocks, self.epoch, self._seq
        )

    def plan(self, plan_id: int) -> ServerPlan:
        """The pinned plan ``plan_id``.

        Raises:
            LocalProtocolError: if it is unknown (completed, aborted, expired).
        """
        try:
            return self._plans[plan_id]
        except KeyError:
            raise LocalProtocolError(f"unknown or released DRC plan {plan_id}") from None

    @property
    def open_plans(self) -> int:
        return len(self._plans)

    def complete(self, plan_id: int, new_block_ids: Any) -> InsertResult:
        """The delta landed: cache the prompt's blocks and release the pin.

        Args:
            plan_id: the plan.
            new_block_ids: MD pool blocks now holding blocks ``hit_blocks ..``
                of the prompt (one per remaining full block).

        Returns:
            The insert's result. ``unused_block_ids`` lists those of
            ``new_block_ids`` the cache did not adopt (the partial tail's, or
            blocks another plan cached meanwhile): the caller frees them.

        Raises:
            LocalProtocolError: for an unknown plan.
        """
        plan = self.plan(plan_id)
        ids = np.concatenate(
            (plan.match.block_ids, np.asarray(new_block_ids, dtype=np.int64).reshape(-1))
        )
        result = self.cache.insert(plan.tokens, ids, keys=plan.match.keys)
        self._release(plan_id)
        self._flush()
        # The pinned prefix is still cached (cached_before >= hit), so insert hands
        # back our own hit ids first: they are the cache's, never the caller's to free.
        hit = plan.match.num_blocks
        return InsertResult(result.cached_before, result.inserted, result.unused_block_ids[hit:])

    def abort(self, plan_id: int) -> bool:
        """Release a plan without caching anything. Returns whether it was open."""
        if plan_id not in self._plans:
            return False
        self._release(plan_id)
        return True

    def get_timer(self) -> float | None:
        """The earliest plan deadline, or None."""
        return min((p.deadline for p in self._plans.values()), default=None)

    def expire(self, now: float) -> list[int]:
        """Release every plan whose lease ran out by ``now``; returns their ids."""
        dead = [pid for pid, p in self._plans.items() if p.deadline <= now]
        for pid in dead:
            self._release(pid)
        return dead

    def _release(self, plan_id: int) -> None:
        del self._plans[plan_id]
        self.cache.unpin(plan_id)
