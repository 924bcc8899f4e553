"""Keep NumPy's BLAS single-threaded for the reference model's small matrices.

The NumPy path multiplies matrices of a few hundred rows. Multi-threaded
OpenBLAS gains nothing there and, on a shared machine with few cores (CI, the
demo's three processes on two cores), its spinning threads contend: one extend
of 100 tokens took 22 ms with the default threads and 0.9 ms with one, measured
on the 2-core development VM under load from other processes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["limit_blas_threads"]

_SYMBOLS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
)


def limit_blas_threads(threads: int = 1) -> bool:
    """Set the thread count of every OpenBLAS loaded in this process.

    Process-wide, like ``OPENBLAS_NUM_THREADS``, but effective after NumPy was
    imported. Other BLAS libraries (MKL, Accelerate) are left alone.

    Args:
        threads: the thread count to set.

    Returns:
        whether an OpenBLAS was found and set.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    libs = {
        line.split()[-1]
        for line in maps.splitlines()
        if "openblas" in line.lower() and ".so" in line and line.split()[-1].startswith("/")
    }
    done = False
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SYMBOLS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(threads))
                done = True
                break
    return done
