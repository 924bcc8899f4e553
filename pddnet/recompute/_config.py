"""Shapes of the reference model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from .._errors import LayoutMismatch
from ..kv import KVLayout

__all__ = ["ModelConfig", "TINY", "MISTRAL_7B_LIKE"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE (rotate-half), GQA attention, SwiGLU MLP.

    Args:
        vocab_size: token ids lie in ``[0, vocab_size)``.
        hidden: model width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: KV heads (``num_heads`` must be a multiple of it).
        head_dim: width of one head.
        intermediate: SwiGLU inner width.
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        init_gain: seeded weights (:meth:`Weights.random`) draw each matrix
            with std ``init_gain / sqrt(fan_in)``; it does not affect loaded
            weights.
    """

    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_gain: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutMismatch(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if not self.init_gain > 0:
            raise LayoutMismatch(f"ModelConfig.init_gain must be positive, got {self.init_gain!r}")
        if self.num_heads % self.num_kv_heads:
            raise LayoutMismatch(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise LayoutMismatch("RoPE needs an even head_dim")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def kv_layout(
        self, block_size: int = 16, dtype: str = "float32", *, kv_major: bool = False
    ) -> KVLayout:
        """The per-layer paged KV layout this model writes (block-major by default)."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype,
            kv_major=kv_major,
        )

    def check_layout(self, layout: KVLayout, *, on_device: bool = False) -> None:
        """Raise :class:`LayoutMismatch` unless ``layout`` can hold this model's KV.

        Args:
            layout: the pool's layout.
            on_device: the pool is on the GPU. The NumPy path reads any block
                interior and fused pools (its K/V are strided views); the CUDA
                kernels assume per-layer buffers with ``'pthd'`` blocks.
        """
        if layout.mla:
            raise LayoutMismatch("the reference model needs non-MLA KV buffers (K and V)")
        if on_device and layout.fused:
            raise LayoutMismatch("the reference model's CUDA path needs per-layer KV buffers")
        if on_device and (layout.interior, layout.key_order) != ("pthd", "td"):
            raise LayoutMismatch(
                "the reference model's CUDA kernels read blocks as 'pthd', the KV layout"
                f" has {layout.interior!r} (key_order {layout.key_order!r})"
            )
        want = (self.num_layers, self.num_kv_heads, self.head_dim)
        have = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
        if want != have:
            raise LayoutMismatch(
                f"model wants (layers, kv_heads, head_dim) = {want}, the KV layout has {have}"
            )

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The same shape with ``num_layers`` layers (benchmarks time one layer)."""
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        try:
            return cls(**data)
        except TypeError as exc:
            raise LayoutMismatch(f"bad ModelConfig description: {exc}") from exc


#: Tests and the demo: ~1 ms per decode step on one CPU core. Seeded with
#: ``init_gain=1``, 12 of the demo's 32 greedy reference streams (seed 7, 8
#: sessions x 4 turns, 32 tokens) end in a cycle of period 3 to 13
#: (``pddnet.demo.tail_period``), where a handoff that shifted tokens by a
#: period would still match; with 2, none does (tests/test_demo.py checks it).
TINY = ModelConfig(
    vocab_size=512,
    hidden=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate=192,
    init_gain=2.0,
)

#: A 7B-class layer shape (Mistral-7B: GQA 32 query / 8 KV heads of 128) for GPU benchmarks.
MISTRAL_7B_LIKE = ModelConfig(
    vocab_size=32000,
    hidden=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate=14336,
    rope_theta=1_000_000.0,
)
