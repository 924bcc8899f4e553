"""The reference model: extend (MD's recompute) agrees with relay decoding (RLD)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pddnet import KVPool, LocalProtocolError, ResourceLimitError, TransferPlan
from pddnet.recompute import (
    TINY,
    BlockAllocator,
    ModelRecomputer,
    PagedSequence,
    Recomputer,
    ReferenceModel,
    Weights,
    greedy,
)

BS = 16
POOL_BLOCKS = 24
POISON = 0xFF  # float32 NaN in every byte pattern


def _handoff_pair(
    seed: int, prefix_len: int, *, kv_major: bool = False
) -> tuple[ReferenceModel, PagedSequence, ReferenceModel, PagedSequence, int, Any]:
    """P prefills a prompt and ships its blocks to RLD and MD pools (poisoned,
    shuffled block tables); returns RLD and MD with their sequences, the first
    generated token and P's pool (the source of the prefix KV)."""
    rng = np.random.default_rng(seed)
    weights = Weights.random(TINY, seed)
    layout = TINY.kv_layout(BS, "float32", kv_major=kv_major)
    p_model = ReferenceModel(
        TINY, weights, KVPool.allocate(layout, POOL_BLOCKS), allocator=BlockAllocator(POOL_BLOCKS)
    )
    p_seq = p_model.new_sequence()
    prompt = rng.integers(0, TINY.vocab_size, prefix_len)
    first = greedy(p_model.prefill(p_seq, prompt))
    src_ids = p_seq.blocks_in_use(BS)
    out = []
    for _ in range(2):
        pool = KVPool.allocate(layout, POOL_BLOCKS, fill=POISON)
        table = rng.permutation(POOL_BLOCKS).astype(np.int32)  # non-contiguous, out of order
        plan = TransferPlan.build(layout, POOL_BLOCKS, src_ids, POOL_BLOCKS, table[: src_ids.size])
        pool.write(plan.dst, p_model.pool.read(plan.src))
        out.append((ReferenceModel(TINY, weights, pool), PagedSequence(table, prefix_len)))
    (rld, rld_seq), (md, md_seq) = out
    return rld, rld_seq, md, md_seq, first, p_model.pool


def _slots(model: ReferenceModel, seq: PagedSequence, lo: int, hi: int, layer: int) -> Any:
    """K and V of positions [lo, hi) as a [2, hi-lo, kv_heads, head_dim] array."""
    pos = np.arange(lo, hi)
    blocks, slots = seq.block_table[pos // BS], pos % BS
    k, v = model.kv_views(layer)
    return np.stack([k[blocks, slots], v[blocks, slots]])


def _max_rel_err(a: Any, b: Any) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("n", [1, 7, 64, 100])
@pytest.mark.parametrize("prefix_len", [13, 32, 45])
def test_extend_matches_relay_decode(n: int, prefix_len: int) -> None:
    rld, rld_seq, md, md_seq, first, _ = _handoff_pair(
        seed=n * 100 + prefix_len, prefix_len=prefix_len
    )
    # RLD decodes n eager tokens one by one
    eager, token = [], first
    for _ in range(n):
        eager.append(token)
        token = greedy(rld.decode_step(rld_seq, token))
    # MD recomputes their KV in one extend
    logits = md.extend(md_seq, eager)
    assert md_seq.length == rld_seq.length == prefix_len + n
    assert greedy(logits) == token
    for layer in range(TINY.num_layers):
        got = _slots(md, md_seq, prefix_len, prefix_len + n, layer)
        want = _slots(rld, rld_seq, prefix_len, prefix_len + n, layer)
        assert np.isfinite(got).all()
        assert _max_rel_err(got[0], want[0]) <= 1e-5  # K
        assert _max_rel_err(got[1], want[1]) <= 1e-5  # V
    # and both continue with the same tokens
    assert md.generate(md_seq, token, 8) == rld.generate(rld_seq, token, 8)


@pytest.mark.parametrize("prefix_len", [13, 32])
def test_extend_writes_only_its_slots(prefix_len: int) -> None:
    _, _, md, md_seq, first, p_pool = _handoff_pair(seed=7, prefix_len=prefix_len)
    before = [b.copy() for b in md.pool.buffers]
    n = 21
    md.extend(md_seq, [first] * n)
    touched = np.zeros((POOL_BLOCKS, BS), bool)
    pos = np.arange(prefix_len, prefix_len + n)
    touched[md_seq.block_table[pos // BS], pos % BS] = True
    for layer, (old, new) in enumerate(zip(before, md.pool.buffers, strict=True)):
        for part in range(2):
            o = old[:, part].view(np.uint32)
            w = new[:, part].view(np.uint32)
            assert (o[~touched] == w[~touched]).all(), f"layer {layer} wrote outside its slots"
            assert np.isfinite(new[:, part][touched]).all()
        # the prefix (including the partly filled block) still equals P's KV
        k_md, _ = md.kv_views(layer)
        k_p = p_pool.buffers[layer][:, 0]
        p_blocks = np.arange(-(-prefix_len // BS))
        p_pos = np.arange(prefix_len)
        assert np.array_equal(
            k_md[md_seq.block_table[p_pos // BS], p_pos % BS],
            k_p[p_blocks[p_pos // BS], p_pos % BS],
        )


def test_kv_major_layout_agrees() -> None:
    rld, rld_seq, md, md_seq, first, _ = _handoff_pair(seed=3, prefix_len=29, kv_major=True)
    eager, token = [], first
    for _ in range(9):
        eager.append(token)
        token = greedy(rld.decode_step(rld_seq, token))
    assert greedy(md.extend(md_seq, eager)) == token
    for layer in range(TINY.num_layers):
        got = _slots(md, md_seq, 29, 38, layer)
        want = _slots(rld, rld_seq, 29, 38, layer)
        assert _max_rel_err(got, want) <= 1e-5


def test_all_logits_match_step_logits() -> None:
    model = ReferenceModel.create(TINY, 32, block_size=BS, seed=5)
    a, b = model.new_sequence(), model.new_sequence()
    prompt = list(range(40, 60))
    tokens = [3, 99, 250, 7, 7, 511]
    model.prefill(a, prompt)
    model.prefill(b, prompt)
    full = model.extend(a, tokens, all_logits=True)
    steps = np.stack([model.decode_step(b, t) for t in tokens])
    assert full.shape == (len(tokens), TINY.vocab_size)
    np.testing.assert_allclose(full, steps, rtol=1e-5, atol=1e-5)


def test_prefill_equals_extend_in_pieces() -> None:
    model = ReferenceModel.create(TINY, 32, block_size=BS, seed=11)
    prompt = np.random.default_rng(1).integers(0, TINY.vocab_size, 50)
    whole, parts = model.new_sequence(), model.new_sequence()
    want = model.prefill(whole, prompt)
    model.prefill(parts, prompt[:17])
    model.extend(parts, prompt[17:33])
    got = model.extend(parts, prompt[33:])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_recomputer_protocol_and_default() -> None:
    rld, rld_seq, md, md_seq, first, _ = _handoff_pair(seed=9, prefix_len=20)
    rec = ModelRecomputer(md)
    assert isinstance(rec, Recomputer)
    eager, token = [], first
    for _ in range(5):
        eager.append(token)
        token = greedy(rld.decode_step(rld_seq, token))
    assert greedy(rec.recompute(md_seq, eager)) == token
    assert md_seq.length == 25


def test_errors_leave_sequence_unchanged() -> None:
    weights = Weights.random(TINY, 0)
    pool = KVPool.allocate(TINY.kv_layout(BS), 8)
    model = ReferenceModel(TINY, weights, pool)  # no allocator
    seq = PagedSequence(np.array([3, 1], np.int32), 30)
    with pytest.raises(ResourceLimitError):
        model.extend(seq, [1, 2, 3])
    assert seq.length == 30 and seq.block_table.tolist() == [3, 1]
    with pytest.raises(LocalProtocolError):
        model.extend(seq, [])
    with pytest.raises(LocalProtocolError):
        model.extend(seq, [TINY.vocab_size])
    with pytest.raises(LocalProtocolError):
        model.prefill(seq, [1])
    assert seq.length == 30
    model.extend(seq, [1, 2])  # exactly fills the two blocks
    assert seq.length == 32


def test_allocator_grows_and_releases() -> None:
    model = ReferenceModel.create(TINY, 4, block_size=BS)
    seq = model.new_sequence()
    model.prefill(seq, list(range(40)))
    assert seq.block_table.size == 3
    assert model.allocator is not None and model.allocator.free_blocks == 1
    with pytest.raises(ResourceLimitError):
        model.extend(seq, list(range(30)))
    model.release(seq)
    assert model.allocator.free_blocks == 4 and seq.length == 0


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([1, 1], "twice"),  # freed twice in one call
        ([2], "double free"),  # freed before: it would be handed out twice
        ([5], "not allocated"),  # in range, never handed out
        ([-1], "outside"),
        ([8], "outside"),
    ],
)
def test_allocator_refuses_double_and_foreign_frees(bad: list[int], match: str) -> None:
    alloc = BlockAllocator(8)
    ids = alloc.allocate(4).tolist()
    assert ids == [0, 1, 2, 3]
    alloc.free([2])
    with pytest.raises(LocalProtocolError, match=match):
        alloc.free(bad)
    # a refused free changes nothing: each block is handed out exactly once more
    assert alloc.free_blocks == 5
    alloc.free([0, 1, 3])
    again = alloc.allocate(8).tolist()
    assert sorted(again) == list(range(8))


def test_public_exports_resolve() -> None:
    import pddnet.recompute as pkg

    assert sorted(pkg.__all__) == sorted(set(pkg.__all__))
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, name
    assert {"ReferenceModel", "Recomputer", "PagedSequence", "kernels_for"} <= set(pkg.__all__)


def test_one_model_serves_interleaved_sequences() -> None:
    model = ReferenceModel.create(TINY, 32, block_size=BS, seed=8)
    prompts = [list(range(1, 21)), list(range(300, 337))]
    alone = []
    for p in prompts:
        seq = model.new_sequence()
        token = greedy(model.prefill(seq, p))
        alone.append([token, *model.generate(seq, token, 12)])
        model.release(seq)
    seqs = [model.new_sequence() for _ in prompts]
    tokens = [greedy(model.prefill(s, p)) for s, p in zip(seqs, prompts, strict=True)]
    together: list[list[int]] = [[t] for t in tokens]
    for _ in range(12):  # alternate steps between the two sequences
        for i, s in enumerate(seqs):
            together[i].append(greedy(model.decode_step(s, together[i][-1])))
    assert together == alone
