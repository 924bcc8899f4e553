"""Block-range arithmetic against a naive per-block reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import KVLayout, KVPool, LayoutMismatch, TransferPlan
from pddnet.kv import block_ranges, coalesce, coalesce_pairs

layouts = st.builds(
    KVLayout,
    num_layers=st.integers(1, 4),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 2, 4, 8]),
    block_size=st.integers(1, 4),
    dtype=st.sampled_from(["float16", "float32", "bfloat16", "uint8"]),
    kv_major=st.booleans(),
    fused=st.booleans(),
)


def naive_runs(ids: list[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for b in ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [(s, n) for s, n in runs]


def naive_block_bytes(pool: KVPool, block: int) -> list[bytes]:
    """Each (layer, part) slice of one block, in plane order, via NumPy indexing."""
    out = []
    lay = pool.layout
    for layer in range(lay.num_layers):
        arr = pool.buffers[0][layer] if lay.fused else pool.buffers[layer]
        if lay.kv_major:
            out.extend(arr[p, block].tobytes() for p in range(lay.parts))
        else:
            out.append(arr[block].tobytes())
    return out


@given(st.lists(st.integers(0, 50), max_size=60))
def test_coalesce_matches_naive(ids: list[int]) -> None:
    starts, counts = coalesce(ids)
    assert list(zip(starts.tolist(), counts.tolist(), strict=True)) == naive_runs(ids)
    assert int(counts.sum()) == len(ids)


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=60))
def test_coalesce_pairs_runs_are_consecutive_on_both_sides(pairs: list[tuple[int, int]]) -> None:
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    s0, d0, n = coalesce_pairs(src, dst)
    rebuilt_src = [s + k for s, c in zip(s0, n, strict=True) for k in range(c)]
    rebuilt_dst = [d + k for d, c in zip(d0, n, strict=True) for k in range(c)]
    assert rebuilt_src == src and rebuilt_dst == dst
    # maximal: two neighbouring runs could not have been merged
    for i in range(len(n) - 1):
        assert not (s0[i] + n[i] == s0[i + 1] and d0[i] + n[i] == d0[i + 1])


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(1, 12), st.data())
def test_block_ranges_cover_exactly_the_blocks(layout: KVLayout, num_blocks: int, data) -> None:
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=num_blocks, unique=True))
    pool = KVPool.allocate(layout, num_blocks, fill=None)
    rng = np.random.default_rng(len(ids))
    for buf in pool.buffers:
        buf.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    ranges = block_ranges(layout, num_blocks, ids)
    assert ranges.total == len(ids) * layout.block_bytes
    got = pool.read(ranges)
    # expected: plane by plane (layer-major), blocks in the given order
    per_block = [naive_block_bytes(pool, b) for b in ids]
    nplanes = len(layout.planes(num_blocks))
    expected = b"".join(per_block[i][p] for p in range(nplanes) for i in range(len(ids)))
    assert got == expected
    bounds = ranges.layer_bounds(layout.num_layers)
    assert bounds[0, 0] == 0 and bounds[-1, 1] == ranges.total
    assert np.all(bounds[:, 1] - bounds[:, 0] == len(ids) * layout.block_bytes_per_layer)


@settings(max_examples=150, deadline=None)
@given(layouts, st.booleans(), st.integers(1, 10), st.integers(1, 10), st.data())
def test_transfer_plan_copies_like_naive(layout, dst_fused, src_n, dst_n, data) -> None:
    k = data.draw(st.integers(0, min(src_n, dst_n)))
    src_ids = data.draw(st.permutations(range(src_n)))[:k]
    dst_ids = data.draw(st.permutations(range(dst_n)))[:k]
    dst_layout = KVLayout(**{**layout.to_dict(), "fused": dst_fused})
    src = KVPool.allocate(layout, src_n, fill=None)
    rng = np.random.default_rng(k)
    for buf in src.buffers:
        buf.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    dst = KVPool.allocate(dst_layout, dst_n, fill=0xAB)
    plan = TransferPlan.build(layout, src_n, src_ids, dst_n, dst_ids, dst_layout)
    assert plan.total == k * layout.block_bytes
    # copy in odd-sized pieces to exercise pieces() across range boundaries
    step = data.draw(st.integers(1, 97))
    for lo in range(0, plan.total, step):
        hi = min(lo + step, plan.total)
        dst.write(plan.dst, src.read(plan.src, lo, hi), lo)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert naive_block_bytes(dst, d) == naive_block_bytes(src, s)
    untouched = set(range(dst_n)) - set(dst_ids)
    for d in untouched:
        assert all(set(part) == {0xAB} for part in naive_block_bytes(dst, d))


def test_pieces_rejects_out_of_range() -> None:
    layout = KVLayout(2, 1, 4, 2, "float32")
    ranges = block_ranges(layout, 4, [0, 2])
    with pytest.raises(LayoutMismatch):
        ranges.pieces(0, ranges.total + 1)
    with pytest.raises(LayoutMismatch):
        ranges.pieces(-1, 3)
    assert ranges.pieces(5, 5) == []


def test_bad_ids_and_lengths_are_typed_errors() -> None:
    layout = KVLayout(2, 1, 4, 2)
    with pytest.raises(LayoutMismatch):
        block_ranges(layout, 4, [4])
    with pytest.raises(LayoutMismatch):
        block_ranges(layout, 4, [-1])
    with pytest.raises(LayoutMismatch):
        TransferPlan.build(layout, 4, [0, 1], 4, [0])
    with pytest.raises(LayoutMismatch):
        TransferPlan.build(layout, 4, [0], 4, [0], KVLayout(2, 1, 4, 2, kv_major=True))


def test_large_plan_is_coalesced() -> None:
    layout = KVLayout(32, 8, 128, 16)
    ids = np.arange(100_000)
    plan = TransferPlan.build(layout, 100_000, ids, 100_000, ids[::-1].copy()[::-1])
    assert len(plan.src) == 32  # one range per layer plane
    assert plan.total == 100_000 * layout.block_bytes
