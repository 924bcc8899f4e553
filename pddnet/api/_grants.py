"""The blocks a decode endpoint grants for a request's KV, and their return.

:class:`BlockGrants` (RLD) allocates a request's blocks from the engine,
grants the prompt's to the data-path receiver, waits for the transfer while
renewing P's lease, and frees the blocks at the end, revoking a grant still
live first. :class:`CachedGrants` (MD) consults the decode-side radix cache
first: it pins the prefix it holds, grants only the missing blocks, evicts
exactly the shortfall when the engine lacks free blocks, and caches a landed
prompt's full blocks when the request ends.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from .._errors import PddnetError
from ..cache import CacheServer, DrcPlanRequest
from ..control import ControlNode
from ..handoff import DecodeEngine
from ..kv import KVPool, block_ranges
from ..transport import Receiver
from ..transport.wan import WanReceiver
from ..wire import encode_tokens
from ._messages import LeaseRenew
from ._record import RequestRecord

__all__ = ["BlockGrants", "CachedGrants"]

log = logging.getLogger("pddnet.api")


class BlockGrants:
    """Blocks and KV grants of the requests one decoder receives.

    Args:
        engine: allocates and frees the blocks.
        pool: the KV pool the blocks index.
        receiver: the data-path receiver the grants go to.
        node: the control node (lease renewals to P).
        lease_s: P's lease; it is renewed every third of it.
    """

    def __init__(
        self,
        engine: DecodeEngine,
        pool: KVPool,
        receiver: Receiver,
        node: ControlNode,
        lease_s: float,
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.receiver = receiver
        self.node = node
        self.lease_s = lease_s
        self.received = 0  # blocks granted to transfers
        self.cached_hit = 0  # blocks a cache hit saved

    def reserve(self, req: RequestRecord) -> tuple[Any, int]:
        """Allocate ``req``'s blocks (cached prefix first) and grant the prompt's
        missing ones to the receiver; sets ``req.table``, ``owned``, ``transfer_id``.

        Returns:
            The receiver's grant, and how many leading blocks the cache held.

        Raises:
            ResourceLimitError: too few free blocks.
            PddnetError: the receiver refused the grant (its own bounds);
                nothing stays allocated or pinned.
        """
        layout = self.pool.layout
        skip, hit_ids = self._plan(req)
        total_blocks = layout.blocks_for_tokens(req.prompt.size + req.max_tokens)
        prompt_blocks = layout.blocks_for_tokens(req.prompt.size)
        try:
            owned = self._allocate(total_blocks - skip)
        except PddnetError:
            self._release_plan(req)
            raise
        req.owned = owned
        req.table = hit_ids + owned
        dst = owned[: prompt_blocks - skip]
        ranges = block_ranges(layout, self.pool.num_blocks, dst)
        extra: dict[str, Any] = {"peer": req.p} if isinstance(self.receiver, WanReceiver) else {}
        try:  # the receiver's own bounds (WanLimits) may refuse the grant
            grant = self.receiver.grant(
                self.pool.host_views(),
                ranges,
                num_layers=layout.num_layers,
                timeout=req.params.kv_timeout_s,
                **extra,
            )
        except PddnetError:
            self.free(req)
            raise
        req.transfer_id = grant.transfer_id
        self.received += len(dst)
        self.cached_hit += skip
        return grant, skip

    async def wait(self, req: RequestRecord) -> None:
        """Wait for the prompt KV, renewing P's lease meanwhile; sets ``req.landed``.

        Raises:
            PddnetError: the transfer failed, timed out or was cancelled.

        Cancellation: the grant stays; :meth:`free` revokes it.
        """
        error: PddnetError | None = None
        async with trio.open_nursery() as nursery:

            async def renew() -> None:
                while True:
                    await trio.sleep(self.lease_s / 3)
                    try:
                        await self.node.send(req.p, LeaseRenew(req.rid), timeout=self.lease_s / 3)
                    except PddnetError as exc:
                        log.info(
                            "%s: lease renewal for %s failed: %s", self.node.name, req.rid, exc
                        )

            nursery.start_soon(renew)
            try:
                await self.receiver.wait_transfer(req.transfer_id)
            except PddnetError as exc:  # raised below, outside the nursery's group
                error = exc
            finally:
                nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        req.landed.set()

    def free(self, req: RequestRecord) -> None:
        """Give the request's blocks back (idempotent)."""
        if req.transfer_id and not req.landed.is_set():
            # A grant still live would write the transfer's bytes into blocks that
            # may be another request's by then: revoke it first (idempotent; the
            # WAN receiver drops a payload revoked mid-chunk).
            self.receiver.cancel(req.transfer_id)
        if req.owned:
            self.engine.free(req.owned)
            req.owned = []

    def _plan(self, req: RequestRecord) -> tuple[int, list[int]]:
        """(cached leading blocks, their ids): none without a cache."""
        return 0, []

    def _allocate(self, n: int) -> list[int]:
        return [int(b) for b in self.engine.allocate(n)]

    def _release_plan(self, req: RequestRecord) -> None:
        """Unpin the request's cached prefix; nothing without a cache."""


class CachedGrants(BlockGrants):
    """:class:`BlockGrants` in front of MD's decode-side radix cache.

    Takes the arguments of :class:`BlockGrants`, plus:

    Args:
        drc: the cache server over MD's radix cache.
    """

    def __init__(self, *args: Any, drc: CacheServer, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.drc = drc
        self.cache = drc.cache

    def free(self, req: RequestRecord) -> None:
        """Cache the prompt's full blocks if its KV landed in them (also when
        RLD kept the request after MD's KV landed), free the rest."""
        if req.landed.is_set() and req.plan_id is not None and req.owned:
            hit = self.drc.plan(req.plan_id).hit_blocks
            full = req.prompt.size // self.cache.block_size
            result = self.drc.complete(req.plan_id, req.owned[: full - hit])
            req.plan_id = None
            keep = set(req.owned[: full - hit]) - {int(b) for b in result.unused_block_ids}
            self.engine.free([b for b in req.owned if b not in keep])
            req.owned = []
            return
        self._release_plan(req)
        super().free(req)

    def _plan(self, req: RequestRecord) -> tuple[int, list[int]]:
        plan_req = DrcPlanRequest(
            request_id=str(req.rid),
            tokens=encode_tokens(req.prompt),
            num_tokens=int(req.prompt.size),
            block_size=self.cache.block_size,
            predicted_blocks=0,
        )
        reply = self.drc.handle_plan(plan_req, trio.current_time())
        req.plan_id = reply.plan_id
        plan = self.drc.plan(reply.plan_id)
        return plan.hit_blocks, [int(b) for b in plan.hit_block_ids]

    def _allocate(self, n: int) -> list[int]:
        short = n - self.engine.free_blocks()
        if short > 0:  # make room from the cache's unpinned, least recently used blocks
            self.engine.free(self.cache.evict(short))
        return super()._allocate(n)

    def _release_plan(self, req: RequestRecord) -> None:
        if req.plan_id is not None:
            self.drc.abort(req.plan_id)
            req.plan_id = None
