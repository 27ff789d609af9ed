"""More of numpy's functions on traced values, composed of the primitives, as update rules and models write them:
np.linalg.norm with numpy's orders (any vector ord; a matrix's Frobenius, 1, -1, inf and -inf norms), vector_norm
and matrix_norm, vdot, trace, diag and diagonal, all / any, median, quantile, percentile and partition (by sort),
and the elementwise fmax, fmin, copysign, signbit, heaviside, hypot, cbrt, float_power and nan_to_num. Registered
on import, as btjit/graph/numpy_fns.py's (btjit/core/program.py imports this module before tracing)."""
from __future__ import annotations

import builtins

import numpy as np

from btjit.graph.indexing import getitem
from btjit.graph.numpy_fns import amin, flatten, moveaxis, sign, stack, vector_norm
from btjit.graph.sort_fns import _sorted
from btjit.graph.trace import (FUNCS, METHODS, UFUNCS, TraceError, _binop, _norm_axes, abs, concatenate, lift, max,
                               maximum, minimum, reshape, sqrt, sum, user_src, where)


# ----------------------------------------------------------------------------- norms
def norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002
    """np.linalg.norm: the 2-norm over `axis` (all of them for None) for ord None; else a vector's (1-d, or along
    one axis) of any ord, or a matrix's (2-d, or over two axes): Frobenius ("fro"), 1 / -1 (the largest / smallest
    column sum of magnitudes) or inf / -inf (row sums). ord 2, -2 and "nuc" of a matrix need its singular values:
    an error."""
    x = lift(x)
    if ord is None:                      # the 2-norm over the axes (numpy's Frobenius norm for two)
        return vector_norm(x, None, axis, keepdims)
    if axis is None and x.ndim > 2:
        raise TraceError(f"norm: ord={ord!r} of a {x.ndim}-d value without an axis (numpy takes an ord for vectors "
                         f"and matrices only): give an axis, or flatten it for the vector norm — {user_src()}")
    axes = tuple(range(x.ndim)) if axis is None else np.atleast_1d(axis).tolist()
    if len(axes) == 1:
        return vector_norm(x, ord, _norm_axes(axes, x.ndim, "norm"), keepdims)
    if len(axes) != 2 or len(set(_norm_axes(axes, x.ndim, "norm"))) != 2:
        raise TraceError(f"norm: axis={axis!r}: one axis (a vector norm) or two (a matrix norm) — {user_src()}")
    return matrix_norm(x, "fro" if ord is None else ord, keepdims, axes)


def matrix_norm(x, ord="fro", keepdims=False, axes=(-2, -1)):  # noqa: A002
    """np.linalg.matrix_norm over the last two axes (norm's over `axes`): "fro", 1, -1, inf or -inf."""
    x = lift(x)
    r, c = (a % x.ndim for a in axes)
    if ord == "fro":
        out = sqrt(sum(x * x, (r, c), keepdims=True))
    elif ord in (1, -1, np.inf, -np.inf):
        along, across = (r, c) if ord in (1, -1) else (c, r)      # 1: sums down the columns, inf: along the rows
        sums = sum(abs(x), along, keepdims=True)
        out = max(sums, across, keepdims=True) if ord > 0 else amin(sums, across, keepdims=True)
    else:
        raise TraceError(f"norm: ord={ord!r} of a matrix needs its singular values, which btjit does not compute; "
                         f"'fro' (the default), 1, -1, inf and -inf are sums — {user_src()}")
    return out if keepdims else reshape(out, tuple(d for i, d in enumerate(x.shape) if i not in (r, c)))


def _vector_norm_np(x, *, axis=None, keepdims=False, ord=2):  # noqa: A002
    """np.linalg.vector_norm: of everything for axis None."""
    return vector_norm(x, ord, axis, keepdims)


def vdot(a, b):
    """numpy's vdot: the dot product of the flattened values."""
    return sum(flatten(lift(a)) * flatten(lift(b)))


def _diagonal_sums(x, offset, axis1, axis2):
    """(sum of x * the diagonal's mask over the last axis, (lo, hi) the rows that have a diagonal element) with
    axis1, axis2 moved last."""
    x = moveaxis(lift(x), (axis1, axis2), (-2, -1))
    n, m = x.shape[-2:]
    return sum(where(np.eye(n, m, k=offset, dtype=bool), x, 0.0), -1), (builtins.max(0, -offset),
                                                                         builtins.min(n, m - offset))


def diagonal(x, offset=0, axis1=0, axis2=1):
    """numpy's diagonal: the elements x[..., i, i + offset] of the two axes (moved last)."""
    rows, (lo, hi) = _diagonal_sums(x, offset, axis1, axis2)
    if hi <= lo:
        raise TraceError(f"diagonal: offset {offset} is outside shape {lift(x).shape} — {user_src()}")
    return getitem(rows, (Ellipsis, slice(lo, hi)))


def trace(x, offset=0, axis1=0, axis2=1):
    """numpy's trace: the sum of diagonal(x, offset, axis1, axis2)."""
    return sum(_diagonal_sums(x, offset, axis1, axis2)[0], -1)


def diag(v, k=0):
    """numpy's diag: a 2-d value's diagonal k, or the square matrix with a 1-d value on diagonal k."""
    v = lift(v)
    if v.ndim == 2:
        return diagonal(v, k)
    if v.ndim != 1:
        raise TraceError(f"diag: takes a 1-d or 2-d value, got shape {v.shape} — {user_src()}")
    n = v.shape[0] + (k if k > 0 else -k)
    pad = [lift(np.zeros(z), v) for z in (builtins.max(0, -k), builtins.max(0, k))]
    rows = concatenate([p for p in pad[:1] if p.size] + [v] + [p for p in pad[1:] if p.size])
    return where(np.eye(n, k=k, dtype=bool), reshape(rows, (n, 1)), 0.0)


# ----------------------------------------------------------------------------- all / any, order statistics
def all_(x, axis=None, keepdims=False):
    """numpy's all: 1 where every element along axis is nonzero, else 0 (a mask)."""
    return amin(_binop("ne", lift(x), 0.0), axis, keepdims)


def any_(x, axis=None, keepdims=False):
    """numpy's any: 1 where some element along axis is nonzero, else 0 (a mask)."""
    return max(_binop("ne", lift(x), 0.0), axis, keepdims)


def _along(fn, x, axis):
    """(x sorted along `axis` and moved last, the shape of a keepdims result): numpy's None flattens."""
    x = lift(x)
    if axis is None:
        return _sorted(fn, reshape(x, (x.size,)), 0, None, False)[0], (1,) * x.ndim
    if not isinstance(axis, (int, np.integer)):
        raise TraceError(f"{fn}: axis must be one int or None, got {axis!r} — {user_src()}")
    (ax,) = _norm_axes(axis, x.ndim, fn)
    return moveaxis(_sorted(fn, x, ax, None, False)[0], ax, -1), x.shape[:ax] + (1,) + x.shape[ax + 1:]


def quantile(x, q, axis=None, keepdims=False, method="linear"):
    """numpy's quantile (method "linear"): between the sorted elements at floor and ceil of q * (n - 1); q a
    number in [0, 1] or a list of them (a leading axis)."""
    if method != "linear":
        raise TraceError(f"quantile: method {method!r}; btjit has 'linear' (numpy's default) — {user_src()}")
    if np.ndim(q):
        return stack([quantile(x, float(v), axis, keepdims) for v in np.asarray(q).ravel()])
    if not 0.0 <= float(q) <= 1.0:
        raise TraceError(f"quantile: q={q} must be in [0, 1] — {user_src()}")
    s, kept = _along("quantile", x, axis)
    pos = float(q) * (s.shape[-1] - 1)
    lo = int(np.floor(pos))
    out = a = getitem(s, (Ellipsis, lo))
    if pos > lo:
        out = a + (getitem(s, (Ellipsis, lo + 1)) - a) * (pos - lo)
    return reshape(out, kept) if keepdims else out


def median(x, axis=None, keepdims=False):
    """numpy's median: the middle sorted element, or the mean of the middle two."""
    return quantile(x, 0.5, axis, keepdims)


def partition(x, kth, axis=-1):
    """numpy's partition: the sorted values along axis (a full sort is one valid partition for every kth)."""
    s, _ = _along("partition", x, axis)
    return s if axis is None else moveaxis(s, -1, axis)


# ----------------------------------------------------------------------------- elementwise
isnan = UFUNCS["isnan"]         # numpy_fns's (x != x)


def fmax(x, y):
    """numpy's fmax: the larger, the other where one is NaN."""
    return where(isnan(y), x, where(isnan(x), y, maximum(x, y)))


def fmin(x, y):
    """numpy's fmin: the smaller, the other where one is NaN."""
    return where(isnan(y), x, where(isnan(x), y, minimum(x, y)))


def signbit(x):
    """numpy's signbit: 1 for x < 0 and -0.0, else 0."""
    x = lift(x)
    return where(_binop("eq", x, 0.0), _binop("lt", 1.0 / x, 0.0), _binop("lt", x, 0.0))


def copysign(x, y):
    """numpy's copysign: |x| with the sign of y (-0.0's too)."""
    m = abs(lift(x))
    return where(signbit(y), -m, m)


def heaviside(x, h0):
    """numpy's heaviside: 0 below 0, 1 above, h0 at 0 (NaN stays NaN)."""
    x = lift(x)
    return where(isnan(x), x, where(_binop("lt", x, 0.0), 0.0, where(_binop("gt", x, 0.0), 1.0, h0)))


def nan_to_num(x, copy=True, nan=0.0, posinf=None, neginf=None):
    """numpy's nan_to_num: NaN -> nan, inf -> posinf, -inf -> neginf (the dtype's largest magnitudes by default)."""
    x = lift(x)
    big = float(np.finfo(np.float32 if x.node.dtype == "f32" else np.float64).max)
    x = where(isnan(x), float(nan), x)
    x = where(_binop("eq", x, np.inf), big if posinf is None else float(posinf), x)
    return where(_binop("eq", x, -np.inf), -big if neginf is None else float(neginf), x)


UFUNCS.update({
    "fmax": fmax, "fmin": fmin, "copysign": copysign, "signbit": signbit, "heaviside": heaviside,
    "hypot": lambda x, y: sqrt(lift(x) * lift(x) + lift(y) * lift(y)),
    "cbrt": lambda x: sign(x) * abs(lift(x)) ** (1.0 / 3.0), "float_power": lambda x, y: lift(x) ** y})
FUNCS.update({
    "norm": norm, "vector_norm": _vector_norm_np, "matrix_norm": lambda x, *, ord="fro", keepdims=False: matrix_norm(
        x, ord, keepdims), "vdot": vdot, "trace": trace, "diag": diag, "diagonal": diagonal, "all": all_,
    "any": any_, "median": median, "quantile": quantile, "partition": partition, "nan_to_num": nan_to_num,
    "percentile": lambda x, q, axis=None, keepdims=False, method="linear": quantile(
        x, np.asarray(q, np.float64) / 100.0, axis, keepdims, method)})
METHODS.update({"all": all_, "any": any_, "trace": trace, "diagonal": diagonal,
                "nan_to_num": lambda x, nan=0.0, posinf=None, neginf=None: nan_to_num(x, True, nan, posinf, neginf)})
