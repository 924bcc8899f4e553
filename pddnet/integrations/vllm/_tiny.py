"""A tiny Llama checkpoint built in code, for tests and the demo that run vLLM offline.

No model hub is reachable from where pddnet is tested, so :func:`build_tiny_llama`
writes everything vLLM needs to load a model from a local directory:
``config.json``, ``generation_config.json``, ``model.safetensors`` (seeded random
float32 weights from NumPy) and a byte-level BPE tokenizer trained in code
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``).

Random weights make a model whose greedy stream may fall into a short cycle, and a
2-token loop would hide an off-by-two handoff bug: a token stream that repeats every
two steps looks right after any even shift. The default scale (std 0.15 on every
matrix) gives streams with no period of 16 tokens or less over 64 tokens for the
prompts the tests use; :func:`tail_period` is the check.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..._errors import LocalProtocolError, MissingExtraError
from ..._optional import require
from ...recompute import ModelConfig

__all__ = ["K_TINY_SEED", "build_tiny_llama", "reference_config", "tail_period"]

K_TINY_SEED = 7
K_BOS = "<s>"
K_EOS = "</s>"


def build_tiny_llama(
    path: str | Path,
    *,
    seed: int = K_TINY_SEED,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vocab: int = 512,
    max_positions: int = 2048,
    scale: float = 0.15,
) -> Path:
    """Write a complete Hugging Face style Llama checkpoint that vLLM loads offline.

    The same arguments always write the same bytes (weights and tokenizer).

    Args:
        path: directory to write into (created if missing; files are overwritten).
        seed: seed of the weights.
        layers: decoder layers.
        hidden: model width.
        heads: attention heads; ``hidden // heads`` is the head dim, which vLLM's
            CPU attention wants in 32, 64, 80, 96, 112, 128, ...
        kv_heads: KV heads (grouped-query attention when fewer than ``heads``).
        intermediate: MLP width.
        vocab: vocabulary size of the model and of the tokenizer (at least 258:
            256 byte tokens and ``<s>``, ``</s>``).
        max_positions: ``max_position_embeddings`` of the config.
        scale: standard deviation of every weight matrix (norm weights are 1).

    Returns:
        The directory, as a :class:`~pathlib.Path`; pass it as vLLM's ``model``.

    Raises:
        LocalProtocolError: if the shape arguments are inconsistent.
        MissingExtraError: if ``safetensors`` or ``tokenizers`` is not installed
            (``pip install 'pddnet[vllm]'`` brings both).
    """
    if hidden % heads or heads % kv_heads:
        raise LocalProtocolError(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    if vocab < 258:
        raise LocalProtocolError(f"vocab must be at least 258 (bytes and specials), got {vocab}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    )
    _write_weights(
        out / "model.safetensors",
        layers=layers,
        hidden=hidden,
        q_out=heads * head_dim,
        kv_out=kv_heads * head_dim,
        inter=intermediate,
        vocab=vocab,
        seed=seed,
        scale=scale,
    )
    _write_tokenizer(out, vocab)
    return out


def reference_config(path: str | Path) -> ModelConfig:
    """The :class:`~pddnet.recompute.ModelConfig` of a Llama checkpoint's ``config.json``.

    With it, ``Weights.load(config, path / "model.safetensors")`` gives pddnet's
    reference model the checkpoint's weights; on :func:`build_tiny_llama`'s
    checkpoint its greedy streams equal vLLM's (tests/test_vllm_engine.py).

    Raises:
        LocalProtocolError: if the config is not a plain Llama (biases, tied
            embeddings, or RoPE scaling, which the reference model lacks).
    """
    cfg = json.loads((Path(path) / "config.json").read_text())
    unsupported = [
        k
        for k in ("attention_bias", "mlp_bias", "tie_word_embeddings", "rope_scaling")
        if cfg.get(k)
    ]
    if cfg.get("model_type") != "llama" or unsupported:
        raise LocalProtocolError(
            f"{path} is not a plain Llama checkpoint (model_type={cfg.get('model_type')!r},"
            f" unsupported: {unsupported})"
        )
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim", int(cfg["hidden_size"]) // heads)),
        intermediate=int(cfg["intermediate_size"]),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
    )


def tail_period(tokens: Sequence[int], *, max_period: int = 16, window: int = 32) -> int | None:
    """The shortest period ``p <= max_period`` of the last ``window`` tokens, or None.

    ``tokens[i] == tokens[i - p]`` must hold for every ``i`` in the window, so a
    stream that has fallen into a cycle of length ``p`` reports ``p``.

    Raises:
        LocalProtocolError: if the stream is shorter than ``window + max_period``.
    """
    if len(tokens) < window + max_period:
        raise LocalProtocolError(
            f"tail_period needs at least {window + max_period} tokens, got {len(tokens)}"
        )
    tail = range(len(tokens) - window, len(tokens))
    for p in range(1, max_period + 1):
        if all(tokens[i] == tokens[i - p] for i in tail):
            return p
    return None


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_weights(
    path: Path,
    *,
    layers: int,
    hidden: int,
    q_out: int,
    kv_out: int,
    inter: int,
    vocab: int,
    seed: int,
    scale: float,
) -> None:
    st = require("safetensors.numpy")
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        # Hugging Face stores a Linear's weight [out, in].
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    ones = np.ones(hidden, dtype=np.float32)
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones.copy()
        tensors[p + "self_attn.q_proj.weight"] = mat(q_out, hidden)
        tensors[p + "self_attn.k_proj.weight"] = mat(kv_out, hidden)
        tensors[p + "self_attn.v_proj.weight"] = mat(kv_out, hidden)
        tensors[p + "self_attn.o_proj.weight"] = mat(hidden, q_out)
        tensors[p + "post_attention_layernorm.weight"] = ones.copy()
        tensors[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = mat(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = mat(hidden, inter)
    tensors["model.norm.weight"] = ones
    tensors["lm_head.weight"] = mat(vocab, hidden)
    st.save_file(tensors, str(path), metadata={"format": "pt"})


def _corpus(seed: int = 0, words: int = 4000) -> list[str]:
    """Deterministic pseudo-English lines from syllables, enough pairs for the merges."""
    rng = np.random.default_rng(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ou", "ee"]
    codas = ["", "", "n", "r", "s", "t", "ng", "st"]
    line: list[str] = []
    lines: list[str] = []
    for _ in range(words):
        n = int(rng.integers(1, 4))
        line.append(
            "".join(
                onsets[rng.integers(len(onsets))]
                + nuclei[rng.integers(len(nuclei))]
                + codas[rng.integers(len(codas))]
                for _ in range(n)
            )
        )
        if len(line) == 12:
            lines.append(" ".join(line) + ".")
            line = []
    return lines


def _write_tokenizer(out: Path, vocab: int) -> None:
    try:
        tk = require("tokenizers")
    except MissingExtraError as exc:
        raise MissingExtraError("tokenizers", "vllm") from exc
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[K_BOS, K_EOS],  # ids 0 and 1, as config.json says
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab:
        raise LocalProtocolError(
            f"the tiny tokenizer reached {tokenizer.get_vocab_size()} tokens, not {vocab}"
        )
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": K_BOS,
            "eos_token": K_EOS,
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(out / "special_tokens_map.json", {"bos_token": K_BOS, "eos_token": K_EOS})
