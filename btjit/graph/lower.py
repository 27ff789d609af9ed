"""Lowering: the planned schedule becomes a kernel tape (int64 rows: opcode, args) run by ONE njit executor.

The executor is generated from the kernel library (the `k_*` functions in btjit/kernels) for the set of
kernels a tape uses -- compiling only those halves a cold start -- written to a real .py file in the cache
dir whose name hashes that source and the kernels' source, imported as a registered module and compiled
with `cache=True` (NUMBA_NOTES.md §4): later processes load it from disk in well under a second. Programs
with the same kernel set share one executor. An unwritable or broken cache degrades to compiling in memory
with a warning.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numba
import numpy as np

from btjit.kernels import attn_lanes, elementwise, linalg, nn, optim, reduce

from .ops import TABLE

ROW = 32
KERNEL_MODULES = (elementwise, reduce, linalg, nn, optim)
KERNELS = [(m.__name__, n) for m in KERNEL_MODULES for n, f in sorted(vars(m).items())
           if n.startswith("k_") and isinstance(f, numba.core.dispatcher.Dispatcher)] + \
    [(attn_lanes.__name__, n) for n in attn_lanes.KERNEL_NAMES]      # defined in the executor file itself
OPCODE = {n: i for i, (_, n) in enumerate(KERNELS)}


class Lowering:
    """What an op's lower() sees: offsets of vars, a pool of float constants, the int scratch."""

    def __init__(self, plan, const_base, threads=1):
        self.attn_shapes: set = set()       # (T, hs) of attention rows the generated kernels serve
        self.threads = max(1, threads)      # numba pool threads one run of the tape may use (par kernels if > 1)
        self.plan = plan
        self.const_base = const_base
        self.consts: list = [1.0, 0.0]
        self.one_zero = const_base
        self.scratch = plan.scratch

    def off(self, v):
        return self.plan.off[v.id]

    def const(self, x) -> int:
        x = float(x)
        for i, c in enumerate(self.consts):
            if c == x and np.signbit(c) == np.signbit(x):
                return self.const_base + i
        self.consts.append(x)
        return self.const_base + len(self.consts) - 1

    @staticmethod
    def row(kernel, *args):
        r = [OPCODE[kernel], *args]
        assert len(r) <= ROW, (kernel, len(r))
        return [int(x) for x in r] + [0] * (ROW - len(r))


def lower_eqns(eqns, L: Lowering) -> tuple[list, list]:
    """Rows for a list of equations, and the op name each row comes from (for profiles)."""
    rows, labels = [], []
    for e in eqns:
        r = TABLE[e.op].lower(e, L)
        rows += r
        labels += [e.op] * len(r)
    return rows, labels


# ----------------------------------------------------------------------------- executor codegen and cache
_REPLICAS = """

@njit(parallel=True, cache={cache}, boundscheck=False)
def replicas_{name}(A, IA, tape, nsplit, stop, flag, p0, npar, g0, ngrad, oout, oinv):
    \"\"\"Data-parallel step over R = A.shape[0] replica arenas (one row each, same plan): replica r takes
    replica 0's params and runs tape rows [0, nsplit) on its own batch shard, one replica per pool thread;
    then replica 0 averages the grads (ngrad floats at g0) and the loss (at oout) with a[oinv] == 1/R and
    runs rows [nsplit, stop) (the update) alone. A replica's failed index check (IA[r, flag]) skips it.\"\"\"
    R = A.shape[0]
    for r in prange(R):
        if r > 0:
            A[r, p0:p0 + npar] = A[0, p0:p0 + npar]
        run_{name}(A[r], IA[r], tape, 0, nsplit)
    for r in range(1, R):
        if IA[r, flag] != 0:
            IA[0, flag] = IA[r, flag]
    if IA[0, flag] != 0:
        return
    inv = A[0, oinv]
    g = A[0, g0:g0 + ngrad]
    loss = A[0, oout]
    for r in range(1, R):
        gr = A[r, g0:g0 + ngrad]
        for i in range(ngrad):
            g[i] += gr[i]
        loss += A[r, oout]
    for i in range(ngrad):
        g[i] *= inv
    A[0, oout] = loss * inv
    run_{name}(A[0], IA[0], tape, nsplit, stop)
"""


def _source(kernels: tuple, attn_shapes: tuple = (), replicas: bool = False) -> str:
    """The executor's source for the kernel opcodes `kernels` (the set a tape uses), with the generated
    attention kernels (btjit/kernels/attn_lanes.py) for the (T, hs) pairs `attn_shapes`, and with
    `replicas`, the data-parallel driver over several replica arenas (trace(..., replicas=R))."""
    kernels = [(i, *KERNELS[i]) for i in sorted(kernels)]
    generated = attn_lanes.executor_source(attn_shapes, [n for _, _, n in kernels]) if attn_shapes else ""
    imports = "\n".join(f"from {m} import {n}" for _, m, n in kernels if f"def {n}(" not in generated)
    branches = "\n".join(f"        {'if' if j == 0 else 'elif'} op == {i}:\n            {n}(a, ia, r)" +
                         ("\n            if ia[r[4]] != 0:\n                return" if n == "k_check_index" else "")
                         for j, (i, _, n) in enumerate(kernels)) or "        pass"
    drivers = "".join(_REPLICAS.format(name=n, cache=c) for n, c in (("cached", True), ("nocache", False))) \
        if replicas else ""
    return f'''# generated by btjit.graph.lower: the kernel-tape executor. Do not edit.
from numba import njit, prange
{imports}
{generated}

def run(a, ia, tape, start, stop):
    for i in range(start, stop):
        r = tape[i]
        op = r[0]
{branches}


run_cached = njit(cache=True, boundscheck=False)(run)
run_nocache = njit(cache=False, boundscheck=False)(run)
{drivers}'''


def cache_dir() -> Path:
    env = os.environ.get("BTJIT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "btjit"


def source_key(kernels: tuple, attn_shapes: tuple = (), replicas: bool = False) -> str:
    h = hashlib.sha256(_source(kernels, attn_shapes, replicas).encode())
    for m in KERNEL_MODULES + (attn_lanes, sys.modules["btjit.kernels.common"]):
        h.update(inspect.getsource(m).encode())
    h.update(numba.__version__.encode() + np.__version__.encode())
    return h.hexdigest()[:16]


def _import_file(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                      # required for numba's cache to reload it
    spec.loader.exec_module(mod)
    return mod


class Executor:
    """The compiled tape runner for one float dtype, one kernel set (sorted opcodes) and the (T, hs) shapes
    of its generated attention kernels; with `replicas`, also `replicas_fn`, the data-parallel driver.
    `cache_hit` tells whether it was loaded from disk."""
    _modules: dict = {}
    kernels: tuple = ()
    attn_shapes: tuple = ()
    replicas: bool = False

    def __init__(self, float_dtype, kernels, attn_shapes=(), replicas=False):
        self.kernels = tuple(sorted(int(k) for k in kernels))
        self.attn_shapes = tuple(sorted(attn_shapes))
        self.replicas = bool(replicas)
        t0 = time.perf_counter()
        self.fn, self.cache_path = self._load()
        dt = np.float32 if float_dtype == "f32" else np.float64
        args = (np.zeros(4, dt), np.zeros(4, np.int32), np.zeros((0, ROW), np.int64), 0, 0)
        try:
            self.fn(*args)                                   # compile, or load from the disk cache, now
            self.replicas_fn = self._driver(dt, self._module().cache_ok)
        except Exception as e:  # noqa: BLE001 — a broken cache file must never stop training
            warnings.warn(f"btjit: kernel cache at {self.cache_path} unusable ({type(e).__name__}: {e}); "
                          "discarding it and compiling")
            self.fn = self._recompile()
            try:
                self.fn(*args)
            except Exception:  # noqa: BLE001
                self.fn = self._module().run_nocache
                self.fn(*args)
            self.replicas_fn = self._driver(dt, False)
        self.seconds = time.perf_counter() - t0
        st = getattr(self.fn, "stats", None)
        self.cache_hit = bool(st and sum(st.cache_hits.values()) > 0)

    def _driver(self, dt, cached):
        """The replicas driver (None without replicas), compiled or loaded now."""
        if not self.replicas:
            return None
        fn = getattr(self._module(), "replicas_cached" if cached else "replicas_nocache")
        fn(np.zeros((1, 4), dt), np.zeros((1, 4), np.int32), np.zeros((0, ROW), np.int64), *[0] * 9)
        return fn

    def _module(self):
        key = source_key(self.kernels, self.attn_shapes, self.replicas)
        if key in Executor._modules:
            return Executor._modules[key]
        name = f"btjit_exec_{key}"
        src = _source(self.kernels, self.attn_shapes, self.replicas)
        try:
            d = cache_dir()
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{name}.py"
            if not path.exists() or path.read_text() != src:
                tmp = d / f"{name}.py.tmp{os.getpid()}"
                tmp.write_text(src)
                # numba keys its cache index on the file's (mtime, size): give every writer of this content the
                # same mtime, so processes compiling at once all save an index that later processes can use
                stamp = int(key, 16) % 2 ** 31 * 10 ** 9
                os.utime(tmp, ns=(stamp, stamp))
                os.replace(tmp, path)
            mod = _import_file(name, path)
            mod.cache_ok = os.access(d, os.W_OK)
        except OSError as e:
            warnings.warn(f"btjit: cache dir {cache_dir()} not writable ({e}); compiling in memory")
            tmpd = Path(tempfile.mkdtemp(prefix="btjit_"))
            path = tmpd / f"{name}.py"
            path.write_text(src)
            mod = _import_file(name, path)
            mod.cache_ok = False
        mod.path = path
        Executor._modules[key] = mod
        return mod

    def _recompile(self):
        """Drop this module's disk-cache entries; a fresh dispatcher compiles (and re-caches) on first call."""
        mod = self._module()
        self.cache_path = None
        if not mod.cache_ok:
            return mod.run_nocache
        for f in (mod.path.parent / "__pycache__").glob(f"{mod.path.stem}.*"):
            try:
                f.unlink()
            except OSError:
                pass
        return numba.njit(cache=True, boundscheck=False)(mod.run)

    def _load(self):
        mod = self._module()
        if mod.cache_ok:
            return mod.run_cached, mod.path
        return mod.run_nocache, None
