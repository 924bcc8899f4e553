"""Weights: seeded, saved and loaded (.npz, Hugging Face names, safetensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pddnet import LayoutMismatch, MissingExtraError
from pddnet._optional import available
from pddnet.recompute import TINY, ModelConfig, ReferenceModel, Weights, greedy


def _logits(weights: Weights) -> np.ndarray:
    model = ReferenceModel.create(TINY, 8, weights=weights)
    return model.prefill(model.new_sequence(), [5, 6, 7, 8, 9])


def test_seeded_weights_are_deterministic_and_seed_dependent() -> None:
    a, b, c = Weights.random(TINY, 1), Weights.random(TINY, 1), Weights.random(TINY, 2)
    assert np.array_equal(a.layers[1].wqkv, b.layers[1].wqkv)
    assert not np.array_equal(a.layers[1].wqkv, c.layers[1].wqkv)
    assert np.array_equal(_logits(a), _logits(b))


def test_npz_round_trip(tmp_path: Path) -> None:
    w = Weights.random(TINY, 3)
    w.save_npz(tmp_path / "w.npz")
    loaded = Weights.load(TINY, tmp_path / "w.npz")
    for name, arr in w.tensors().items():
        assert np.array_equal(loaded.tensors()[name], arr), name
    assert np.array_equal(_logits(loaded), _logits(w))


def test_hugging_face_names_are_transposed() -> None:
    w = Weights.random(TINY, 4)
    ours = w.tensors()
    hf = {
        "model.embed_tokens.weight": ours["embed"],
        "model.norm.weight": ours["final_norm"],
        "lm_head.weight": ours["lm_head"].T,
    }
    names = {
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
    for i in range(TINY.num_layers):
        for ours_name, (hf_name, transpose) in names.items():
            arr = ours[f"layers.{i}.{ours_name}"]
            hf[f"model.layers.{i}.{hf_name}"] = arr.T if transpose else arr
    loaded = Weights.from_tensors(TINY, hf)
    assert greedy(_logits(loaded)) == greedy(_logits(w))
    assert np.array_equal(_logits(loaded), _logits(w))


def test_wrong_or_missing_tensors_are_layout_mismatches() -> None:
    ours = Weights.random(TINY, 5).tensors()
    del ours["layers.1.wv"]
    with pytest.raises(LayoutMismatch, match=r"layers\.1\.wv"):
        Weights.from_tensors(TINY, ours)
    bigger = ModelConfig(**{**TINY.to_dict(), "hidden": 96})
    with pytest.raises(LayoutMismatch, match="shape"):
        Weights.from_tensors(bigger, Weights.random(TINY, 5).tensors())
    with pytest.raises(LayoutMismatch):
        ReferenceModel.create(bigger, 4, weights=Weights.random(TINY, 5))


@pytest.mark.skipif(available("safetensors"), reason="safetensors is installed")
def test_safetensors_without_the_package_names_it(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(MissingExtraError, match="safetensors"):
        Weights.load(TINY, path)


@pytest.mark.skipif(not available("safetensors"), reason="safetensors is not installed")
def test_safetensors_round_trip(tmp_path: Path) -> None:
    from safetensors.numpy import save_file  # type: ignore[import-not-found, unused-ignore]

    w = Weights.random(TINY, 6)
    save_file({k: np.ascontiguousarray(v) for k, v in w.tensors().items()}, tmp_path / "w.st")
    (tmp_path / "w.st").rename(tmp_path / "w.safetensors")
    assert np.array_equal(_logits(Weights.load(TINY, tmp_path / "w.safetensors")), _logits(w))
