"""How an engine's paged KV cache is laid out in memory.

A KV cache is a set of *planes*. A plane is a run of equally sized, densely
packed block slots: slot ``b`` of a plane starts at ``plane.base + b *
plane.block_bytes`` within one buffer. Every layout pddnet supports reduces to
planes, and all byte arithmetic (:mod:`pddnet.kv._ranges`) works on them:

* ``kv_major=False`` (block-major, vLLM FlashInfer style): per layer one array
  ``[num_blocks, parts, block_size, kv_heads, head_dim]``; one plane per layer,
  holding K and V of a block together.
* ``kv_major=True`` (vLLM flash-attn style): per layer ``[parts, num_blocks,
  block_size, kv_heads, head_dim]``; one plane per (layer, part).
* ``fused=True`` puts all layers in one array with a leading layer dimension;
  the planes then live in buffer 0 at per-layer offsets.
* ``mla=True`` stores a single latent per token (parts = 1, kv_heads = 1,
  head_dim = the latent width).
* ``interior`` names the order of the axes inside one layer's block slot:
  ``p`` (K/V part), ``t`` (token), ``h`` (KV head), ``d`` (head width).
  ``"pthd"`` (the default) is ``[parts, block_size, kv_heads, head_dim]``;
  vLLM's CPU backend stores ``"hptd"`` (per head, K of the block's tokens,
  then V). Transfers move whole slots and never look inside, but two peers
  must agree on it: the same bytes read in another order are other KV.
* ``key_order="dt"`` stores K of a block transposed, ``[head_dim,
  block_size]`` where V is ``[block_size, head_dim]`` (vLLM CPU's ``vec``
  attention kernels: interior ``"hptd"``, K as ``"hpdt"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import LayoutMismatch

__all__ = ["KVLayout", "Plane"]


@dataclass(frozen=True, slots=True)
class Plane:
    """One run of block slots: slot ``b`` is ``[base + b*block_bytes, +block_bytes)``."""

    layer: int
    part: int  # 0 = K (or K+V / latent when parts are not split), 1 = V
    buffer: int
    base: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a paged KV cache.

    Args:
        num_layers: transformer layers.
        num_kv_heads: KV heads per layer (1 for MLA).
        head_dim: width of one head (the latent width for MLA).
        block_size: tokens per block.
        dtype: element type, any NumPy dtype spelling ("float16", "bfloat16" is
            stored as a 2-byte "uint16" view where NumPy lacks it).
        mla: one latent per token instead of separate K and V.
        kv_major: K and V in separate planes (``[2, blocks, ...]`` per layer).
        fused: one tensor for all layers instead of one per layer.
        interior: the axis order inside a block slot, a permutation of
            ``"pthd"``; a KV-major layout keeps ``p`` outermost.
        key_order: ``"td"``, or ``"dt"`` when K's innermost ``[t, d]`` axes
            are stored transposed (the interior must end in ``"td"``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    mla: bool = False
    kv_major: bool = False
    fused: bool = False
    interior: str = "pthd"
    key_order: str = "td"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutMismatch(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.mla and self.num_kv_heads != 1:
            raise LayoutMismatch("an MLA layout has exactly one latent head")
        if self.mla and self.kv_major:
            raise LayoutMismatch("an MLA layout has no separate K and V planes")
        if not isinstance(self.interior, str) or sorted(self.interior) != sorted("pthd"):
            raise LayoutMismatch(
                f"KVLayout.interior must be a permutation of 'pthd', got {self.interior!r}"
            )
        if self.kv_major and self.interior[0] != "p":
            raise LayoutMismatch(
                f"a KV-major layout keeps K and V outermost: interior {self.interior!r}"
            )
        if self.key_order not in ("td", "dt") or (
            self.key_order == "dt" and not self.interior.endswith("td")
        ):
            raise LayoutMismatch(
                f"KVLayout.key_order must be 'td', or 'dt' with an interior ending in 'td',"
                f" got {self.key_order!r} with {self.interior!r}"
            )
        _ = self.np_dtype  # validates the dtype

    # ----------------------------------------------------------------- sizes
    @property
    def np_dtype(self) -> np.dtype[Any]:
        name = "uint16" if self.dtype == "bfloat16" else self.dtype
        try:
            return np.dtype(name)
        except TypeError as exc:
            raise LayoutMismatch(f"unknown KV dtype {self.dtype!r}") from exc

    @property
    def parts(self) -> int:
        """1 for MLA (a single latent), 2 for K and V."""
        return 1 if self.mla else 2

    @property
    def token_bytes_per_layer(self) -> int:
        return self.parts * self.num_kv_heads * self.head_dim * self.np_dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers."""
        return self.num_layers * self.token_bytes_per_layer

    @property
    def block_bytes_per_layer(self) -> int:
        return self.block_size * self.token_bytes_per_layer

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and parts."""
        return self.num_layers * self.block_bytes_per_layer

    def num_buffers(self) -> int:
        return 1 if self.fused else self.num_layers

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- arrays
    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's array for a pool of ``num_blocks`` blocks."""
        size = {"p": self.parts, "t": self.block_size, "h": self.num_kv_heads, "d": self.head_dim}
        inner = tuple(size[axis] for axis in self.interior)
        if self.kv_major:
            return (inner[0], num_blocks, *inner[1:])
        return (num_blocks, *inner)

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of each buffer the pool holds (one per layer, or one fused)."""
        if self.fused:
            return (self.num_layers, *self.layer_shape(num_blocks))
        return self.layer_shape(num_blocks)

    def planes(self, num_blocks: int) -> tuple[Plane, ...]:
        """Every plane of a pool of ``num_blocks`` blocks, in layer-major order."""
        layer_bytes = num_blocks * self.block_bytes_per_layer
        out: list[Plane] = []
        for layer in range(self.num_layers):
            buffer = 0 if self.fused else layer
            layer_base = layer * layer_bytes if self.fused else 0
            if self.kv_major:
                part_bytes = self.block_bytes_per_layer // self.parts
                for part in range(self.parts):
                    base = layer_base + part * num_blocks * part_bytes
                    out.append(Plane(layer, part, buffer, base, part_bytes))
            else:
                out.append(Plane(layer, 0, buffer, layer_base, self.block_bytes_per_layer))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "mla": self.mla,
            "kv_major": self.kv_major,
            "fused": self.fused,
            "interior": self.interior,
            "key_order": self.key_order,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        try:
            return cls(**data)
        except TypeError as exc:
            raise LayoutMismatch(f"bad KVLayout description: {exc}") from exc

    def check_compatible(
        self, other: KVLayout, *, mine: str = "here", theirs: str = "there"
    ) -> None:
        """Raise :class:`LayoutMismatch` unless blocks of ``other`` mean the same as ours.

        Every field must agree except ``fused``, which only changes how planes
        map onto buffers: the same bytes in another dtype, head layout or
        interior order would be read as other KV.

        Args:
            other: the peer's layout.
            mine, theirs: names of the two sides, for the error message.
        """
        fields = [f for f in self.to_dict() if f != "fused"]
        differ = [f for f in fields if getattr(self, f) != getattr(other, f)]
        if differ:
            said = ", ".join(
                f"{f} {getattr(self, f)!r} at {mine} vs {getattr(other, f)!r} at {theirs}"
                for f in differ
            )
            raise LayoutMismatch(f"incompatible KV layouts ({said})")
