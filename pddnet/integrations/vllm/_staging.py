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


def _layers(pool: KVPool) -> list[Any]:
    """One array ``[blocks, ...]`` per layer (views)."""
    if pool.layout.kv_major:
        raise LayoutMismatch("copy_blocks: K/V-major pools are not supported")
    if pool.layout.fused:
        return [pool.buffers[0][i] for i in range(pool.layout.num_layers)]
    return list(pool.buffers)


def copy_blocks(src: KVPool, dst: KVPool, src_ids: Any, dst_ids: Any) -> int:
    """Copy blocks ``src_ids`` of ``src`` into ``dst_ids`` of ``dst``, every layer.

    One NumPy slice copy per layer per run of blocks consecutive on both sides
    (no gather into a temporary).

    Returns:
        The bytes copied.

    Raises:
        LayoutMismatch: if the pools' layouts differ (``fused`` aside), or
            for K/V-major pools.
    """
    a, b = src.layout, dst.layout
    if KVLayout(**{**a.to_dict(), "fused": False}) != KVLayout(**{**b.to_dict(), "fused": False}):
        raise LayoutMismatch(f"copy_blocks: {a} -> {b}")
    runs = _runs([int(b) for b in src_ids], [int(b) for b in dst_ids])
    for s_layer, d_layer in zip(_layers(src), _layers(dst), strict=True):
        for s, d, n in runs:
            d_layer[d : d + n] = s_layer[s : s + n]
    return sum(n for _, _, n in runs) * a.block_bytes


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src, dst, count)`` runs consecutive on both sides. Plain Python: a
    load is a handful of blocks, where NumPy's coalesce_pairs cost more than
    the copy (measured: docs/vllm.md)."""
    if len(src) != len(dst):
        raise LayoutMismatch(f"{len(src)} source blocks but {len(dst)} destination blocks")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
