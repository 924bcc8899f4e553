"""``copy_blocks`` (the decoder connector's load) and ``pddnet bench vllm``.

copy_blocks is checked against a per-block, per-layer reference copy for
fused and per-layer pools, consecutive, scattered and repeated destination
blocks, and scattered sources; the bench's load-rate part runs without vLLM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from pddnet import KVLayout, KVPool, LayoutMismatch
from pddnet.bench import vllm as bench
from pddnet.integrations.vllm import copy_blocks


def _pool(fused: bool, n: int, seed: int | None) -> KVPool:
    layout = KVLayout(3, 2, 8, 4, "float32", fused=fused, interior="hptd", key_order="dt")
    pool = KVPool.allocate(layout, n)
    if seed is not None:
        rng = np.random.default_rng(seed)
        for b in pool.buffers:
            b[...] = rng.standard_normal(b.shape)
    return pool


def _block(pool: KVPool, layer: int, block: int) -> np.ndarray:
    if pool.layout.fused:
        return np.asarray(pool.buffers[0][layer, block])
    return np.asarray(pool.buffers[layer][block])


@pytest.mark.parametrize("src_fused, dst_fused", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(
    "src_ids, dst_ids",
    [
        ([0], [5]),
        ([0, 1, 2, 3], [4, 5, 6, 7]),  # one run both sides
        ([0, 1, 2, 3], [9, 2, 14, 3]),  # consecutive source, scattered destination
        ([0, 1, 2, 3], [4, 5, 9, 10]),  # two destination runs under one source run
        ([7, 2, 3, 11], [1, 2, 3, 4]),  # scattered source
        ([0, 1, 2], [6, 6, 8]),  # a repeated destination: the last copy wins
    ],
)
def test_copy_blocks_matches_a_per_block_copy(
    src_fused: bool, dst_fused: bool, src_ids: list[int], dst_ids: list[int]
) -> None:
    src = _pool(src_fused, 12, seed=1)
    dst = _pool(dst_fused, 16, seed=2)
    want = _pool(dst_fused, 16, seed=2)
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(3):
            _block(want, layer, d)[...] = _block(src, layer, s)
    n = copy_blocks(src, dst, np.asarray(src_ids), dst_ids)
    assert n == len(src_ids) * src.layout.block_bytes
    for a, b in zip(dst.buffers, want.buffers, strict=True):
        np.testing.assert_array_equal(a, b)


def test_copy_blocks_refuses_mismatches() -> None:
    src = _pool(True, 4, seed=None)
    other = KVPool.allocate(KVLayout(3, 2, 8, 4, "float32", fused=True, interior="hptd"), 4)
    with pytest.raises(LayoutMismatch):
        copy_blocks(src, other, [0], [1])  # key_order differs
    with pytest.raises(LayoutMismatch):
        copy_blocks(src, _pool(True, 4, seed=None), [0, 1], [1])


def test_bench_vllm_load_rate_quick(tmp_path: Path) -> None:
    out = tmp_path / "v.json"
    args = argparse.Namespace(
        quick=True,
        json=str(out),
        png=None,
        rounds=2,
        engine_rounds=None,
        requests=4,
        skip_engine=True,
    )
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    rows = report["load_rate"]
    sizes = {(r["layout"], r["blocks"], r["pattern"]) for r in rows}
    assert ("tiny", 512, "scattered") in sizes and ("7b", 32, "consecutive") in sizes
    for r in rows:
        assert r["copy_blocks_GBps"] > 0 and r["numpy_GBps"] > 0
        assert 0 < r["load_ratio_worst"] <= r["load_ratio_vs_numpy_copy"]
    assert report["scheduler"] is None
    assert report["summary"]["load_target"] == 0.8
