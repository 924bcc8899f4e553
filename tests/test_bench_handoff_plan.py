"""The pure parts of ``pddnet bench handoff``: options, shapes, token ranges, crossover."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import LayoutMismatch, LocalProtocolError
from pddnet.bench._handoff_plan import (
    K_DEFAULT_KV_BYTES_PER_TOKEN,
    K_QUICK_LINK,
    LinkConditions,
    crossover,
    model_for_bytes,
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


@pytest.mark.parametrize("b", [512, 8, 4096, 131072, 1001, 7, 47616 + 4])
def test_model_for_bytes_is_exact(b: int) -> None:
    choice = model_for_bytes(b)
    assert choice.kv_bytes_per_token == b
    assert choice.shared_pool == (choice.model.kv_layout(16, "float32") == choice.kv_layout)
    if not choice.shared_pool:
        assert str(b) in choice.note


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
    fp32 = parse_model("layers=4,kv_heads=2,head_dim=32,dtype=float32")
    assert fp32.shared_pool and fp32.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4
    mla = parse_model("layers=61,head_dim=576,mla=1,dtype=bfloat16")
    assert mla.kv_bytes_per_token == 61 * 576 * 2 and not mla.shared_pool
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
