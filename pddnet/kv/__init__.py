"""KV layout, the engine's KV memory, and block-range arithmetic."""

from ._layout import KVLayout, Plane
from ._pool import KVPool
from ._ranges import ByteRanges, TransferPlan, block_ranges, coalesce, coalesce_pairs

__all__ = [
    "ByteRanges",
    "KVLayout",
    "KVPool",
    "Plane",
    "TransferPlan",
    "block_ranges",
    "coalesce",
    "coalesce_pairs",
]
