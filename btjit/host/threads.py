"""Thread control for btjit's native code: numba's thread pool (parallel kernels) and the OpenBLAS that the
GEMM kernels call (scipy's). Small-matrix training is fastest single-threaded, and OpenBLAS's default of
one busy thread per core is ruinous on a loaded machine (measured: 5.5 -> 40 ms per E6 step), so btjit
starts with 1 thread unless BTJIT_NUM_THREADS (or OPENBLAS_NUM_THREADS) says otherwise.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path


def default_threads() -> int:
    v = os.environ.get("BTJIT_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or "1"
    try:
        return max(1, int(v))
    except ValueError:
        return 1


def _openblas_libs(scipy_only: bool):
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = sorted({ln.split()[-1] for ln in maps.splitlines() if "openblas" in ln.rsplit("/", 1)[-1]})
    return [p for p in libs if not scipy_only or "scipy" in p.replace("scipy_openblas", "")]


def set_blas_threads(n: int, scipy_only: bool = True) -> list[int]:
    """Set the thread count of the loaded OpenBLAS libraries (scipy's, which btjit calls; all with
    scipy_only=False) through their own C entry points. Returns what each reports. Linux only."""
    got = []
    for lib in _openblas_libs(scipy_only):
        try:
            dll = ctypes.CDLL(lib)
        except OSError:
            continue
        for suffix in ("", "64_"):
            set_fn = getattr(dll, f"scipy_openblas_set_num_threads{suffix}", None) or \
                getattr(dll, f"openblas_set_num_threads{suffix}", None)
            get_fn = getattr(dll, f"scipy_openblas_get_num_threads{suffix}", None) or \
                getattr(dll, f"openblas_get_num_threads{suffix}", None)
            if set_fn is not None:
                set_fn(ctypes.c_int(n))
                if get_fn is not None:
                    got.append(int(get_fn()))
                break
    return got


def set_num_threads(n: int = 0) -> int:
    """Use n threads (0 = all cores) for programs traced from now on; returns n used. The parallelism is all
    numba's thread pool: large GEMMs are split into one single-threaded BLAS call per thread, and OpenBLAS
    itself stays at 1 thread (its spinning threads beside numba's pool cost 30x on 2 cores, measured)."""
    import numba
    n = n or os.cpu_count() or 1
    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    set_blas_threads(1)
    return n


MIN_REPLICA_ROWS = 128   # loss rows (targets) per replica from which data parallelism beats threaded kernels


def replicas_for(batch: int, rows: int, threads: int = 0) -> int:
    """Data-parallel replicas for a step whose loss is a mean over `rows` targets in `batch` examples, on
    `threads` threads (0 = numba's current count): one per thread when they divide the batch and each gets
    >= MIN_REPLICA_ROWS rows, else 1 (the kernels then split their own work). Every replica re-reads the
    params and its grads are summed, so it pays only with enough rows per param (measured, 2 threads):
    E6 batch 64 (512 rows, 46k params) 1.64 -> 1.00 ms per step, E5 (64 rows, 1.08M params) 1.30 -> 2.31 ms.
    `btjit train` and `btjit bench` use this."""
    if threads <= 0:
        import numba
        threads = numba.get_num_threads()
    ok = threads > 1 and batch % threads == 0 and rows // threads >= MIN_REPLICA_ROWS
    return threads if ok else 1
