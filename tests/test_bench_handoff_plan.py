"""The pure parts of ``pddnet bench handoff``: options, shapes, token ranges, crossover."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import LayoutMismatch, LocalProtocolError
from pddnet.bench._handoff_plan import (
    K_DEFAULT_KV_BYTES_PER_TOKEN,
    K_H100_SXM,
    K_QUICK_LINK,
    DeviceSpec,
    LinkConditions,
    crossover,
    gpu_recompute_s,
    model_for_bytes,
    model_of_kv,
    model_params,
    parse_model,
    parse_wan,
    summary_stats,
    token_ranges,
)
from pddnet.kv import KVLayout, KVPool
from pddnet.recompute import TINY


def test_parse_wan_reads_every_key() -> None:
    link = parse_wan("rtt=30ms,jitter=5ms,loss=0.1%,rate=1gbit")
    assert link == LinkConditions(0.030, 0.005, 0.001, 1e9, 9000)
    quick = parse_wan("rtt=30ms, jitter=2ms, loss=0.5%, rate=200mbit")
    assert quick == K_QUICK_LINK
    assert parse_wan("mtu=1500,rtt=80ms").mtu == 1500
    assert parse_wan("rtt=80ms").jitter_s == LinkConditions().jitter_s  # others keep defaults
    assert "rate=200Mbit" in K_QUICK_LINK.name and "loss=0.5%" in K_QUICK_LINK.name


@pytest.mark.parametrize("text", ["rtt", "speed=1gbit", "rtt=fast", "loss=150%"])
def test_parse_wan_rejects(text: str) -> None:
    with pytest.raises(LocalProtocolError):
        parse_wan(text)


def test_default_bytes_match_the_published_payload() -> None:
    assert K_DEFAULT_KV_BYTES_PER_TOKEN * 100 // 1024 == 4650  # "4649 KB" for 100 tokens
    choice = model_for_bytes(K_DEFAULT_KV_BYTES_PER_TOKEN)
    assert choice.kv_bytes_per_token == 47616
    assert choice.shared_pool and not choice.note
    m = choice.model
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (31, 3, 64)
    assert m.kv_layout(16, "float32") == choice.kv_layout
    # recompute runs the model whose KV is shipped: the KV bytes agree, and the width is
    # that of a real model with this KV (query heads x head width), not a narrow stand-in
    # (it was 128 wide with 6 x 64 query dims: a 0.01 B-parameter model)
    assert m.kv_layout().kv_bytes_per_token == choice.kv_bytes_per_token
    assert choice.same_model
    assert (m.num_heads, m.hidden, m.intermediate) == (12, 12 * 64, 2048)
    assert 0.2e9 < model_params(m) < 0.3e9
    assert choice.to_dict()["model_params"] == model_params(m)


def test_model_of_kv_follows_llama_conventions() -> None:
    # Llama-2-7B's KV (32 x 32 x 128, MHA) gives Llama-2-7B itself: 4096 wide, SwiGLU
    # 11008, 6 738 415 616 parameters (its published count)
    llama2 = model_of_kv(32, 32, 128, group=1)
    assert (llama2.hidden, llama2.num_heads, llama2.intermediate) == (4096, 32, 11008)
    assert model_params(llama2) == 6_738_415_616
    # Mistral-7B's KV (32 x 8 x 128, GQA 4:1): width 4096, 32 query heads
    mistral = model_of_kv(32, 8, 128)
    assert (mistral.hidden, mistral.num_heads, mistral.num_kv_heads) == (4096, 32, 8)
    with pytest.raises(LayoutMismatch):
        model_of_kv(4, 2, 64, group=0)


def test_gpu_cost_model_adds_compute_and_weight_traffic() -> None:
    m = model_of_kv(32, 32, 128, group=1)  # Llama-2-7B
    dev = DeviceSpec("test", flops=1e15, bandwidth=1e12)
    layer_params = 202_383_360
    n, prefix = 100, 0
    flops = 2 * 32 * layer_params * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2) + 2 * 4096 * 32000
    traffic = 2 * (32 * layer_params + (32000 + n) * 4096 + 2 * 32 * 32 * 128 * 2 * n)
    assert gpu_recompute_s(m, n, prefix, dev) == pytest.approx(flops / 1e15 + traffic / 1e12)
    # weights dominate a short extend: about 13.5 GB of bf16 at 3.35 TB/s = 4 ms
    assert 4e-3 < gpu_recompute_s(m, 100, 256, K_H100_SXM) < 6e-3
    assert gpu_recompute_s(m, 512, 256) > gpu_recompute_s(m, 100, 256)


@pytest.mark.parametrize("b", [512, 8, 4096, 131072, 1001, 7, 47616 + 4])
def test_model_for_bytes_is_exact(b: int) -> None:
    choice = model_for_bytes(b)
    assert choice.kv_bytes_per_token == b
    assert choice.shared_pool == (choice.model.kv_layout(16, "float32") == choice.kv_layout)
    if not choice.shared_pool:
        assert str(b) in choice.note
    # where no float32 shape holds B exactly the two sides are not the same model
    assert choice.same_model == choice.shared_pool


def test_model_for_bytes_rejects_nonpositive() -> None:
    with pytest.raises(LocalProtocolError):
        model_for_bytes(0)


def test_parse_model() -> None:
    tiny = parse_model("tiny")
    assert tiny.model == TINY and tiny.kv_bytes_per_token == 512 and tiny.shared_pool
    fp16 = parse_model("layers=32,kv_heads=8,head_dim=128,dtype=float16")
    assert fp16.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert not fp16.shared_pool and "float32" in fp16.note
    assert (fp16.model.num_layers, fp16.model.num_kv_heads, fp16.model.head_dim) == (32, 8, 128)
    assert fp16.same_model and fp16.model.hidden == 4096  # the same model, KV kept in float32
    fp32 = parse_model("layers=4,kv_heads=2,head_dim=32,dtype=float32")
    assert fp32.shared_pool and fp32.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4
    mla = parse_model("layers=61,head_dim=576,mla=1,dtype=bfloat16")
    assert mla.kv_bytes_per_token == 61 * 576 * 2 and not mla.shared_pool
    assert not mla.same_model  # the reference model has no MLA
    for bad in ("layers=4", "layers=x,head_dim=2", "layers=4,head_dim=8,colour=red", "huge"):
        with pytest.raises(LocalProtocolError):
            parse_model(bad)


def _slot_view(pool: KVPool, layer: int, block: int, part: int, slot: int) -> np.ndarray:
    return np.asarray(pool.buffers[layer][block, part, slot]).view(np.uint8)


@settings(max_examples=40, deadline=None)
@given(
    start=st.integers(0, 60),
    n=st.integers(1, 70),
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 4, 16]),
    mla=st.booleans(),
)
def test_token_ranges_cover_exactly_the_new_slots(
    start: int, n: int, seed: int, block_size: int, mla: bool
) -> None:
    if mla:
        layout = KVLayout(3, 1, 6, block_size, dtype="uint8", mla=True)
    else:
        layout = KVLayout(3, 2, 4, block_size, dtype="float16")
    rng = np.random.default_rng(seed)
    blocks = -(-(start + n) // block_size)
    num_blocks = blocks + 5
    src_table = rng.permutation(num_blocks)[:blocks]
    dst_table = rng.permutation(num_blocks)[:blocks]
    src = KVPool.allocate(layout, num_blocks, fill=None)
    for b in src.buffers:
        b.view(np.uint8)[...] = rng.integers(0, 256, b.view(np.uint8).shape, dtype=np.uint8)
    dst = KVPool.allocate(layout, num_blocks)
    sr = token_ranges(layout, num_blocks, src_table, start, n)
    dr = token_ranges(layout, num_blocks, dst_table, start, n)
    assert sr.total == dr.total == n * layout.kv_bytes_per_token
    bounds = dr.layer_bounds(layout.num_layers)
    assert np.all(bounds[:, 1] - bounds[:, 0] == n * layout.token_bytes_per_layer)
    # ship the logical stream from src to dst, as the transport does
    dst.write(dr, src.read(sr))
    touched = np.zeros((num_blocks, block_size), bool)
    for p in range(start, start + n):
        touched[dst_table[p // block_size], p % block_size] = True
        for layer in range(layout.num_layers):
            for part in range(layout.parts):
                got = _slot_view(dst, layer, dst_table[p // block_size], part, p % block_size)
                want = _slot_view(src, layer, src_table[p // block_size], part, p % block_size)
                assert np.array_equal(got, want)
    for layer in range(layout.num_layers):  # nothing else was written
        buf = np.moveaxis(np.asarray(dst.buffers[layer]).view(np.uint8), 1, 2)  # [nb, bs, ...]
        rest = buf[~touched]
        assert not rest.any()


def test_token_ranges_rejects() -> None:
    layout = KVLayout(2, 1, 8, 16)
    with pytest.raises(LayoutMismatch):
        token_ranges(layout, 4, [0, 1], 20, 20)  # needs 3 blocks
    with pytest.raises(LayoutMismatch):
        token_ranges(layout, 4, [0, 9], 0, 20)  # block outside the pool
    with pytest.raises(LayoutMismatch):
        token_ranges(KVLayout(2, 1, 8, 16, kv_major=True), 4, [0], 0, 1)
    assert token_ranges(layout, 4, [0], 0, 0).total == 0


@pytest.mark.parametrize(
    ("kv", "rc", "want"),
    [
        ([1, 2, 3, 4], [2, 2.5, 2.9, 3], 16),  # recompute wins from the third point
        ([1, 2, 3, 4], [0.5, 3, 2, 3], 16),  # an early win that does not last is no crossover
        ([1, 2, 3, 4], [0.5, 1, 2, 3], 1),
        ([1, 2, 3, 4], [2, 3, 4, 5], None),
        ([1, 2, 3, 4], [0.5, 1, 2, 5], None),  # loses at the largest count
    ],
)
def test_crossover(kv: list[float], rc: list[float], want: int | None) -> None:
    assert crossover([1, 4, 16, 64], kv, rc) == want


def test_summary_stats() -> None:
    s = summary_stats([0.1, 0.1, 0.1, 0.5])
    assert s["mean"] == pytest.approx(0.2)
    assert s["max_over_mean"] == pytest.approx(2.5)
    assert s["cv"] == pytest.approx(np.std([0.1, 0.1, 0.1, 0.5]) / 0.2)
