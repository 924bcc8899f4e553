"""vLLM 0.32 loads pddnet's tiny checkpoint offline and decodes it reproducibly.

The tiny model's greedy streams must not fall into short cycles (a 2-token loop
would hide an off-by-two handoff bug in the tests built on this model), must
depend on the prompt, and must be the same whether vLLM is driven by
``LLM.generate`` or step by step from our own loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pddnet import LocalProtocolError
from pddnet.integrations.vllm import (
    apply_cpu_env,
    build_tiny_llama,
    cpu_engine_kwargs,
    reference_config,
    run_greedy,
    tail_period,
)
from pddnet.recompute import ReferenceModel, Weights, greedy

K_NEW = 64  # tokens generated per prompt


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(2, 512, size=n)] for n in (5, 17, 32, 40, 64, 100)]


def test_tail_period_finds_planted_cycles() -> None:
    rng = np.random.default_rng(0)
    head = [int(t) for t in rng.permutation(1000)[:30]]
    for p in (1, 2, 7, 16):
        cycle = [1000 + i for i in range(p)]
        assert tail_period(head + cycle * (48 // p + 1)) == p
    assert tail_period(head + [int(t) for t in rng.permutation(1000)[:40]]) is None
    assert tail_period(head + [2000 + i for i in range(17)] * 3) is None  # period 17 > 16
    with pytest.raises(LocalProtocolError, match="at least 48"):
        tail_period([1, 2, 3])


def test_build_tiny_llama_is_reproducible(tmp_path: Path) -> None:
    _need_checkpoint_writers()
    a = build_tiny_llama(tmp_path / "a")
    b = build_tiny_llama(tmp_path / "b")
    c = build_tiny_llama(tmp_path / "c", seed=8)
    names = sorted(p.name for p in a.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with pytest.raises(LocalProtocolError, match="divide"):
        build_tiny_llama(tmp_path / "d", hidden=250)


def _need_checkpoint_writers() -> None:
    pytest.importorskip("safetensors", reason="needs the safetensors package (pddnet[vllm])")
    pytest.importorskip("tokenizers", reason="needs the tokenizers package (pddnet[vllm])")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _need_checkpoint_writers()
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(request: pytest.FixtureRequest) -> Iterator[Any]:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    apply_cpu_env()
    engine = vllm.LLM(**cpu_engine_kwargs(request.getfixturevalue("tiny")))
    yield engine
    del engine


def _generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=K_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def streams(llm: Any) -> list[list[int]]:
    return _generate(llm, _prompts())


def test_greedy_streams_are_long_cycle_free_and_prompt_dependent(streams: list[list[int]]) -> None:
    for prompt, stream in zip(_prompts(), streams, strict=True):
        assert len(stream) == K_NEW
        assert tail_period(stream) is None, (prompt[:8], stream)
        assert len(set(stream)) >= K_NEW // 2, stream
    # Each prompt leads somewhere else: the model reads its context.
    assert len({tuple(s[:8]) for s in streams}) == len(streams)


def test_greedy_is_deterministic_and_batch_independent(llm: Any, streams: list[list[int]]) -> None:
    # A prompt of the batch again, alone: the same tokens (the step-loop test
    # repeats two more in a batch of two).
    prompts = _prompts()
    assert _generate(llm, [prompts[3]]) == [streams[3]]


def test_own_step_loop_matches_generate(llm: Any, streams: list[list[int]]) -> None:
    prompts = _prompts()
    steps = run_greedy(llm.llm_engine, {"a": prompts[0], "b": prompts[5]}, K_NEW)
    assert sorted(steps) == ["a", "b"]
    # One new token per step per request (no speculative decoding here).
    assert all(len(s) == 1 for per_req in steps.values() for s in per_req)
    assert [t for s in steps["a"] for t in s] == streams[0]
    assert [t for s in steps["b"] for t in s] == streams[5]


def test_vllm_loads_the_tiny_tokenizer(llm: Any) -> None:
    tok = llm.get_tokenizer()
    text = "the cat sat on a mat."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert 0 < len(ids) < len(text)  # merges were learned
    assert max(len(tok), max(ids) + 1) <= 512


def test_abort_mid_stream_stops_one_request_only(llm: Any, streams: list[list[int]]) -> None:
    # RLD's engine stops a request when MD takes over; the batch goes on.
    import vllm
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = vllm.SamplingParams(
        temperature=0.0, max_tokens=K_NEW, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    prompts = _prompts()
    got: dict[str, list[int]] = {"stay": [], "stop": []}
    engine.add_request("stay", {"prompt_token_ids": prompts[1]}, params)
    engine.add_request("stop", {"prompt_token_ids": prompts[2]}, params)
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        if len(got["stop"]) == 10:
            engine.abort_request(["stop"])
        for out in engine.step():
            got[out.request_id] += list(out.outputs[0].token_ids)
    assert got["stop"] == streams[2][:10]
    assert got["stay"] == streams[1]
    assert engine.get_num_unfinished_requests() == 0


def test_pddnet_reference_model_decodes_as_vllm_does(tiny: Path, streams: list[list[int]]) -> None:
    # The same checkpoint in pddnet's NumPy reference model gives the same greedy
    # tokens, so a reference run is a token-for-token oracle for vLLM runs.
    config = reference_config(tiny)
    model = ReferenceModel.create(
        config,
        num_blocks=64,
        block_size=32,
        weights=Weights.load(config, tiny / "model.safetensors"),
    )
    for prompt, stream in zip(_prompts(), streams, strict=True):
        seq = model.new_sequence(len(prompt) + K_NEW)
        tokens = [greedy(model.prefill(seq, prompt))]
        while len(tokens) < K_NEW:
            tokens.append(greedy(model.decode_step(seq, tokens[-1])))
        assert model.allocator is not None
        model.allocator.free(seq.block_table)
        assert tokens == stream


def test_reference_config_refuses_what_the_reference_model_lacks(tmp_path: Path) -> None:
    _need_checkpoint_writers()
    path = build_tiny_llama(tmp_path / "m")
    assert reference_config(path).num_kv_heads == 2
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(LocalProtocolError, match="tie_word_embeddings"):
        reference_config(path)
