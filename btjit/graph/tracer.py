"""The recording core of tracing: the graph being built, `emit()` (one equation, its output types from the op
table's shape rule; a shape or dtype error becomes a `TraceError` naming the op, the shapes and the user's source
line), `lift()` (Python numbers and numpy arrays become graph constants) and the user's source line.

The values it returns are instances of the tracer class that btjit/graph/trace.py defines and registers here
(`TRACER`), so this module imports nothing of the tracer's numpy-like surface.
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from btjit.graph.ir import Eqn, Graph
from btjit.graph.optable import TABLE, ShapeError

TRACER: list = []          # [the Tracer class] (btjit/graph/trace.py registers it)

_HERE = os.path.dirname(os.path.abspath(__file__))
_OPTIM = tuple(os.path.join(os.path.dirname(_HERE), "optim", f) for f in ("base.py", "build.py", "near_one.py"))
_STACK: list = []          # graphs being built (innermost last)
_SRC_OVERRIDE: list = []   # source line forced by autodiff for backward equations


class TraceError(Exception):
    """A problem in the user's traced function: names the op, the shapes and the source line."""


_INTERNAL: dict = {}       # code filename -> (is btjit/graph, optimizer tracing or numpy internals, basename)


def _frame_file(fn):
    if fn not in _INTERNAL:
        path = os.path.abspath(fn)
        _INTERNAL[fn] = (path.startswith(_HERE) or path in _OPTIM or "numpy" in fn.split(os.sep)[-3:-1],
                         os.path.basename(fn))
    return _INTERNAL[fn]


def user_src() -> str:
    """"file.py:line" of the innermost frame outside btjit's graph package and the optimizer's tracing (the user's
    code: a model's line, an update rule's)."""
    if _SRC_OVERRIDE:
        return _SRC_OVERRIDE[-1]
    f = sys._getframe(1)
    while f is not None:
        internal, base = _frame_file(f.f_code.co_filename)
        if not internal:
            return f"{base}:{f.f_lineno}"
        f = f.f_back
    return ""


@contextlib.contextmanager
def building(graph: Graph):
    _STACK.append(graph)
    try:
        yield graph
    finally:
        _STACK.pop()


@contextlib.contextmanager
def source(src: str):
    _SRC_OVERRIDE.append(src)
    try:
        yield
    finally:
        _SRC_OVERRIDE.pop()


def current_graph() -> Graph:
    if not _STACK:
        raise TraceError("btjit tensor functions can only be used inside a function traced by btjit.trace")
    return _STACK[-1]


def emit(op: str, ins, **attrs):
    """Append one equation; returns its output tracers (a tuple if the op has several outputs)."""
    g = current_graph()
    ins = tuple(ins)
    for t in ins:
        if t.graph is not g:
            raise TraceError(f"{op}: uses a traced value from another btjit.trace call (kept in a global or closure); "
                             f"tracers are only valid inside the function being traced — {user_src()}")
    try:
        types = TABLE[op].infer([(t.node.shape, t.node.dtype) for t in ins], attrs, g.float_dtype)
    except ShapeError as e:
        shapes = " and ".join(str(t.node.shape) for t in ins)
        raise TraceError(f"{op}: {e} (input shapes {shapes}) — {user_src()}") from None
    outs = tuple(g.new_var(s, d) for s, d in types)
    g.eqns.append(Eqn(op, tuple(t.node for t in ins), outs, attrs, user_src()))
    res = tuple(TRACER[0](v, g) for v in outs)
    return res[0] if len(res) == 1 else res


def lift(x, like=None):
    """A Tracer for x: tracers pass through; Python numbers and numpy arrays become graph constants."""
    if isinstance(x, TRACER[0]):
        return x
    g = current_graph()
    if isinstance(x, (bool, int, float, np.number, np.ndarray, list)):
        arr = np.asarray(x)
        if arr.dtype.kind in "iu" and (like.node.dtype == "i32" if like is not None else arr.ndim > 0):
            return TRACER[0](g.const(arr, "i32"), g)
        if arr.dtype.kind not in "iubf":
            raise TraceError(f"cannot use a {arr.dtype} array in a traced function — {user_src()}")
        return TRACER[0](g.const(arr.astype(np.float64), g.float_dtype), g)
    raise TraceError(f"cannot use a value of type {type(x).__name__} in a traced function — {user_src()}")


def _norm_axes(axis, ndim, op):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise TraceError(f"{op}: axis {a} out of range for {ndim}-d input — {user_src()}")
        out.append(int(a) % ndim)
    return tuple(sorted(set(out)))
