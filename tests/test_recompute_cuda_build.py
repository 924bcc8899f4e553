"""The CUDA sources compile offline: nvcc for sm_80/sm_90 (ptxas report), and NVRTC."""

from __future__ import annotations

import re
import shutil

import pytest

from pddnet.recompute import _build

ARCHS = ["sm_80", "sm_90"]


def test_sources_include_nothing_from_outside() -> None:
    # NVRTC (CuPy's compiler) has no host headers and, as checked with 12.9, no
    # cuda_fp16.h / cuda_bf16.h of its own: only our folder may be included.
    names = {p.name for p in _build.sources()}
    assert {"kv_write.cu", "extend_attention.cu", "rope.cu", "rms_norm.cu"} <= names
    for path in [*_build.sources(), _build.K_KERNEL_DIR / "prelude.cu"]:
        for inc in re.findall(r"^\s*#\s*include\s*(\S+)", path.read_text(), re.M):
            assert inc == '"prelude.cu"', f"{path.name} includes {inc}"


@pytest.fixture(scope="module")
def reports() -> list[_build.KernelReport]:
    if not shutil.which("nvcc"):
        pytest.skip("nvcc is not installed")
    return _build.report_table(ARCHS)


def test_nvcc_builds_every_variant_without_spills(reports: list[_build.KernelReport]) -> None:
    kernels = {(r.arch, r.kernel) for r in reports}
    for arch in ARCHS:
        for k in (
            "pdd_kv_write",
            "pdd_rope",
            "pdd_rms_norm",
            "pdd_extend_attention",
            "pdd_attention_combine",
        ):
            assert (arch, k) in kernels
    for r in reports:
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert r.smem_bytes <= 48 * 1024, r  # static shared memory limit
        assert r.stack_bytes == 0 or r.kernel == "pdd_rope", r  # sincos's slow path only
        # 16-bit KV (the GPU path): <= 128 registers keeps 4+ blocks of 128 threads per SM
        dtype = dict(r.defines).get("KV_DTYPE", 0)
        assert r.registers <= (128 if dtype in (1, 2) else 255), r


@pytest.mark.skipif(_build.find_nvrtc() is None, reason="libnvrtc not found")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_builds_every_variant(arch: str) -> None:
    for source, defines in _build.K_VARIANTS:
        _build.nvrtc_compile(source, arch, defines)
