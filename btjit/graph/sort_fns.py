"""Sorting, rounding and remainders as numpy and torch write them: sort, argsort and topk (one kernel gives the
sorted positions, graph/ops/layout.py's argsort; the values are gathered at them, so their gradient goes back to the
positions taken), floor / ceil / round / trunc (zero gradient), x % y (remainder) and fmod with torch's gradients,
x // y, cumsum, cumprod and diff (composed). Registered on import, as btjit/graph/numpy_fns.py's (btjit/core/tracing.py
imports this module before tracing): np.sort, np.argsort, np.floor, ..., x.topk(k), x.sort(dim), x % y, round(x)."""
from __future__ import annotations

import numpy as np

from btjit.graph.indexing import Positions, getitem, take
from btjit.graph.numpy_fns import ValuesIndices
from btjit.graph.trace import (FUNCS, METHODS, UFUNCS, TraceError, Tracer, _norm_axes, broadcast_to, concatenate,
                               emit, lift, matmul, reshape, swapaxes, user_src)


# ----------------------------------------------------------------------------- sort, argsort, topk
def _sorted(fn, x, axis, k, descending):
    """(values, Positions) of the first k (all for None) of x along axis in sorted order: the smaller first (the
    larger if descending), NaN as the largest value, the lower position first among equal values (a stable sort)."""
    x = lift(x)
    if x.node.dtype == "i32":
        x = x.astype(float)
    if x.ndim == 0:
        raise TraceError(f"{fn}: needs at least 1 dim, got a 0-d value — {user_src()}")
    if not isinstance(axis, (int, np.integer)):
        raise TraceError(f"{fn}: dim must be one int, got {axis!r} — {user_src()}")
    (ax,) = _norm_axes(axis, x.ndim, fn)
    n = x.shape[ax]
    k = n if k is None else k
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= n:
        raise TraceError(f"{fn}: k={k!r} out of range: dim {axis} of shape {x.shape} has size {n}, k must be in "
                         f"[1, {n}] — {user_src()}")
    xm = swapaxes(x, ax, -1)                              # the axis last (the kernel sorts rows)
    pos = emit("argsort", (xm,), k=int(k), descending=bool(descending))
    rows = xm.size // n
    flat = reshape(pos, (rows, int(k)))
    if rows > 1:                                          # each row's positions into the flattened x
        flat = flat + lift(np.arange(rows, dtype=np.int32)[:, None] * n, flat)
    values = reshape(take(reshape(xm, (xm.size,)), flat), pos.shape)
    return swapaxes(values, ax, -1), Positions(swapaxes(pos, ax, -1))


def _descending(fn, descending):
    """torch's descending flag, or numpy's kind (a string: every sort here is stable)."""
    if isinstance(descending, str):
        return False
    if not isinstance(descending, (bool, np.bool_, int)):
        raise TraceError(f"{fn}: descending must be True or False, got {descending!r} — {user_src()}")
    return bool(descending)


def topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 -- torch's names
    """torch.topk: (values, indices) of the k largest (smallest: largest=False) entries along dim, in order; among
    equal values the lower position first (torch leaves their order unspecified). The values' gradient goes to the
    positions taken; the indices are floats (as argmax's) that index as ints (take_along_axis, x.gather)."""
    return ValuesIndices(_sorted("topk", x, dim, k, largest))


def sort(x, dim=-1, descending=False, stable=False):
    """torch.sort: (values, indices) along dim, ascending (descending=True: the largest first), stable always
    (the lower position first among equal values), NaN as the largest value. np.sort(x, axis) gives the values."""
    return ValuesIndices(_sorted("sort", x, dim, None, _descending("sort", descending)))


def argsort(x, dim=-1, descending=False, stable=False, *, axis=None, kind=None):
    """numpy's / torch's argsort: the positions that sort x along dim (as sort's indices: floats that index)."""
    return _sorted("argsort", x, dim if axis is None else axis, None, _descending("argsort", descending))[1]


def _np_sort(fn):
    """np.sort / np.argsort: axis -1 by default, None for the flattened array."""
    def f(a, axis=-1, kind=None, order=None, *, stable=None, descending=False):
        a = lift(a)
        if order is not None:
            raise TraceError(f"np.{fn}: order= (structured arrays) is not supported — {user_src()}")
        if axis is None:
            a, axis = reshape(a, (a.size,)), 0
        return _sorted(fn, a, axis, None, descending)[fn == "argsort"]
    return f


def _method(fn):
    """x.sort(dim) / x.argsort(dim) with torch's (dim, descending) or numpy's (axis, kind) names."""
    def f(x, dim=-1, descending=False, stable=False, *, axis=None, kind=None, order=None):
        r = _sorted(fn, x, dim if axis is None else axis, None, _descending(fn, descending))
        return ValuesIndices(r) if fn == "sort" else r[1]
    return f


# ----------------------------------------------------------------------------- rounding and remainders
def floor(x):
    """The largest whole number <= x (zero gradient, as torch's)."""
    return _round_op("floor", x)


def ceil(x):
    """The smallest whole number >= x (zero gradient)."""
    return _round_op("ceil", x)


def trunc(x):
    """x rounded toward 0 (zero gradient)."""
    return _round_op("trunc", x)


def round(x, decimals=0):  # noqa: A001 -- numpy's and torch's name
    """numpy's / torch's round: to the nearest whole number, halves to the even one (np.round(x, decimals) as
    numpy: rint(x * 10**decimals) / 10**decimals). Zero gradient, as torch's."""
    d = int(decimals)
    if d == 0:
        return _round_op("round", x)
    f = float(10.0 ** abs(d))
    x = lift(x)
    return _round_op("round", x * f) / f if d > 0 else _round_op("round", x / f) * f      # as numpy


def _round_op(op, x):
    x = lift(x)
    return x.astype(float) if x.node.dtype == "i32" else emit(op, (x,))


def _pair(x, y):
    """x and y lifted, each of the output's shape or one value (broadcast_to where neither: k_rounding's modes)."""
    x = lift(x, y if isinstance(y, Tracer) else None)
    y = lift(y, x)
    try:
        shape = tuple(np.broadcast_shapes(x.shape, y.shape))
    except ValueError:
        raise TraceError(f"remainder: shapes {x.shape} and {y.shape} do not broadcast — {user_src()}") from None
    n = int(np.prod(shape, dtype=np.int64))
    return tuple(v if v.size in (n, 1) else broadcast_to(v, shape) for v in (x, y))


def remainder(x, y):
    """x % y as Python, numpy (np.mod) and torch (torch.remainder) compute it: x - floor(x / y) y, with y's sign
    (exact: fmod then y added where the signs differ). Gradient as torch's: 1 for x, -floor(x / y) for y."""
    return emit("remainder", _pair(x, y))


def fmod(x, y):
    """C's fmod (np.fmod, torch.fmod): x - trunc(x / y) y, with x's sign (exact). Gradient as torch's: 1 for x,
    -trunc(x / y) for y."""
    return emit("fmod", _pair(x, y))


def floor_divide(x, y):
    """x // y as Python and numpy compute it for floats: (x - x % y) / y rounded (floor(x / y) but where x / y
    rounds up to a whole number: 1.0 // 0.1 is 9.0). Zero gradient."""
    x, y = _pair(x, y)
    return round((x - remainder(x, y)) / y)


def frac(x):
    """torch's frac: x - trunc(x) (gradient 1)."""
    x = lift(x)
    return x - trunc(x)


# ----------------------------------------------------------------------------- scans and differences
def one_axis(fn, x, axis):
    """(x, axis) of a function along one axis: None is the flattened x's axis 0, an int is normalized."""
    x = lift(x)
    if axis is None:
        return reshape(x, (x.size,)), 0
    if not isinstance(axis, (int, np.integer)):
        raise TraceError(f"{fn}: axis must be one int or None, got {axis!r} — {user_src()}")
    return x, _norm_axes(axis, x.ndim, fn)[0]


def scan(x, ax, identity, op):
    """Running op (+ or *) along axis ax in log2(n) steps: each step the values op themselves shifted by 1, 2, 4,
    ... with the identity shifted in (cumsum's long axes, cumprod)."""
    n, s, out, pre = x.shape[ax], 1, x, (slice(None),) * ax
    while s < n:
        fill = lift(np.full(x.shape[:ax] + (s,) + x.shape[ax + 1:], identity), out)
        out = op(out, concatenate([fill, getitem(out, pre + (slice(0, n - s),))], ax))
        s *= 2
    return out


def cumsum(x, axis=None):
    """numpy's cumsum along axis (of the flattened x for None): up to 256 long, a product with the upper triangle of
    ones (one GEMM); longer (an n x n triangle would be n^2 floats), a scan of log2(n) steps, each the values plus
    themselves shifted by 1, 2, 4, ... with zeros shifted in."""
    x, ax = one_axis("cumsum", x, axis)
    n = x.shape[ax]
    if n <= 256:
        return swapaxes(matmul(swapaxes(x, ax, -1), np.triu(np.ones((n, n)))), ax, -1)
    return scan(x, ax, 0.0, lambda a, b: a + b)


def cumprod(x, axis=None, *, dim=None):
    """numpy's cumprod (torch's x.cumprod(dim)): running products along axis (the flattened x for None), as a scan of
    log2(n) steps (each the values times themselves shifted by 1, 2, 4, ... with ones shifted in); the gradient by
    the product rule, right at zeros too."""
    x, ax = one_axis("cumprod", x, axis if dim is None else dim)
    return scan(x, ax, 1.0, lambda a, b: a * b)


def diff(x, n=1, axis=-1, prepend=None, append=None, *, dim=None):
    """numpy's diff (torch's x.diff(n, dim)): x[i + 1] - x[i] along axis, n times; prepend / append values (a
    number or an array, broadcast to one slice of x) joined first."""
    x, ax = one_axis("diff", x, axis if dim is None else dim)
    parts, edge = [], x.shape[:ax] + (1,) + x.shape[ax + 1:]
    for v in (prepend, x, append):
        if v is not None and v is not x:
            v = lift(v, x)
            v = broadcast_to(v, edge) if v.ndim == 0 else v
            if v.ndim != x.ndim:
                raise TraceError(f"diff: prepend / append of shape {v.shape} for x of shape {x.shape} — "
                                 f"{user_src()}")
        if v is not None:
            parts.append(v)
    x = concatenate(parts, ax) if len(parts) > 1 else x
    pre = (slice(None),) * ax
    for _ in range(int(n)):
        if x.shape[ax] < 1:
            break
        x = getitem(x, pre + (slice(1, None),)) - getitem(x, pre + (slice(0, -1),))
    return x


UFUNCS.update({"floor": floor, "ceil": ceil, "trunc": trunc, "rint": lambda x: _round_op("round", x),
               "remainder": remainder, "fmod": fmod, "floor_divide": floor_divide})
FUNCS.update({"sort": _np_sort("sort"), "argsort": _np_sort("argsort"), "round": round, "around": round,
              "fix": trunc, "cumsum": cumsum, "cumprod": cumprod, "diff": diff})
METHODS.update({
    "topk": topk, "sort": _method("sort"), "argsort": _method("argsort"), "floor": floor, "ceil": ceil,
    "trunc": trunc, "fix": trunc, "round": round, "remainder": remainder, "fmod": fmod, "floor_divide": floor_divide,
    "frac": frac, "cumprod": cumprod, "diff": diff,
    "cumsum": lambda x, axis=None, dim=None: cumsum(x, axis if dim is None else dim)})
