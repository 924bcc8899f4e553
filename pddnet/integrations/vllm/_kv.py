"""vLLM's CPU KV cache as a pddnet :class:`~pddnet.kv.KVPool`, without a copy.

vLLM 0.32's CPU attention backend keeps each layer's KV in one tensor of shape
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, which it reads as
``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` split in half: per KV
head, K of the block's tokens, then V (``cpu_attn.py``; docs/vllm.md). That is
pddnet's block interior ``"hptd"``. The ``vec`` attention kernels (float32 and
float16 on x86 with head sizes that are a multiple of 32) store K transposed,
``[head_dim, block_size]`` per head, and V as ``[block_size, head_dim]``
(measured: tests/test_vllm_prefill_role.py): ``key_order="dt"``. Other ISAs
(``amx``, ``neon``, ``vec16``, ...) may store K otherwise (not checked) and
are refused. The layers are normally consecutive slices of one storage;
:func:`kv_pool_from_vllm` then makes one fused pool over them, and one buffer
per layer otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._errors import LayoutMismatch, LocalProtocolError
from ..._optional import require
from ...kv import KVLayout, KVPool

__all__ = [
    "K_VLLM_CPU_INTERIOR",
    "K_VLLM_CPU_KEY_ORDER",
    "kv_pool_from_vllm",
    "layer_index",
    "vllm_cpu_layout",
]

#: vLLM CPU's block interior: per KV head, K of the block's tokens, then V.
K_VLLM_CPU_INTERIOR = "hptd"
#: vLLM CPU attention ISAs whose KV layout pddnet knows: ISA -> K's key_order.
K_VLLM_CPU_KEY_ORDER = {"vec": "dt"}


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name ("model.layers.<i>.self_attn.attn").

    Raises:
        LocalProtocolError: if the name has no numeric part.
    """
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise LocalProtocolError(f"no layer index in KV cache name {name!r}")


def vllm_cpu_layout(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str = "float32",
    *,
    block_size: int = 32,
    fused: bool = True,
    isa: str = "vec",
) -> KVLayout:
    """The :class:`KVLayout` of vLLM's CPU KV cache for a model of this shape.

    Raises:
        LayoutMismatch: for an ISA whose K layout pddnet does not know.
    """
    if isa not in K_VLLM_CPU_KEY_ORDER:
        raise LayoutMismatch(f"vLLM CPU attention ISA {isa!r}: its K cache layout is not known")
    return KVLayout(
        num_layers,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        fused=fused,
        interior=K_VLLM_CPU_INTERIOR,
        key_order=K_VLLM_CPU_KEY_ORDER[isa],
    )


def kv_pool_from_vllm(kv_caches: Mapping[str, Any], *, isa: str | None = None) -> KVPool:
    """Wrap the tensors of vLLM's ``register_kv_caches`` as a pool (NumPy views).

    Args:
        kv_caches: layer name -> CPU tensor ``[num_blocks, kv_heads,
            block_size, 2 * head_dim]``, as vLLM's CPU backend allocates them.
        isa: vLLM's CPU attention ISA for these tensors; None asks vLLM
            (``cpu_attn._get_attn_isa``, as its backend does).

    Returns:
        A pool with ``KVLayout(layers, kv_heads, head_dim, block_size, dtype,
        interior="hptd", key_order="dt")``; ``fused=True`` when layer ``i`` starts exactly ``i``
        layers into one storage (as vLLM allocates it), per-layer otherwise.
        Its buffers are the tensors' own memory: pddnet reads and writes vLLM's
        blocks in place.

    Raises:
        LayoutMismatch: for no layers, layers of different shapes or dtypes, a
            non-contiguous or non-CPU tensor, a dtype NumPy cannot view, or
            an ISA whose K layout pddnet does not know.
    """
    torch = require("torch")
    if not kv_caches:
        raise LayoutMismatch("vLLM registered no KV cache layers")
    tensors = [kv_caches[name] for name in sorted(kv_caches, key=layer_index)]
    first = tensors[0]
    for name, t in zip(sorted(kv_caches, key=layer_index), tensors, strict=True):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 4:
            raise LayoutMismatch(
                f"KV cache {name}: want a contiguous 4-D CPU tensor, got {tuple(t.shape)}"
                f" on {t.device} (contiguous: {t.is_contiguous()})"
            )
        if t.shape != first.shape or t.dtype != first.dtype:
            raise LayoutMismatch(
                f"KV cache {name} is {tuple(t.shape)} {t.dtype}, layer 0 is"
                f" {tuple(first.shape)} {first.dtype}"
            )
    num_blocks, kv_heads, block_size, width = (int(x) for x in first.shape)
    if width % 2:
        raise LayoutMismatch(f"KV cache last axis {width} is not 2 * head_dim")
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in ("float32", "float16"):
        raise LayoutMismatch(f"no NumPy view of a {dtype} KV cache")
    if isa is None:
        cpu_attn = require("vllm.v1.attention.backends.cpu_attn")
        isa = str(cpu_attn._get_attn_isa(first.dtype, block_size, width // 2))
    per_layer = vllm_cpu_layout(
        len(tensors), kv_heads, width // 2, dtype, block_size=block_size, fused=False, isa=isa
    )
    layer_elems = first.numel()
    fused = all(
        t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.storage_offset() == first.storage_offset() + i * layer_elems
        for i, t in enumerate(tensors)
    )
    if fused:
        whole = torch.as_strided(
            first,
            (len(tensors), *first.shape),
            (layer_elems, *first.stride()),
            first.storage_offset(),
        )
        layout = KVLayout(**{**per_layer.to_dict(), "fused": True})
        buffers = [whole.numpy().reshape(layout.buffer_shape(num_blocks))]
        starts = [buffers[0][i].ctypes.data for i in range(len(tensors))]
    else:
        layout = per_layer
        buffers = [t.numpy().reshape(layout.layer_shape(num_blocks)) for t in tensors]
        starts = [b.ctypes.data for b in buffers]
    # reshape of a contiguous array is a view; make sure no step copied
    if starts != [t.data_ptr() for t in tensors]:
        raise LayoutMismatch("wrapping vLLM's KV cache would copy it")
    return KVPool(layout, buffers, num_blocks)
