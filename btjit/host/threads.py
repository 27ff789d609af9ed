"""Thread control for btjit's native code: numba's thread pool (parallel kernels, data-parallel replicas) and the
OpenBLAS that the GEMM kernels call (scipy's). btjit uses every core the process may run on
(os.sched_getaffinity) unless told otherwise: `btjit.set_num_threads(n)`, `trace(..., threads=n)`,
$BTJIT_NUM_THREADS, `--threads`, `[train] threads`. OpenBLAS's own threads stay off: its spinning threads beside
numba's pool cost 30x on 2 cores and 7x on a loaded machine (measured), so all parallelism is numba's.
Numba's threading layer is chosen here, before its pool starts: OpenMP, then its workqueue, then TBB (numba's
own order puts TBB first, which an installed MKL brings in). Measured on 2 cores (znver5), a 2048 x 768 x 768
k_matmul_micro row split in two: OpenMP 1.91x one part's time, workqueue 1.66x, TBB 1.13x (its second thread
rarely took its part). $NUMBA_THREADING_LAYER / $NUMBA_THREADING_LAYER_PRIORITY still decide where set.
"""
from __future__ import annotations

import ctypes
import operator
import os
from pathlib import Path

import numba

LAYERS = ["omp", "workqueue", "tbb"]
if not {"NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"} & set(os.environ):
    numba.config.THREADING_LAYER_PRIORITY = LAYERS


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    """$BTJIT_NUM_THREADS if set (0 = every core), else every core the process may run on."""
    v = os.environ.get("BTJIT_NUM_THREADS", "").strip()
    if not v:
        return cores()
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"BTJIT_NUM_THREADS={v!r}: expected a whole number of threads (0 = every core)") from None
    if n < 0:
        raise ValueError(f"BTJIT_NUM_THREADS={v!r}: expected a whole number of threads >= 0 (0 = every core)")
    return n or cores()


def whole(n):
    """n as a Python int when it is an integer (numpy's too: np.int64(2) from a config or an array), else None."""
    if isinstance(n, bool):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


_chosen = None    # btjit.set_num_threads's count: the default of programs traced without threads=


def _count(n) -> int:
    """n threads (0 = every core) as a count numba's pool can run: an error for anything but a whole n >= 0."""
    if whole(n) is None or n < 0:
        raise ValueError(f"threads must be a whole number >= 0 (0 = every core), got {n!r}")
    return max(1, min(whole(n) or cores(), numba.config.NUMBA_NUM_THREADS))


def resolve(n=None) -> int:
    """The thread count a program traced now uses: n (0 = every core), else btjit.set_num_threads's, or numba's
    count where that is lower (kept apart from numba's pool, which a program traced with threads=n grows: that
    must not change the next program's default). The numba pool grows to n if it is smaller."""
    if n is None:
        pool = numba.get_num_threads()
        return pool if _chosen is None else min(_chosen, pool)
    n = _count(n)
    if n > numba.get_num_threads():
        numba.set_num_threads(n)
    return n


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
    global _chosen
    n = _chosen = _count(n)
    numba.set_num_threads(n)
    set_blas_threads(1)
    return n


MIN_REPLICA_ROWS = 128   # loss rows (targets) per replica from which data parallelism beats threaded kernels


def replicas_for(batch: int, rows: int, threads: int = 0) -> int:
    """Data-parallel replicas for a step whose loss is a mean over `rows` targets in `batch` examples, on
    `threads` threads (0 = btjit.set_num_threads's count): one per thread when they divide the batch and each gets
    >= MIN_REPLICA_ROWS rows, else 1 (the kernels then split their own work). Every replica re-reads the
    params and its grads are summed, so it pays only with enough rows per param (measured, 2 threads):
    E6 batch 64 (512 rows, 46k params) 1.64 -> 1.00 ms per step, E5 (64 rows, 1.08M params) 1.30 -> 2.31 ms.
    `btjit train` and `btjit bench` use this."""
    if threads <= 0:
        threads = resolve()
    ok = threads > 1 and batch % threads == 0 and rows // threads >= MIN_REPLICA_ROWS
    return threads if ok else 1
