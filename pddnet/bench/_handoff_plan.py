"""Pure parts of ``pddnet bench handoff``: options, KV shapes, token ranges, analysis.

Nothing here does I/O, so all of it is unit tested without a network.

* :func:`parse_wan` reads ``rtt=30ms,jitter=5ms,loss=0.1%,rate=1gbit``;
* :func:`model_for_bytes` finds a reference-model shape whose KV is exactly
  ``B`` bytes per token (float32, as the NumPy path keeps it), so that shipped
  KV and recomputed KV land in the *same* pool slots;
* :func:`model_of_kv` completes a KV shape into the whole model that has it
  (query heads, width, SwiGLU width by Llama's conventions), so that MD
  recomputes with the model whose KV is shipped, not a narrower one;
* :func:`parse_model` reads ``--model tiny|<shape>``;
* :func:`gpu_recompute_s` is a stated cost model of that recompute on a GPU
  (the bench measures it on CPU; the model is reported apart, as a model);
* :func:`token_ranges` builds token-granular byte ranges (the incremental KV of
  ``n`` tokens, not whole blocks) in a layer-major logical order that sender
  and receiver derive identically;
* :func:`crossover` finds the smallest token count from which recompute beats
  KV shipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._errors import LayoutMismatch, LocalProtocolError
from ..emu import parse_duration, parse_fraction, parse_rate
from ..kv import ByteRanges, KVLayout
from ..recompute import TINY, ModelConfig

__all__ = [
    "K_DEFAULT_KV_BYTES_PER_TOKEN",
    "K_QUICK_LINK",
    "LinkConditions",
    "K_H100_SXM",
    "DeviceSpec",
    "ModelChoice",
    "crossover",
    "gpu_recompute_s",
    "model_for_bytes",
    "model_of_kv",
    "model_params",
    "parse_model",
    "parse_wan",
    "token_ranges",
]

#: 46.5 KiB: the source's 4649 KB per 100-token relay (4 761 600 B / 100).
K_DEFAULT_KV_BYTES_PER_TOKEN = 47616
#: Query heads per KV head when a shape gives only the KV side: GQA 4:1, the ratio of
#: Mistral-7B, Llama-3-8B and Llama-3.2-1B (32 query / 8 KV heads).
K_DEFAULT_GROUP = 4
#: Llama-2/Mistral vocabulary: about half of the ids need 3 varint bytes.
K_DEFAULT_VOCAB = 32000
K_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class LinkConditions:
    """One emulated WAN setting (per-direction jitter and loss, RTT total)."""

    rtt_s: float = 0.030
    jitter_s: float = 0.005
    loss: float = 0.001
    rate_bps: float | None = 1e9
    mtu: int = 9000

    @property
    def name(self) -> str:
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e6:g}Mbit"
        return (
            f"rtt={self.rtt_s * 1e3:g}ms,jitter={self.jitter_s * 1e3:g}ms,"
            f"loss={self.loss * 100:g}%,rate={rate}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}


#: The issue's quick link: 30 ms RTT, 2 ms jitter, 0.5 % loss, 200 Mbit/s.
K_QUICK_LINK = LinkConditions(0.030, 0.002, 0.005, 200e6)


def parse_wan(text: str, base: LinkConditions | None = None) -> LinkConditions:
    """Parse ``rtt=30ms,jitter=5ms,loss=0.1%,rate=1gbit[,mtu=9000]``.

    Keys left out keep their value in ``base`` (default :class:`LinkConditions`).

    Raises:
        LocalProtocolError: for an unknown key or a malformed value.
    """
    out = asdict(base or LinkConditions())
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep:
            raise LocalProtocolError(f"--wan wants key=value items, got {item!r}")
        if key == "rtt":
            out["rtt_s"] = parse_duration(value)
        elif key == "jitter":
            out["jitter_s"] = parse_duration(value)
        elif key == "loss":
            out["loss"] = parse_fraction(value)
        elif key == "rate":
            out["rate_bps"] = parse_rate(value)
        elif key == "mtu":
            out["mtu"] = int(value)
        else:
            raise LocalProtocolError(f"unknown --wan key {key!r} (rtt, jitter, loss, rate, mtu)")
    return LinkConditions(**out)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What the two methods run with.

    Attributes:
        kv_layout: the layout of the shipped KV (``kv_bytes_per_token`` = B).
        model: the reference model MD recomputes with.
        shared_pool: shipped KV lands in the model's own pool (the model's
            float32 KV layout *is* ``kv_layout``); otherwise MD keeps a
            separate pool of ``kv_layout`` for the shipped bytes.
        note: a sentence for the report when the two differ.
    """

    kv_layout: KVLayout
    model: ModelConfig
    shared_pool: bool
    note: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_layout.kv_bytes_per_token

    @property
    def same_model(self) -> bool:
        """Whether the recomputed model is the one whose KV is shipped (same KV shape).

        Only then may the bench say from which N recompute wins; a float16
        layout still counts (the NumPy path merely keeps that KV in float32).
        """
        k, m = self.kv_layout, self.model
        return not k.mla and (k.num_layers, k.num_kv_heads, k.head_dim) == (
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kv_layout": self.kv_layout.to_dict(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "model": self.model.to_dict(),
            "model_params": model_params(self.model),
            "same_model": self.same_model,
            "shared_pool": self.shared_pool,
            "note": self.note,
        }


def model_of_kv(
    layers: int,
    kv_heads: int,
    head_dim: int,
    *,
    group: int = K_DEFAULT_GROUP,
    vocab: int = K_DEFAULT_VOCAB,
) -> ModelConfig:
    """The Llama-style model whose KV is ``layers`` x ``kv_heads`` x ``head_dim``.

    A KV shape fixes neither the query heads nor the width, so this takes the
    conventions of current GQA models: ``group`` query heads per KV head,
    width = query heads x head width (as in every Llama, Mistral and Qwen2),
    and Llama's SwiGLU width (8/3 of the width, rounded up to a multiple of
    256). The default 46.5 KiB (31 x 3 x 64) gives 12 heads, width 768,
    SwiGLU 2048: 0.24 B parameters.

    Raises:
        LayoutMismatch: for a non-positive dimension.
    """
    if group < 1:
        raise LayoutMismatch(f"group must be at least 1, got {group}")
    heads = group * kv_heads
    hidden = heads * head_dim
    return ModelConfig(
        vocab_size=vocab,
        hidden=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=256 * -(-(8 * hidden // 3) // 256),
    )


def model_params(cfg: ModelConfig) -> int:
    """Parameters of the reference model: embedding, layers, final norm, LM head."""
    h = cfg.hidden
    per_layer = h * cfg.qkv_width + cfg.num_heads * cfg.head_dim * h + 3 * h * cfg.intermediate
    return 2 * cfg.vocab_size * h + cfg.num_layers * (per_layer + 2 * h) + h


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Datasheet throughput of an accelerator, for :func:`gpu_recompute_s`.

    Attributes:
        name: what the figures are.
        flops: dense bf16 FLOP/s.
        bandwidth: memory bandwidth, B/s.
    """

    name: str
    flops: float
    bandwidth: float


#: NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16 (no sparsity), 3.35 TB/s HBM3.
K_H100_SXM = DeviceSpec(
    "H100 SXM, datasheet peak: 989 TFLOP/s bf16 dense, 3.35 TB/s", 989e12, 3.35e12
)


def gpu_recompute_s(
    cfg: ModelConfig, n: int, prefix: int, device: DeviceSpec = K_H100_SXM, dtype_bytes: int = 2
) -> float:
    """A cost model (not a measurement) of one ``extend`` of ``n`` tokens on a GPU.

    ``FLOPs / device.flops + bytes / device.bandwidth``, in ``dtype_bytes``
    (bf16) weights and KV: FLOPs = 2 x (layer parameters) x n, plus attention
    (4 x heads x head width per (query, key) pair over a ``prefix`` + causal
    context) and the LM head of the last token; bytes = every weight read once
    (embedding rows of the n tokens only) plus the context's KV read and the
    new KV written. Compute and memory do not overlap and nothing else costs
    (no kernel launches, no framework): it is a stated estimate, optimistic
    by the launch overhead of a real stack (of order 1 ms for 30 layers).
    """
    h, layers = cfg.hidden, cfg.num_layers
    layer_params = (model_params(cfg) - 2 * cfg.vocab_size * h - h) // layers
    pairs = n * prefix + n * (n + 1) // 2
    flops = (
        2 * layers * layer_params * n
        + 4 * layers * cfg.num_heads * cfg.head_dim * pairs
        + 2 * h * cfg.vocab_size
    )
    kv_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim
    weights = layers * layer_params + (cfg.vocab_size + n) * h
    traffic = dtype_bytes * (weights + kv_token * (prefix + 2 * n))
    return flops / device.flops + traffic / device.bandwidth


def model_for_bytes(
    kv_bytes_per_token: int,
    *,
    group: int = K_DEFAULT_GROUP,
    vocab: int = K_DEFAULT_VOCAB,
    block_size: int = K_BLOCK_SIZE,
) -> ModelChoice:
    """The reference model whose float32 KV is exactly ``kv_bytes_per_token`` bytes.

    It searches layers (32 down to 1, then up to 128), head widths (128, 64, 32,
    16) and KV heads (up to 16) for ``layers * 2 * kv_heads * head_dim * 4 ==
    B``, and completes the shape with :func:`model_of_kv`; 46.5 KiB gives 31
    layers x 3 KV heads x 64, width 768. If no shape fits, the shipped KV uses
    a byte-granular latent layout of B bytes per token and the recompute model
    is :data:`~pddnet.recompute.TINY`-like: not the same model
    (:attr:`ModelChoice.same_model` is False, ``note`` says so).

    Raises:
        LocalProtocolError: if ``kv_bytes_per_token`` is not positive.
    """
    b = int(kv_bytes_per_token)
    if b <= 0:
        raise LocalProtocolError(f"--kv-bytes-per-token must be positive, got {b}")
    if b % 8 == 0:
        per = b // 8  # layers * kv_heads * head_dim
        for layers in [*range(32, 0, -1), *range(33, 129)]:
            if per % layers:
                continue
            for head_dim in (128, 64, 32, 16):
                rest = per // layers
                if rest % head_dim == 0 and 1 <= rest // head_dim <= 16:
                    cfg = model_of_kv(layers, rest // head_dim, head_dim, group=group, vocab=vocab)
                    return ModelChoice(cfg.kv_layout(block_size, "float32"), cfg, True)
    layers = 32 if b % 32 == 0 else 1
    layout = KVLayout(layers, 1, b // layers, block_size, dtype="uint8", mla=True)
    cfg = model_of_kv(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, group=group, vocab=vocab)
    note = (
        f"no float32 reference shape holds exactly {b} B/token: shipped KV uses a "
        f"{layers}-layer byte latent of {b} B/token, recompute runs a "
        f"{cfg.num_layers}-layer model ({cfg.kv_layout().kv_bytes_per_token} B/token)"
    )
    return ModelChoice(layout, cfg, False, note)


def parse_model(
    text: str,
    *,
    group: int = K_DEFAULT_GROUP,
    vocab: int = K_DEFAULT_VOCAB,
    block_size: int = K_BLOCK_SIZE,
) -> ModelChoice:
    """``tiny`` or a shape ``layers=32,kv_heads=8,head_dim=128[,dtype=float16][,mla=1]``.

    ``tiny`` is the reference :data:`~pddnet.recompute.TINY` model itself (512
    B/token). For a shape, B comes from its :class:`~pddnet.kv.KVLayout`; MD
    recomputes with :func:`model_of_kv` of the same layers, KV heads and head
    width, whose KV is float32: if the shape's dtype is not
    float32 (or it is MLA) the shipped bytes go to a separate pool of the
    shape's layout, and ``note`` says so.

    Raises:
        LocalProtocolError: for a malformed shape.
        LayoutMismatch: for an impossible one.
    """
    if text.strip().lower() == "tiny":
        return ModelChoice(TINY.kv_layout(block_size, "float32"), TINY, True)
    fields: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise LocalProtocolError(f"--model wants tiny or key=value items, got {item!r}")
        fields[key.strip().lower()] = value.strip()
    try:
        layers = int(fields.pop("layers"))
        kv_heads = int(fields.pop("kv_heads", "1"))
        head_dim = int(fields.pop("head_dim"))
        dtype = fields.pop("dtype", "float16")
        mla = fields.pop("mla", "0").lower() in ("1", "true", "yes")
    except (KeyError, ValueError) as exc:
        raise LocalProtocolError(f"bad --model shape {text!r}: {exc}") from None
    if fields:
        raise LocalProtocolError(f"unknown --model keys {sorted(fields)}")
    layout = KVLayout(layers, kv_heads, head_dim, block_size, dtype=dtype, mla=mla)
    cfg = model_of_kv(layers, kv_heads, head_dim, group=group, vocab=vocab)
    if layout == cfg.kv_layout(block_size, "float32"):
        return ModelChoice(layout, cfg, True)
    note = (
        f"shipped KV is {layout.kv_bytes_per_token} B/token ({dtype}{', MLA' if mla else ''}); "
        f"recompute runs the same layers/heads in float32 "
        f"({cfg.kv_layout().kv_bytes_per_token} B/token) on the NumPy path"
    )
    return ModelChoice(layout, cfg, False, note)


def token_ranges(
    layout: KVLayout, num_blocks: int, block_table: Sequence[int] | Any, start: int, n: int
) -> ByteRanges:
    """Byte ranges of the KV of positions ``[start, start + n)`` of one sequence.

    Only those token slots, not whole blocks: this is the *incremental* KV.
    Logical order is layer-major, then block by block in position order, then
    part (K before V): the same for every pool of the same ``layout`` and the
    same ``start % block_size``, so sender and receiver agree on it.

    Args:
        layout: a per-layer, block-major layout (what the reference model uses).
        num_blocks: blocks in the pool.
        block_table: the sequence's block ids, position ``p`` in
            ``block_table[p // block_size]``.
        start: first position.
        n: number of tokens.

    Raises:
        LayoutMismatch: for a fused or KV-major layout, or a short block table.
    """
    if layout.fused or layout.kv_major:
        raise LayoutMismatch("token ranges need a per-layer, block-major layout")
    table = np.asarray(block_table, dtype=np.int64)
    if n <= 0:
        return ByteRanges.build([], [], [], [])
    bs = layout.block_size
    first, last = start // bs, (start + n - 1) // bs
    if last >= table.size:
        raise LayoutMismatch(f"block table has {table.size} blocks, positions need {last + 1}")
    if np.any(table[first : last + 1] >= num_blocks) or np.any(table[first : last + 1] < 0):
        raise LayoutMismatch("block id outside the pool")
    idx = np.arange(first, last + 1)
    lo = np.maximum(idx * bs, start) - idx * bs  # first slot used in each block
    hi = np.minimum((idx + 1) * bs, start + n) - idx * bs
    runs = idx.size
    tok = layout.token_bytes_per_layer // layout.parts  # one token of one part
    part_bytes = bs * tok
    # [layers, runs, parts] grid, flattened in that (logical) order
    parts = layout.parts
    layer = np.repeat(np.arange(layout.num_layers), runs * parts)
    run = np.tile(np.repeat(np.arange(runs), parts), layout.num_layers)
    part = np.tile(np.arange(parts), layout.num_layers * runs)
    offset = table[first:][run] * layout.block_bytes_per_layer + part * part_bytes + lo[run] * tok
    length = (hi - lo)[run] * tok
    return ByteRanges.build(layer, offset, length, layer)


def crossover(
    tokens: Sequence[int], kv_s: Sequence[float], recompute_s: Sequence[float]
) -> int | None:
    """The smallest token count from which recompute is faster at every larger count.

    Args:
        tokens: increasing token counts.
        kv_s: KV-shipping latency at each count (any statistic, e.g. the mean).
        recompute_s: token-id latency at each count.

    Returns:
        The first ``tokens[i]`` such that recompute wins at ``i`` and after, or
        None if it does not win at the largest count.
    """
    wins = [r < k for k, r in zip(kv_s, recompute_s, strict=True)]
    if not wins or not wins[-1]:
        return None
    i = len(wins) - 1
    while i > 0 and wins[i - 1]:
        i -= 1
    return int(tokens[i])


def summary_stats(samples: Sequence[float]) -> dict[str, float]:
    """mean/p50/p99/max/min/std (seconds) plus ``cv`` and ``max_over_mean``."""
    from ._common import percentiles

    out = percentiles(samples)
    mean = out["mean"]
    out["cv"] = out["std"] / mean if mean > 0 else float("nan")
    out["max_over_mean"] = out["max"] / mean if mean > 0 else float("nan")
    return out
