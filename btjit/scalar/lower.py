"""Lowering of scalar graphs (every value shape ()): straight-line native code below a size bound, a scalar tape
run by one compiled-once interpreter above it.

A scalar graph (traced by btjit.scalar.front.trace_scalar into the ordinary IR, differentiated by the ordinary
autodiff) becomes a `ScalarProgram`: constant-folded SSA instructions over "atoms" (input k, a float constant,
or the value of an earlier instruction). Two backends compute exactly the op table's numpy references
(`OPS` below holds, per op, the expression used by the generated code and the interpreter's opcode; the
tests check both against TABLE[op].ref and against finite differences):

1. Straight-line code (`StraightLine`): Python source in SSA-locals form (`v12 = v3 * v7`), written to
   a hash-named .py file in btjit's cache dir, imported as a registered module and compiled with
   `njit(<signature>, cache=True, fastmath={'nsz','arcp','contract','afn','reassoc'}, error_model='numpy')`
   (no nnan/ninf: NaN and inf propagate as in numpy). Entry points, each compiled on first use:
     one(x0, .., xn-1) -> (value, (g0, .., gn-1))      (n inputs <= ARGS_MAX; else one(X) with X a 1-D array)
     many(X, OV, OG)   rows of X (N, n) -> OV (N, n_out), OG (N, n); one native loop over the rows
     many_t(XT, OV, OG) the same on transposed (column-major) data: XT (n, N) -> OV (n_out, N), OG (n, N);
                       unit-stride, so LLVM vectorizes it across rows (E1 0.5 vs 1.25 ns/row, E2 1.0 vs 5.5)
     nodes(x0, ..)     -> tuple of the named nodes' values (forward part only)
   A later process loads the compiled code from disk (~0.25 s for the first njit use in a process, then
   a few ms).
2. Scalar tape (`ScalarTape`, btjit/scalar/tape.py): packed int32 rows [op, out, in1, in2] over one register
   file (inputs, then constants, then instruction results with slots reused once a value is dead), run by
   `tape_many`, an njit interpreter compiled once per float dtype and cached on disk like any module.

The size bound (STRAIGHT_LINE_MAX, in instructions of the differentiated, constant-folded, CSE'd program) was
measured on this machine (2-core EPYC Zen 4, shared with other jobs, numba 0.68.1, float64, random DAGs of
mul/add/sub/tanh/relu/div, empty cache dir; `python -m btjit.scalar.lower 100 300 600 ...` reruns it):

    instructions             117     318     529     907    1838    2882
    compile `one` (cold)    0.38 s  0.53 s  0.80 s  1.6 s   3.7 s   7.1 s    (first: incl. ~0.3 s numba init)
    compile `many` (cold)   0.25 s  0.52 s  0.90 s  1.9 s   4.2 s   7.7 s
    run, straight-line      0.4-0.75 ns/instr (per row of many)
    run, tape               2.7-5.9 ns/instr  (grows with size: register file and tanh share)

Compile time grows a bit faster than linearly (~2 ms/instr at 500, ~2.5 ms/instr at 2,900; NUMBA_NOTES §2
saw worse on other mixes: 5 s at 1,000, >180 s at 5,000). At 600 instructions the cold compile of one entry
point is about 1 s, and later processes load it from the cache in ~0.3 s; above that the tape costs ~3 ns per
instruction more per evaluation but nothing to compile (the interpreter is compiled once per dtype and
cached; a 100k-instruction tape is built in ~0.3 s). Break-even against a 1-2 s compile is ~10^6 evaluations.
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

import numba
import numpy as np
from numba import njit, types as nt

from btjit.kernels.elementwise import RSQRT2 as _RS2, RSQRT2PI as _RS2PI    # the exact GELU's constants
from btjit.host.cachedir import cache_dir
from btjit.kernels.entries import import_file as _import_file
from btjit.graph.ops import TABLE

STRAIGHT_LINE_MAX = 600      # instructions; see the module docstring for the measurement
ARGS_MAX = 16                # above this many inputs, the straight-line `one` takes a 1-D array
FASTMATH = {'nsz', 'arcp', 'contract', 'afn', 'reassoc'}
FM = dict(fastmath=FASTMATH, error_model='numpy', boundscheck=False)
GEN_VERSION = "2"            # bump when the generated code's shape changes (part of the file hash)


class ScalarGraphError(Exception):
    """The graph uses something a scalar program cannot run (non-scalar values, tensor-only ops)."""


# ----------------------------------------------------------------------------- op semantics
# opcode of the tape interpreter; the generated-code expression uses {0},{1},{2} for the operands, ONE/ZERO/
# HALF for dtype-correct literals, and may be a list of statements with {o} the result and {t} a temp prefix.
(ADD, SUB, MUL, DIV, NEG, COPY, EXP, LOG, TANH, SQRT, ABS, RELU, SIGMOID, POW, MAXIMUM, MINIMUM, EQ, NE, GT,
 GE, LT, LE, TANH_GRAD, RELU_GRAD, SIGMOID_GRAD, WHERE, GELU, GELU_GRAD, ARG, ERF, LOG1P, SIGN, FLOOR, CEIL,
 ROUND, TRUNC, FMOD, REMAINDER, SIN, COS, GELU_ERF, GELU_ERF_GRAD, SILU, SILU_GRAD) = range(44)

_G0 = 0.7978845608028654      # sqrt(2/pi), as in graph/ops/elementwise.py's _gelu_ref
_G1 = 0.044715

OPS = {
    "add": (ADD, "{0} + {1}"),
    "sub": (SUB, "{0} - {1}"),
    "mul": (MUL, "{0} * {1}"),
    "div": (DIV, "{0} / {1}"),
    "neg": (NEG, "-{0}"),
    "copy": (COPY, "{0}"),
    "exp": (EXP, "math.exp({0})"),
    "log": (LOG, "math.log({0})"),
    "tanh": (TANH, "math.tanh({0})"),
    "sqrt": (SQRT, "math.sqrt({0})"),
    "erf": (ERF, "math.erf({0})"),
    "log1p": (LOG1P, "math.log1p({0})"),
    "abs": (ABS, "abs({0})"),
    "sign": (SIGN, "ONE if {0} > ZERO else (-ONE if {0} < ZERO else {0})"),     # 0 and NaN kept
    "floor": (FLOOR, "np.floor({0})"),                                # as the tensor kernels' k_rounding
    "ceil": (CEIL, "np.ceil({0})"),
    "round": (ROUND, "np.rint({0})"),                                 # half to even, as numpy's and torch's
    "trunc": (TRUNC, "np.trunc({0})"),
    "sin": (SIN, "math.sin({0})"),
    "cos": (COS, "math.cos({0})"),
    "fmod": (FMOD, "np.fmod({0}, {1})"),                              # exact; the sign of x
    "remainder": (REMAINDER, ["{t}m = np.fmod({0}, {1})",             # numpy's mod, torch's remainder: y's sign
                              "{o} = {t}m + {1} if ({t}m != ZERO and ({t}m < ZERO) != ({1} < ZERO)) else {t}m"]),
    "relu": (RELU, "{0} if not ({0} <= ZERO) else ZERO"),            # max(x, 0); NaN stays NaN as np.maximum
    "sigmoid": (SIGMOID, "ONE / (ONE + math.exp(-{0}))"),
    "pow": (POW, "{0} ** {1}"),                                        # attr p becomes operand {1}
    "pow2": (POW, "{0} ** {1}"),
    "maximum": (MAXIMUM, "{0} if ({0} >= {1} or {0} != {0}) else {1}"),   # NaN in either -> NaN
    "minimum": (MINIMUM, "{0} if ({0} <= {1} or {0} != {0}) else {1}"),
    "eq": (EQ, "ONE if {0} == {1} else ZERO"),
    "ne": (NE, "ONE if {0} != {1} else ZERO"),
    "gt": (GT, "ONE if {0} > {1} else ZERO"),
    "ge": (GE, "ONE if {0} >= {1} else ZERO"),
    "lt": (LT, "ONE if {0} < {1} else ZERO"),
    "le": (LE, "ONE if {0} <= {1} else ZERO"),
    "tanh_grad": (TANH_GRAD, "{1} * (ONE - {0} * {0})"),              # (tanh output, upstream grad)
    "relu_grad": (RELU_GRAD, "{1} if {0} > ZERO else {1} * ZERO"),     # (relu input, upstream): g * 1[x > 0]
    "sigmoid_grad": (SIGMOID_GRAD, "{1} * {0} * (ONE - {0})"),        # (sigmoid output, upstream grad)
    "where": (WHERE, "{1} if {0} != ZERO else {2}"),
    "gelu": (GELU, ["{t}u = G0 * ({0} + G1 * {0} * {0} * {0})",
                    "{o} = HALF * {0} * (ONE + math.tanh({t}u))"]),
    "gelu_grad": (GELU_GRAD, ["{t}t = math.tanh(G0 * ({0} + G1 * {0} * {0} * {0}))",
                              "{o} = {1} * (HALF * (ONE + {t}t) + HALF * {0} * (ONE - {t}t * {t}t) * G0 * "
                              "(ONE + G3 * {0} * {0}))"]),
    "gelu_erf": (GELU_ERF, "{0} * (HALF + HALF * math.erf({0} * RS2))"),
    "gelu_erf_grad": (GELU_ERF_GRAD, "{1} * (HALF + HALF * math.erf({0} * RS2) + {0} * RS2PI * "
                                     "math.exp(-HALF * {0} * {0}))"),
    "silu": (SILU, "{0} / (ONE + math.exp(-{0}))"),
    "silu_grad": (SILU_GRAD, ["{t}s = ONE / (ONE + math.exp(-{0}))",
                              "{o} = {1} * {t}s * (ONE + {0} * (ONE - {t}s))"]),
}
ALIASES = {"reshape", "broadcast_to"}
_COMMUTATIVE = {"add", "mul", "maximum", "minimum", "eq", "ne"}     # shape () -> shape (): the output is the input


# ----------------------------------------------------------------------------- the scalar program
class ScalarProgram:
    """Constant-folded, common-subexpression-eliminated SSA over atoms. atoms[var id] = ("x", k) input k | ("c", float) | ("v", id)."""

    def __init__(self, graph, input_vars, value_vars, grad_vars, named):
        self.dtype = graph.float_dtype
        self.np_dtype = np.dtype(np.float32 if self.dtype == "f32" else np.float64)
        self.n_in = len(input_vars)
        atoms = {v.id: ("x", k) for k, v in enumerate(input_vars)}
        for v, c in graph.consts.items():
            if v.shape != () or v.dtype == "i32":
                raise ScalarGraphError(f"constant {v!r} of type {v.type_str}: scalar graphs hold float scalars only")
            atoms[v.id] = ("c", float(c))
        self.instrs = []
        seen: dict = {}
        for e in graph.eqns:
            for v in (*e.ins, *e.outs):
                if v.shape != () or v.dtype == "i32":
                    raise ScalarGraphError(f"{e.op}: value {v!r} has type {v.type_str}; trace_scalar graphs are made of "
                                           f"float scalars only — {e.src}")
            (o,) = e.outs
            if e.op in ALIASES:
                atoms[o.id] = atoms[e.ins[0].id]
                continue
            if e.op not in OPS:
                raise ScalarGraphError(f"op {e.op!r} is not available on scalars — {e.src}")
            ins = [atoms[v.id] for v in e.ins]
            if e.op == "pow":
                ins.append(("c", float(e.attrs["p"])))
            if all(a[0] == "c" for a in ins):      # constant folding with the op table's numpy reference
                xs = [np.asarray(a[1], self.np_dtype) for a in ins[:len(e.ins)]]
                with np.errstate(all="ignore"):
                    atoms[o.id] = ("c", float(np.asarray(TABLE[e.op].ref(xs, e.attrs)[0], self.np_dtype)))
                continue
            key = (e.op, *ins)                      # common subexpressions (all ops are pure)
            if e.op in _COMMUTATIVE:
                key = (e.op, *sorted(ins))
            if key in seen:
                atoms[o.id] = seen[key]
                continue
            atoms[o.id] = seen[key] = ("v", o.id)
            self.instrs.append((e.op, o.id, ins))
        self.atoms = atoms
        self.values = [atoms[v.id] for v in value_vars]
        self.grads = [atoms[v.id] if v is not None else ("c", 0.0) for v in grad_vars]
        self.named = [(k, atoms[v.id]) for k, v in named]

    def needed(self, roots):
        """Instructions that the atoms `roots` depend on, in order."""
        need = {a[1] for a in roots if a[0] == "v"}
        keep = []
        for ins in reversed(self.instrs):
            if ins[1] in need:
                keep.append(ins)
                need.update(a[1] for a in ins[2] if a[0] == "v")
        return keep[::-1]


# ----------------------------------------------------------------------------- straight-line code generation
def _literal(x: float, dtype: str) -> str:
    if math.isnan(x):
        s = "math.nan"
    elif math.isinf(x):
        s = "math.inf" if x > 0 else "(-math.inf)"
    else:
        s = repr(float(x))
        s = f"({s})" if s.startswith("-") else s
    return f"np.float32({s})" if dtype == "f32" else s


def _operand(a, dtype):
    kind, x = a
    return f"x{x}" if kind == "x" else (f"v{x}" if kind == "v" else _literal(x, dtype))


def _body(prog: ScalarProgram, instrs, indent: str) -> list:
    lines = []
    for op, out, ins in instrs:
        args = [_operand(a, prog.dtype) for a in ins]
        tmpl = OPS[op][1]
        if isinstance(tmpl, str):
            lines.append(f"{indent}v{out} = {tmpl.format(*args)}")
        else:
            for t in tmpl:
                lines.append(indent + t.replace("{o}", f"v{out}").replace("{t}", f"t{out}_").format(*args))
    return lines


def _tuple(items):
    return "(" + "".join(i + ", " for i in items) + ")"


def generate_source(prog: ScalarProgram) -> str:
    dt = prog.dtype
    lit = lambda x: _literal(x, dt)  # noqa: E731
    n = prog.n_in
    xs = [f"x{k}" for k in range(n)]
    header = [f"# generated by btjit.scalar.lower (version {GEN_VERSION}): a {dt} scalar program of "
              f"{len(prog.instrs)} instructions, {n} inputs. Do not edit.",
              f"# njit options: {sorted(FASTMATH)} error_model=numpy boundscheck=False; numba {numba.__version__}",
              "import math", "import numpy as np", "",
              f"ONE = {lit(1.0)}", f"ZERO = {lit(0.0)}", f"HALF = {lit(0.5)}", f"G0 = {lit(_G0)}",
              f"G1 = {lit(_G1)}", f"G3 = {lit(3 * _G1)}", f"RS2 = {lit(_RS2)}", f"RS2PI = {lit(_RS2PI)}",
              ""]
    full = prog.needed(prog.values + prog.grads)
    ops = lambda atoms: [_operand(a, dt) for a in atoms]  # noqa: E731
    vals, grads = ops(prog.values), ops(prog.grads)
    value_expr = vals[0] if len(vals) == 1 else _tuple(vals)
    src = header
    if n <= ARGS_MAX:
        src += [f"def one({', '.join(xs)}):", *_body(prog, full, "    "),
                f"    return ({value_expr}, {_tuple(grads)})", ""]
    else:
        src += ["def one(X):", *[f"    x{k} = X[{k}]" for k in range(n)], *_body(prog, full, "    "),
                f"    G = np.empty({n}, X.dtype)", *[f"    G[{k}] = {g}" for k, g in enumerate(grads)],
                f"    return ({value_expr}, G)", ""]
    src += ["def many(X, OV, OG):", "    for i in range(X.shape[0]):",
            *[f"        x{k} = X[i, {k}]" for k in range(n)], *_body(prog, full, "        "),
            *[f"        OV[i, {k}] = {v}" for k, v in enumerate(vals)],
            *[f"        OG[i, {k}] = {g}" for k, g in enumerate(grads)], ""]
    # the same over columns: XT (n, N), OV (n_out, N), OG (n, N). Unit-stride loads and stores let LLVM
    # vectorize across rows (measured 2.6x on E1, 5x on E2); the row-major `many` above stays scalar.
    src += ["def many_t(XT, OV, OG):", "    for i in range(XT.shape[1]):",
            *[f"        x{k} = XT[{k}, i]" for k in range(n)], *_body(prog, full, "        "),
            *[f"        OV[{k}, i] = {v}" for k, v in enumerate(vals)],
            *[f"        OG[{k}, i] = {g}" for k, g in enumerate(grads)], ""]
    if prog.named:
        named = [a for _, a in prog.named]
        if n <= ARGS_MAX:
            src += [f"def nodes({', '.join(xs)}):"]
        else:
            src += ["def nodes(X):", *[f"    x{k} = X[{k}]" for k in range(n)]]
        src += [*_body(prog, prog.needed(named), "    "), f"    return {_tuple(ops(named))}", ""]
    return "\n".join(src)


_MODULES: dict = {}


def load_module(src: str):
    """Import generated source through the cache recipe (NUMBA_NOTES §4). Returns (module, cache_ok)."""
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    name = f"btjit_scalar_{key}"
    if name in _MODULES:
        return _MODULES[name]
    try:
        d = cache_dir() / "scalar"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{name}.py"
        if not path.exists():            # never rewrite: its mtime is part of numba's cache key
            tmp = d / f"{name}.py.tmp{os.getpid()}"
            tmp.write_text(src)
            os.replace(tmp, path)
        mod = _import_file(name, path)
        cache_ok = os.access(d, os.W_OK)
    except OSError as e:
        warnings.warn(f"btjit: cache dir {cache_dir()} not writable ({e}); compiling scalar code in memory")
        path = Path(tempfile.mkdtemp(prefix="btjit_")) / f"{name}.py"
        path.write_text(src)
        mod, cache_ok = _import_file(name, path), False
    _MODULES[name] = (mod, cache_ok)
    return mod, cache_ok


class StraightLine:
    """The njit entry points of one generated module, each compiled (or loaded from disk) on first use."""

    def __init__(self, prog: ScalarProgram):
        self.prog = prog
        self.source = generate_source(prog)
        self.module, self.cache_ok = load_module(self.source)
        self.seconds = 0.0            # compile/load time spent so far
        self._fns: dict = {}
        f = nt.float32 if prog.dtype == "f32" else nt.float64
        scalars = (f,) * prog.n_in if prog.n_in <= ARGS_MAX else (f[::1],)
        self._sigs = {"one": scalars, "nodes": scalars, "many": (f[:, ::1], f[:, ::1], f[:, ::1]),
                      "many_t": (f[:, ::1], f[:, ::1], f[:, ::1])}

    def get(self, name):
        fn = self._fns.get(name)
        if fn is None:
            t0 = time.perf_counter()
            py = getattr(self.module, name)
            try:
                fn = njit(self._sigs[name], cache=self.cache_ok, **FM)(py)
            except Exception as e:  # noqa: BLE001 — a broken cache entry must not stop the user
                if not self.cache_ok:
                    raise
                warnings.warn(f"btjit: scalar code cache unusable ({type(e).__name__}: {e}); compiling in memory")
                fn = njit(self._sigs[name], cache=False, **FM)(py)
            self._fns[name] = fn
            self.seconds += time.perf_counter() - t0
        return fn

    def cache_hit(self, name) -> bool:
        st = getattr(self._fns.get(name), "stats", None)
        return bool(st and sum(st.cache_hits.values()) > 0)
