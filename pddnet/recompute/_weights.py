"""Weights of the reference model: seeded, or loaded from ``.npz`` / ``.safetensors``.

Matrices are stored ``[in, out]`` (``y = x @ W``). Two naming schemes load:

* pddnet's own (what :meth:`Weights.save_npz` writes): ``embed``, ``final_norm``,
  ``lm_head`` and ``layers.{i}.{attn_norm,wq,wk,wv,wo,mlp_norm,w_gate,w_up,w_down}``;
* Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight`` ...,
  stored ``[out, in]`` and transposed on load). Llama checkpoints already use the
  rotate-half RoPE convention this model implements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import LayoutMismatch
from .._optional import require
from ._config import ModelConfig

__all__ = ["LayerWeights", "Weights"]

_HF_LAYER = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_HF_TOP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; Q, K and V (and gate and up) are fused for one GEMM each."""

    attn_norm: Any  # [hidden]
    wqkv: Any  # [hidden, (heads + 2 kv_heads) * head_dim]
    wo: Any  # [heads * head_dim, hidden]
    mlp_norm: Any  # [hidden]
    w_gate_up: Any  # [hidden, 2 * intermediate]
    w_down: Any  # [intermediate, hidden]


@dataclass(slots=True)
class Weights:
    """All weights of a :class:`ModelConfig`, as NumPy or CuPy arrays."""

    config: ModelConfig
    embed: Any  # [vocab, hidden], float32
    layers: list[LayerWeights]
    final_norm: Any  # [hidden]
    lm_head: Any  # [hidden, vocab]

    # -------------------------------------------------------------- creation
    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> Weights:
        """Deterministic weights drawn from ``seed`` (float32, NumPy).

        Matrices are scaled by ``config.init_gain / sqrt(fan_in)`` (1 keeps
        activations O(1) through the layers; TINY takes 2, with which its
        greedy streams do not fall into short cycles), and norm
        gains are ``1 + 0.1 N(0, 1)`` so that they are not trivially one.
        """
        rng = np.random.default_rng(seed)

        def mat(fan_in: int, fan_out: int) -> Any:
            w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
            return w * np.float32(config.init_gain / np.sqrt(fan_in))

        def gain() -> Any:
            return 1.0 + 0.1 * rng.standard_normal(config.hidden, dtype=np.float32)

        c = config
        embed = rng.standard_normal((c.vocab_size, c.hidden), dtype=np.float32)
        layers = [
            LayerWeights(
                attn_norm=gain(),
                wqkv=mat(c.hidden, c.qkv_width),
                wo=mat(c.num_heads * c.head_dim, c.hidden),
                mlp_norm=gain(),
                w_gate_up=mat(c.hidden, 2 * c.intermediate),
                w_down=mat(c.intermediate, c.hidden),
            )
            for _ in range(c.num_layers)
        ]
        return cls(c, embed, layers, gain(), mat(c.hidden, c.vocab_size))

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Mapping[str, Any]) -> Weights:
        """Build from a name -> array mapping in either naming scheme (see module doc).

        Raises:
            LayoutMismatch: if a tensor is missing or has the wrong shape.
        """
        hf = "model.embed_tokens.weight" in tensors

        def get(name: str, shape: tuple[int, ...], layer: int | None = None) -> Any:
            if hf:
                key, transpose = (_HF_TOP if layer is None else _HF_LAYER)[name]
                if layer is not None:
                    key = f"model.layers.{layer}.{key}"
            else:
                key, transpose = (name if layer is None else f"layers.{layer}.{name}"), False
            if key not in tensors:
                raise LayoutMismatch(f"weights lack tensor {key!r}")
            arr = np.asarray(tensors[key], dtype=np.float32)
            if transpose:
                arr = arr.T
            if arr.shape != shape:
                raise LayoutMismatch(f"tensor {key!r} has shape {arr.shape}, want {shape}")
            return np.ascontiguousarray(arr)

        c = config
        hd, h, kv = c.head_dim, c.num_heads, c.num_kv_heads
        layers = []
        for i in range(c.num_layers):
            wq = get("wq", (c.hidden, h * hd), i)
            wk = get("wk", (c.hidden, kv * hd), i)
            wv = get("wv", (c.hidden, kv * hd), i)
            gate = get("w_gate", (c.hidden, c.intermediate), i)
            up = get("w_up", (c.hidden, c.intermediate), i)
            layers.append(
                LayerWeights(
                    attn_norm=get("attn_norm", (c.hidden,), i),
                    wqkv=np.concatenate([wq, wk, wv], axis=1),
                    wo=get("wo", (h * hd, c.hidden), i),
                    mlp_norm=get("mlp_norm", (c.hidden,), i),
                    w_gate_up=np.concatenate([gate, up], axis=1),
                    w_down=get("w_down", (c.intermediate, c.hidden), i),
                )
            )
        return cls(
            c,
            get("embed", (c.vocab_size, c.hidden)),
            layers,
            get("final_norm", (c.hidden,)),
            get("lm_head", (c.hidden, c.vocab_size)),
        )

    @classmethod
    def load(cls, config: ModelConfig, path: str | Path) -> Weights:
        """Load ``.npz`` (NumPy) or ``.safetensors`` weights.

        Raises:
            MissingExtraError: for ``.safetensors`` when the ``safetensors``
                package is not installed.
            LayoutMismatch: if a tensor is missing or misshapen.
        """
        path = Path(path)
        if path.suffix == ".safetensors":
            st = require("safetensors.numpy")
            return cls.from_tensors(config, st.load_file(str(path)))
        with np.load(path) as data:
            return cls.from_tensors(config, {k: data[k] for k in data.files})

    def tensors(self) -> dict[str, Any]:
        """The weights in pddnet's naming scheme (host float32 arrays)."""
        c = self.config
        hd = c.head_dim
        q, kv = c.num_heads * hd, c.num_kv_heads * hd
        out: dict[str, Any] = {
            "embed": _host(self.embed),
            "final_norm": _host(self.final_norm),
            "lm_head": _host(self.lm_head),
        }
        for i, lw in enumerate(self.layers):
            wqkv, gu = _host(lw.wqkv), _host(lw.w_gate_up)
            out |= {
                f"layers.{i}.attn_norm": _host(lw.attn_norm),
                f"layers.{i}.wq": wqkv[:, :q],
                f"layers.{i}.wk": wqkv[:, q : q + kv],
                f"layers.{i}.wv": wqkv[:, q + kv :],
                f"layers.{i}.wo": _host(lw.wo),
                f"layers.{i}.mlp_norm": _host(lw.mlp_norm),
                f"layers.{i}.w_gate": gu[:, : c.intermediate],
                f"layers.{i}.w_up": gu[:, c.intermediate :],
                f"layers.{i}.w_down": _host(lw.w_down),
            }
        return out

    def save_npz(self, path: str | Path) -> None:
        """Write the weights as ``.npz`` in pddnet's naming scheme."""
        np.savez(path, **self.tensors())

    def to(self, xp: Any, matrix_dtype: str = "float32") -> Weights:
        """A copy on array module ``xp`` with matrices in ``matrix_dtype``.

        Norm gains and the embedding stay float32 (the residual stream is fp32).
        """

        def m(a: Any) -> Any:
            return xp.ascontiguousarray(xp.asarray(a, dtype=matrix_dtype))

        def f(a: Any) -> Any:
            return xp.ascontiguousarray(xp.asarray(a, dtype="float32"))

        layers = [
            LayerWeights(
                f(lw.attn_norm), m(lw.wqkv), m(lw.wo), f(lw.mlp_norm), m(lw.w_gate_up), m(lw.w_down)
            )
            for lw in self.layers
        ]
        return Weights(self.config, f(self.embed), layers, f(self.final_norm), m(self.lm_head))


def _host(a: Any) -> Any:
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a, dtype=np.float32)
