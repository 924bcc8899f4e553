"""The staging pool a vLLM decoder lands KV in, and the copy into vLLM's blocks.

No vLLM import here: :class:`~pddnet.integrations.vllm.VllmDecodeEngine` maps
the pool (the file its connector created) and benchmarks time the copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import LayoutMismatch
from ...kv import KVLayout, KVPool

__all__ = ["BlockCopier", "copy_blocks", "open_staging"]


def open_staging(path: str | Path) -> KVPool:
    """Map the staging pool a :class:`DecodeKVConnector` created at ``path``.

    Raises:
        LayoutMismatch: if ``<path>.json`` does not describe the file.
    """
    desc = json.loads(Path(f"{path}.json").read_text())
    layout = KVLayout.from_dict(desc["layout"])
    n = int(desc["num_blocks"])
    if not layout.fused:
        raise LayoutMismatch(f"a staging pool is one fused buffer, {path} is {layout}")
    buffer = np.memmap(path, dtype=layout.np_dtype, mode="r+", shape=layout.buffer_shape(n))
    return KVPool(layout, [buffer], n)


def _views(src: KVPool, dst: KVPool) -> list[tuple[Any, Any]]:
    """``(src, dst)`` arrays ``[layers, blocks, ...]`` to copy between: one pair
    over every layer when both pools are fused, one per layer otherwise."""
    a, b = src.layout, dst.layout
    if a.kv_major or b.kv_major:
        raise LayoutMismatch("copy_blocks: K/V-major pools are not supported")
    if a.fused and b.fused:
        return [(src.buffers[0], dst.buffers[0])]
    return [(s[None], d[None]) for s, d in zip(_layers(src), _layers(dst), strict=True)]


def _layers(pool: KVPool) -> list[Any]:
    """One array ``[blocks, ...]`` per layer (views)."""
    if pool.layout.fused:
        return [pool.buffers[0][i] for i in range(pool.layout.num_layers)]
    return list(pool.buffers)


def copy_blocks(src: KVPool, dst: KVPool, src_ids: Any, dst_ids: Any) -> int:
    """Copy blocks ``src_ids`` of ``src`` into ``dst_ids`` of ``dst``, every layer.

    One NumPy assignment per run of consecutive source blocks, over every
    layer at once when both pools are fused (as vLLM's cache and the staging
    pool are): a slice when the run's destination blocks are consecutive too,
    else an index array on the destination side (vLLM's allocator hands out
    scattered blocks). The source is always a slice, so nothing is gathered
    into a temporary. :class:`BlockCopier` does the same between two fixed
    pools with the checks done once (what the decoder connector runs).

    Returns:
        The bytes copied.

    Raises:
        LayoutMismatch: if the pools' layouts differ (``fused`` aside), or
            for K/V-major pools.
    """
    return BlockCopier(src, dst)(src_ids, dst_ids)


class BlockCopier:
    """:func:`copy_blocks` from ``src`` to ``dst``, layouts checked and views built once.

    A call is then about a microsecond of Python beyond the NumPy
    assignments (``pddnet bench vllm``; docs/vllm.md): for a one-block load
    of the tiny model, 64 KiB in two 32 KiB spans, that is what decides the
    load rate.

    Raises:
        LayoutMismatch: if the pools' layouts differ (``fused`` aside), or
            for K/V-major pools.
    """

    __slots__ = ("_views",)

    def __init__(self, src: KVPool, dst: KVPool) -> None:
        a, b = src.layout, dst.layout
        if a != b and _unfused(a) != _unfused(b):
            raise LayoutMismatch(f"copy_blocks: {a} -> {b}")
        self._views = _views(src, dst)

    def __call__(self, src_ids: Any, dst_ids: Any) -> int:
        """Copy ``src_ids`` into ``dst_ids``; returns the bytes copied.

        Raises:
            LayoutMismatch: if the two id lists differ in length.
        """
        runs = _runs(src_ids, dst_ids)
        copied = 0
        for s_buf, d_buf in self._views:
            for s, d in runs:
                n = len(d)
                part = s_buf[:, s : s + n]
                first = d[0]
                if d[-1] - first == n - 1 and (n < 3 or d == list(range(first, first + n))):
                    d_buf[:, first : first + n] = part
                else:
                    d_buf[:, d] = part
                copied += part.nbytes
        return copied


def _unfused(layout: KVLayout) -> dict[str, Any]:
    return {**layout.to_dict(), "fused": False}


def _runs(src_ids: Any, dst_ids: Any) -> list[tuple[int, list[int]]]:
    """``(first source block, destination blocks)`` per run of consecutive
    source blocks. Plain Python: a load is a handful of runs, where NumPy's
    coalesce_pairs cost more than the copy (measured: docs/vllm.md)."""
    src, dst = _ints(src_ids), _ints(dst_ids)
    n = len(src)
    if n != len(dst):
        raise LayoutMismatch(f"{n} source blocks but {len(dst)} destination blocks")
    if n and src[-1] - src[0] == n - 1 and (n < 3 or src == list(range(src[0], src[0] + n))):
        return [(src[0], dst)]  # the usual load: one run of staged blocks
    out: list[tuple[int, list[int]]] = []
    for s, d in zip(src, dst, strict=True):
        if out and s == out[-1][0] + len(out[-1][1]):
            out[-1][1].append(d)
        else:
            out.append((s, [d]))
    return out


def _ints(ids: Any) -> list[int]:
    """Block ids as a list of ints (``tolist`` for an array: one call, not one per id)."""
    if isinstance(ids, np.ndarray):
        return list(ids.astype(np.int64, copy=False).tolist())
    return [int(i) for i in ids]
