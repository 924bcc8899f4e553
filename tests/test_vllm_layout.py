"""vLLM CPU's KV layout in pddnet: the ``'hptd'`` block interior and the pool bridge.

* pddnet's NumPy reference model reads and writes ``'hptd'`` blocks (per KV
  head, K of the block's tokens, then V), per-layer or fused, and decodes
  exactly as from its native ``'pthd'`` pool; the bytes land where vLLM's CPU
  attention reads them (``[blocks, heads, 2 * block_size, head_dim]``, split
  in half). Its CUDA path still refuses anything but per-layer ``'pthd'``.
* :func:`kv_pool_from_vllm` wraps vLLM's per-layer tensors without a copy:
  one fused buffer over the shared storage, or one buffer per layer.

tests/test_vllm_prefill_role.py checks the interpretation against vLLM itself:
decoders reading a real vLLM instance's blocks continue its greedy stream.
"""

from __future__ import annotations

import numpy as np
import pytest

from pddnet import KVLayout, KVPool, LayoutMismatch
from pddnet.recompute import TINY, BlockAllocator, ReferenceModel, Weights, greedy

NB = 24
BS = 32


def _model(layout: KVLayout) -> ReferenceModel:
    pool = KVPool.allocate(layout, NB, fill=0xFF)  # NaN: a slot read before written shows
    return ReferenceModel(TINY, Weights.random(TINY, 3), pool, allocator=BlockAllocator(NB))


@pytest.mark.parametrize(
    "interior, fused, key_order",
    [
        ("hptd", False, "td"),
        ("hptd", True, "td"),
        ("hptd", True, "dt"),  # vLLM CPU's
        ("pthd", True, "td"),
        ("thpd", False, "td"),
    ],
)
def test_reference_model_decodes_the_same_from_any_interior(
    interior: str, fused: bool, key_order: str
) -> None:
    base = TINY.kv_layout(BS, "float32")
    change = {"interior": interior, "fused": fused, "key_order": key_order}
    other = KVLayout(**{**base.to_dict(), **change})
    prompt = np.random.default_rng(5).integers(0, TINY.vocab_size, 100)
    runs = []
    for layout in (base, other):
        model = _model(layout)
        assert model.allocator is not None
        model.allocator.allocate(3)  # the sequence's blocks are not 0, 1, 2, ...
        seq = model.new_sequence(len(prompt) + 40)
        first = greedy(model.prefill(seq, prompt))
        runs.append((model, seq, [first, *model.generate(seq, first, 39)]))
    (ref, ref_seq, want), (got_model, seq, got) = runs
    assert got == want
    # the bytes are in the layout's order: K of (block b, token t, head h) sits
    # at [b, (h, 0, t)] of an 'hptd' slot, V at [b, (h, 1, t)]
    ids = seq.block_table[: -(-len(prompt) // BS)]
    assert list(ids) == list(ref_seq.block_table[: ids.size])
    names = ["b", *other.interior]
    for layer in range(TINY.num_layers):
        buf = got_model.pool.buffers[0][layer] if fused else got_model.pool.buffers[layer]
        slots = buf.transpose([names.index(a) for a in "bpthd"])[ids]  # [blocks, p, t, h, d]
        k, v = ref.kv_views(layer)
        np.testing.assert_array_equal(slots[:, 1], v[ids])
        if key_order == "td":  # 'dt': test_vllm_cpu_reading_of_an_hptd_block
            np.testing.assert_array_equal(slots[:, 0], k[ids])


def test_vllm_cpu_reading_of_an_hptd_block() -> None:
    # vLLM's CPU attention (vec ISA): per head [2 * block_size * d] split in
    # half, K as [d, block_size], V as [block_size, d]
    layout = KVLayout(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, BS, "float32",
                      interior="hptd", key_order="dt")  # fmt: skip
    ref = _model(TINY.kv_layout(BS, "float32"))
    model = _model(layout)
    for m in (ref, model):
        seq = m.new_sequence(50)
        m.prefill(seq, list(range(50)))
    d, h = TINY.head_dim, TINY.num_kv_heads
    n = 50 - BS  # tokens in the second block
    b = seq.block_table[1]
    for layer in range(TINY.num_layers):
        halves = model.pool.buffers[layer].reshape(NB, h, 2, BS * d)
        key_cache = halves[:, :, 0].reshape(NB, h, d, BS)
        value_cache = halves[:, :, 1].reshape(NB, h, BS, d)
        k, v = ref.kv_views(layer)  # [blocks, t, h, d], the NumPy model's native order
        np.testing.assert_array_equal(key_cache[b].transpose(2, 0, 1)[:n], k[b][:n])
        np.testing.assert_array_equal(value_cache[b].transpose(1, 0, 2)[:n], v[b][:n])


def test_cuda_path_still_refuses_other_interiors_and_fused_pools() -> None:
    base = TINY.kv_layout(BS, "float16")
    TINY.check_layout(base, on_device=True)
    for change in ({"interior": "hptd"}, {"fused": True}, {"interior": "hptd", "key_order": "dt"}):
        with pytest.raises(LayoutMismatch, match="CUDA"):
            TINY.check_layout(KVLayout(**{**base.to_dict(), **change}), on_device=True)
        TINY.check_layout(KVLayout(**{**base.to_dict(), **change}))  # the NumPy path takes it
    with pytest.raises(LayoutMismatch, match="non-MLA"):
        TINY.check_layout(KVLayout(2, 1, 16, BS, mla=True))


def _vllm_like(num_blocks: int, layers: int, *, shared: bool) -> dict[str, object]:
    torch = pytest.importorskip(
        "torch", reason="torch comes with vLLM (pip install 'pddnet[vllm]')"
    )
    shape = (num_blocks, 2, BS, 2 * 16)
    per = int(np.prod(shape))
    if shared:  # as vLLM allocates it: one storage, layer i at i * layer bytes
        whole = torch.arange(layers * per, dtype=torch.float32)
        tensors = [whole[i * per : (i + 1) * per].view(shape) for i in range(layers)]
    else:
        tensors = [torch.arange(per, dtype=torch.float32).view(shape) + i for i in range(layers)]
    # vLLM's names; out of order, as a dict may hold them
    return {f"model.layers.{i}.self_attn.attn": tensors[i] for i in reversed(range(layers))}


@pytest.mark.parametrize("shared", [True, False])
def test_kv_pool_from_vllm_wraps_without_a_copy(shared: bool) -> None:
    from pddnet.integrations.vllm import kv_pool_from_vllm

    caches = _vllm_like(10, 3, shared=shared)
    pool = kv_pool_from_vllm(caches, isa="vec")  # head_dim 16 would be vec16
    want = KVLayout(3, 2, 16, BS, "float32", fused=shared, interior="hptd", key_order="dt")
    assert pool.layout == want
    assert pool.num_blocks == 10
    for i in range(3):
        t = caches[f"model.layers.{i}.self_attn.attn"]
        buf = pool.buffers[0][i] if shared else pool.buffers[i]
        assert buf.ctypes.data == t.data_ptr()  # type: ignore[attr-defined]
        # a write on either side shows on the other: the same bytes
        t[4, 1, 7, 20] = -1.0  # type: ignore[index]
        # row 7, column 20 of a head's [block_size, 2 * d] is its element 244 = [p, t, d] [0, 15, 4]
        assert buf[4, 1, 0, 15, 4] == -1.0
        buf[4, 1, 1, 31, 15] = -2.0
        assert float(t[4, 1, 31, 31]) == -2.0  # type: ignore[index]
    # the pool's byte planes are vLLM's layer offsets
    if shared:
        base = pool.buffers[0].ctypes.data
        layer_bytes = 10 * pool.layout.block_bytes_per_layer
        for plane in pool.layout.planes(10):
            t = caches[f"model.layers.{plane.layer}.self_attn.attn"]
            assert base + plane.base == t.data_ptr()  # type: ignore[attr-defined]
            assert plane.base == plane.layer * layer_bytes


def test_kv_pool_from_vllm_refuses_what_it_cannot_view() -> None:
    torch = pytest.importorskip(
        "torch", reason="torch comes with vLLM (pip install 'pddnet[vllm]')"
    )
    from pddnet.integrations.vllm import kv_pool_from_vllm

    good = torch.zeros(4, 2, BS, 32)
    with pytest.raises(LayoutMismatch, match="no KV cache layers"):
        kv_pool_from_vllm({})
    with pytest.raises(LayoutMismatch, match="layer 0 is"):
        kv_pool_from_vllm({"l.0": good, "l.1": torch.zeros(5, 2, BS, 32)})
    with pytest.raises(LayoutMismatch, match="contiguous"):
        kv_pool_from_vllm({"l.0": good.transpose(1, 2)})
    with pytest.raises(LayoutMismatch, match="bfloat16"):
        kv_pool_from_vllm({"l.0": good.to(torch.bfloat16)})
    with pytest.raises(LayoutMismatch, match="'amx'"):
        kv_pool_from_vllm({"l.0": good}, isa="amx")
    with pytest.raises(LayoutMismatch, match="key_order"):
        KVLayout(2, 2, 16, BS, interior="pthd", key_order="dt")
