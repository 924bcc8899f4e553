"""Block-range arithmetic, vectorised with NumPy.

Engines address KV by block index. Transports move bytes. This module turns
the one into the other without a Python loop per block: NIXL users lost
seconds to per-block descriptor lists, so a plan for 100,000 blocks is built
with a handful of array operations (``pddnet bench kv`` measures it).

Terms:

* a **run** is a maximal stretch of consecutive block ids (on both sides, for
  a transfer) and is coalesced into one byte range per plane;
* a :class:`ByteRanges` is a set of ``(buffer, offset, length)`` ranges in a
  fixed order, with the *logical* offset of each range in the concatenated
  stream. Transfers address bytes by logical offset, so a grant is simply
  ``[0, total)`` and bounds checks are one comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LayoutMismatch
from ._layout import KVLayout

__all__ = ["ByteRanges", "TransferPlan", "coalesce", "coalesce_pairs", "block_ranges"]

IntArray = npt.NDArray[np.int64]


def _as_ids(block_ids: Any, num_blocks: int | None, what: str) -> IntArray:
    ids = np.ascontiguousarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size and num_blocks is not None and (ids.min() < 0 or ids.max() >= num_blocks):
        raise LayoutMismatch(f"{what} block ids must lie in [0, {num_blocks})")
    return ids


def coalesce(block_ids: Any) -> tuple[IntArray, IntArray]:
    """Split block ids into runs of consecutive ids.

    Returns:
        ``(starts, counts)``: run ``i`` covers ``starts[i] .. starts[i]+counts[i]-1``.
        Order is preserved; ids need not be sorted.
    """
    ids = _as_ids(block_ids, None, "")
    if ids.size == 0:
        empty = np.empty(0, np.int64)
        return empty, empty.copy()
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    first = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((first, [ids.size])))
    return ids[first], counts.astype(np.int64)


def coalesce_pairs(src_ids: Any, dst_ids: Any) -> tuple[IntArray, IntArray, IntArray]:
    """Runs that are consecutive on both sides of a block mapping.

    Returns:
        ``(src_starts, dst_starts, counts)``.
    """
    src = _as_ids(src_ids, None, "source")
    dst = _as_ids(dst_ids, None, "destination")
    if src.shape != dst.shape:
        raise LayoutMismatch(f"{src.size} source blocks but {dst.size} destination blocks")
    if src.size == 0:
        empty = np.empty(0, np.int64)
        return empty, empty.copy(), empty.copy()
    joined = (np.diff(src) == 1) & (np.diff(dst) == 1)
    first = np.concatenate(([0], np.flatnonzero(~joined) + 1))
    counts = np.diff(np.concatenate((first, [src.size])))
    return src[first], dst[first], counts.astype(np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class ByteRanges:
    """Byte ranges in transfer order, with their position in the logical stream.

    All fields are equal-length int64 arrays (``layer`` is the KV layer each
    range belongs to). ``logical[i]`` is the stream offset of range ``i``.
    """

    buffer: IntArray
    offset: IntArray
    length: IntArray
    layer: IntArray
    logical: IntArray

    @classmethod
    def build(cls, buffer: Any, offset: Any, length: Any, layer: Any) -> ByteRanges:
        length = np.asarray(length, dtype=np.int64)
        logical = np.zeros(length.size, np.int64)
        if length.size:
            np.cumsum(length[:-1], out=logical[1:])
        return cls(
            np.asarray(buffer, dtype=np.int64),
            np.asarray(offset, dtype=np.int64),
            length,
            np.asarray(layer, dtype=np.int64),
            logical,
        )

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def total(self) -> int:
        return int(self.logical[-1] + self.length[-1]) if self.length.size else 0

    def layer_bounds(self, num_layers: int) -> IntArray:
        """Logical ``[start, end)`` of each layer as a ``(num_layers, 2)`` array.

        Ranges are layer-major, so each layer is one contiguous logical stretch
        (empty layers get ``start == end``).
        """
        starts = np.searchsorted(self.layer, np.arange(num_layers), side="left")
        ends = np.searchsorted(self.layer, np.arange(num_layers), side="right")
        bounds = np.empty((num_layers, 2), np.int64)
        ext = np.concatenate((self.logical, [self.total]))
        bounds[:, 0] = ext[starts]
        bounds[:, 1] = ext[ends]
        return bounds

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The ``(buffer, offset, length)`` pieces that logical ``[lo, hi)`` covers.

        Raises:
            LayoutMismatch: if ``[lo, hi)`` is not inside ``[0, total)``.
        """
        if not 0 <= lo <= hi <= self.total:
            raise LayoutMismatch(f"logical range [{lo}, {hi}) outside [0, {self.total})")
        out: list[tuple[int, int, int]] = []
        i = int(np.searchsorted(self.logical, lo, side="right")) - 1
        pos = lo
        while pos < hi:
            start = int(self.logical[i])
            skip = pos - start
            take = min(int(self.length[i]) - skip, hi - pos)
            out.append((int(self.buffer[i]), int(self.offset[i]) + skip, take))
            pos += take
            i += 1
        return out

    def select_layers(self, layers: Any) -> ByteRanges:
        """The ranges of the given layers only, in order, with a fresh logical space."""
        keep = np.isin(self.layer, np.asarray(layers, dtype=np.int64))
        return ByteRanges.build(
            self.buffer[keep], self.offset[keep], self.length[keep], self.layer[keep]
        )


def _expand(layout: KVLayout, num_blocks: int, starts: IntArray, counts: IntArray) -> ByteRanges:
    planes = layout.planes(num_blocks)
    base = np.array([p.base for p in planes], np.int64)[:, None]
    stride = np.array([p.block_bytes for p in planes], np.int64)[:, None]
    nruns = starts.size
    buffer = np.repeat(np.array([p.buffer for p in planes], np.int64), nruns)
    layer = np.repeat(np.array([p.layer for p in planes], np.int64), nruns)
    offset = (base + starts[None, :] * stride).reshape(-1)
    length = (counts[None, :] * stride).reshape(-1)
    return ByteRanges.build(buffer, offset, length, layer)


def block_ranges(layout: KVLayout, num_blocks: int, block_ids: Any) -> ByteRanges:
    """Byte ranges of ``block_ids`` in a pool of ``num_blocks`` blocks.

    Ranges are ordered layer-major (all of layer 0's planes, then layer 1's...)
    and, within a plane, in the order of ``block_ids``; consecutive ids are
    coalesced into one range.
    """
    ids = _as_ids(block_ids, num_blocks, "")
    starts, counts = coalesce(ids)
    return _expand(layout, num_blocks, starts, counts)


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    """Source and destination ranges of a block mapping, range for range.

    ``src.length == dst.length`` elementwise and both share one logical space,
    so logical stream offset ``x`` is read from ``src`` and written to ``dst``.
    """

    src: ByteRanges
    dst: ByteRanges
    num_blocks: int

    @classmethod
    def build(
        cls,
        layout: KVLayout,
        src_pool_blocks: int,
        src_ids: Any,
        dst_pool_blocks: int,
        dst_ids: Any,
        dst_layout: KVLayout | None = None,
    ) -> TransferPlan:
        """Plan copying block ``src_ids[i]`` to block ``dst_ids[i]`` for every ``i``.

        Raises:
            LayoutMismatch: if the id lists differ in length, an id is out of its
                pool, or the destination layout is incompatible.
        """
        dst_layout = dst_layout or layout
        layout.check_compatible(dst_layout)
        src = _as_ids(src_ids, src_pool_blocks, "source")
        dst = _as_ids(dst_ids, dst_pool_blocks, "destination")
        s, d, n = coalesce_pairs(src, dst)
        return cls(
            _expand(layout, src_pool_blocks, s, n),
            _expand(dst_layout, dst_pool_blocks, d, n),
            int(src.size),
        )

    @property
    def total(self) -> int:
        return self.src.total
