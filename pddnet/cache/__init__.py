"""The decode-side radix cache (DRC) and prefix-delta planning.

MD keeps a :class:`RadixCache` of history KV blocks and serves it through a
:class:`CacheServer` (events and the plan handshake). P keeps a
:class:`CacheMirror` fed by MD's events and uses it to plan which blocks of a
prompt to send over the WAN (:class:`DeltaPlan`). The protocol is in
docs/drc.md.
"""

from ._hash import K_HASH_ALGOS, K_ROOT_KEY, block_hashes
from ._messages import (
    DrcEvicted,
    DrcInserted,
    DrcPlanAbort,
    DrcPlanReply,
    DrcPlanRequest,
    DrcSnapshot,
    DrcSnapshotRequest,
)
from ._mirror import CacheMirror, DeltaPlan, MirrorStats
from ._radix import CacheOp, CacheStats, InsertResult, Match, RadixCache
from ._server import CacheServer, ServerPlan

__all__ = [
    "K_HASH_ALGOS",
    "K_ROOT_KEY",
    "CacheMirror",
    "CacheOp",
    "CacheServer",
    "CacheStats",
    "DeltaPlan",
    "DrcEvicted",
    "DrcInserted",
    "DrcPlanAbort",
    "DrcPlanReply",
    "DrcPlanRequest",
    "DrcSnapshot",
    "DrcSnapshotRequest",
    "InsertResult",
    "Match",
    "MirrorStats",
    "RadixCache",
    "ServerPlan",
    "block_hashes",
]
