"""The reference model: a Llama-style decoder over a paged KV cache.

One :class:`ReferenceModel` owns weights and wraps a :class:`~pddnet.kv.KVPool`;
any number of sequences share it, each a :class:`PagedSequence` (a block table
plus a length). The three operations are one code path:

* ``prefill(seq, tokens)``: ``extend`` from an empty sequence;
* ``decode_step(seq, token)``: ``extend`` by one token;
* ``extend(seq, tokens)``: a multi-token forward over the paged prefix
  ``[0, seq.length)``: it writes the KV of the new tokens and returns their
  logits. On MD this is the recompute of RLD's eager tokens.

The array module follows the pool: NumPy buffers run the float32 NumPy path,
CuPy buffers run the CUDA kernels (KV in fp16, bf16 or fp32; activations fp32,
GEMMs through ``cupy.matmul`` in the weights' dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import LayoutMismatch, LocalProtocolError, ResourceLimitError
from ..kv import KVPool
from ._config import ModelConfig
from ._ops import array_module, kernels_for
from ._threads import limit_blas_threads
from ._weights import Weights

__all__ = ["BlockAllocator", "PagedSequence", "ReferenceModel", "greedy"]


@dataclass(slots=True)
class PagedSequence:
    """A sequence's view of the pool: its blocks in order, and how many tokens they hold.

    Attributes:
        block_table: int32 block ids; token ``t`` lives in block
            ``block_table[t // block_size]``. May hold spare blocks beyond ``length``.
        length: tokens whose KV is in the cache.
    """

    block_table: Any = field(default_factory=lambda: np.empty(0, np.int32))
    length: int = 0

    def __post_init__(self) -> None:
        self.block_table = np.ascontiguousarray(self.block_table, dtype=np.int32).reshape(-1)
        if self.length < 0:
            raise LocalProtocolError(f"negative sequence length {self.length}")

    def capacity(self, block_size: int) -> int:
        """Tokens the current block table can hold."""
        return int(self.block_table.size) * block_size

    def blocks_in_use(self, block_size: int) -> Any:
        """The block ids that hold tokens ``[0, length)``."""
        return self.block_table[: -(-self.length // block_size)]


class BlockAllocator:
    """A free list of block ids (the demo's and tests' stand-in for an engine's).

    It keeps one flag per block (allocated or free), so a block returned twice,
    or one it never handed out, is refused loudly instead of being handed to
    two requests later (two sequences writing each other's KV: silently wrong
    tokens).

    Args:
        num_blocks: ids ``0 .. num_blocks-1`` start free.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated = np.zeros(num_blocks, dtype=np.bool_)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> Any:
        """``count`` free block ids as an int32 array.

        Raises:
            ResourceLimitError: if fewer than ``count`` blocks are free.
        """
        if count > len(self._free):
            raise ResourceLimitError(f"want {count} KV blocks, {len(self._free)} free")
        ids = np.asarray([self._free.pop() for _ in range(count)], dtype=np.int32)
        self._allocated[ids] = True
        return ids

    def free(self, block_ids: Any) -> None:
        """Return ``block_ids`` to the free list.

        Raises:
            LocalProtocolError: if an id is out of range, listed twice, or not
                allocated (freed already, or never handed out); then nothing is
                freed.
        """
        ids = np.asarray(block_ids).reshape(-1).astype(np.int64)
        if ids.size == 0:
            return
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise LocalProtocolError(
                f"free of block {int(bad[0])} outside 0..{self.num_blocks - 1}"
            )
        uniq, counts = np.unique(ids, return_counts=True)
        if uniq.size != ids.size:
            raise LocalProtocolError(f"free lists block {int(uniq[counts > 1][0])} twice")
        stale = ids[~self._allocated[ids]]
        if stale.size:
            raise LocalProtocolError(
                f"double free: {stale.size} of {ids.size} blocks are not allocated"
                f" (first: {int(stale[0])}); {len(self._free)} of {self.num_blocks} free"
            )
        self._allocated[ids] = False
        self._free.extend(ids[::-1].tolist())


def _kv_views(pool: KVPool) -> list[tuple[Any, Any]]:
    """Per layer, ``[num_blocks, block_size, kv_heads, head_dim]`` views of K and V.

    Views of the pool's own bytes, never copies: for a ``'pthd'`` per-layer
    pool they are plain slices, for another block interior (vLLM CPU's
    ``'hptd'``, with K transposed: ``key_order='dt'``) or a fused pool,
    strided views.
    """
    layout = pool.layout
    # axis names of one layer's array: "b" is the block axis
    names = ["p", "b", *layout.interior[1:]] if layout.kv_major else ["b", *layout.interior]
    order = [names.index(axis) for axis in "pbthd"]
    if layout.fused:
        layers = [pool.buffers[0][i] for i in range(layout.num_layers)]
    else:
        layers = list(pool.buffers)
    views = [layer.transpose(order) for layer in layers]
    if layout.key_order == "td":
        return [(v[0], v[1]) for v in views]
    # K's innermost [t, d] bytes hold [d, t]: view them so, then swap
    at = (slice(None),) * names.index("p") + (0,)
    rest = [axis for axis in names if axis != "p"]
    bs, d = layout.block_size, layout.head_dim
    keys = [
        layer[at]
        .reshape(*layer[at].shape[:-2], d, bs)
        .swapaxes(-1, -2)
        .transpose([rest.index(axis) for axis in "bthd"])
        for layer in layers
    ]
    return [(k, v[1]) for k, v in zip(keys, views, strict=True)]


def greedy(logits: Any) -> int:
    """The argmax token of a logits row (or of the last row of a 2-D array)."""
    row = logits[-1] if logits.ndim == 2 else logits
    return int(row.argmax())


class ReferenceModel:
    """A Llama-style decoder whose KV lives in a :class:`KVPool`.

    Args:
        config: model shape.
        weights: float32 weights (moved to the pool's device if it is CuPy).
        pool: its KV buffers (``mla=False``; block-major or KV-major; on the
            NumPy path also fused and with any block interior, such as vLLM
            CPU's ``'hptd'``; on the GPU per-layer ``'pthd'``). The pool is used
            in place: KV that arrives by transfer into it is visible to the
            model at once.
        allocator: if given, sequences grow into blocks taken from it;
            otherwise their block tables must already be large enough.
        matrix_dtype: GEMM dtype on the GPU path ("float16" or "float32");
            ignored on the NumPy path, which is float32 throughout.
        blas_threads: on the NumPy path, set OpenBLAS to this many threads
            (process-wide; see :func:`limit_blas_threads`); None leaves it alone.

    Raises:
        LayoutMismatch: if the pool's layout does not fit ``config``, or a NumPy
            pool is not float32.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        pool: KVPool,
        *,
        allocator: BlockAllocator | None = None,
        matrix_dtype: str = "float16",
        blas_threads: int | None = 1,
    ) -> None:
        self.xp = array_module(pool.buffers[0])
        config.check_layout(pool.layout, on_device=self.xp is not np)
        if weights.config != config:
            raise LayoutMismatch("weights were made for another ModelConfig")
        self.config = config
        self.pool = pool
        self.allocator = allocator
        self.block_size = pool.layout.block_size
        if self.xp is np:
            if pool.layout.np_dtype != np.float32:
                raise LayoutMismatch("the NumPy path keeps KV in float32")
            self.weights = weights
            if blas_threads is not None:
                limit_blas_threads(blas_threads)
        else:
            self.weights = weights.to(self.xp, matrix_dtype)
        self.kernels = kernels_for(self.xp)
        self.scale = float(config.head_dim) ** -0.5
        self._kv = _kv_views(pool)

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        num_blocks: int,
        *,
        block_size: int = 16,
        seed: int = 0,
        weights: Weights | None = None,
        fill: int | None = 0,
    ) -> ReferenceModel:
        """A NumPy model with seeded weights, a fresh float32 pool and an allocator."""
        pool = KVPool.allocate(config.kv_layout(block_size, "float32"), num_blocks, fill=fill)
        weights = weights or Weights.random(config, seed)
        return cls(config, weights, pool, allocator=BlockAllocator(num_blocks))

    def kv_views(self, layer: int) -> tuple[Any, Any]:
        """``(k_cache, v_cache)`` of ``layer``, each ``[num_blocks, block_size, kv_heads, d]``."""
        return self._kv[layer]

    # ------------------------------------------------------------ sequences
    def new_sequence(self, num_tokens: int = 0) -> PagedSequence:
        """An empty sequence with room for ``num_tokens`` (needs an allocator)."""
        seq = PagedSequence()
        self.reserve(seq, num_tokens)
        return seq

    def reserve(self, seq: PagedSequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens.

        Raises:
            ResourceLimitError: if it must grow and there is no allocator, or the
                allocator runs out.
        """
        need = -(-num_tokens // self.block_size) - int(seq.block_table.size)
        if need <= 0:
            return
        if self.allocator is None:
            raise ResourceLimitError(
                f"sequence holds {seq.capacity(self.block_size)} tokens, needs {num_tokens},"
                " and the model has no block allocator"
            )
        seq.block_table = np.concatenate([seq.block_table, self.allocator.allocate(need)])

    def release(self, seq: PagedSequence) -> None:
        """Give ``seq``'s blocks back to the allocator and empty it."""
        if self.allocator is not None:
            self.allocator.free(seq.block_table)
        seq.block_table = np.empty(0, np.int32)
        seq.length = 0

    # ------------------------------------------------------------ operations
    def prefill(self, seq: PagedSequence, tokens: Sequence[int] | Any) -> Any:
        """Run the prompt ``tokens`` into an empty ``seq``; returns the last logits row.

        Raises:
            LocalProtocolError: if ``seq`` is not empty.
        """
        if seq.length:
            raise LocalProtocolError(f"prefill into a sequence that holds {seq.length} tokens")
        return self.extend(seq, tokens)

    def decode_step(self, seq: PagedSequence, token: int) -> Any:
        """Feed one token; returns its logits row ``[vocab]``."""
        return self.extend(seq, [token])

    def extend(
        self, seq: PagedSequence, tokens: Sequence[int] | Any, *, all_logits: bool = False
    ) -> Any:
        """Append ``tokens`` to ``seq`` in one forward pass over its paged prefix.

        Writes the KV of positions ``seq.length .. seq.length+n-1`` (only those
        slots) and advances ``seq.length`` by ``n``.

        Args:
            seq: the sequence; its blocks hold valid KV for ``[0, seq.length)``.
            tokens: the new token ids.
            all_logits: return ``[n, vocab]`` logits instead of the last row.

        Returns:
            float32 logits on the model's array module (``[vocab]`` or ``[n, vocab]``).

        Raises:
            LocalProtocolError: for no tokens or a token id outside the vocabulary.
            ResourceLimitError: if the block table is too small and cannot grow.
        """
        xp, k, c, w = self.xp, self.kernels, self.config, self.weights
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = int(ids.size)
        if n == 0:
            raise LocalProtocolError("extend needs at least one token")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise LocalProtocolError(f"token id outside [0, {c.vocab_size})")
        start = seq.length
        self.reserve(seq, start + n)
        table = seq.block_table[: -(-(start + n) // self.block_size)]
        if xp is not np:
            table = xp.asarray(table)
            ids = xp.asarray(ids)
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        x = w.embed[ids]  # [n, hidden] float32 residual stream
        for layer, lw in enumerate(w.layers):
            h = k.rms_norm(x, lw.attn_norm, c.norm_eps)
            qkv = self._mm(h, lw.wqkv)
            q = xp.ascontiguousarray(qkv[:, : nh * hd]).reshape(n, nh, hd)
            kn = xp.ascontiguousarray(qkv[:, nh * hd : (nh + nkv) * hd]).reshape(n, nkv, hd)
            vn = xp.ascontiguousarray(qkv[:, (nh + nkv) * hd :]).reshape(n, nkv, hd)
            k.rope_(q, start, c.rope_theta)
            k.rope_(kn, start, c.rope_theta)
            k_cache, v_cache = self._kv[layer]
            k.kv_write(k_cache, v_cache, table, start, kn, vn)
            attn = k.extend_attention(q, k_cache, v_cache, table, start, self.scale)
            x = x + self._mm(attn.reshape(n, nh * hd), lw.wo)
            h = k.rms_norm(x, lw.mlp_norm, c.norm_eps)
            gu = self._mm(h, lw.w_gate_up)
            gate, up = gu[:, : c.intermediate], gu[:, c.intermediate :]
            # silu(g) = g * sigmoid(g) = g * (1 + tanh(g / 2)) / 2: no overflow for large |g|
            act = gate * (xp.tanh(gate * 0.5) + 1.0) * 0.5 * up
            x = x + self._mm(act, lw.w_down)
        seq.length = start + n
        if not all_logits:
            x = x[-1:]
        logits = self._mm(k.rms_norm(xp.ascontiguousarray(x), w.final_norm, c.norm_eps), w.lm_head)
        return logits if all_logits else logits[0]

    def generate(self, seq: PagedSequence, token: int, steps: int) -> list[int]:
        """Greedy decoding: feed ``token``, then each prediction, ``steps`` times.

        Returns:
            the ``steps`` predicted token ids.
        """
        out: list[int] = []
        for _ in range(steps):
            token = greedy(self.decode_step(seq, token))
            out.append(token)
        return out

    def _mm(self, x: Any, w: Any) -> Any:
        if x.dtype == w.dtype:
            return self.xp.matmul(x, w)
        return self.xp.matmul(x.astype(w.dtype), w).astype(np.float32)
