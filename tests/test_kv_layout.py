from __future__ import annotations

import numpy as np
import pytest

from pddnet import KVLayout, KVPool, LayoutMismatch


def test_sizes_of_a_7b_like_layout() -> None:
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
    assert lay.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert lay.block_bytes == 16 * lay.kv_bytes_per_token
    assert len(lay.planes(10)) == 32


def test_mla_has_one_part() -> None:
    lay = KVLayout(num_layers=4, num_kv_heads=1, head_dim=576, block_size=64, mla=True)
    assert lay.parts == 1
    assert lay.layer_shape(3) == (3, 1, 64, 1, 576)
    with pytest.raises(LayoutMismatch):
        KVLayout(num_layers=4, num_kv_heads=2, head_dim=576, block_size=64, mla=True)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kv_major", [False, True])
def test_pool_wraps_without_copy(fused: bool, kv_major: bool) -> None:
    lay = KVLayout(3, 2, 4, 2, "float32", kv_major=kv_major, fused=fused)
    bufs = [np.zeros(lay.buffer_shape(5), np.float32) for _ in range(lay.num_buffers())]
    pool = KVPool(lay, bufs)
    assert pool.num_blocks == 5
    assert all(a is b for a, b in zip(pool.buffers, bufs, strict=True))
    view = pool.host_views()[0]
    view[0:4] = b"\x01\x02\x03\x04"
    assert bufs[0].view(np.uint8).reshape(-1)[:4].tolist() == [1, 2, 3, 4]


def test_pool_rejects_mismatched_arrays() -> None:
    lay = KVLayout(2, 2, 4, 2, "float16")
    good = lay.layer_shape(4)
    with pytest.raises(LayoutMismatch, match="buffers"):
        KVPool(lay, [np.zeros(good, np.float16)])
    with pytest.raises(LayoutMismatch, match="shape"):
        KVPool(lay, [np.zeros((4, 2, 2, 2, 5), np.float16)] * 2, num_blocks=4)
    with pytest.raises(LayoutMismatch, match="dtype"):
        KVPool(lay, [np.zeros(good, np.float32)] * 2)
    with pytest.raises(LayoutMismatch, match="contiguous"):
        arr = np.zeros((good[0] * 2, *good[1:]), np.float16)[::2]
        KVPool(lay, [arr, arr])


def test_layout_round_trips_and_validates() -> None:
    lay = KVLayout(2, 2, 4, 2, "bfloat16", kv_major=True)
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(LayoutMismatch):
        KVLayout.from_dict({"num_layers": 2})
    with pytest.raises(LayoutMismatch):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(LayoutMismatch):
        KVLayout(1, 1, 1, 1, dtype="notadtype")


def test_interior_orders_the_axes_of_a_block_slot() -> None:
    vllm_cpu = KVLayout(2, 4, 64, 32, "float32", interior="hptd")
    assert vllm_cpu.layer_shape(10) == (10, 4, 2, 32, 64)
    assert KVLayout(2, 4, 64, 32, "float32").layer_shape(10) == (10, 2, 32, 4, 64)
    assert KVLayout(2, 4, 64, 32, "float32", kv_major=True).layer_shape(10) == (2, 10, 32, 4, 64)
    assert KVLayout.from_dict(vllm_cpu.to_dict()) == vllm_cpu
    with pytest.raises(LayoutMismatch, match="permutation"):
        KVLayout(2, 4, 64, 32, interior="pthx")
    with pytest.raises(LayoutMismatch, match="outermost"):
        KVLayout(2, 4, 64, 32, kv_major=True, interior="tphd")
