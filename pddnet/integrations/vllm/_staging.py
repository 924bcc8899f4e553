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

__all__ = ["copy_blocks", "open_staging"]


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
    if src.layout.kv_major or dst.layout.kv_major:
        raise LayoutMismatch("copy_blocks: K/V-major pools are not supported")
    if src.layout.fused and dst.layout.fused:
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
    into a temporary. Per call this is a few microseconds of Python
    (measured: docs/vllm.md, ``pddnet bench vllm``).

    Returns:
        The bytes copied.

    Raises:
        LayoutMismatch: if the pools' layouts differ (``fused`` aside), or
            for K/V-major pools.
    """
    a, b = src.layout, dst.layout
    if {**a.to_dict(), "fused": False} != {**b.to_dict(), "fused": False}:
        raise LayoutMismatch(f"copy_blocks: {a} -> {b}")
    runs = _runs([int(i) for i in src_ids], [int(i) for i in dst_ids])
    for s_buf, d_buf in _views(src, dst):
        for s, d in runs:
            n = len(d)
            if d == list(range(d[0], d[0] + n)):
                d_buf[:, d[0] : d[0] + n] = s_buf[:, s : s + n]
            else:
                d_buf[:, d] = s_buf[:, s : s + n]
    return sum(len(d) for _, d in runs) * a.block_bytes


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, list[int]]]:
    """``(first source block, destination blocks)`` per run of consecutive
    source blocks. Plain Python: a load is a handful of runs, where NumPy's
    coalesce_pairs cost more than the copy (measured: docs/vllm.md)."""
    if len(src) != len(dst):
        raise LayoutMismatch(f"{len(src)} source blocks but {len(dst)} destination blocks")
    out: list[tuple[int, list[int]]] = []
    for s, d in zip(src, dst, strict=True):
        if out and s == out[-1][0] + len(out[-1][1]):
            out[-1][1].append(d)
        else:
            out.append((s, [d]))
    return out
