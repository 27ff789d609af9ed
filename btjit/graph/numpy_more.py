"""More of numpy's functions on traced values, composed of the primitives, as update rules and models write them:
np.linalg.norm with numpy's orders (any vector ord; a matrix's Frobenius, 1, -1, inf and -inf norms), vector_norm
and matrix_norm, vdot, trace, diag and diagonal, all / any, median, quantile, percentile and partition (by sort),
the elementwise sinh, cosh, arcsinh, arccosh, arctanh, fmax, fmin, copysign, signbit, heaviside, hypot, cbrt,
float_power and nan_to_num; einsum (one or two operands, as batched matmuls), pad's modes, tril / triu,
zeros_like / ones_like and logaddexp. Registered on import, as btjit/graph/numpy_fns.py's (btjit/core/tracing.py
imports this module before tracing)."""
from __future__ import annotations

import builtins

import numpy as np

from btjit.graph.indexing import getitem
from btjit.graph.numpy_fns import amin, flatten, full_like, moveaxis, sign, stack, vector_norm
from btjit.graph.sort_fns import _sorted
from btjit.graph.trace import (FUNCS, METHODS, UFUNCS, TraceError, _binop, _norm_axes, abs, concatenate, exp, lift,
                               log, log1p, matmul, max, maximum, minimum, reshape, sqrt, stop_gradient, sum, transpose,
                               user_src, where)


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


# ----------------------------------------------------------------------------- einsum, pad, triangles, logaddexp
def einsum(subscripts, *operands):
    """numpy's einsum for one or two operands ("bhqd,bhkd->bhqk", "ij->j", "...ij,...jk->...ik", or "ij,jk" with
    numpy's implicit output; no letter twice in one operand): a letter only one operand has and the output lacks is
    summed first; two operands are then one batched matmul (letters in both and the output: batch; in both only:
    contracted)."""
    operands = [lift(x) for x in operands]
    ins, _, out = _einsum_letters(subscripts.replace(" ", ""), operands).partition("->")
    terms = ins.split(",")
    if "." in ins + out or len(terms) != len(operands) or len(terms) > 2 or \
            any(len(set(t)) != len(t) for t in terms + [out]):
        raise TraceError(f"einsum: {subscripts!r}: one or two operands, no letter twice in one term — {user_src()}")
    xs = []
    for t, x in zip(terms, operands):
        x = lift(x)
        if x.ndim != len(t):
            raise TraceError(f"einsum: term {t!r} for an operand of shape {x.shape} — {user_src()}")
        others = "".join(terms).replace(t, "", 1) + out
        gone = [i for i, c in enumerate(t) if c not in others]
        xs.append((sum(x, tuple(gone)) if gone else x, "".join(c for c in t if c in others)))
    size = {c: d for x, t in xs for c, d in zip(t, x.shape)}
    if any(size[c] != d for x, t in xs for c, d in zip(t, x.shape)):
        raise TraceError(f"einsum: {subscripts!r}: a letter of two sizes in operands of shapes "
                         f"{', '.join(str(x.shape) for x in operands)} — {user_src()}")
    if len(xs) == 1:
        (x, t), = xs
        return transpose(x, tuple(t.index(c) for c in out))
    (a, ta), (b, tb) = xs
    batch = [c for c in out if c in ta and c in tb]
    con = [c for c in ta if c in tb and c not in out]
    fa, fb = [c for c in ta if c not in tb], [c for c in tb if c not in ta]
    n = lambda cs: int(np.prod([size[c] for c in cs]))                      # noqa: E731
    a = reshape(transpose(a, tuple(ta.index(c) for c in batch + fa + con)), (n(batch), n(fa), n(con)))
    b = reshape(transpose(b, tuple(tb.index(c) for c in batch + con + fb)), (n(batch), n(con), n(fb)))
    y = reshape(matmul(a, b), tuple(size[c] for c in batch + fa + fb))
    return transpose(y, tuple((batch + fa + fb).index(c) for c in out))


def _einsum_letters(s, operands):
    """s with each "..." written as letters of its own (the dims it covers, aligned at the right) and numpy's
    implicit output made explicit (the ellipsis' letters, then the letters used once, in alphabetical order)."""
    ins, arrow, out = s.partition("->")
    terms = ins.split(",")
    ell = ""
    if "..." in s and len(terms) == len(operands):
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in s]
        nd = builtins.max([x.ndim - (len(t) - 3) for t, x in zip(terms, operands) if "..." in t] + [0])
        ell = "".join(free[:nd])
        terms = [t.replace("...", ell[nd - (x.ndim - (len(t) - 3)):]) if "..." in t else t
                 for t, x in zip(terms, operands)]
        out = out.replace("...", ell)
    if not arrow:
        used = "".join(terms)
        out = ell + "".join(sorted(c for c in set(used) if used.count(c) == 1 and c not in ell))
    return ",".join(terms) + "->" + out


PAD_MODES = ("constant", "reflect", "edge", "wrap")


def pad(x, pad_width, mode="constant", constant_values=0):
    """numpy's pad in modes "constant" (each axis between blocks of constant_values), "reflect" (mirrored
    without the edge), "edge" (the edge repeated) and "wrap" (circular): the last three gather each axis by an
    index array, so their gradients sum back where an element is read twice."""
    if mode not in PAD_MODES:
        raise TraceError(f"pad: mode must be one of {PAD_MODES}, got {mode!r} — {user_src()}")
    x = lift(x)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (x.ndim, 2))
    for ax, (lo, hi) in enumerate(widths):
        lo, hi, n = int(lo), int(hi), x.shape[ax]
        if mode != "constant" and (lo or hi):
            if mode == "reflect" and builtins.max(lo, hi) >= n or mode == "wrap" and builtins.max(lo, hi) > n:
                raise TraceError(f"pad: {mode} padding of ({lo}, {hi}) on an axis of size {n} — {user_src()}")
            ids = np.arange(-lo, n + hi)
            ids = (np.abs(ids) if mode == "reflect" else np.clip(ids, 0, n - 1) if mode == "edge" else ids % n)
            if mode == "reflect":
                ids = np.where(ids > n - 1, 2 * (n - 1) - ids, ids)
            x = getitem(x, (slice(None),) * ax + (ids,))
            continue
        parts = [x]
        for k, at in ((lo, 0), (hi, 1)):
            if k:
                shape = x.shape[:ax] + (k,) + x.shape[ax + 1:]
                parts.insert(len(parts) * at, lift(np.full(shape, float(constant_values)), x))
        x = concatenate(parts, ax) if len(parts) > 1 else x
    return x


def tri(x, k=0, lower=True):
    """numpy's tril / triu: the last two axes' entries on and below (above) diagonal k kept, the others 0."""
    x = lift(x)
    if x.ndim < 2:
        raise TraceError(f"{'tril' if lower else 'triu'}: needs at least 2 dims, got shape {x.shape} — {user_src()}")
    keep = np.tri(*x.shape[-2:], k=k, dtype=bool)
    return where(keep if lower else ~np.tri(*x.shape[-2:], k=k - 1, dtype=bool), x, 0.0)


def tril(x, k=0, *, diagonal=None):
    """numpy's tril (torch's with diagonal=): entries above diagonal k set to 0."""
    return tri(x, k if diagonal is None else diagonal)


def triu(x, k=0, *, diagonal=None):
    """numpy's triu (torch's with diagonal=): entries below diagonal k set to 0."""
    return tri(x, k if diagonal is None else diagonal, lower=False)


def zeros_like(x):
    """numpy's / torch's zeros_like: zeros of x's shape (no gradient to x)."""
    return full_like(x, 0.0)


def ones_like(x):
    """numpy's / torch's ones_like: ones of x's shape (no gradient to x)."""
    return full_like(x, 1.0)


def logaddexp(x, y):
    """numpy's logaddexp: log(exp(x) + exp(y)), computed as m + log(exp(x - m) + exp(y - m)) with m = max(x, y)
    held constant: its gradient is the two softmax weights (1/2 each where x == y, as torch's)."""
    x, y = lift(x), lift(y)
    m = stop_gradient(maximum(x, y))
    return m + log(exp(x - m) + exp(y - m))


UFUNCS.update({
    "sinh": lambda x: (exp(x) - exp(-lift(x))) * 0.5, "cosh": lambda x: (exp(x) + exp(-lift(x))) * 0.5,
    "arcsinh": lambda x: sign(x) * log(abs(x) + sqrt(lift(x) * lift(x) + 1.0)),
    "arccosh": lambda x: log(lift(x) + sqrt(lift(x) * lift(x) - 1.0)),
    "arctanh": lambda x: (log1p(x) - log1p(-lift(x))) * 0.5,
    "logaddexp": logaddexp, "fmax": fmax, "fmin": fmin, "copysign": copysign, "signbit": signbit,
    "heaviside": heaviside,
    "hypot": lambda x, y: sqrt(lift(x) * lift(x) + lift(y) * lift(y)),
    "cbrt": lambda x: sign(x) * abs(lift(x)) ** (1.0 / 3.0), "float_power": lambda x, y: lift(x) ** y})
FUNCS.update({
    "einsum": einsum, "pad": pad, "tril": tril, "triu": triu, "zeros_like": zeros_like, "ones_like": ones_like,
    "logaddexp": logaddexp, "norm": norm, "vector_norm": _vector_norm_np,
    "matrix_norm": lambda x, *, ord="fro", keepdims=False: matrix_norm(x, ord, keepdims), "vdot": vdot,
    "trace": trace, "diag": diag, "diagonal": diagonal, "all": all_,
    "any": any_, "median": median, "quantile": quantile, "partition": partition, "nan_to_num": nan_to_num,
    "percentile": lambda x, q, axis=None, keepdims=False, method="linear": quantile(
        x, np.asarray(q, np.float64) / 100.0, axis, keepdims, method)})
METHODS.update({"tril": tril, "triu": triu, "all": all_, "any": any_, "trace": trace, "diagonal": diagonal,
                "nan_to_num": lambda x, nan=0.0, posinf=None, neginf=None: nan_to_num(x, True, nan, posinf, neginf)})
