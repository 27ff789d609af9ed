"""Tracing: tracer objects with numpy-like operators that record equations into a Graph.

`Tracer` wraps a Var of the graph being built. Every operation goes through `emit()` (btjit/graph/tracer.py, the
recording core, re-exported here). The numpy-like tensor functions (btjit.exp, btjit.matmul, btjit.reshape, ...)
live here too, and the VJP rules in graph/ops/ are written with them, so backward equations come from the same
place; the neural-network functions are in btjit/graph/functional.py.
"""
from __future__ import annotations

import builtins

import numpy as np

from btjit.graph import tracer as _core
from btjit.graph.tracer import (TraceError, _norm_axes, building, current_graph, emit, lift,  # noqa: F401
                                source, user_src)

# numpy's functions on traced values (__array_function__ / __array_ufunc__, by name) and the methods found by
# Tracer.__getattr__: filled by btjit/graph/numpy_fns.py, which composes them of this module's primitives, and
# indexing (x[idx], x[idx] = v) by btjit/graph/indexing.py.
FUNCS: dict = {}
UFUNCS: dict = {}
METHODS: dict = {}
IN_PLACE: dict = {}        # torch's in-place methods without an out-of-place name (x.zero_(), x.uniform_(), ...)


def _binop(op, x, y, **attrs):
    x = lift(x, y if isinstance(y, Tracer) else None)
    y = lift(y, x)
    if op in ("eq", "ne", "gt", "ge", "lt", "le") and (x.node.dtype == "i32") != (y.node.dtype == "i32"):
        x, y = (emit("to_float", (v,)) if v.node.dtype == "i32" else v for v in (x, y))    # labels vs argmax
    return emit(op, (x, y), **attrs)


class _Size(int):
    """numpy's x.size (the element count, an int) that torch's x.size() / x.size(dim) can call (the shape)."""

    def __new__(cls, n, shape):
        s = super().__new__(cls, n)
        s.shape = shape
        return s

    def __call__(self, dim=None):
        return self.shape if dim is None else self.shape[dim]


class Tracer:
    """A traced array value. Supports numpy-style operators, methods and many numpy functions."""
    __slots__ = ("node", "graph")
    __array_priority__ = 1000

    def __init__(self, var, graph):
        self.node, self.graph = var, graph

    shape = property(lambda self: self.node.shape)
    ndim = property(lambda self: len(self.node.shape))
    size = property(lambda self: _Size(self.node.size, self.node.shape))
    dtype = property(lambda self: np.dtype({"f32": np.float32, "f64": np.float64, "i32": np.int32}[self.node.dtype]))
    T = property(lambda self: transpose(self))
    mT = property(lambda self: swapaxes(self, -1, -2))      # torch's: the last two axes swapped
    device = property(lambda self: "cpu")                   # torch's x.device (torch.rand(..., device=x.device))

    def __repr__(self):
        return f"Tracer({self.node!r}: {self.node.type_str})"

    def __len__(self):
        if not self.shape:
            raise TraceError(f"len() of a 0-d traced value — {user_src()}")
        return self.shape[0]

    # -- arithmetic
    __add__ = lambda s, o: _binop("add", s, o)
    __radd__ = lambda s, o: _binop("add", o, s)
    __sub__ = lambda s, o: _binop("sub", s, o)
    __rsub__ = lambda s, o: _binop("sub", o, s)
    __mul__ = lambda s, o: _binop("mul", s, o)
    __rmul__ = lambda s, o: _binop("mul", o, s)
    __truediv__ = lambda s, o: _binop("div", s, o)
    __rtruediv__ = lambda s, o: _binop("div", o, s)
    __mod__ = lambda s, o: METHODS["remainder"](s, o)      # these six: btjit/graph/sort_fns.py
    __rmod__ = lambda s, o: METHODS["remainder"](o, s)
    __floordiv__ = lambda s, o: METHODS["floor_divide"](s, o)
    __rfloordiv__ = lambda s, o: METHODS["floor_divide"](o, s)
    __floor__ = lambda s: METHODS["floor"](s)             # math.floor(x), math.ceil(x), math.trunc(x), round(x)
    __ceil__ = lambda s: METHODS["ceil"](s)
    __trunc__ = lambda s: METHODS["trunc"](s)
    __round__ = lambda s, n=None: METHODS["round"](s, n or 0)
    __matmul__ = lambda s, o: matmul(s, o)
    __rmatmul__ = lambda s, o: matmul(o, s)
    __neg__ = lambda s: emit("neg", (s,))
    __pos__ = lambda s: s
    __abs__ = lambda s: emit("abs", (s,))
    __eq__ = lambda s, o: _binop("eq", s, o)      # a 0/1 mask, as numpy's bool array (for btjit.where)
    __ne__ = lambda s, o: _binop("ne", s, o)
    __hash__ = object.__hash__
    __gt__ = lambda s, o: _binop("gt", s, o)
    __ge__ = lambda s, o: _binop("ge", s, o)
    __lt__ = lambda s, o: _binop("lt", s, o)
    __le__ = lambda s, o: _binop("le", s, o)

    def __pow__(self, p):
        if isinstance(p, np.ndarray) and p.ndim == 0:
            p = p.item()
        if isinstance(p, (Tracer, np.ndarray, list)):      # an array exponent, as numpy allows
            return _binop("pow2", self, p)
        if not isinstance(p, (int, float, np.number)):
            raise TraceError(f"pow: exponent must be a number or a traced value — {user_src()}")
        p = float(p)
        if p == 0.0:                    # 1 everywhere (0 ** 0, nan ** 0 too), gradient 0 (p * x ** -1 is NaN at 0)
            return broadcast_to(lift(1.0, self), self.shape)
        if p == 1.0:
            return self
        if p == 2.0:
            return self * self
        if p == 3.0:                    # products: exact, vectorized, and ~20x faster than a pow() call
            return self * self * self
        if p == 4.0:
            sq = self * self
            return sq * sq
        return emit("pow", (self,), p=p)

    def __rpow__(self, b):
        return _binop("pow2", b, self)

    # -- masks (0/1 values, as comparisons make them): numpy's bool operators, as logical ones
    __and__ = __rand__ = lambda s, o: logical("and", s, o)
    __or__ = __ror__ = lambda s, o: logical("or", s, o)
    __xor__ = __rxor__ = lambda s, o: logical("xor", s, o)
    __invert__ = lambda s: logical("not", s)

    # -- control flow on traced values is not traceable
    def _no_concrete(self, what, instead="use btjit.where or compute it outside the traced function"):
        raise TraceError(f"{what} of a traced value: the value is not known while tracing (data-dependent "
                         f"control flow); {instead} — {user_src()}")

    __bool__ = lambda s: s._no_concrete(
        "bool() (an if, while, and, or, not, or Python's max() / min())",
        "use np.where(cond, a, b) (btjit.where), np.maximum / np.minimum, & | ~ on masks")
    __float__ = lambda s: s._no_concrete(
        "float() (or a math.* function such as math.sqrt)",
        "use the value itself, numpy's functions (np.sqrt, np.exp, x ** y) and btjit.where")

    __divmod__ = lambda s, o: (s // o, s % o)
    __rdivmod__ = lambda s, o: (o // s, o % s)
    __int__ = lambda s: s._no_concrete("int()")
    __index__ = lambda s: s._no_concrete("int()")
    item = lambda s, *a: s._no_concrete(".item()")
    tolist = lambda s: s._no_concrete(".tolist()")

    def __array__(self, *a, **k):
        raise TraceError(f"a traced value cannot be converted to a numpy array (np.asarray or an unsupported "
                         f"numpy function) — {user_src()}")

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    # -- numpy protocols
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = UFUNCS.get(ufunc.__name__)
        if method != "__call__" or fn is None or kwargs:
            raise TraceError(f"numpy function np.{ufunc.__name__} is not supported on traced values — {user_src()}")
        return fn(*inputs)

    def __array_function__(self, func, types, args, kwargs):
        fn = FUNCS.get(func.__name__)
        if fn is None:
            raise TraceError(f"numpy function np.{func.__name__} is not supported on traced values — {user_src()}")
        return fn(*args, **kwargs)

    def __getattr__(self, name):
        """The methods btjit/graph/numpy_fns.py registers (METHODS: x.var(0), x.min(1), x.view(B, T, C), ...), and
        torch's in-place forms of them and of the class's own (x.mul_(g), x.div_(p), x.clamp_(0, 1), x.relu_()):
        this tracer then holds the result, as after x[idx] = v (other tracers of the old value keep it)."""
        fn = METHODS.get(name)
        if name.endswith("_") and not name.startswith("_"):
            base = name[:-1]
            fn = IN_PLACE.get(name) or ((lambda s, *a, **k: getattr(s, base)(*a, **k))
                                        if base in METHODS or callable(getattr(Tracer, base, None)) else None)
            if fn is not None:
                return lambda *a, **k: self._in_place(name, fn(self, *a, **k))
        if fn is None:
            if name.startswith("__"):
                raise AttributeError(name)
            raise AttributeError(f"traced values have no attribute {name!r}: not one of the numpy or torch methods "
                                 f"btjit has (docs/guide.md) — {user_src()}")
        return lambda *a, **k: fn(self, *a, **k)

    def _in_place(self, name, out):
        out = lift(out, self)
        if out.shape != self.shape:
            raise TraceError(f"{name}: an in-place op keeps the shape {self.shape}, its result is {out.shape} "
                             f"(use the out-of-place form) — {user_src()}")
        self.node = out.node
        return self

    # -- methods
    def sum(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        return sum(self, axis if dim is None else dim, keepdims if keepdim is None else keepdim)

    def mean(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        return mean(self, axis if dim is None else dim, keepdims if keepdim is None else keepdim)

    def max(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        return METHODS["max_dim"](self, axis if dim is None else dim, keepdims if keepdim is None else keepdim,
                                  torch=dim is not None or keepdim is not None)

    def reshape(self, *shape):
        return reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def transpose(self, *axes):
        if len(axes) == 2 and all(isinstance(a, (int, np.integer)) for a in axes) and \
                all(-self.ndim <= a < self.ndim for a in axes) and axes[0] % self.ndim != axes[1] % self.ndim:
            return swapaxes(self, *axes)    # torch's x.transpose(0, 1): two axes swapped (numpy's would be a no-op)
        return transpose(self, axes[0] if len(axes) == 1 and not isinstance(axes[0], int) else (axes or None))

    def swapaxes(self, a1, a2):
        return swapaxes(self, a1, a2)

    # torch-style methods (micrograd's x.relu(), torch's x.sigmoid())
    exp = lambda s: exp(s)          # noqa: E731
    log = lambda s: log(s)          # noqa: E731
    tanh = lambda s: tanh(s)        # noqa: E731
    relu = lambda s: relu(s)        # noqa: E731
    sigmoid = lambda s: sigmoid(s)  # noqa: E731
    sqrt = lambda s: sqrt(s)        # noqa: E731
    abs = lambda s: abs(s)          # noqa: E731
    sin = lambda s: sin(s)          # noqa: E731
    cos = lambda s: cos(s)          # noqa: E731

    def __getitem__(self, idx):                 # btjit/graph/indexing.py
        return METHODS["__getitem__"](self, idx)

    def __setitem__(self, idx, value):
        """x[idx] = value, as torch and numpy write it: this tracer then holds the new value (functionally:
        a slice_set equation; other tracers of the old value keep it)."""
        self.node = METHODS["__setitem__"](self, idx, value).node

    def astype(self, dtype):
        """Integer -> the program's float dtype (float32 / float64 / float); float -> float is a no-op."""
        if np.dtype(dtype).kind != "f":
            raise TraceError(f"astype: only conversion to float is supported, got {dtype} — {user_src()}")
        return emit("to_float", (self,)) if self.node.dtype == "i32" else self

    def float(self):
        return self.astype(float)

    def expand(self, *shape):
        """torch's expand: broadcast to shape, -1 keeping a dimension."""
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        lead = len(shape) - self.ndim
        return broadcast_to(self, tuple(self.shape[i - lead] if n == -1 and i >= lead else n
                                        for i, n in enumerate(shape)))


# ----------------------------------------------------------------------------- public tensor functions
def exp(x): return emit("exp", (lift(x),))
def log(x): return emit("log", (lift(x),))
def tanh(x): return emit("tanh", (lift(x),))
def relu(x, inplace=False): return emit("relu", (lift(x),))
def sigmoid(x): return emit("sigmoid", (lift(x),))
def sqrt(x): return emit("sqrt", (lift(x),))
def erf(x): return emit("erf", (lift(x),))
def log1p(x): return emit("log1p", (lift(x),))
def sin(x): return emit("sin", (lift(x),))
def cos(x): return emit("cos", (lift(x),))
def abs(x): return emit("abs", (lift(x),))  # noqa: A001
def maximum(x, y, ties="split"):
    """numpy's / torch's maximum. Its gradient at a tie x == y: half to each input (torch's and jax's rule), all
    of it to x with ties="first" (clamp's rule: the gradient passes where x >= a bound) or to y with ties="second"
    (hardtanh's: where x > the bound)."""
    return _binop("maximum", x, y, **_ties(ties))


def minimum(x, y, ties="split"):
    """numpy's / torch's minimum; ties as in maximum."""
    return _binop("minimum", x, y, **_ties(ties))


def _ties(ties):
    if ties not in ("split", "first", "second"):
        raise TraceError(f"maximum / minimum: ties must be 'split', 'first' or 'second', got {ties!r} — {user_src()}")
    return {} if ties == "split" else {"ties": ties}


def equal(x, y): return _binop("eq", x, y)


def logical(how, x, y=None):
    """numpy's logical_and / or / xor / not (and & | ^ ~ on masks): 1 or 0, nonzero counting as true."""
    xs = [lift(v) for v in ((x,) if y is None else (x, y))]
    if any(v.node.dtype == "i32" for v in xs):
        raise TraceError(f"{how}: & | ^ ~ take masks (comparisons' 0/1 values), not integers — {user_src()}")
    if how == "not":
        return _binop("eq", xs[0], 0.0)
    a, b = (_binop("ne", v, 0.0) for v in xs)
    return a * b if how == "and" else maximum(a, b) if how == "or" else _binop("ne", a, b)


def copy(x): return emit("copy", (lift(x),))
def stop_gradient(x):
    """x, through which no gradient flows (torch's x.detach())."""
    return emit("stop_gradient", (lift(x),))


def where(cond, x, y):
    """Select x where cond is true (nonzero), else y. cond is usually a constant numpy mask."""
    c = lift(np.asarray(cond, dtype=np.float64) if not isinstance(cond, Tracer) else cond)
    if c.node.dtype == "i32":
        raise TraceError(f"where: the condition must be boolean/float, not integer — {user_src()}")
    x = lift(x, y if isinstance(y, Tracer) else None)
    return emit("where", (c, x, lift(y, x)))


def sum(x, axis=None, keepdims=False):  # noqa: A001
    return _reduce("sum", lift(x), axis, keepdims)


def max(x, axis=None, keepdims=False):  # noqa: A001
    return _reduce("max", lift(x), axis, keepdims)


def mean(x, axis=None, keepdims=False):
    x = lift(x)
    axes = _norm_axes(axis, x.ndim, "mean")
    n = int(np.prod([x.shape[a] for a in axes]))
    return _reduce("sum", x, axes, keepdims) * (1.0 / n)


def _reduce(op, x, axis, keepdims):
    axes = _norm_axes(axis, x.ndim, op)
    out = x
    # one equation per run of adjacent axes, last run first so earlier axis numbers stay valid
    runs = []
    for a in axes:
        if runs and runs[-1][1] == a:
            runs[-1][1] = a + 1
        else:
            runs.append([a, a + 1])
    for lo, hi in reversed(runs):
        out = emit(op, (out,), lo=lo, hi=hi)
    if keepdims:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        out = reshape(out, shape)
    return out


def reshape(x, shape):
    x = lift(x)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    if shape.count(-1) == 1:
        known = int(np.prod([d for d in shape if d != -1]))
        shape = tuple(x.size // known if known and d == -1 else d for d in shape)
    if shape == x.shape:
        return x
    return emit("reshape", (x,), shape=shape)


def transpose(x, axes=None):
    x = lift(x)
    if axes is not None and len(axes) == 2 != x.ndim:     # not a permutation: torch's x.transpose(1, 2)
        return swapaxes(x, *axes)
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(int(a) % x.ndim for a in axes)
    if perm == tuple(range(x.ndim)):
        return x
    key = ("transpose", x.node.id, perm)
    if key in x.graph.memo:
        return Tracer(x.graph.memo[key], x.graph)
    out = emit("transpose", (x,), perm=perm)
    x.graph.memo[key] = out.node
    return out


def swapaxes(x, a1, a2):
    x = lift(x)
    perm = list(range(x.ndim))
    a1, a2 = a1 % x.ndim, a2 % x.ndim
    perm[a1], perm[a2] = perm[a2], perm[a1]
    return transpose(x, perm)


def broadcast_to(x, shape):
    x = lift(x)
    shape = tuple(shape)
    return x if x.shape == shape else emit("broadcast_to", (x,), shape=shape)


def matmul(x, y):
    """numpy matmul: 1-D operands are promoted and the added axis removed; batch dims broadcast."""
    x, y = lift(x), lift(y)
    xv, yv = x, y
    if x.ndim == 1:
        xv = reshape(x, (1, x.shape[0]))
    if y.ndim == 1:
        yv = reshape(y, (y.shape[0], 1))
    out = emit("matmul", (xv, yv), ta=False, tb=False)
    if x.ndim == 1 or y.ndim == 1:
        shape = out.shape[:-2] + ((out.shape[-2],) if x.ndim > 1 else ()) + ((out.shape[-1],) if y.ndim > 1 else ())
        out = reshape(out, shape)
    return out


def concatenate(xs, axis=0, *, dim=None):
    axis = axis if dim is None else dim                  # torch.cat's keyword
    xs = [lift(x) for x in xs]
    if not xs:
        raise TraceError(f"concatenate: no inputs — {user_src()}")
    return emit("concatenate", xs, axis=int(axis) % xs[0].ndim if xs[0].ndim else 0)


def split(x, indices_or_sections, axis=0):
    x = lift(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    if isinstance(indices_or_sections, (int, np.integer)):
        k = int(indices_or_sections)
        if n % k:
            raise TraceError(f"split: axis {axis} of size {n} does not divide into {k} sections — {user_src()}")
        cuts = [i * (n // k) for i in range(1, k)]
    else:
        cuts = list(indices_or_sections)
    bounds = [0, *cuts, n]
    if len(bounds) == 2:
        return [x]
    starts, stops = [0] * x.ndim, list(x.shape)
    return [emit("slice", (x,), starts=tuple(starts[:axis] + [lo] + starts[axis + 1:]),
                 stops=tuple(stops[:axis] + [hi] + stops[axis + 1:]), steps=(1,) * x.ndim)
            for lo, hi in zip(bounds, bounds[1:])]


def arange(start, stop=None, step=1, *, dtype=None, device=None, requires_grad=False):
    """An integer constant 0..n-1 (or start..stop by step), e.g. nanoGPT's positions `pos = arange(t)`; torch's
    keywords: `dtype=torch.float32` (any float dtype) gives floats of the program's dtype, `device=` is taken."""
    a = np.arange(start, stop, step) if stop is not None else np.arange(start)
    to_float = dtype is not None and any(f in str(dtype) for f in ("float", "double", "half"))
    if dtype is not None and not to_float and not any(i in str(dtype) for i in ("int", "long")):
        raise TraceError(f"arange: dtype must be an integer or float one, got {dtype!r} — {user_src()}")
    if a.dtype.kind not in "iu" and not to_float:
        raise TraceError(f"arange: integer bounds only (or dtype=float), got {start!r}, {stop!r}, {step!r} — "
                         f"{user_src()}")
    g = current_graph()
    if to_float:
        return Tracer(g.const(a.astype(np.float64), g.float_dtype), g)
    return Tracer(g.const(a.astype(np.int32), "i32"), g)


_core.TRACER.append(Tracer)
