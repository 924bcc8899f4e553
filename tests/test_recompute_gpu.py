"""The CuPy model path: extend vs relay decoding on the GPU, and GPU vs NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pddnet import KVPool
from pddnet.recompute import TINY, ModelConfig, PagedSequence, ReferenceModel, Weights, greedy
from pddnet.recompute import _reference as ref

pytestmark = pytest.mark.gpu

# head_dim 64 exercises more than one lane-dimension per warp than TINY's 16 does
SMALL = ModelConfig(
    vocab_size=1000,
    hidden=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    intermediate=512,
)


@pytest.fixture
def cp() -> Any:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:
        pytest.skip(f"no CUDA device: {exc}")
    return cupy


def _gpu_model(cp: Any, cfg: ModelConfig, weights: Weights, dtype: str, blocks: int) -> Any:
    layout = cfg.kv_layout(16, dtype)
    bufs = [cp.zeros(layout.buffer_shape(blocks), layout.np_dtype) for _ in range(cfg.num_layers)]
    matrix = "float32" if dtype == "float32" else "float16"
    return ReferenceModel(cfg, weights, KVPool(layout, bufs), matrix_dtype=matrix)


def _as_f32(a: Any) -> Any:
    return ref.bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


@pytest.mark.parametrize("cfg", [TINY, SMALL], ids=["tiny", "small"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("prefix_len", "n"), [(13, 1), (45, 7), (32, 64), (29, 100)])
def test_gpu_extend_matches_gpu_decode(
    cp: Any, cfg: ModelConfig, dtype: str, prefix_len: int, n: int
) -> None:
    weights = Weights.random(cfg, 1)
    blocks = 16
    rld = _gpu_model(cp, cfg, weights, dtype, blocks)
    md = _gpu_model(cp, cfg, weights, dtype, blocks)
    rng = np.random.default_rng(prefix_len * n)
    prompt = rng.integers(0, cfg.vocab_size, prefix_len)
    t_rld = rng.permutation(blocks).astype(np.int32)
    t_md = rng.permutation(blocks).astype(np.int32)
    rld_seq, md_seq = PagedSequence(t_rld), PagedSequence(t_md)
    token = greedy(rld.prefill(rld_seq, prompt))
    nb = -(-prefix_len // 16)
    for a, b in zip(rld.pool.buffers, md.pool.buffers, strict=True):  # "transfer" the prefix
        b[cp.asarray(t_md[:nb])] = a[cp.asarray(t_rld[:nb])]
    md_seq.length = prefix_len
    eager = []
    for _ in range(n):
        eager.append(token)
        token = greedy(rld.decode_step(rld_seq, token))
    assert greedy(md.extend(md_seq, eager)) == token
    pos = np.arange(prefix_len, prefix_len + n)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for a, b in zip(rld.pool.buffers, md.pool.buffers, strict=True):
        want = _as_f32(cp.asnumpy(a)[t_rld[pos // 16], :, pos % 16])
        got = _as_f32(cp.asnumpy(b)[t_md[pos // 16], :, pos % 16])
        assert np.abs(got - want).max() / np.abs(want).max() <= tol


def test_gpu_fp32_model_matches_numpy_model(cp: Any) -> None:
    weights = Weights.random(SMALL, 2)
    gpu = _gpu_model(cp, SMALL, weights, "float32", 16)
    cpu = ReferenceModel.create(SMALL, 16, weights=weights)
    prompt = list(range(100, 140))
    g_seq = PagedSequence(np.arange(16, dtype=np.int32))
    c_seq = cpu.new_sequence()
    g = cp.asnumpy(gpu.prefill(g_seq, prompt))
    c = cpu.prefill(c_seq, prompt)
    np.testing.assert_allclose(g, c, rtol=1e-3, atol=1e-3)
    token = greedy(c)
    assert gpu.generate(g_seq, token, 10) == cpu.generate(c_seq, token, 10)
