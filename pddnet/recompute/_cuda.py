"""CuPy RawKernels with the signatures of :mod:`pddnet.recompute._reference`.

The CUDA sources live in ``kernels/*.cu`` (shipped as package data) and are
compiled by NVRTC through ``cupy.RawModule``; they include nothing outside
their folder (no cuda_fp16.h: fp16/bf16 are converted with PTX and bit
arithmetic), so no toolkit headers are needed. Compile-time parameters are ``-D``
defines; a module is memoised per ``(device, source, kv dtype, config)``.
Grids and blocks are computed here, at the call sites. Everything runs on
CuPy's current stream and nothing here synchronises.

CuPy is imported lazily (:func:`pddnet._optional.require`), so importing this
module without the ``gpu`` extra raises :class:`~pddnet.MissingExtraError` only
when a kernel is first used.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import LayoutMismatch
from .._optional import require

__all__ = ["extend_attention", "kernel_code", "kernel_source_dir", "kv_write", "rms_norm", "rope_"]

K_KERNEL_DIR = Path(__file__).with_name("kernels")
# extend attention: warps per block, context positions per tile (match the .cu defines)
K_WARPS = 4
K_TILE = 32
K_MAX_HEAD_DIM = 128
# KV storage dtype (NumPy spelling; bf16 is stored as uint16) -> KV_DTYPE define
K_KV_DTYPES = {"float32": 0, "float16": 1, "uint16": 2}


def kernel_source_dir() -> Path:
    """The folder holding the ``.cu`` sources."""
    return K_KERNEL_DIR


def _cp() -> Any:
    return require("cupy")


def kernel_code(source: str) -> str:
    """The text NVRTC compiles for ``source``: the file with ``prelude.cu`` inlined.

    Inlining (rather than ``-I``) keeps the compile self-contained and makes the
    prelude part of the text CuPy keys its kernel cache on.
    """
    prelude = (K_KERNEL_DIR / "prelude.cu").read_text().replace("#pragma once\n", "")
    return (K_KERNEL_DIR / source).read_text().replace('#include "prelude.cu"', prelude)


@functools.cache
def _module(device: int, source: str, kv_dtype: str, config: tuple[tuple[str, int], ...]) -> Any:
    """The compiled module of ``source`` for one device, KV dtype and config."""
    cp = _cp()
    defines = [f"-DKV_DTYPE={K_KV_DTYPES[kv_dtype]}"]
    defines += [f"-D{name}={value}" for name, value in config]
    with cp.cuda.Device(device):
        return cp.RawModule(code=kernel_code(source), options=tuple(defines))


def _function(source: str, name: str, kv_dtype: str, **config: int) -> Any:
    cp = _cp()
    device = cp.cuda.Device().id
    return _module(device, source, kv_dtype, tuple(sorted(config.items()))).get_function(name)


@functools.cache
def _sm_count(device: int) -> int:
    return int(_cp().cuda.Device(device).attributes["MultiProcessorCount"])


def _grid_1d(total: int, block: int) -> int:
    return max(1, min(-(-total // block), 65535 * 8))


def _alias(view: Any) -> Any:
    """A contiguous 1-element alias starting at ``view``'s first element.

    RawKernels take raw pointers; aliasing makes the pointer passed exactly
    ``view.data.ptr`` whatever the view's strides (the strides go in as ints).
    """
    cp = _cp()
    return cp.ndarray((1,), dtype=view.dtype, memptr=view.data)


def _f32(a: Any, what: str) -> Any:
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise LayoutMismatch(f"{what} must be a C-contiguous float32 CuPy array")
    return a


def _cache_strides(k_cache: Any, v_cache: Any) -> tuple[str, int]:
    """KV dtype key and the block stride (elements) of two paged views."""
    if k_cache.shape != v_cache.shape or k_cache.strides != v_cache.strides:
        raise LayoutMismatch("k_cache and v_cache views differ in shape or strides")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype.name not in K_KV_DTYPES:
        raise LayoutMismatch(f"unsupported KV dtype {k_cache.dtype}")
    _, _, kvh, d = k_cache.shape
    item = k_cache.dtype.itemsize
    if k_cache.strides[1:] != (kvh * d * item, d * item, item):
        raise LayoutMismatch("a KV block's [block_size, kv_heads, head_dim] must be dense")
    if k_cache.strides[0] % item:
        raise LayoutMismatch("KV block stride is not a whole number of elements")
    return k_cache.dtype.name, k_cache.strides[0] // item


def _table(block_table: Any) -> Any:
    cp = _cp()
    return cp.ascontiguousarray(cp.asarray(block_table), dtype=cp.int32)


def rms_norm(x: Any, weight: Any, eps: float, *, out: Any = None) -> Any:
    """CuPy twin of :func:`pddnet.recompute._reference.rms_norm`."""
    cp = _cp()
    _f32(x, "x")
    _f32(weight, "weight")
    rows, hidden = x.shape
    if out is None:
        out = cp.empty_like(x)
    block = min(1024, max(32, 32 * -(-min(hidden, 1024) // 32)))
    block = 256 if hidden >= 256 else block
    fn = _function("rms_norm.cu", "pdd_rms_norm", "float32")
    fn((rows,), (block,), (x, weight, _f32(out, "out"), np.int32(hidden), np.float32(eps)))
    return out


def rope_(x: Any, start: int, theta: float) -> None:
    """CuPy twin of :func:`pddnet.recompute._reference.rope_` (in place)."""
    _f32(x, "x")
    n, heads, d = x.shape
    total = n * heads * (d // 2)
    fn = _function("rope.cu", "pdd_rope", "float32")
    fn(
        (_grid_1d(total, 256),),
        (256,),
        (x, np.int32(n), np.int32(heads), np.int32(d), np.int32(start), np.float64(theta)),
    )


def kv_write(k_cache: Any, v_cache: Any, block_table: Any, start: int, k: Any, v: Any) -> None:
    """CuPy twin of :func:`pddnet.recompute._reference.kv_write`."""
    kv_dtype, block_stride = _cache_strides(k_cache, v_cache)
    _f32(k, "k")
    _f32(v, "v")
    n, kvh, d = k.shape
    bs = k_cache.shape[1]
    fn = _function("kv_write.cu", "pdd_kv_write", kv_dtype)
    total = n * kvh * d
    fn(
        (_grid_1d(total, 256),),
        (256,),
        (
            k,
            v,
            _alias(k_cache),
            _alias(v_cache),
            _table(block_table),
            np.int32(n),
            np.int32(start),
            np.int32(kvh),
            np.int32(d),
            np.int32(bs),
            np.int64(block_stride),
        ),
    )


def _rows_per_warp(rows: int) -> int:
    # Few query rows (decode, small n): one row per warp keeps all four warps busy.
    for rw in (1, 2):
        if rows <= K_WARPS * rw:
            return rw
    return 4


def plan_splits(rows: int, kv_heads: int, length: int, sm_count: int) -> tuple[int, int, int]:
    """``(rows_per_warp, splits, chunk)`` of an extend-attention launch.

    Splits the context so that about four blocks per SM are in flight, in chunks
    that are whole tiles.
    """
    rw = _rows_per_warp(rows)
    q_tiles = _cdiv(rows, K_WARPS * rw)
    want = _cdiv(4 * sm_count, kv_heads * q_tiles)
    splits = max(1, min(want, _cdiv(length, K_TILE)))
    chunk = K_TILE * _cdiv(_cdiv(length, splits), K_TILE)
    return rw, _cdiv(length, chunk), chunk


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extend_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    start: int,
    scale: float,
    *,
    out: Any = None,
) -> Any:
    """CuPy twin of :func:`pddnet.recompute._reference.extend_attention`."""
    cp = _cp()
    _f32(q, "q")
    kv_dtype, block_stride = _cache_strides(k_cache, v_cache)
    n, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    if d > K_MAX_HEAD_DIM or (d * k_cache.dtype.itemsize) % 16:
        raise LayoutMismatch(f"head_dim {d} unsupported: want <= {K_MAX_HEAD_DIM} and 16-byte rows")
    aligned = (k_cache.data.ptr, v_cache.data.ptr, block_stride * k_cache.dtype.itemsize)
    if any(a % 16 for a in aligned):
        raise LayoutMismatch("KV views must be 16-byte aligned")
    group = heads // kvh
    rows = n * group
    length = start + n
    rw, splits, chunk = plan_splits(rows, kvh, length, _sm_count(cp.cuda.Device().id))
    q_tiles = -(-rows // (K_WARPS * rw))
    part_acc = cp.empty((splits, n, heads, d), np.float32)
    part_ml = cp.empty((splits, n, heads, 2), np.float32)
    if out is None:
        out = cp.empty((n, heads, d), np.float32)
    _f32(out, "out")
    cfg = {"HEAD_DIM": d, "ROWS_PER_WARP": rw}
    attend = _function("extend_attention.cu", "pdd_extend_attention", kv_dtype, **cfg)
    attend(
        (q_tiles, kvh, splits),  # query tiles sharing a KV chunk launch together
        (K_WARPS * 32,),
        (
            q,
            _alias(k_cache),
            _alias(v_cache),
            _table(block_table),
            part_acc,
            part_ml,
            np.int32(n),
            np.int32(start),
            np.int32(heads),
            np.int32(kvh),
            np.int32(bs),
            np.int64(block_stride),
            np.int32(chunk),
            np.float32(scale * math.log2(math.e)),
        ),
    )
    combine = _function("extend_attention.cu", "pdd_attention_combine", kv_dtype, **cfg)
    combine(
        (n * heads,),
        (min(128, 32 * -(-d // 32)),),
        (part_acc, part_ml, out, np.int32(n * heads), np.int32(splits)),
    )
    return out
