"""Offline builds of the CUDA sources: ``nvcc`` with the ptxas report, and NVRTC.

Used by the CI compile test and by ``python -m pddnet.recompute._build``, which
prints the register/spill table recorded in docs/kernels.md. Neither needs a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .._errors import PddnetError
from ._cuda import kernel_code

__all__ = [
    "K_VARIANTS",
    "KernelReport",
    "find_nvrtc",
    "nvcc_compile",
    "nvrtc_compile",
    "report_table",
    "sources",
]

K_KERNEL_DIR = Path(__file__).with_name("kernels")
K_DTYPE_NAMES = {0: "fp32", 1: "fp16", 2: "bf16"}

#: (source, defines) builds the CuPy path uses: every KV dtype, and the
#: ROWS_PER_WARP choices of extend attention at head_dim 128.
K_VARIANTS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = tuple(
    [(src, (("KV_DTYPE", dt),)) for src in ("kv_write.cu",) for dt in (0, 1, 2)]
    + [("rope.cu", (("KV_DTYPE", 0),)), ("rms_norm.cu", (("KV_DTYPE", 0),))]
    + [
        ("extend_attention.cu", (("KV_DTYPE", dt), ("HEAD_DIM", 128), ("ROWS_PER_WARP", rw)))
        for dt in (0, 1, 2)
        for rw in (1, 2, 4)
    ]
)


@dataclass(frozen=True, slots=True)
class KernelReport:
    """ptxas's account of one kernel entry."""

    source: str
    defines: tuple[tuple[str, int], ...]
    arch: str
    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int


def sources() -> list[Path]:
    """The kernel sources (every ``.cu`` but the shared prelude)."""
    return sorted(p for p in K_KERNEL_DIR.glob("*.cu") if p.name != "prelude.cu")


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def nvcc_compile(
    source: str, arch: str, defines: Sequence[tuple[str, int]] = (), nvcc: str = "nvcc"
) -> list[KernelReport]:
    """Compile one source to a cubin with ``-Xptxas -v`` and parse the report.

    Raises:
        PddnetError: if nvcc fails (its output is in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            nvcc,
            f"-arch={arch}",
            "-cubin",
            "-Xptxas",
            "-v",
            f"-I{K_KERNEL_DIR}",
            *(f"-D{k}={v}" for k, v in defines),
            "-o",
            str(Path(tmp) / "out.cubin"),
            str(K_KERNEL_DIR / source),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise PddnetError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    reports: list[KernelReport] = []
    entry: tuple[str, str] | None = None
    props = (0, 0, 0)
    for line in (proc.stdout + proc.stderr).splitlines():
        if m := _ENTRY.search(line):
            entry = (m.group(1), m.group(2))
        elif (m := _PROPS.search(line)) and entry:
            props = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _REGS.search(line)) and entry:
            reports.append(
                KernelReport(
                    source,
                    tuple(defines),
                    entry[1],
                    entry[0],
                    int(m.group(1)),
                    props[1],
                    props[2],
                    props[0],
                    int(m.group(2) or 0),
                )
            )
            entry = None
    return reports


def find_nvrtc() -> str | None:
    """Path of a loadable libnvrtc (pip's nvidia-cuda-nvrtc or the toolkit's), or None."""
    patterns = [
        str(Path(p) / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so*") for p in sys.path if p
    ]
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            patterns.append(str(Path(os.environ[env]) / "lib64" / "libnvrtc.so*"))
    patterns.append("/usr/local/cuda/lib64/libnvrtc.so*")
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if ".alt." not in path and "builtins" not in path:
                return path
    return ctypes.util.find_library("nvrtc")


def nvrtc_compile(
    source: str, arch: str, defines: Sequence[tuple[str, int]] = (), lib: str | None = None
) -> str:
    """Compile one source with NVRTC (as ``cupy.RawModule`` does) and return the log.

    The text and options are :mod:`._cuda`'s: the prelude inlined, no include path.

    Raises:
        PddnetError: if libnvrtc is missing or the compile fails.
    """
    lib = lib or find_nvrtc()
    if not lib:
        raise PddnetError("libnvrtc not found")
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    code = kernel_code(source).encode()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code, source.encode(), 0, None, None)
    if rc:
        raise PddnetError(f"nvrtcCreateProgram failed with {rc}")
    opts = [f"--gpu-architecture={arch}"]
    opts += [f"-D{k}={v}" for k, v in defines]
    arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    try:
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    if rc:
        raise PddnetError(f"NVRTC failed on {source} {defines} ({rc}):\n{log}")
    return log


def report_table(archs: Sequence[str] = ("sm_80", "sm_90")) -> list[KernelReport]:
    """ptxas reports of every variant in :data:`K_VARIANTS` for ``archs``."""
    if not shutil.which("nvcc"):
        raise PddnetError("nvcc is not installed")
    jobs = [(src, arch, defs) for arch in archs for src, defs in K_VARIANTS]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = pool.map(lambda j: nvcc_compile(j[0], j[1], j[2]), jobs)
    return [r for rs in results for r in rs]


def _markdown(reports: Sequence[KernelReport]) -> str:
    lines = [
        "| arch | source | kernel | config | registers | spill st/ld (B) | stack (B) | smem (B) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        cfg = ", ".join(f"{k}={K_DTYPE_NAMES[v] if k == 'KV_DTYPE' else v}" for k, v in r.defines)
        lines.append(
            f"| {r.arch} | {r.source} | {r.kernel} | {cfg} | {r.registers} |"
            f" {r.spill_stores}/{r.spill_loads} | {r.stack_bytes} | {r.smem_bytes} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a docs helper
    print(_markdown(report_table()))
