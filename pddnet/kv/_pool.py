"""A view of an engine's KV arrays, without copying them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import LayoutMismatch
from ._layout import KVLayout
from ._ranges import ByteRanges, block_ranges

__all__ = ["KVPool"]


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.startswith("cupy")


class KVPool:
    """Wraps the engine's KV buffers (NumPy or CuPy arrays) in place.

    The pool never copies or reallocates: it checks that each buffer has the
    shape and dtype ``layout`` implies and is C-contiguous, and then hands out
    byte views of it. Writes through those views land in the engine's memory.

    Args:
        layout: the KV layout.
        buffers: one array per layer, or a single fused array, as the layout says.
        num_blocks: blocks in the pool; inferred from the first buffer if omitted.

    Raises:
        LayoutMismatch: if a buffer disagrees with the layout.
    """

    def __init__(
        self, layout: KVLayout, buffers: Sequence[Any], num_blocks: int | None = None
    ) -> None:
        buffers = list(buffers)
        if len(buffers) != layout.num_buffers():
            raise LayoutMismatch(f"layout wants {layout.num_buffers()} buffers, got {len(buffers)}")
        if num_blocks is None:
            axis = 1 if layout.kv_major else 0
            if layout.fused:
                axis += 1
            num_blocks = int(buffers[0].shape[axis])
        expected = layout.buffer_shape(num_blocks)
        for i, buf in enumerate(buffers):
            if tuple(buf.shape) != expected:
                raise LayoutMismatch(f"buffer {i} has shape {tuple(buf.shape)}, want {expected}")
            if buf.dtype.itemsize != layout.np_dtype.itemsize:
                raise LayoutMismatch(f"buffer {i} has dtype {buf.dtype}, want {layout.dtype}")
            if not buf.flags.c_contiguous:
                raise LayoutMismatch(f"buffer {i} is not C-contiguous")
        self.layout = layout
        self.num_blocks = num_blocks
        self.buffers = buffers
        self.on_device = _is_cupy(buffers[0])
        self._host_views: list[memoryview] | None = None

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, *, fill: int | None = 0) -> KVPool:
        """A host pool of fresh NumPy arrays (for tests, benchmarks and the demo)."""
        shape = layout.buffer_shape(num_blocks)
        make = np.zeros if fill == 0 else np.empty
        buffers = [make(shape, dtype=layout.np_dtype) for _ in range(layout.num_buffers())]
        if fill not in (0, None):
            for b in buffers:
                b.view(np.uint8).fill(fill)
        return cls(layout, buffers, num_blocks)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers)

    def host_views(self) -> list[memoryview]:
        """Flat writable byte views of host buffers (``recv_into`` targets).

        Raises:
            LayoutMismatch: for device buffers, which have no host view.
        """
        if self.on_device:
            raise LayoutMismatch("device KV buffers have no host byte view")
        if self._host_views is None:
            self._host_views = [memoryview(b.reshape(-1).view(np.uint8)) for b in self.buffers]
        return self._host_views

    def ranges(self, block_ids: Any) -> ByteRanges:
        """Byte ranges of ``block_ids`` in this pool (see :func:`block_ranges`)."""
        return block_ranges(self.layout, self.num_blocks, block_ids)

    def read(self, ranges: ByteRanges, lo: int = 0, hi: int | None = None) -> bytes:
        """Copy logical ``[lo, hi)`` of ``ranges`` out of the pool (tests, small messages)."""
        views = self.host_views()
        hi = ranges.total if hi is None else hi
        return b"".join(bytes(views[b][o : o + n]) for b, o, n in ranges.pieces(lo, hi))

    def write(self, ranges: ByteRanges, data: bytes | memoryview, lo: int = 0) -> None:
        """Copy ``data`` into logical ``[lo, lo+len(data))`` of ``ranges``."""
        views = self.host_views()
        pos = 0
        mv = memoryview(data).cast("B")
        for b, o, n in ranges.pieces(lo, lo + len(mv)):
            views[b][o : o + n] = mv[pos : pos + n]
            pos += n
