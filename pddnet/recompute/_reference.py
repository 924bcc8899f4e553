"""NumPy reference kernels: the CPU path, and the oracle for the CuPy kernels.

Each function here has a CuPy twin in :mod:`pddnet.recompute._cuda` with the same
signature; :func:`pddnet.recompute.kernels_for` picks one by array module. All
activations are float32. The paged KV cache is passed as two views
``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, kv_heads, head_dim]``
(slices of a :class:`~pddnet.kv.KVLayout` layer buffer, in either block-major or
KV-major layout), in float32, float16, or bfloat16 stored as uint16.

Positions are absolute: token ``t`` of a sequence lives in slot
``t % block_size`` of block ``block_table[t // block_size]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "bf16_to_f32",
    "extend_attention",
    "f32_to_bf16",
    "kv_write",
    "rms_norm",
    "rope_",
]


def bf16_to_f32(a: Any) -> Any:
    """bfloat16 bits (uint16) to float32."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a: Any) -> Any:
    """float32 to bfloat16 bits (uint16), rounding to nearest even (as ``__float2bfloat16_rn``)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    return rounded.astype(np.uint16)


def _load(a: Any) -> Any:
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)


def _store(values: Any, dtype: np.dtype[Any]) -> Any:
    return f32_to_bf16(values) if dtype == np.uint16 else values.astype(dtype, copy=False)


def rms_norm(x: Any, weight: Any, eps: float, *, out: Any = None) -> Any:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis.

    Args:
        x: ``[rows, hidden]`` float32.
        weight: ``[hidden]`` float32 gain.
        eps: epsilon inside the square root.
        out: optional ``[rows, hidden]`` float32 destination.

    Returns:
        ``out`` (or a new array).
    """
    ms = np.einsum("ij,ij->i", x, x, dtype=np.float32) / np.float32(x.shape[-1])
    r = (np.float32(1.0) / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    if out is None:
        out = np.empty_like(x, dtype=np.float32)
    np.multiply(x, r[:, None], out=out)
    out *= weight
    return out


def rope_(x: Any, start: int, theta: float) -> None:
    """Rotate-half RoPE, in place, for tokens at positions ``start .. start+n-1``.

    Angles and the rotation are computed in float64 (as the CUDA kernel does),
    so both paths agree to float32 rounding even at 64K positions.

    Args:
        x: ``[n, heads, head_dim]`` float32, C-contiguous; modified in place.
        start: position of ``x[0]``.
        theta: RoPE base.
    """
    n, _, d = x.shape
    half = d // 2
    inv = np.power(float(theta), -2.0 * np.arange(half, dtype=np.float64) / d)
    ang = np.arange(start, start + n, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x1 = x[..., :half].astype(np.float64)
    x2 = x[..., half:].astype(np.float64)
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:] = x2 * cos + x1 * sin


def kv_write(k_cache: Any, v_cache: Any, block_table: Any, start: int, k: Any, v: Any) -> None:
    """Scatter new K and V rows into their paged slots.

    Writes exactly the slots of positions ``start .. start+n-1`` and nothing else
    (earlier slots of a partly filled block are left alone).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` views.
        block_table: int32 block ids of the sequence, covering ``start + n`` tokens.
        start: position of the first new token.
        k, v: ``[n, kv_heads, head_dim]`` float32.
    """
    n = k.shape[0]
    bs = k_cache.shape[1]
    pos = np.arange(start, start + n)
    blocks = np.asarray(block_table)[pos // bs]
    slots = pos % bs
    k_cache[blocks, slots] = _store(k, k_cache.dtype)
    v_cache[blocks, slots] = _store(v, v_cache.dtype)


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
    """Attention of ``n`` new tokens over a paged prefix plus themselves.

    The new tokens' K and V must already be in the cache (:func:`kv_write`).
    Row ``i`` (position ``start + i``) attends to positions ``0 .. start + i``:
    all of the prefix and causally within the new tokens. GQA: query head ``h``
    uses KV head ``h // (heads // kv_heads)``. Softmax in float32.

    Args:
        q: ``[n, heads, head_dim]`` float32 (RoPE applied).
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` views.
        block_table: int32 block ids covering ``start + n`` tokens.
        start: tokens already in the cache before the new ones.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[n, heads, head_dim]`` float32 destination.

    Returns:
        ``out`` (or a new array): the attention output per head.
    """
    n, heads, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = heads // kvh
    length = start + n
    ids = np.asarray(block_table)[: -(-length // bs)]
    keys = _load(k_cache[ids]).reshape(-1, kvh, d)[:length]
    vals = _load(v_cache[ids]).reshape(-1, kvh, d)[:length]
    qg = q.reshape(n, kvh, g, d).transpose(1, 0, 2, 3).reshape(kvh, n * g, d)
    s = np.matmul(qg * np.float32(scale), keys.transpose(1, 2, 0))  # [kvh, n*g, length]
    if n > 1:  # the prefix is visible to all; causal among the new tokens only
        hidden = np.arange(n)[None, :] > np.arange(n)[:, None]
        bias = np.where(hidden, np.float32(-np.inf), np.float32(0.0))
        s.reshape(kvh, n, g, length)[..., start:] += bias[None, :, None, :]
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    # a column of ones after V yields the softmax denominators in the same matmul,
    # and normalising the [n*g, d] output is cheaper than the [n*g, length] weights
    vals1 = np.empty((kvh, length, d + 1), np.float32)
    vals1[..., :d] = vals.transpose(1, 0, 2)
    vals1[..., d] = 1.0
    o1 = np.matmul(s, vals1)  # [kvh, n*g, d+1]
    o = o1[..., :d] / o1[..., d:]
    if out is None:
        out = np.empty((n, heads, d), np.float32)
    out[...] = o.reshape(kvh, n, g, d).transpose(1, 0, 2, 3).reshape(n, heads, d)
    return out
