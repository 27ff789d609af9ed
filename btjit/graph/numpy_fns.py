"""numpy's functions and the array methods of traced values, composed of btjit/graph/trace.py's primitives: what
`np.<name>(tracer)` dispatches to (trace.FUNCS / UFUNCS, by name) and the methods numpy and torch code calls
(trace.METHODS, found by Tracer.__getattr__): x.var(0), x.min(1), x.squeeze(), x.view(B, T, C), x.permute(0, 2,
1), x.masked_fill(mask, v), ... Registered on import (btjit/core/tracing.py imports this module before tracing).

Where numpy and torch give one name two meanings, numpy's is taken (x.repeat repeats elements, x.max(axis)
gives the values); torch's meaning is kept where numpy's call would be an error (x.transpose(1, 2) of a 3-d value
swaps two axes, x.split(size, dim), x.size() called) or under its own name (permute)."""
from __future__ import annotations

import builtins
import functools

import numpy as np

from btjit.graph.functional import log_softmax, softmax
from btjit.graph.trace import (FUNCS, METHODS, UFUNCS, TraceError, Tracer, _binop, _norm_axes, abs, broadcast_to,
                               concatenate, copy, emit, equal, erf, exp, lift, log, log1p, logical, matmul, max,
                               maximum, mean, minimum, reshape, sin, cos, split, sqrt, stop_gradient, sum, swapaxes,
                               tanh, transpose, user_src, where)
from btjit.graph.indexing import getitem, take


def clip(x, lo=None, hi=None):
    """numpy's clip / torch's clamp: min(max(x, lo), hi); either bound may be None (the gradient passes where
    lo <= x <= hi, as torch)."""
    if lo is None and hi is None:
        raise TraceError(f"clip: give at least one of the bounds — {user_src()}")
    x = lift(x)
    x = x if lo is None else maximum(x, lo, ties="first")
    return x if hi is None else minimum(x, hi, ties="first")


def var(x, axis=None, ddof=0, keepdims=False, *, dim=None, keepdim=None, unbiased=None, correction=None):
    """numpy's var: the mean squared deviation over `axis`, divided by n - ddof instead of n. torch's keywords
    (dim, keepdim, unbiased, correction) select torch's default too: the unbiased estimate (ddof=1), as in
    makemore's `hpreact.var(0, keepdim=True)`."""
    if (dim, keepdim, unbiased, correction) != (None,) * 4:
        axis = axis if dim is None else dim
        keepdims = keepdims if keepdim is None else keepdim
        ddof = correction if correction is not None else (0 if unbiased is False else 1)
    x = lift(x)
    axes = _norm_axes(axis, x.ndim, "var")
    n = int(np.prod([x.shape[a] for a in axes]))
    d = x - mean(x, axes, keepdims=True)
    return sum(d * d, axes, keepdims) * (1.0 / (n - ddof) if n > ddof else float("inf"))


def std(x, axis=None, ddof=0, keepdims=False, **torch_kw):
    """numpy's std: sqrt(var(x, axis, ddof, keepdims)) (torch's keywords as var)."""
    return sqrt(var(x, axis, ddof, keepdims, **torch_kw))


def stack(xs, axis=0, *, dim=None):
    """numpy/torch stack: the inputs (one shape) along a new axis."""
    axis = axis if dim is None else dim
    xs = [lift(x) for x in xs]
    if not xs:
        raise TraceError(f"stack: no inputs — {user_src()}")
    axis = int(axis) % (xs[0].ndim + 1)
    return concatenate([reshape(x, x.shape[:axis] + (1,) + x.shape[axis:]) for x in xs], axis)


def roll(x, shift, axis):
    """numpy/torch roll along one axis: element i moves to (i + shift) % n."""
    x = lift(x)
    axis = int(axis) % x.ndim
    n = x.shape[axis]
    k = int(shift) % n if n else 0
    if k == 0:
        return x
    pre = (slice(None),) * axis
    return concatenate([getitem(x, pre + (slice(n - k, n),)), getitem(x, pre + (slice(0, n - k),))], axis)


def _np_take(a, idx, axis=None):
    """np.take: axis=None indexes the flattened array (as numpy does), axis=0 gathers rows."""
    a = lift(a)
    if axis is None:
        return take(reshape(a, (a.size,)), idx)
    if axis % builtins.max(a.ndim, 1) != 0:
        raise TraceError(f"np.take: only axis=0 or axis=None is supported (got axis={axis}) — {user_src()}")
    return take(a, idx)




def amin(x, axis=None, keepdims=False):
    """numpy's min: -max(-x) (the gradient goes to the first smallest element, as max's to the first largest)."""
    return -max(-lift(x), axis, keepdims)


def sign(x):
    """numpy's sign: 1, 0 or -1 (zero gradient, as torch)."""
    x = lift(x)
    return emit("sign", (x,)) if x.node.dtype != "i32" else _binop("gt", x, 0.0) - _binop("lt", x, 0.0)


def expand_dims(x, axis):
    x = lift(x)
    axes = sorted(a % (x.ndim + len(axis)) for a in axis) if isinstance(axis, (tuple, list)) else \
        [axis % (x.ndim + 1)]
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return reshape(x, tuple(shape))


def squeeze(x, axis=None, *, dim=None):
    """numpy's squeeze (torch's with dim): drop the given axes of size 1 (all of them for None)."""
    x, axis = lift(x), axis if dim is None else dim
    axes = [i for i, d in enumerate(x.shape) if d == 1] if axis is None else _norm_axes(axis, x.ndim, "squeeze")
    if any(x.shape[a] != 1 for a in axes):
        raise TraceError(f"squeeze: axis {list(axes)} of shape {x.shape} is not of size 1 — {user_src()}")
    return reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def flatten(x, start_dim=0, end_dim=-1):
    """numpy's x.flatten() (everything) and torch's x.flatten(start_dim, end_dim) / torch.flatten: dims start_dim ..
    end_dim merged into one (btjit.flatten's default start_dim is 1, as torch.nn.Flatten)."""
    x = lift(x)
    n = builtins.max(x.ndim, 1)
    lo, hi = start_dim % n, end_dim % n
    if lo > hi:
        raise TraceError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} (input shapes {x.shape}) — "
                         f"{user_src()}")
    return reshape(x, x.shape[:lo] + (int(np.prod(x.shape[lo:hi + 1], dtype=np.int64)),) + x.shape[hi + 1:])


def dot(a, b):
    """numpy's dot for operands of at most 2 dims (a matrix or vector product; a scalar multiplies)."""
    a, b = lift(a), lift(b)
    if a.ndim == 0 or b.ndim == 0:
        return a * b
    if a.ndim > 2 or b.ndim > 2:
        raise TraceError(f"dot: operands of at most 2 dims, got {a.shape} and {b.shape}; use matmul — {user_src()}")
    return matmul(a, b)


def outer(a, b):
    """np.outer / torch.outer: a flattened as a column times b flattened as a row (an integer array meeting floats
    becomes floats: llama's RoPE frequencies `torch.outer(t, freqs)`)."""
    a, b = lift(a), lift(b)
    if (a.node.dtype == "i32") != (b.node.dtype == "i32"):
        a, b = a.float(), b.float()
    return reshape(a, (a.size, 1)) * reshape(b, (1, b.size))


def vector_norm(x, ord=None, axis=None, keepdims=False):  # noqa: A002
    """The vector norm along `axis` (of everything for None, as torch's x.norm(p) and np.linalg.vector_norm): the
    2-norm (ord None, 2, "fro"), inf / -inf (the largest / smallest magnitude), 0 (the nonzero count) or any other
    p: sum(|x| ** p) ** (1 / p). np.linalg.norm's matrix norms are btjit/graph/numpy_more.py's."""
    x = lift(x)
    if ord in (None, 2, "fro"):
        return sqrt(sum(x * x, axis, keepdims))
    if isinstance(ord, str) or not np.isscalar(ord) or np.isnan(ord):
        raise TraceError(f"norm: ord={ord!r} of a vector must be a number (or None, 'fro') — {user_src()}")
    if ord == 1:
        return sum(abs(x), axis, keepdims)
    if ord in (np.inf, -np.inf):
        return max(abs(x), axis, keepdims) if ord > 0 else amin(abs(x), axis, keepdims)
    if ord == 0:
        return sum(_binop("ne", x, 0.0), axis, keepdims)
    return sum(abs(x) ** float(ord), axis, keepdims) ** (1.0 / float(ord))


norm = vector_norm


def repeat(x, repeats, axis=None):
    """numpy's repeat with one count: each element `repeats` times along `axis` (of the flattened x for None)."""
    x = lift(x)
    if axis is None:
        x, axis = reshape(x, (x.size,)), 0
    if not -x.ndim <= axis < x.ndim:
        raise TraceError(f"repeat: axis {axis} out of range for a {x.ndim}-d value (numpy's x.repeat(n, axis); "
                         f"torch's x.repeat(*sizes) is np.tile(x, sizes)) — {user_src()}")
    ax = axis % x.ndim
    r = int(repeats)
    head, tail = x.shape[:ax + 1], x.shape[ax + 1:]
    wide = broadcast_to(reshape(x, head + (1,) + tail), head + (r,) + tail)
    return reshape(wide, x.shape[:ax] + (x.shape[ax] * r,) + tail)


def tile(x, reps):
    """numpy's tile: x repeated reps[i] times along axis i (reps aligned to the last axes)."""
    x = lift(x)
    reps = (int(reps),) if isinstance(reps, (int, np.integer)) else tuple(int(r) for r in reps)
    n = builtins.max(len(reps), x.ndim)
    reps, shape = (1,) * (n - len(reps)) + reps, (1,) * (n - x.ndim) + x.shape
    pairs = reshape(x, tuple(d for s in shape for d in (1, s)))
    wide = broadcast_to(pairs, tuple(d for r, s in zip(reps, shape) for d in (r, s)))
    return reshape(wide, tuple(r * s for r, s in zip(reps, shape)))


def chunk(x, chunks, dim=0):
    """torch's chunk: pieces of ceil(n / chunks) along dim (the last one smaller)."""
    x = lift(x)
    return torch_split(x, -(-x.shape[dim % x.ndim] // int(chunks)), dim)


def torch_split(x, split_size_or_sections, dim=0):
    """torch's x.split: pieces of split_size along dim (the last one smaller), or of the listed sizes."""
    x = lift(x)
    n = x.shape[dim % x.ndim]
    s = split_size_or_sections
    sizes = [int(v) for v in s] if isinstance(s, (list, tuple)) else [builtins.min(int(s), n - lo)
                                                                     for lo in range(0, n, int(s))]
    if builtins.sum(sizes) != n:
        raise TraceError(f"split: sizes {sizes} must add up to {n}, the size of dim {dim} — {user_src()}")
    return split(x, list(np.cumsum(sizes)[:-1]), dim % x.ndim)


def argmax(x, axis=None, keepdims=False):
    """numpy's argmax as a float (the first largest element's index along axis, of the flattened x for None): an
    accuracy written as (logits.argmax(-1) == y).mean(). No gradient, as in numpy and torch."""
    x = lift(x)
    if axis is None:
        x, axis = reshape(x, (x.size,)), 0
    ax = axis % x.ndim
    n = x.shape[ax]
    pos = np.arange(n, dtype=np.float64).reshape([n if i == ax else 1 for i in range(x.ndim)])
    return amin(where(equal(x, max(x, ax, True)), pos, float(n)), ax, keepdims)


def argmin(x, axis=None, keepdims=False):
    """numpy's argmin, as argmax's float indices."""
    return argmax(-lift(x), axis, keepdims)


def take_along_axis(x, indices, axis):
    """numpy's take_along_axis (torch's x.gather(dim, index)): x's elements at `indices` along axis, the other
    axes paired by position (-take_along_axis(logp, y[:, None], 1) picks each row's label)."""
    x = lift(x)
    ax = axis % x.ndim
    if np.ndim(indices) != x.ndim if not isinstance(indices, Tracer) else indices.ndim != x.ndim:
        raise TraceError(f"take_along_axis: indices need x's {x.ndim} dims — {user_src()}")
    return getitem(x, tuple(indices if d == ax else np.arange(x.shape[d]).reshape(
        [-1 if e == d else 1 for e in range(x.ndim)]) for d in range(x.ndim)))


def prod(x, axis=None, keepdims=False):
    """numpy's prod: the slices along axis multiplied in turn (the gradient by the product rule)."""
    x = lift(x)
    if axis is None:
        x, axis = reshape(x, (x.size,)), 0
    ax = axis % x.ndim
    if x.shape[ax] > 256:
        raise TraceError(f"prod: {x.shape[ax]} factors along axis {ax}; at most 256 — {user_src()}")
    out = None
    for i in range(x.shape[ax]):
        s = getitem(x, (slice(None),) * ax + (slice(i, i + 1),))
        out = s if out is None else out * s
    return out if keepdims else reshape(out, x.shape[:ax] + x.shape[ax + 1:])


def moveaxis(x, source, destination):
    """numpy's moveaxis (torch's movedim): axes `source` moved to `destination`, the others in order."""
    x = lift(x)
    src, dst = ([_norm_axes(a, x.ndim, "moveaxis")[0] for a in np.atleast_1d(v)] for v in (source, destination))
    if len(src) != len(dst) or len(set(src)) < len(src) or len(set(dst)) < len(dst):
        raise TraceError(f"moveaxis: source {source} and destination {destination} must be as many distinct axes "
                         f"— {user_src()}")
    perm = [a for a in range(x.ndim) if a not in src]
    for d, s in sorted(zip(dst, src)):
        perm.insert(d, s)
    return transpose(x, perm)


def flip(x, axis=None, *, dims=None):
    """numpy's flip (torch's flip(dims)): the order reversed along the axes (all for None)."""
    x, axis = lift(x), axis if dims is None else dims
    axes = range(x.ndim) if axis is None else [a % x.ndim for a in (axis if isinstance(axis, (tuple, list))
                                                                       else (axis,))]
    return getitem(x, tuple(slice(None, None, -1) if a in axes else slice(None) for a in range(x.ndim)))


class ValuesIndices(tuple):
    """torch's x.max(dim=) / x.min(dim=): (values, indices), the indices as floats (see argmax)."""
    values = property(lambda self: self[0])
    indices = property(lambda self: self[1])


class Extremum(Tracer):
    """numpy's x.max(axis) / x.min(axis) (the values), with torch's `.values` and `.indices` beside."""
    __slots__ = ("_of",)

    def __init__(self, t, of):
        super().__init__(t.node, t.graph)
        self._of = of
    values = property(lambda self: Tracer(self.node, self.graph))
    indices = property(lambda self: argmax(*self._of))

    def __getitem__(self, idx):
        if type(idx) in (int, np.int64) and idx in (0, 1):
            import warnings
            warnings.warn(f"x.max(axis)[{idx}] / x.min(axis)[{idx}] is numpy's: element {idx} of the maxima (minima); "
                          f"torch's (values, indices) pair is x.max(dim=axis)[{idx}], or x.max(axis).values / "
                          f".indices — {user_src()}", stacklevel=2)
        return super().__getitem__(idx)


def max_dim(x, axis, keepdims=False, sign=1.0, torch=False):
    """x.max / x.min (sign -1): numpy's values, or with torch's dim= / keepdim= (values, indices)."""
    xs = lift(x) if sign == 1.0 else -lift(x)
    if torch:           # the value at the index: its gradient goes to that element alone, as torch's (amax splits)
        ax = axis % xs.ndim
        ik, n = argmax(xs, ax, True), xs.shape[ax]
        pos = np.arange(n, dtype=np.float64).reshape([n if i == ax else 1 for i in range(xs.ndim)])
        v = sum(where(equal(ik, pos), xs, 0.0), ax, True)
        v = v if sign == 1.0 else -v
        return ValuesIndices((v, ik) if keepdims else (squeeze(v, ax), squeeze(ik, ax)))
    v = max(xs, axis, keepdims) if sign == 1.0 else -max(xs, axis, keepdims)
    return Extremum(v, (xs, axis, keepdims)) if isinstance(axis, (int, np.integer)) else v


def extremum(sign):
    """btjit.max (sign 1) / btjit.min (sign -1), as x.max / x.min."""
    def fn(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
        return max_dim(x, axis if dim is None else dim, keepdims if keepdim is None else keepdim, sign,
                       dim is not None or keepdim is not None)
    fn.__name__ = name = ("max", "min")[sign < 0]
    fn.__doc__ = (f"numpy's {name} over axis (with torch's `.values` and `.indices` beside); with torch's dim= / "
                  f"keepdim=, torch's (values, indices). The gradient goes to the first extreme element.")
    return fn


def _torch_dims(fn):
    """fn(x, axis, keepdims) taking numpy's (axis, keepdims) or torch's (dim, keepdim) names (methods, btjit.*)."""
    @functools.wraps(fn)
    def named(x, axis=None, keepdims=False, *, dim=None, keepdim=None):
        return fn(x, axis if dim is None else dim, keepdims if keepdim is None else keepdim)
    return named


def full_like(x, fill_value):
    """numpy's full_like (zeros_like, ones_like): a constant of x's shape, broadcast from one value."""
    x = lift(x)
    return broadcast_to(lift(float(fill_value), x), x.shape)


def _shape_args(shape):
    return shape[0] if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape


UFUNCS.update({
    "add": lambda x, y: _binop("add", x, y), "subtract": lambda x, y: _binop("sub", x, y),
    "multiply": lambda x, y: _binop("mul", x, y), "divide": lambda x, y: _binop("div", x, y),
    "true_divide": lambda x, y: _binop("div", x, y), "negative": lambda x: emit("neg", (lift(x),)),
    "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt, "absolute": abs, "maximum": maximum, "erf": erf,
    "log1p": log1p, "minimum": minimum, "matmul": matmul, "power": lambda x, y: lift(x) ** y,
    "square": lambda x: lift(x) * lift(x), "sign": sign, "reciprocal": lambda x: 1.0 / lift(x),
    "expm1": lambda x: exp(x) - 1.0, "log2": lambda x: log(x) * float(1 / np.log(2)),
    "log10": lambda x: log(x) * float(1 / np.log(10)),
    "equal": equal, "greater": lambda x, y: _binop("gt", x, y), "less": lambda x, y: _binop("lt", x, y),
    "not_equal": lambda x, y: _binop("ne", x, y), "greater_equal": lambda x, y: _binop("ge", x, y),
    "less_equal": lambda x, y: _binop("le", x, y), "sin": sin, "cos": cos,
    **{f"{k}_{how}": lambda x, y=None, how=how: logical(how, x, y) for k in ("logical", "bitwise")
       for how in ("and", "or", "xor")},
    "logical_not": lambda x: logical("not", x), "invert": lambda x: logical("not", x),
    "isnan": lambda x: _binop("ne", x, x), "isinf": lambda x: _binop("eq", abs(x), np.inf),
    "isfinite": lambda x: _binop("lt", abs(x), np.inf)})
FUNCS.update({
    "sum": sum, "mean": mean, "max": max, "amax": max, "min": amin, "amin": amin, "reshape": reshape,
    "transpose": transpose, "swapaxes": swapaxes, "concatenate": concatenate, "split": split, "where": where,
    "matmul": matmul, "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt, "maximum": maximum,
    "broadcast_to": broadcast_to, "take": lambda a, idx, axis=None: _np_take(a, idx, axis), "stack": stack,
    "roll": roll, "clip": lambda a, a_min=None, a_max=None, min=None, max=None: clip(  # noqa: A002
        a, min if a_min is None else a_min, max if a_max is None else a_max),
    "var": var, "std": std, "log1p": log1p, "expand_dims": expand_dims, "squeeze": squeeze, "dot": dot,
    "outer": outer, "norm": norm, "repeat": repeat, "tile": tile, "ravel": lambda a: flatten(a),
    "full_like": full_like, "copy": copy, "argmax": argmax,
    "argmin": argmin, "prod": prod,
    "flip": flip, "take_along_axis": take_along_axis, "moveaxis": moveaxis, "sin": sin, "cos": cos,
    "vstack": lambda tup: concatenate([reshape(t, (1, -1)) if lift(t).ndim < 2 else t for t in tup], 0),
    "hstack": lambda tup: concatenate(tup, 0 if lift(tup[0]).ndim == 1 else 1)})
METHODS.update({
    # numpy's
    "var": var, "std": std, "clip": lambda x, min=None, max=None: clip(x, min, max),  # noqa: A002
    "min": extremum(-1.0), "max_dim": max_dim,
    "squeeze": squeeze, "flatten": flatten, "ravel": flatten, "dot": dot, "repeat": repeat,
    "copy": copy, "argmax": _torch_dims(argmax), "argmin": _torch_dims(argmin),
    "prod": _torch_dims(prod),
    # torch's (beside x.relu(), x.sigmoid(), ... on the Tracer class itself)
    "square": lambda x: x * x, "sign": sign, "pow": lambda x, p: x ** p, "clone": copy, "detach": stop_gradient,
    "amax": _torch_dims(max), "amin": _torch_dims(amin),
    "flip": lambda x, *dims, **kw: flip(x, _shape_args(dims) if dims else kw.get("dims")),
    "norm": lambda x, p=2, dim=None, keepdim=False: vector_norm(x, p, dim, keepdim),
    "gather": lambda x, dim, index: take_along_axis(x, index, dim),
    "clamp": lambda x, min=None, max=None: clip(x, min, max),  # noqa: A002
    "view": lambda x, *shape: reshape(x, _shape_args(shape)),
    "permute": lambda x, *dims: transpose(x, _shape_args(dims)),
    "unsqueeze": lambda x, dim: expand_dims(x, dim), "contiguous": lambda x: x, "t": lambda x: transpose(x),
    "masked_fill": lambda x, mask, value: where(mask, value, x), "chunk": chunk, "split": torch_split,
    "softmax": lambda x, dim=-1: softmax(x, dim), "log_softmax": lambda x, dim=-1: log_softmax(x, dim),
    "movedim": moveaxis, "numel": lambda x: x.node.size,
    "expand_as": lambda x, other: broadcast_to(x, other.shape), "clamp_min": lambda x, m: clip(x, m),
    "clamp_max": lambda x, m: clip(x, None, m), "type_as": lambda x, other: x.astype(other.dtype)})
