"""Scalar (micrograd-style) graphs: trace a function of Python scalars once, run value-and-gradient natively.

    f = btjit.trace_scalar(lambda a, b: (a * b + b ** 3) / 2, dtype="float64")
    value, (da, db) = f(-41.0, 2.0)        # one native call; grads are w.r.t. every argument, in order
    values, grads = f.many(X)              # X (N, n_inputs) -> values (N,), grads (N, n_inputs); one native loop

The function takes N positional scalars (named by its parameters: the graph's params; a `*args` function
needs `n_args=`) and uses plain Python operators (+ - * / **, unary minus, comparisons inside btjit.where),
btjit.relu/tanh/exp/log/sigmoid/sqrt/abs/erf/log1p/maximum/minimum/gelu/where and the methods x.relu(),
.tanh() .exp() .log() .sigmoid() .sqrt() .abs() on them; `x += y` rebinding works. It is
traced once into the ordinary IR (shape () values), differentiated by the ordinary autodiff, dead code is
removed, and it is lowered by btjit.scalar.lower: straight-line native code up to STRAIGHT_LINE_MAX
instructions, a scalar tape run by one cached interpreter above it (`lowering=` forces either).

What the function may return:
    out                          one output: f(...) -> (value, grads)
    (o1, o2, ...)                several outputs: f(...) -> ((v1, v2, ...), grads) where grads is the gradient
                                 of o1 + o2 + ... : exactly what accumulating o1.backward(); o2.backward() into
                                 .grad means (BurTorch drops gradient there when the outputs share nodes)
    (out_or_outs, {"c": c, ...}) named nodes as well: f.values(...) -> {"c": value, ...}, f.save_values(path, d)

Named node values go to and from a file (E3/E4): btjit/scalar/nodefile.py's save_values / load_values.
"""
from __future__ import annotations

import inspect
import time

import numpy as np

from btjit.graph import autodiff, trace as T
from btjit.graph.ir import Graph, verify
from btjit.graph.ops import TABLE
from btjit.scalar.nodefile import save_values
from btjit.scalar.lower import ARGS_MAX, STRAIGHT_LINE_MAX, ScalarGraphError, ScalarProgram, StraightLine
from btjit.scalar.tape import ScalarTape

__all__ = ["trace_scalar", "ScalarFunction", "STRAIGHT_LINE_MAX"]


def _arg_names(fn, n_args):
    try:
        ps = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        ps = None
    if n_args is None:
        if ps is None or any(p.kind == p.VAR_POSITIONAL for p in ps):
            raise TypeError("trace_scalar: cannot count the function's arguments; pass n_args=")
        n_args = sum(1 for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)
    pos = [p for p in ps or [] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in pos[:n_args]]
    return names + [f"x{i}" for i in range(len(names), n_args)]


def _lift_out(x, what):
    if isinstance(x, T.Tracer):
        return x
    if isinstance(x, (bool, int, float, np.number)):
        return T.lift(float(x))
    raise T.TraceError(f"trace_scalar: {what} is a {type(x).__name__}, not a traced scalar or a number")


def trace_scalar(fn, dtype="float64", *, n_args=None, lowering="auto", compile=True) -> "ScalarFunction":
    """Trace fn(*scalars) once; returns a ScalarFunction computing its value and gradient natively.

    dtype: "float64" (default) or "float32". n_args: the number of inputs of a *args function.
    lowering: "auto" (straight-line code up to STRAIGHT_LINE_MAX instructions, else the tape), "straight" or
    "tape". compile: compile (or load from the cache) the single-call entry point now rather than at first use.
    """
    t0 = time.perf_counter()
    fd = {"float32": "f32", "float64": "f64"}.get(str(np.dtype(dtype)))
    if fd is None:
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    if lowering not in ("auto", "straight", "tape"):
        raise ValueError(f"lowering must be auto, straight or tape, got {lowering!r}")
    names = _arg_names(fn, n_args)
    g = Graph(float_dtype=fd)
    for name in names:
        g.params[name] = g.new_var((), fd)
    with T.building(g):
        xs = [T.Tracer(v, g) for v in g.params.values()]
        res = fn(*xs)
        named = {}
        if isinstance(res, tuple) and res and isinstance(res[-1], dict):
            named, res = res[-1], (res[0] if len(res) == 2 else res[:-1])
        multi = isinstance(res, (tuple, list))
        outs = [_lift_out(o, f"output {i}") for i, o in enumerate(res if multi else [res])]
        named = {str(k): _lift_out(v, f"named node {k!r}") for k, v in named.items()}
        if not outs:
            raise T.TraceError("trace_scalar: the function returned no output")
        for t in [*outs, *named.values()]:
            if t.shape != () or t.node.dtype == "i32":
                raise T.TraceError(f"trace_scalar: outputs must be float scalars, got {t.node.type_str}")
        g.n_forward = len(g.eqns)
        loss = outs[0]
        for o in outs[1:]:                      # the gradient of several outputs is the gradient of their sum
            loss = loss + o
    g.loss = loss.node
    grads = autodiff.differentiate(g)
    grad_vars = [grads.get(n) for n in names]
    autodiff.eliminate_dead_code(g, [o.node for o in outs] + [t.node for t in named.values()] +
                                 [v for v in grad_vars if v is not None])
    g.n_backward = len(g.eqns)
    if len(outs) > 1:
        g.loss = None                           # the sum of the outputs was only needed for autodiff
    g.outputs = {**{k: t.node for k, t in named.items()}, **{f"<out{i}>": o.node for i, o in enumerate(outs)}}
    g.grads = {n: v for n, v in zip(names, grad_vars) if v is not None}
    verify(g, TABLE)
    try:
        prog = ScalarProgram(g, list(g.params.values()), [o.node for o in outs], grad_vars,
                             [(k, t.node) for k, t in named.items()])
    except ScalarGraphError as e:
        raise T.TraceError(str(e)) from None
    trace_seconds = time.perf_counter() - t0
    if lowering == "auto":
        lowering = "straight" if len(prog.instrs) <= STRAIGHT_LINE_MAX else "tape"
    f = object.__new__(ScalarFunction)
    f._init(names, g, prog, multi, list(named), lowering, trace_seconds)
    if compile:
        f.compile()
    return f


class ScalarFunction:
    """A traced scalar function. f(*args) -> (value, grads); f.many(X) -> (values, grads);
    f.values(*args) -> {name: value} of the named nodes; f.save_values(path, values)."""

    __slots__ = ("arg_names", "graph", "program", "multi", "named", "lowering", "dtype", "trace_seconds",
                 "_straight", "_tape", "_tape_seconds", "_one_bufs", "__weakref__")

    def _init(self, names, graph, prog, multi, named, lowering, trace_seconds):
        self.arg_names, self.graph, self.program = list(names), graph, prog
        self.multi, self.named, self.lowering = multi, named, lowering
        self.dtype = prog.np_dtype
        self.trace_seconds = trace_seconds
        self._straight = StraightLine(prog) if lowering == "straight" else None
        self._tape = None
        self._tape_seconds = 0.0
        if lowering == "tape":
            t0 = time.perf_counter()
            self._tape = ScalarTape(prog)
            n, k, dt = prog.n_in, len(prog.values), self.dtype
            self._one_bufs = (np.empty((1, n), dt), np.empty((1, k), dt), np.empty((1, n), dt), None)
            self._tape_seconds = time.perf_counter() - t0

    # -- introspection
    @property
    def n_inputs(self) -> int:
        return self.program.n_in

    @property
    def n_instructions(self) -> int:
        return len(self.program.instrs)

    @property
    def compile_seconds(self) -> float:
        """Seconds spent building the tape or compiling/loading native code so far (not tracing)."""
        return self._straight.seconds if self._straight else self._tape_seconds

    @property
    def source(self) -> str | None:
        """The generated Python source of the straight-line lowering (None on the tape)."""
        return self._straight.source if self._straight else None

    @property
    def tape(self):
        return self._tape

    def __repr__(self):
        return (f"<btjit ScalarFunction ({', '.join(self.arg_names)}) {self.n_instructions} instructions, "
                f"{self.lowering}, {self.dtype.name}>")

    def compile(self, many=False):
        """Compile or load the native code of the single-call path now (otherwise at first use); with
        many=True also the row-major f.many kernel."""
        if self._straight:
            if many:
                self._straight.get("many")
            one = self._straight.get("one")
            if self.program.n_in <= ARGS_MAX and type(self) is ScalarFunction:
                # f(...) then calls the njit entry point with no Python frame in between (~200 ns per call)
                self.__class__ = type("ScalarFunction", (ScalarFunction,), {
                    "__call__": staticmethod(one), "__slots__": (), "__doc__": ScalarFunction.__doc__})
        else:
            t0 = time.perf_counter()
            n = self.program.n_in
            self._run_tape(np.zeros((0, n), self.dtype))
            self._tape_seconds += time.perf_counter() - t0
        return self

    def export(self, path):
        """Write this function as a self-contained native library (btjit/export_scalar.py); btjit.runtime.load(path)
        gives the same callable without numba. Returns the dir."""
        from btjit.scalar.export import export_scalar
        return export_scalar(self, path)

    # -- evaluation
    def _run_tape(self, X, with_named=False):
        p = self.program
        N = X.shape[0]
        OV = np.empty((N, len(p.values)), self.dtype)
        OG = np.empty((N, p.n_in), self.dtype)
        ON = np.empty((N, len(p.named) if with_named else 0), self.dtype)
        if with_named:
            self._tape.many(X, OV, OG, ON)
        else:
            self._tape.many(X, OV, OG)
        return OV, OG, ON

    def _row(self, args):
        if len(args) != self.program.n_in:
            raise TypeError(f"expected {self.program.n_in} arguments ({', '.join(self.arg_names)}), got {len(args)}")
        return np.array([args], self.dtype)

    def __call__(self, *args):
        """-> (value, (d/d arg0, d/d arg1, ...)); value is a tuple with several outputs."""
        if self._straight:
            if self.program.n_in <= ARGS_MAX:      # not compiled yet: compile, then call directly from now on
                self.compile()
                return self._straight.get("one")(*args)
            v, G = self._straight.get("one")(self._row(args)[0])    # many inputs: the entry point takes an array
            return v, tuple(G.tolist())
        if len(args) != self.program.n_in:
            raise TypeError(f"expected {self.program.n_in} arguments ({', '.join(self.arg_names)}), got {len(args)}")
        X, OV, OG, ON = self._one_bufs
        X[0] = args
        self._tape.many(X, OV, OG)
        v = OV[0].tolist()
        return (tuple(v) if self.multi else v[0]), tuple(OG[0].tolist())

    def many(self, X, out=None):
        """X (N, n_inputs) (or (N,) for a one-input function) -> (values (N,) or (N, n_outputs), grads (N, n_inputs))
        in one native loop over the rows.

        Layout: a C-ordered X gives C-ordered results. A Fortran-ordered X (e.g. `XT.T` for data held as
        (n_inputs, N) columns) takes the column kernel, which LLVM vectorizes across rows (2-5x faster per row
        on the straight-line lowering) and gives Fortran-ordered grads (and values when several outputs).
        out=(values, grads): preallocated arrays of the function's dtype, shaped (N, n_outputs) and (N, n_inputs),
        in the same order (C or F) as X; they are filled and returned (values reshaped to (N,) with one output).
        """
        n = self.program.n_in
        X = np.asarray(X)
        if X.ndim == 1 and n == 1:
            X = X.reshape(-1, 1)
        if X.ndim != 2 or X.shape[1] != n:
            raise ValueError(f"many: inputs must have shape (N, {n}), got {X.shape}")
        N, k, dt = X.shape[0], len(self.program.values), self.dtype
        cols = self._straight is not None and X.flags.f_contiguous and not X.flags.c_contiguous and N > 0
        X = np.asarray(X, dt, order="F" if cols else "C")
        order = "F" if cols else "C"
        if out is None:
            OV, OG = np.empty((N, k), dt, order=order), np.empty((N, n), dt, order=order)
        else:
            OV, OG = out
            flag = "f_contiguous" if cols else "c_contiguous"
            if OV.shape != (N, k) or OG.shape != (N, n) or OV.dtype != dt or OG.dtype != dt or \
                    not (getattr(OV.flags, flag) and getattr(OG.flags, flag)):
                raise ValueError(f"many: out must be {order}-ordered {dt.name} arrays of shapes {(N, k)} and {(N, n)}")
        if cols:
            self._straight.get("many_t")(X.T, OV.T, OG.T)
        elif self._straight:
            self._straight.get("many")(X, OV, OG)
        else:
            self._tape.many(X, OV, OG)
        return (OV if self.multi else OV.reshape(N, order="A")), OG

    def values(self, *args) -> dict:
        """{name: value} of the named nodes (the dict the traced function returned) at these inputs."""
        if not self.named:
            return {}
        if self._straight:
            fn = self._straight.get("nodes")
            vals = fn(*args) if self.program.n_in <= ARGS_MAX else fn(self._row(args)[0])
            return dict(zip(self.named, map(float, vals)))
        _, _, ON = self._run_tape(self._row(args), with_named=True)
        return dict(zip(self.named, ON[0].tolist()))

    def save_values(self, path, values: dict | None = None, *args) -> None:
        """Write named node values to `path` in the node-value format (module docstring), in this function's
        dtype. values: a {name: float} dict (e.g. from f.values(...)); or None with the inputs as *args."""
        if values is None:
            values = self.values(*args)
        save_values(path, values, self.dtype)

    def reference(self, *args):
        """(value, grads, named) evaluated in Python with the op table's numpy references (for tests)."""
        g, dt = self.graph, self.dtype
        env = {v.id: np.asarray(c, dt) for v, c in g.consts.items()}
        env.update({v.id: np.asarray(x, dt) for v, x in zip(g.params.values(), args)})
        with np.errstate(all="ignore"):
            for e in g.eqns:
                outs = TABLE[e.op].ref([env[v.id] for v in e.ins], e.attrs)
                for v, o in zip(e.outs, outs):
                    env[v.id] = np.asarray(o, dt)
        vals = [float(env[g.outputs[f"<out{i}>"].id]) for i in range(len(self.program.values))]
        grads = tuple(float(env[g.grads[n].id]) if n in g.grads else 0.0 for n in self.arg_names)
        named = {k: float(env[g.outputs[k].id]) for k in self.named}
        return (tuple(vals) if self.multi else vals[0]), grads, named
