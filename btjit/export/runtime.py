"""btjit.runtime: run an exported program (btjit/export.py) with ctypes and numpy only -- no numba, llvmlite
or scipy is imported, and nothing compiles.

    prog = btjit.runtime.load("out/gpt")      # what prog.export("out/gpt") wrote
    loss = prog.step(x, y)                    # the same step(), forward(), value_and_grad(), params, grads,
                                              # buffers, lr, state_dict() and batch checks as btjit.Program
    f = btjit.runtime.load("out/e1")          # what f.export("out/e1") wrote for a trace_scalar function
    value, grads = f(a, b);  values, grads = f.many(X)

Loading checks everything it relies on and refuses with a LoadError naming the file and the reason: a missing,
truncated or corrupt file (sizes and CRC-32s in the manifest, the manifest's own checksum), another format
version, a CPU without an instruction set the code uses, a missing BLAS library.
"""
from __future__ import annotations

import ctypes
import json
import platform
import zlib
from pathlib import Path

import numpy as np

from btjit.export.runner import Runner, Views

FORMAT = 1                      # the export format this runtime reads (btjit/export.py writes it)
_c = ctypes.c_void_p, ctypes.c_int64


class LoadError(ValueError):
    """An export that cannot be loaded; str(e) names the file and the reason."""


def manifest_checksum(m: dict) -> int:
    """CRC-32 of the manifest's canonical JSON without its "checksum" field."""
    body = json.dumps({k: v for k, v in m.items() if k != "checksum"}, sort_keys=True)
    return zlib.crc32(body.encode()) & 0xFFFFFFFF


def _cpu_flags():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _read_manifest(d: Path) -> dict:
    mpath = d / "manifest.json"
    if not mpath.is_file():
        raise LoadError(f"{mpath}: missing ({d} is not a btjit export dir)")
    try:
        m = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoadError(f"{mpath}: not valid JSON ({e}): corrupt or truncated") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise LoadError(f"{mpath}: export format {got!r}, this btjit reads format {FORMAT}: export it again with "
                        "this btjit")
    if m.get("checksum") != manifest_checksum(m):
        raise LoadError(f"{mpath}: checksum mismatch (the manifest was modified or is corrupt)")
    for name, f in m["files"].items():
        p = d / name
        if not p.is_file():
            raise LoadError(f"{p}: missing")
        size = p.stat().st_size
        if size != f["bytes"]:
            raise LoadError(f"{p}: {size} bytes, the manifest says {f['bytes']} (truncated or replaced)")
        crc = 0
        with open(p, "rb") as fh:                 # in chunks: a large arena is not held twice
            while chunk := fh.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
        if crc != f["crc32"]:
            raise LoadError(f"{p}: checksum mismatch (corrupt)")
    lib = d / "libbtjit.so"
    cpu = m["cpu"]
    if cpu["machine"] != platform.machine():
        raise LoadError(f"{lib}: built for {cpu['machine']}, this machine is {platform.machine()}")
    flags = _cpu_flags()
    missing = [f for f in m["cpu_flags"] if flags is not None and f not in flags]
    if missing:
        raise LoadError(f"{lib}: built for a CPU with {', '.join(missing)} ({cpu['name']}); this CPU lacks them: "
                        "export it again on this machine")
    if m["blas"] and not Path(m["blas"]["path"]).is_file():
        raise LoadError(f"{lib}: links the BLAS library {m['blas']['path']} (recorded at export time), which is "
                        "missing: install the same scipy, or export again")
    return m


def _pycall(d: Path, m: dict, lib):
    """The export's CPython call module's call (a scalar export's f(*args) without ctypes' per-call cost),
    bound to lib's functions, when it was built for this Python; else None."""
    import importlib.machinery
    import importlib.util
    name = m.get("pycall")
    if not name or not name.endswith(importlib.machinery.EXTENSION_SUFFIXES[0]):
        return None
    spec = importlib.util.spec_from_file_location("btjit_pycall", d / name)
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError:             # e.g. built against another libpython: the ctypes path does the same
        return None
    addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value or 0    # noqa: E731
    mod.bind(addr(lib.btjit_scalar_one) if m["one"] else 0, addr(lib.btjit_scalar_many))
    return mod.call


def load(path):
    """Load an export dir: an `Exported` (tensor program) or an `ExportedScalar` (trace_scalar function)."""
    d = Path(path)
    m = _read_manifest(d)
    try:
        lib = ctypes.CDLL(str((d / "libbtjit.so").resolve()))
    except OSError as e:
        raise LoadError(f"{d / 'libbtjit.so'}: cannot be loaded ({e})") from None
    lib.btjit_check_cpu.restype = ctypes.c_char_p
    lacks = lib.btjit_check_cpu()
    if lacks:
        raise LoadError(f"{d / 'libbtjit.so'}: built for a CPU with {lacks.decode()}, which this one lacks")
    lib.btjit_init()                              # BLAS (if linked) to one thread
    if m["kind"] == "tensor":
        return Exported(d, m, lib)
    f = ExportedScalar(d, m, lib)
    call = _pycall(d, m, lib)
    if call is not None:        # f(...) goes straight to C, as a ScalarFunction's goes straight to numba
        f.__class__ = type("ExportedScalar", (ExportedScalar,), {"__call__": staticmethod(call),
                                                                 "__doc__": ExportedScalar.__doc__})
    return f


def _aligned(path: Path, dtype) -> np.ndarray:
    """The file's contents read into a writable 64-byte aligned 1-D array."""
    dt = np.dtype(dtype)
    n = path.stat().st_size // dt.itemsize
    buf = np.empty(n + 64 // dt.itemsize, dt)
    start = (-buf.ctypes.data % 64) // dt.itemsize
    a = buf[start:start + n]
    with open(path, "rb") as fh:
        fh.readinto(memoryview(a).cast("B"))
    return a


class Exported(Runner):
    """A tensor program loaded from an export: the arena, the tape and btjit_run of its libbtjit.so."""

    def __init__(self, d: Path, m: dict, lib):
        self.dir, self.manifest, self._lib = d, m, lib
        self.dtype = np.dtype(m["dtype"])
        self.a = _aligned(d / "arena.bin", self.dtype)
        self.ia = _aligned(d / "iarena.bin", np.int32)
        t = m["tape"]
        self.tape = _aligned(d / "tape.bin", "<i8").reshape(t["rows"], t["cols"])
        if self.a.size != m["arena"]["floats"] or self.ia.size != m["arena"]["ints"] or \
                (self.tape[:, 0] >= len(m["kernels"])).any() or (self.tape[:, 0] < 0).any():
            raise LoadError(f"{d}: the arena or tape does not match the manifest")
        # one struct for the arenas and the tape, so a call passes two arguments (ctypes' cost is per argument)
        self._prog = (ctypes.c_int64 * 7)(self.a.ctypes.data, self.a.size, self.ia.ctypes.data, self.ia.size,
                                          self.tape.ctypes.data, t["rows"], t["cols"])
        self._fn = lib.btjit_run_to
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self._fn.restype = ctypes.c_int
        self._pp = ctypes.addressof(self._prog)

        def view(s):
            arena = self.ia if s["dtype"] == "int32" else self.a
            return arena[s["offset"]:s["offset"] + int(np.prod(s["shape"], dtype=np.int64))].reshape(s["shape"])
        self.params = Views({k: view(s) for k, s in m["params"].items()}, "param")
        self.grads = Views({k: view(s) for k, s in m["grads"].items()}, "grad")
        self.buffers = Views({k: view(s) for k, s in m.get("buffers", {}).items()}, "buffer")
        self.has_assigns = bool(m.get("assigns"))
        self.outputs = Views({k: view(s) for k, s in m["outputs"].items()}, "output")
        self._in = [view(s) for s in m["inputs"]]
        self.input_names = [s["name"] for s in m["inputs"]]
        self.inputs = dict(zip(self.input_names, self._in))
        self._in_types = [(tuple(s["batch_shape"]), np.dtype(np.int32) if s["dtype"] == "int32" else self.dtype)
                          for s in m["inputs"]]
        self._bounds = {i: (s["bound"], s["ignore"]) for i, s in enumerate(m["inputs"]) if s["bound"] is not None}
        self._flag, self._computed_checks = m["flag"], m["computed_checks"]
        self._hyper, self._out = m["hyper"], self.outputs["out"]
        self.n_fwd, self.n_bwd, self.n_rows = t["n_fwd"], t["n_bwd"], t["rows"]
        self.optimizer = m["optimizer"]
        self.has_optimizer, self.has_grad = m["optimizer"] is not None, m["loss"] is not None
        self._group_hyper = m.get("group_hyper", [])
        self._hp_untraced = m.get("hp_untraced", [])       # prog.hp refuses a nonzero value for these, as in-process
        self._int_state, self._state, self._span = m["int_state"], [tuple(s) for s in m["state"]], m["span"]
        self._state_shapes = m.get("state_shapes", {})

    def _exec(self, stop, split=None):
        rc = self._fn(self._pp, stop)
        if rc == 2:
            raise RuntimeError(f"{self.dir / 'libbtjit.so'}: a kernel failed (see the message above)")

    def __repr__(self):
        return (f"Exported({self.dir}, {self.n_rows} kernel rows, {self.n_params} params, "
                f"{len(self.manifest['kernels'])} kernels, {self.dtype})")


class ExportedScalar:
    """A trace_scalar function loaded from an export: f(*args) -> (value, grads); f.many(X)."""

    def __init__(self, d: Path, m: dict, lib):
        self.dir, self.manifest = d, m
        self.dtype = np.dtype(m["dtype"])
        self.arg_names, self.n_inputs, self.n_outputs = m["arg_names"], m["n_inputs"], m["n_outputs"]
        self.multi = m["multi"]
        self._fn = lib.btjit_scalar_many
        self._fn.argtypes = [*_c, ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int
        n, k = self.n_inputs, self.n_outputs
        self._one = (np.empty((1, n), self.dtype), np.empty((1, k), self.dtype), np.empty((1, n), self.dtype))
        self._call = None
        if m["one"]:                 # f(...)'s own code (straight-line): values then grads into one buffer
            c = ctypes.c_float if self.dtype == np.float32 else ctypes.c_double
            self._x, self._vg = (c * n)(), (c * (k + n))()
            self._call = lib.btjit_scalar_one
            self._call.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self._call.restype = ctypes.c_int
            self._args = (ctypes.addressof(self._x), ctypes.addressof(self._vg))

    def __call__(self, *args):
        """-> (value, (d/d arg0, ...)); value is a tuple with several outputs."""
        if len(args) != self.n_inputs:
            raise TypeError(f"expected {self.n_inputs} arguments ({', '.join(self.arg_names)}), got {len(args)}")
        if self._call is not None:
            self._x[:] = args
            self._call(*self._args)
            vg = self._vg[:]
            v, g = vg[:self.n_outputs], tuple(vg[self.n_outputs:])
        else:
            X, OV, OG = self._one
            X[0] = args
            self._fn(X.ctypes.data, 1, OV.ctypes.data, OG.ctypes.data)
            v, g = OV[0].tolist(), tuple(OG[0].tolist())
        return (tuple(v) if self.multi else v[0]), g

    def many(self, X, out=None):
        """X (N, n_inputs) (or (N,) for one input) -> (values (N,) or (N, n_outputs), grads (N, n_inputs)).
        out=(values, grads): preallocated C-ordered arrays of shapes (N, n_outputs), (N, n_inputs), filled."""
        n = self.n_inputs
        X = np.asarray(X)
        if X.ndim == 1 and n == 1:
            X = X.reshape(-1, 1)
        if X.ndim != 2 or X.shape[1] != n:
            raise ValueError(f"many: inputs must have shape (N, {n}), got {X.shape}")
        X = np.ascontiguousarray(X, self.dtype)
        N = X.shape[0]
        if out is None:
            OV, OG = np.empty((N, self.n_outputs), self.dtype), np.empty((N, n), self.dtype)
        else:
            OV, OG = out
            if OV.shape != (N, self.n_outputs) or OG.shape != (N, n) or OV.dtype != self.dtype or \
                    OG.dtype != self.dtype or not (OV.flags.c_contiguous and OG.flags.c_contiguous):
                raise ValueError(f"many: out must be C-ordered {self.dtype.name} arrays of shapes "
                                 f"{(N, self.n_outputs)} and {(N, n)}")
        self._fn(X.ctypes.data, N, OV.ctypes.data, OG.ctypes.data)
        return (OV if self.multi else OV.reshape(N)), OG

    def __repr__(self):
        return f"<btjit ExportedScalar ({', '.join(self.arg_names)}) from {self.dir}, {self.dtype.name}>"
