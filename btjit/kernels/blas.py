"""The BLAS that btjit's GEMM kernels call (`btjit_sgemm` / `btjit_dgemm`, Fortran sgemm_/dgemm_ ABI).

Candidates: scipy's OpenBLAS (always there: the fallback) and Intel MKL where its wheel is installed
(`pip install 'btjit[mkl]'`; libmkl_rt in the environment's lib dir, used with its sequential threading
layer). Which one: $BTJIT_BLAS (openblas | mkl) if set, else a measurement -- single-thread sgemm at three
shapes of the sizes btjit hands to BLAS, best of several calls each, the faster library by total time, MKL
only if >= 5% faster -- made once per machine and remembered in the cache dir (`blas.json`, keyed by the
CPU and the libraries' paths and sizes). The symbols are bound with llvmlite.add_symbol before any kernel
loads, so cached kernels call whichever library is chosen without recompiling; exports link the same one.
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import sys
import time

import llvmlite.binding as llvm
from numba.extending import get_cython_function_address

MKL_SEQUENTIAL = 1          # MKL_Set_Threading_Layer's value for the sequential layer
MIN_GAIN = 1.05


def _openblas():
    """scipy's OpenBLAS: {name, path, sgemm, dgemm (addresses), symbols (btjit's -> the library's, for an
    export; None if the library file is not found), init (the C call an export makes at load)}."""
    from btjit.host.threads import _openblas_libs, set_blas_threads
    wheel = _wheel_openblas()
    if wheel:                       # the library file of scipy's wheel, loaded without importing scipy.linalg
        lib = ctypes.CDLL(wheel)    # (0.25 s of every process start, measured)
        s, d = (ctypes.cast(getattr(lib, f"scipy_{n}gemm_"), ctypes.c_void_p).value for n in "sd")
    else:                           # scipy built otherwise: its cython_blas wrappers (loads its BLAS)
        s = get_cython_function_address("scipy.linalg.cython_blas", "sgemm")
        d = get_cython_function_address("scipy.linalg.cython_blas", "dgemm")
    set_blas_threads(1)             # btjit calls it single-threaded (btjit/threads.py); so is it measured
    out = {"name": "openblas", "path": None, "sgemm": s, "dgemm": d, "symbols": None, "init": None}
    for path in _openblas_libs(scipy_only=True):
        lib = ctypes.CDLL(path)
        prefix = next((p for p in ("scipy_", "") if hasattr(lib, f"{p}sgemm_")), None)
        if prefix is not None:
            threads = next((n for n in (f"{prefix}openblas_set_num_threads", "openblas_set_num_threads")
                            if hasattr(lib, n)), None)
            out.update(path=path, symbols={"btjit_sgemm": f"{prefix}sgemm_", "btjit_dgemm": f"{prefix}dgemm_"},
                       init=threads and [threads, 1])
            break
    return out


def _wheel_openblas():
    """The OpenBLAS of scipy's PyPI wheel (scipy.libs/libscipy_openblas*.so, exporting scipy_sgemm_ and
    scipy_dgemm_, the functions scipy.linalg.cython_blas wraps), or None."""
    import importlib.util
    spec = importlib.util.find_spec("scipy")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(glob.glob(os.path.join(os.path.dirname(loc), "scipy.libs", "libscipy_openblas*.so"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, "scipy_sgemm_") and hasattr(lib, "scipy_dgemm_"):
                return path
    return None


def _mkl():
    """MKL's libmkl_rt from the environment (the `mkl` wheel), sequential; None if not installed."""
    paths = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    if not paths:
        return None
    try:
        lib = ctypes.CDLL(paths[0])
        lib.MKL_Set_Threading_Layer(ctypes.c_int(MKL_SEQUENTIAL))
        s = ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
        d = ctypes.cast(lib.dgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return {"name": "mkl", "path": paths[0], "sgemm": s, "dgemm": d, "_lib": lib,
            "symbols": {"btjit_sgemm": "sgemm_", "btjit_dgemm": "dgemm_"},
            "init": ["MKL_Set_Threading_Layer", MKL_SEQUENTIAL]}


def _time_sgemm(addr) -> float:
    """Seconds of the best of 5 calls at each of three shapes (row-major products as btjit issues them)."""
    import numpy as np
    fn = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 13))(addr)
    total = 0.0
    for M, N, K in ((256, 384, 128), (512, 256, 512), (1024, 96, 256)):
        A, B = np.ones((M, K), np.float32), np.ones((K, N), np.float32)
        C = np.empty((M, N), np.float32)
        ints = [ctypes.c_int(v) for v in (N, M, K, N, K, N)]
        one, zero, no = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_char(b"N")
        args = [ctypes.addressof(no), ctypes.addressof(no), *(ctypes.addressof(i) for i in ints[:3]),
                ctypes.addressof(one), B.ctypes.data, ctypes.addressof(ints[3]), A.ctypes.data,
                ctypes.addressof(ints[4]), ctypes.addressof(zero), C.ctypes.data, ctypes.addressof(ints[5])]
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            fn(*args)
            best = min(best, time.perf_counter() - t)
        total += best
    return total


def _key(cands) -> str:
    cpu = llvm.get_host_cpu_name() + llvm.get_host_cpu_features().flatten()
    return json.dumps([cpu] + [(c["path"], os.path.getsize(c["path"]) if c["path"] else 0) for c in cands])


def choose() -> dict:
    """The BLAS to bind (see the module docstring)."""
    from btjit.host.cachedir import remembered
    want = os.environ.get("BTJIT_BLAS", "").lower()
    cands = [c for c in (_openblas(), _mkl() if want != "openblas" else None) if c]
    if want:
        for c in cands:
            if c["name"] == want:
                return c
        import warnings
        warnings.warn(f"btjit: BTJIT_BLAS={want!r} is not installed here (have: "
                      f"{', '.join(c['name'] for c in cands)}); using {cands[0]['name']}")
        return cands[0]
    if len(cands) == 1:
        return cands[0]

    def measure():
        times = {c["name"]: _time_sgemm(c["sgemm"]) for c in cands}
        best = min(cands[1:], key=lambda c: times[c["name"]])
        choice = best if times["openblas"] >= MIN_GAIN * times[best["name"]] else cands[0]
        return {"choice": choice["name"], "measured": times}     # seconds of each library's sgemm probes
    saved = remembered("blas.json", _key(cands), measure)
    return next((c for c in cands if c["name"] == saved.get("choice")), cands[0])


CHOICE = choose()
llvm.add_symbol("btjit_sgemm", CHOICE["sgemm"])
llvm.add_symbol("btjit_dgemm", CHOICE["dgemm"])
