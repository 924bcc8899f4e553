"""Kernels: the NumPy references against independent loops, and CuPy against NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pddnet.recompute import _reference as ref
from pddnet.recompute import kernels_for

KV_DTYPES = ["float32", "float16", "bfloat16"]


def _storage(dtype: str) -> Any:
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def _to_f32(a: Any) -> Any:
    return ref.bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def _paged_case(
    rng: Any, *, n: int, start: int, heads: int, kvh: int, d: int, bs: int, dtype: str
) -> dict[str, Any]:
    """A block-major layer buffer with random KV for ``start + n`` tokens, scattered."""
    length = start + n
    nblocks = -(-length // bs) + 3
    buf = rng.standard_normal((nblocks, 2, bs, kvh, d), dtype=np.float32)
    if dtype == "bfloat16":
        buf = ref.f32_to_bf16(buf)
    else:
        buf = buf.astype(dtype)
    table = rng.permutation(nblocks)[: -(-length // bs)].astype(np.int32)
    q = rng.standard_normal((n, heads, d), dtype=np.float32)
    return {"buf": buf, "table": table, "q": q, "start": start}


def _naive_attention(q: Any, k_cache: Any, v_cache: Any, table: Any, start: int) -> Any:
    n, heads, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros((n, heads, d), np.float64)
    for i in range(n):
        visible = np.arange(start + i + 1)
        keys = _to_f32(k_cache[table[visible // bs], visible % bs]).astype(np.float64)
        vals = _to_f32(v_cache[table[visible // bs], visible % bs]).astype(np.float64)
        for h in range(heads):
            kv = h // (heads // kvh)
            s = keys[:, kv] @ q[i, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vals[:, kv]
    return out


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("n", "start"), [(1, 0), (1, 37), (5, 0), (9, 23), (16, 16)])
def test_reference_attention_matches_loops(dtype: str, n: int, start: int) -> None:
    rng = np.random.default_rng(n * 31 + start)
    c = _paged_case(rng, n=n, start=start, heads=6, kvh=2, d=8, bs=4, dtype=dtype)
    k_cache, v_cache = c["buf"][:, 0], c["buf"][:, 1]
    got = ref.extend_attention(c["q"], k_cache, v_cache, c["table"], start, 8**-0.5)
    want = _naive_attention(c["q"], k_cache, v_cache, c["table"], start)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_reference_kv_write_touches_only_its_slots(dtype: str) -> None:
    rng = np.random.default_rng(2)
    bs, kvh, d, start, n = 4, 2, 8, 6, 7
    buf = np.ascontiguousarray(np.zeros((6, 2, bs, kvh, d), _storage(dtype)))
    buf.view(np.uint8).fill(0xAB)
    table = np.array([5, 0, 3, 1], np.int32)
    k = rng.standard_normal((n, kvh, d), dtype=np.float32)
    v = rng.standard_normal((n, kvh, d), dtype=np.float32)
    ref.kv_write(buf[:, 0], buf[:, 1], table, start, k, v)
    pos = np.arange(start, start + n)
    blocks, slots = table[pos // bs], pos % bs
    tol = {"float32": 0, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    np.testing.assert_allclose(_to_f32(buf[blocks, 0, slots]), k, rtol=tol, atol=tol)
    np.testing.assert_allclose(_to_f32(buf[blocks, 1, slots]), v, rtol=tol, atol=tol)
    mask = np.ones((6, bs), bool)
    mask[blocks, slots] = False
    untouched = buf.view(np.uint8).reshape(6, 2, bs, -1).transpose(0, 2, 1, 3)[mask]
    assert (untouched == 0xAB).all()


def test_bf16_round_to_nearest_even() -> None:
    x = np.array([1.0, -2.5, 3.140625, 1.00390625, 1.01171875, 1e-3, 65504.0], np.float32)
    bits = ref.f32_to_bf16(x)
    back = ref.bf16_to_f32(bits)
    assert np.abs(back - x).max() <= np.abs(x).max() * 2**-8
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
    assert back[3] == 1.0
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6
    assert back[4] == np.float32(1 + 2**-6)


def test_reference_rope_is_a_rotation_by_position() -> None:
    rng = np.random.default_rng(3)
    d, theta = 16, 10000.0
    q = rng.standard_normal((1, 1, d), dtype=np.float32)
    k = rng.standard_normal((1, 1, d), dtype=np.float32)

    def at(x: Any, pos: int) -> Any:
        y = x.copy()
        ref.rope_(y, pos, theta)
        return y

    # norm preserved, and <rope(q, m), rope(k, m')> depends only on m - m'
    assert np.isclose(np.linalg.norm(at(q, 77)), np.linalg.norm(q), rtol=1e-6)
    a = float((at(q, 10) * at(k, 3)).sum())
    b = float((at(q, 1010) * at(k, 1003)).sum())
    assert np.isclose(a, b, rtol=1e-5)
    # rotate-half: dims j and j + d/2 form the complex pair rotated by pos * theta^(-2j/d)
    z = q[0, 0, : d // 2] + 1j * q[0, 0, d // 2 :]
    ang = 5 * theta ** (-2 * np.arange(d // 2) / d)
    rz = z * np.exp(1j * ang)
    np.testing.assert_allclose(at(q, 5)[0, 0], np.concatenate([rz.real, rz.imag]), rtol=1e-6)
    # a batch of tokens starts at `start`
    batch = np.concatenate([q, k])
    ref.rope_(batch, 40, theta)
    np.testing.assert_allclose(batch[1], at(k, 41)[0], rtol=1e-6)


def test_reference_rms_norm() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 64), dtype=np.float32) * 5
    w = rng.standard_normal(64, dtype=np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_kernels_for_numpy_is_reference() -> None:
    assert kernels_for(np) is ref


# ------------------------------------------------------------------ CuPy vs NumPy
@pytest.fixture
def cp() -> Any:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # CUDARuntimeError without a driver
        pytest.skip(f"no CUDA device: {exc}")
    return cupy


def _poisoned(cp: Any, shape: Any, dtype: Any = np.float32) -> Any:
    a = cp.empty(shape, dtype)
    a.view(cp.uint8).fill(0xFF)  # NaN for float32
    return a


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("n", "start", "heads", "kvh", "d", "bs"),
    [
        (1, 0, 4, 4, 64, 16),
        (1, 3000, 32, 8, 128, 16),
        (7, 45, 8, 2, 16, 16),
        (16, 4093, 32, 8, 128, 32),
        (100, 13, 4, 2, 64, 16),
        (257, 1500, 16, 4, 128, 16),
    ],
)
def test_cupy_attention_matches_numpy(
    cp: Any, dtype: str, n: int, start: int, heads: int, kvh: int, d: int, bs: int
) -> None:
    gpu = kernels_for(cp)
    rng = np.random.default_rng(n + start + d)
    c = _paged_case(rng, n=n, start=start, heads=heads, kvh=kvh, d=d, bs=bs, dtype=dtype)
    buf = cp.asarray(c["buf"])
    out = _poisoned(cp, (n, heads, d))
    gpu.extend_attention(
        cp.asarray(c["q"]), buf[:, 0], buf[:, 1], cp.asarray(c["table"]), start, d**-0.5, out=out
    )
    got = cp.asnumpy(out)
    want = ref.extend_attention(c["q"], c["buf"][:, 0], c["buf"][:, 1], c["table"], start, d**-0.5)
    assert np.isfinite(got).all(), "an output element was not written"
    # inputs are quantised identically on both sides; only accumulation order differs
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("kv_major", [False, True])
def test_cupy_kv_write_matches_numpy(cp: Any, dtype: str, kv_major: bool) -> None:
    gpu = kernels_for(cp)
    rng = np.random.default_rng(5)
    nb, bs, kvh, d, start, n = 9, 16, 2, 32, 21, 70
    shape = (2, nb, bs, kvh, d) if kv_major else (nb, 2, bs, kvh, d)
    host = np.zeros(shape, _storage(dtype))
    host.view(np.uint8).fill(0xAB)
    dev = cp.asarray(host)
    table = rng.permutation(nb).astype(np.int32)
    k = rng.standard_normal((n, kvh, d), dtype=np.float32)
    v = rng.standard_normal((n, kvh, d), dtype=np.float32)

    def views(b: Any) -> tuple[Any, Any]:
        return (b[0], b[1]) if kv_major else (b[:, 0], b[:, 1])

    ref.kv_write(*views(host), table, start, k, v)
    gpu.kv_write(*views(dev), cp.asarray(table), start, cp.asarray(k), cp.asarray(v))
    # same rounding (RNE) on both sides: bit-identical, including untouched slots
    assert np.array_equal(cp.asnumpy(dev).view(np.uint8), host.view(np.uint8))


@pytest.mark.gpu
def test_cupy_rope_and_rms_norm_match_numpy(cp: Any) -> None:
    gpu = kernels_for(cp)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((33, 8, 128), dtype=np.float32)
    dx = cp.asarray(x)
    ref.rope_(x, 65000, 1e6)
    gpu.rope_(dx, 65000, 1e6)
    np.testing.assert_allclose(cp.asnumpy(dx), x, rtol=1e-5, atol=1e-6)
    h = rng.standard_normal((5, 4096), dtype=np.float32)
    w = rng.standard_normal(4096, dtype=np.float32)
    out = _poisoned(cp, h.shape)
    gpu.rms_norm(cp.asarray(h), cp.asarray(w), 1e-5, out=out)
    got = cp.asnumpy(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref.rms_norm(h, w, 1e-5), rtol=1e-5, atol=1e-5)


# ------------------------------------------- the CUDA decomposition, on the CPU
def _emulate_cuda_attention(
    q: Any, k_cache: Any, v_cache: Any, table: Any, start: int, scale: float, sm_count: int
) -> tuple[Any, Any]:
    """A line-by-line NumPy port of extend_attention.cu's block/tile/split logic,
    launched as _cuda.extend_attention plans it. Returns (out, part_ml)."""
    from pddnet.recompute import _cuda

    n, heads, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = heads // kvh
    rows, length = n * group, start + n
    rw, splits, chunk = _cuda.plan_splits(rows, kvh, length, sm_count)
    qt = _cuda.K_WARPS * rw
    part_acc = np.full((splits, n, heads, d), np.nan, np.float32)
    part_ml = np.full((splits, n, heads, 2), np.nan, np.float32)
    log2e = np.float32(np.log2(np.e))
    for split in range(splits):
        for kv in range(kvh):
            for tile in range(-(-rows // qt)):
                row0 = tile * qt
                last_row = min(rows, row0 + qt) - 1
                c0 = split * chunk
                c_end = min(c0 + chunk, start + last_row // group + 1)
                for row in range(row0, min(rows, row0 + qt)):
                    i, h = row // group, kv * group + row % group
                    limit = start + row // group
                    qs = q[i, h] * np.float32(scale) * log2e
                    m, denom, acc = -np.inf, 0.0, np.zeros(d, np.float32)
                    for t0 in range(c0, c_end, _cuda.K_TILE):
                        pos = t0 + np.arange(_cuda.K_TILE)
                        ok = (pos < c_end) & (pos <= limit)
                        safe = np.where(pos < c_end, pos, 0)
                        keys = _to_f32(k_cache[table[safe // bs], safe % bs, kv])
                        vals = _to_f32(v_cache[table[safe // bs], safe % bs, kv])
                        s = np.where(ok, keys @ qs, -np.inf)
                        m_new = max(m, float(s.max()))
                        if m_new == -np.inf:
                            alpha, p = 1.0, np.zeros_like(s)
                        else:
                            alpha = float(np.exp2(m - m_new))
                            p = np.where(ok, np.exp2(s - m_new), 0.0)
                        denom = denom * alpha + float(p.sum())
                        m = m_new
                        acc = acc * alpha + p @ vals
                    part_acc[split, i, h] = acc
                    part_ml[split, i, h] = (m, denom)
    mx = part_ml[..., 0].max(axis=0)
    w = np.where(part_ml[..., 0] == -np.inf, 0.0, np.exp2(part_ml[..., 0] - mx))
    denom = (part_ml[..., 1] * w).sum(axis=0)
    out = (part_acc * w[..., None]).sum(axis=0) / denom[..., None]
    return out, part_ml


@pytest.mark.parametrize("sm_count", [1, 8, 132])
@pytest.mark.parametrize(
    ("n", "start", "heads", "kvh"),
    [(1, 0, 4, 4), (1, 200, 8, 2), (3, 61, 8, 2), (9, 40, 4, 1), (20, 100, 4, 2)],
)
def test_cuda_split_plan_covers_every_row_and_position(
    sm_count: int, n: int, start: int, heads: int, kvh: int
) -> None:
    rng = np.random.default_rng(n + start + sm_count)
    c = _paged_case(rng, n=n, start=start, heads=heads, kvh=kvh, d=8, bs=4, dtype="float16")
    k_cache, v_cache = c["buf"][:, 0], c["buf"][:, 1]
    out, part_ml = _emulate_cuda_attention(
        c["q"], k_cache, v_cache, c["table"], start, 0.3, sm_count
    )
    assert not np.isnan(part_ml).any(), "a (split, token, head) partial was never written"
    want = ref.extend_attention(c["q"], k_cache, v_cache, c["table"], start, 0.3)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_split_plan_shapes() -> None:
    from pddnet.recompute import _cuda

    # decode on a long prefix: enough splits to fill an H200 (132 SMs)
    rw, splits, chunk = _cuda.plan_splits(rows=4, kv_heads=8, length=65537, sm_count=132)
    assert rw == 1 and splits * chunk >= 65537 and (splits - 1) * chunk < 65537
    assert 8 * splits >= 3 * 132 and chunk % _cuda.K_TILE == 0
    # a big extend already fills the GPU with query tiles: no split
    rw, splits, _ = _cuda.plan_splits(rows=256 * 4, kv_heads=8, length=4352, sm_count=132)
    assert rw == 4 and splits == 2
