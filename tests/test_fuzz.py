"""Property-based fuzzing of the whole compiler (hypothesis): random graphs built from the op table's
user-facing ops — random shapes, broadcasting, fan-out, reductions with keepdims, reshapes, transposes,
slices, concatenate/split, matmul, softmax, where, take, layer_norm, cross_entropy, attention, long
elementwise chains (fused into one row), take with an index computed from integers (roll, slice, assignment,
stack, transpose) — each
checked three ways in float64:

  1. the compiled forward (loss and every intermediate value) against a direct numpy evaluation of the
     same random program (an independent numpy implementation of each op, below);
  2. the compiled gradient against central finite differences of the compiled forward, element by element;
  3. the native forward+backward against the numpy interpretation of the planned IR (btjit.graph.interp).

Plus a float32 compile of the same program against the float64 result (loose tolerance).

Inputs stay in safe domains: log/sqrt/pow/div get positive (or away-from-zero) operands; relu/abs/max/
maximum/where conditions are used only where every element is at least GAP from a kink or a tie (checked on
the numpy values while the graph is drawn), so finite differences are valid.

CI runs a bounded, derandomized set of examples. To fuzz longer (random seeds, hypothesis's database in
.hypothesis/ replays failures):   BTJIT_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py
Failures found by the fuzzer are kept as explicit regression tests at the end of this file.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import btjit
from btjit.graph import interp

_N_LONG = int(os.environ.get("BTJIT_FUZZ_EXAMPLES", "0") or 0)
FUZZ = settings(max_examples=_N_LONG or 100, deadline=None, derandomize=not _N_LONG, print_blob=True,
                suppress_health_check=list(HealthCheck))

GAP = 1e-3          # minimum distance from a kink / tie, relative to nothing (values are O(1))
MAX_ABS = 1e3       # values beyond this are rejected while drawing (keeps finite differences accurate)
MAX_SIZE = 192      # elements per value


# ----------------------------------------------------------------------------- an independent numpy backend
def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _np_attention(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hs).transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return (_np_softmax(s) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)


class NP:
    """numpy implementations of the btjit tensor API (what a replayed program calls on the numpy side)."""
    exp, log, tanh, sqrt, abs, maximum, minimum = np.exp, np.log, np.tanh, np.sqrt, np.abs, np.maximum, np.minimum
    matmul, concatenate, split, reshape, transpose, swapaxes = (np.matmul, np.concatenate, np.split, np.reshape,
                                                                np.transpose, np.swapaxes)
    broadcast_to = staticmethod(lambda x, s: np.broadcast_to(x, s))
    sum = staticmethod(lambda x, axis=None, keepdims=False: np.sum(x, axis=axis, keepdims=keepdims))
    mean = staticmethod(lambda x, axis=None, keepdims=False: np.mean(x, axis=axis, keepdims=keepdims))
    max = staticmethod(lambda x, axis=None, keepdims=False: np.max(x, axis=axis, keepdims=keepdims))
    sigmoid = staticmethod(lambda x: 1.0 / (1.0 + np.exp(-x)))
    relu = staticmethod(lambda x: np.maximum(x, 0.0))
    gelu = staticmethod(lambda x, approximate: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))))
    where = staticmethod(lambda c, x, y: np.where(np.asarray(c) != 0, x, y))
    softmax = staticmethod(lambda x, axis=-1: _np_softmax(x))
    log_softmax = staticmethod(lambda x, axis=-1: _np_log_softmax(x))
    take = staticmethod(lambda t, i: np.asarray(t)[np.asarray(i)])
    causal_attention = staticmethod(_np_attention)
    roll, stack = staticmethod(np.roll), staticmethod(np.stack)

    @staticmethod
    def layer_norm(x, w, b, eps=1e-5):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w + b

    @staticmethod
    def cross_entropy(logits, t):
        lp = _np_log_softmax(logits).reshape(-1, logits.shape[-1])
        return -lp[np.arange(lp.shape[0]), np.asarray(t).ravel()].mean()


BT = btjit          # the traced side: the same calls on btjit's tensor functions


# ----------------------------------------------------------------------------- random programs
class Builder:
    """Draws a random program step by step. A step is `f(xp, env, P, batch) -> value | [values]`, replayed
    with xp = NP (numpy arrays) or xp = BT (tracers). Each step is evaluated on the numpy side while drawing,
    so domain, kink and size checks see the actual values."""

    def __init__(self, draw):
        self.draw = draw
        self.rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1), label="numpy seed"))
        self.params: dict = {}
        self.batch: list = []
        self.steps: list = []
        self.vals: list = []          # numpy value of each env entry
        self.log: list = []

    # -- drawing helpers
    def i(self, lo, hi, label=None):
        return self.draw(st.integers(lo, hi), label=label)

    def b(self):
        return self.draw(st.booleans())

    def choice(self, xs):
        return xs[self.i(0, len(xs) - 1)]

    def shape(self, max_rank=3):
        return tuple(self.i(1, 4) for _ in range(self.i(0, max_rank)))

    def new_param(self, shape):
        name = f"p{len(self.params)}"
        self.params[name] = self.rng.normal(size=shape)
        return self.add(lambda xp, env, P, B, n=name: P[n], f"{name} = param{tuple(shape)}", force=True, kind="param")

    def const(self, shape):
        return self.rng.normal(size=shape)

    def int_index(self, shape, hi, allow_negative=True):
        lo = -hi if allow_negative else 0
        idx = self.rng.integers(lo, hi, size=shape).astype(np.int32)
        if self.b():             # as a batch input (an int32 input of the program) instead of a constant
            idx = idx % hi
            self.batch.append(idx)
            k = len(self.batch) - 1
            return lambda B: B[k]
        return lambda B: idx

    def add(self, f, text, force=False, kind=None):
        """Evaluate f on the numpy side; keep it only if every output is finite, small and not too large."""
        try:
            with np.errstate(all="ignore"):
                out = f(NP, self.vals, self.params, self.batch)
        except (ValueError, IndexError):
            return None
        outs = out if isinstance(out, list) else [out]
        outs = [np.asarray(o, np.float64) for o in outs]
        if not force and any(o.size == 0 or o.size > MAX_SIZE or not np.all(np.isfinite(o)) or
                           np.abs(o).max() > MAX_ABS for o in outs):
            return None
        first = len(self.vals)
        event(kind or f.__qualname__.split(".")[0])
        self.steps.append(f)
        self.vals.extend(outs)
        self.log.append(f"v{first}{'..' + str(len(self.vals) - 1) if len(outs) > 1 else ''} = {text}")
        return first

    def pick(self, pred=lambda v: True):
        """A value satisfying pred; the newest first (hypothesis shrinks towards 0: deep chains)."""
        ok = [k for k, v in enumerate(self.vals) if pred(v)][::-1]
        return self.choice(ok) if ok else None

    def broadcast_partner(self, shape):
        """A shape that broadcasts with `shape`: trailing dims kept or set to 1, leading dims maybe added."""
        s = [1 if self.b() and self.b() else d for d in shape]
        if self.b():
            s = s[self.i(0, len(s)):]              # fewer leading dims
        elif self.i(0, 2) == 0 and len(s) < 4:
            s = [self.i(1, 3)] + s                 # an extra leading dim
        return tuple(s)

    def operand(self, like_shape):
        """Another operand for a binary op: a pool value that broadcasts, a new param, a numpy constant or a
        Python float. Returns (getter, numpy value)."""
        kind = self.i(0, 3)
        if kind == 0:
            k = self.pick(lambda v: _broadcasts(v.shape, like_shape))
            if k is not None:
                return (lambda xp, env, P, B, k=k: env[k]), self.vals[k]
        if kind == 1:
            c = float(np.round(self.rng.normal(), 3))
            return (lambda xp, env, P, B, c=c: c), np.float64(c)
        shape = self.broadcast_partner(like_shape)
        if kind == 2:
            c = self.const(shape)
            return (lambda xp, env, P, B, c=c: c), c
        k = self.new_param(shape)
        return (lambda xp, env, P, B, k=k: env[k]), self.vals[k]


def _broadcasts(a, b):
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def _positive(bld, k):
    """A getter for a strictly positive version of value k: itself if already >= 0.2, else x*x + 0.5."""
    if bld.vals[k].min() >= 0.2:
        return lambda env: env[k]
    return lambda env: env[k] * env[k] + 0.5


# each op builder appends zero or more steps; None = not applicable now
def op_unary(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    name = bld.choice(["neg", "exp", "log", "sqrt", "tanh", "sigmoid", "gelu", "relu", "abs", "pow", "rpow",
                       "copy", "np.exp", "np.tanh", "np.sqrt", "np.log", "abs()"])
    if name in ("relu", "abs", "abs()") and np.abs(x).min() < GAP:
        return None
    if name in ("exp", "np.exp") and x.max() > 4:
        return None
    if name in ("log", "sqrt", "np.sqrt", "np.log"):
        pos = _positive(bld, k)
        fn = {"log": lambda xp, v: xp.log(v), "sqrt": lambda xp, v: xp.sqrt(v),
              "np.sqrt": lambda xp, v: np.sqrt(v), "np.log": lambda xp, v: np.log(v)}[name]
        return bld.add(lambda xp, env, P, B: fn(xp, pos(env)), f"{name}(positive(v{k}))", kind=name)
    if name == "pow":
        p = bld.choice([3.0, 2.0, 1.0, 0.5, -1.5, -1.0])
        if p in (0.5, -1.5):
            pos = _positive(bld, k)
            return bld.add(lambda xp, env, P, B: pos(env) ** p, f"positive(v{k}) ** {p}", kind="pow")
        if p < 0 and np.abs(x).min() < 0.3:
            return None
        return bld.add(lambda xp, env, P, B: env[k] ** p, f"v{k} ** {p}", kind="pow")
    if name == "rpow":                     # constant base ** traced exponent (pow2 with a constant)
        if x.max() > 4:
            return None
        base = bld.choice([2.0, 0.5, 3.0])
        return bld.add(lambda xp, env, P, B: base ** env[k], f"{base} ** v{k}", kind="rpow")
    fns = {"neg": lambda xp, v: -v, "exp": lambda xp, v: xp.exp(v), "tanh": lambda xp, v: xp.tanh(v),
           "sigmoid": lambda xp, v: xp.sigmoid(v), "gelu": lambda xp, v: xp.gelu(v, approximate="tanh"),
           "relu": lambda xp, v: xp.relu(v), "abs": lambda xp, v: xp.abs(v), "abs()": lambda xp, v: abs(v),
           "copy": lambda xp, v: (btjit.copy(v) if xp is BT else v.copy()),
           "np.exp": lambda xp, v: np.exp(v), "np.tanh": lambda xp, v: np.tanh(v)}
    fn = fns[name]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k]), f"{name}(v{k})", kind=name)


def op_binary(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    name = bld.choice(["add", "sub", "mul", "div", "maximum", "minimum", "pow2", "np.add", "np.multiply"])
    get, y = bld.operand(x.shape)
    swap = bld.b()
    if name == "div":                      # the denominator is kept away from zero
        den_val = x if swap else y
        if np.abs(den_val).min() < 0.3:
            return None
    if name in ("maximum", "minimum") and np.abs(np.subtract(x, y)).min() < GAP:
        return None
    if name == "pow2":                     # positive traced base ** operand
        if not (np.max(y) < 3 and np.min(y) > -3):
            return None
        pos = _positive(bld, k)
        return bld.add(lambda xp, env, P, B: pos(env) ** get(xp, env, P, B), f"positive(v{k}) ** operand", kind="pow2")
    ops = {"add": lambda xp, a, b: a + b, "sub": lambda xp, a, b: a - b, "mul": lambda xp, a, b: a * b,
           "div": lambda xp, a, b: a / b, "maximum": lambda xp, a, b: xp.maximum(a, b),
           "minimum": lambda xp, a, b: xp.minimum(a, b), "np.add": lambda xp, a, b: np.add(a, b),
           "np.multiply": lambda xp, a, b: np.multiply(a, b)}
    fn = ops[name]
    if swap:
        return bld.add(lambda xp, env, P, B: fn(xp, get(xp, env, P, B), env[k]), f"{name}(operand, v{k})", kind=name)
    return bld.add(lambda xp, env, P, B: fn(xp, env[k], get(xp, env, P, B)), f"{name}(v{k}, operand)", kind=name)


def _axes(bld, ndim):
    form = bld.i(0, 3)
    if form == 0 or ndim == 0:
        return None
    if form == 1:
        return bld.i(-ndim, ndim - 1)
    axes = sorted({bld.i(0, ndim - 1) for _ in range(bld.i(1, ndim))})
    return tuple(a - ndim if bld.b() else a for a in axes)


def op_reduce(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    name = bld.choice(["sum", "mean", "max", ".sum", ".mean", ".max", "np.sum", "np.mean", "np.max"])
    axis, keep = _axes(bld, x.ndim), bld.b()
    if name.endswith("max"):
        ax = tuple(range(x.ndim)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
        ax = tuple(a % x.ndim for a in ax) if x.ndim else ()
        moved = np.moveaxis(x, ax, tuple(range(x.ndim - len(ax), x.ndim))).reshape(-1, int(np.prod(
            [x.shape[a] for a in ax], dtype=int)))
        if moved.shape[1] >= 2:
            top = np.sort(moved, axis=1)
            if (top[:, -1] - top[:, -2]).min() < GAP:
                return None
    base = name.split(".")[-1]
    if name.startswith("np."):
        fn = lambda xp, v: getattr(np, base)(v, axis=axis, keepdims=keep)  # noqa: E731
    elif name.startswith("."):
        fn = lambda xp, v: getattr(v, base)(axis=axis, keepdims=keep)  # noqa: E731
    else:
        fn = lambda xp, v: getattr(xp, base)(v, axis=axis, keepdims=keep)  # noqa: E731
    return bld.add(lambda xp, env, P, B: fn(xp, env[k]), f"{name}(v{k}, axis={axis}, keepdims={keep})", kind=name)


def _factor(bld, n, max_rank=5):
    """A random factorization of n into at most max_rank dims (some 1s inserted)."""
    dims = []
    while n > 1 and len(dims) < max_rank - 1:
        d = bld.choice([d for d in range(2, n + 1) if n % d == 0])
        dims.append(d)
        n //= d
    dims.append(n)
    for _ in range(bld.i(0, 2)):
        if len(dims) < max_rank:
            dims.insert(bld.i(0, len(dims)), 1)
    return dims


def op_reshape(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    dims = _factor(bld, x.size)
    if int(np.prod(dims)) != x.size:
        return None
    if bld.b() and dims:
        dims[bld.i(0, len(dims) - 1)] = -1
    shape = tuple(dims)
    how = bld.i(0, 2)
    fn = [lambda xp, v: v.reshape(shape), lambda xp, v: xp.reshape(v, shape),
          lambda xp, v: v.reshape(*shape) if shape else v.reshape(())][how]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k]), f"reshape(v{k}, {shape})")


def op_transpose(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 2)
    if k is None:
        return None
    nd = bld.vals[k].ndim
    how = bld.i(0, 3)
    if how == 0:
        return bld.add(lambda xp, env, P, B: env[k].T, f"v{k}.T")
    if how == 1:
        a1, a2 = bld.i(-nd, nd - 1), bld.i(-nd, nd - 1)
        return bld.add(lambda xp, env, P, B: xp.swapaxes(env[k], a1, a2), f"swapaxes(v{k}, {a1}, {a2})")
    perm = tuple(int(p) for p in bld.rng.permutation(nd))
    if how == 2:
        return bld.add(lambda xp, env, P, B: env[k].transpose(perm), f"v{k}.transpose{perm}")
    return bld.add(lambda xp, env, P, B: np.transpose(env[k], perm), f"np.transpose(v{k}, {perm})")


def op_getitem(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    shape = bld.vals[k].shape
    idx = []
    for d in range(bld.i(1, len(shape))):
        n = shape[d]
        kind = bld.i(0, 3)
        if kind == 0:
            idx.append(slice(None))
        elif kind == 1:
            i = bld.i(-n, n - 1)
            idx.append(i)
        else:
            start = bld.i(-n, n - 1) if bld.b() else None
            stop = bld.i(-n, n) if bld.b() else None
            step = bld.i(1, 3) if bld.b() else None
            s = slice(start, stop, step)
            if len(range(*s.indices(n))) == 0:
                return None
            idx.append(s)
        if bld.i(0, 5) == 0:
            idx.append(None)
    if bld.i(0, 3) == 0:
        idx.insert(bld.i(0, len(idx)), Ellipsis)
    idx = tuple(idx)
    return bld.add(lambda xp, env, P, B: env[k][idx], f"v{k}[{idx}]")


def op_concat(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    x = bld.vals[k]
    ax = bld.i(0, x.ndim - 1)
    parts = [lambda xp, env, P, B: env[k]]
    for _ in range(bld.i(1, 2)):
        kind = bld.i(0, 2)
        if kind == 0:                   # fan-out: the same value again
            parts.append(lambda xp, env, P, B: env[k])
        else:
            s = list(x.shape)
            s[ax] = bld.i(1, 3)
            if kind == 1:
                kp = bld.new_param(tuple(s))
                parts.append(lambda xp, env, P, B, kp=kp: env[kp])
            else:
                c = bld.const(tuple(s))
                parts.append(lambda xp, env, P, B, c=c: c)
    order = [int(i) for i in bld.rng.permutation(len(parts))]
    neg = bld.b()
    axis = ax - x.ndim if neg else ax
    return bld.add(lambda xp, env, P, B: xp.concatenate([parts[i](xp, env, P, B) for i in order], axis=axis),
                   f"concatenate(v{k} & {len(parts) - 1} more, axis={axis})")


def op_split(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1 and max(v.shape) >= 2)
    if k is None:
        return None
    x = bld.vals[k]
    ax = bld.choice([a for a in range(x.ndim) if x.shape[a] >= 2])
    n = x.shape[ax]
    if bld.b():
        secs = bld.choice([d for d in range(1, n + 1) if n % d == 0])
    else:
        secs = sorted({bld.i(1, n - 1) for _ in range(bld.i(1, 2))})
    return bld.add(lambda xp, env, P, B: list(xp.split(env[k], secs, axis=ax)), f"split(v{k}, {secs}, axis={ax})")


def op_matmul(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    a = bld.vals[k]
    K = a.shape[-1]
    form = bld.i(0, 4)
    if form == 0:
        bshape = (K,)
    elif form in (1, 2):
        bshape = (K, bld.i(1, 4))
    else:
        bshape = tuple(bld.broadcast_partner(a.shape[:-2]) if a.ndim > 2 else (bld.i(1, 2),)[:bld.i(0, 1)]) + \
            (K, bld.i(1, 3))
    kb = bld.pick(lambda v: v.shape == bshape)
    if kb is None or bld.b():
        kb = bld.new_param(bshape)
    swap = form == 2 and a.ndim >= 2           # (a @ b)^T computed as b^T @ a^T: transposed operands
    if swap:
        return bld.add(lambda xp, env, P, B: xp.swapaxes(env[kb], -1, -2) @ xp.swapaxes(env[k], -1, -2),
                       f"v{kb}^T @ v{k}^T")
    how = bld.i(0, 2)
    fn = [lambda xp, p, q: p @ q, lambda xp, p, q: xp.matmul(p, q), lambda xp, p, q: np.matmul(p, q)][how]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k], env[kb]), f"v{k} @ v{kb}")


def op_softmax(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    name = bld.choice(["softmax", "log_softmax"])
    axis = bld.choice([-1, bld.vals[k].ndim - 1])
    return bld.add(lambda xp, env, P, B: getattr(xp, name)(env[k], axis=axis), f"{name}(v{k})")


def op_where(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    get, y = bld.operand(x.shape)
    if bld.b():                                  # a constant numpy mask
        mshape = bld.broadcast_partner(x.shape)
        mask = bld.rng.random(mshape) < 0.5
        cond = lambda xp, env, P, B: mask  # noqa: E731
        text = f"mask{mshape}"
    else:                                        # a traced comparison c > t (a float 0/1 value when traced)
        kc = bld.pick(lambda v: _broadcasts(v.shape, x.shape))
        c = bld.vals[kc]
        t = float(np.round(bld.rng.normal(0, 0.5), 2))
        if np.abs(c - t).min() < GAP:
            return None
        op = bld.choice([">", "<", ">=", "<="])
        f = {">": lambda a: a > t, "<": lambda a: a < t, ">=": lambda a: a >= t, "<=": lambda a: a <= t}[op]
        cond = lambda xp, env, P, B: f(env[kc])  # noqa: E731
        text = f"v{kc} {op} {t}"
    if bld.b():
        return bld.add(lambda xp, env, P, B: xp.where(cond(xp, env, P, B), env[k], get(xp, env, P, B)),
                       f"where({text}, v{k}, operand)")
    return bld.add(lambda xp, env, P, B: xp.where(cond(xp, env, P, B), get(xp, env, P, B), env[k]),
                   f"where({text}, operand, v{k})")


def op_take(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None or bld.i(0, 2) == 0:
        k = bld.new_param((bld.i(1, 6),) + bld.shape(1))
    rows = bld.vals[k].shape[0]
    ishape = bld.shape(2)
    how = bld.i(0, 4)
    idx = bld.int_index(ishape, rows, allow_negative=how != 3)   # negative ids wrap only in a direct take
    if how == 3 and ishape:                                  # an int array reshaped (a view of the input) before the gather
        flat = lambda B: idx(B).reshape(-1)      # noqa: E731
        fn = lambda xp, t, i: xp.take(t, xp.reshape(i, (-1,)) if xp is BT else i)  # noqa: E731
        return bld.add(lambda xp, env, P, B: fn(xp, env[k], idx(B) if xp is BT else flat(B)),
                       f"take(v{k}, int{ishape}.reshape(-1))")
    if how == 4:                                  # a Python list of ints as the index
        lst = [int(i) for i in bld.rng.integers(-rows, rows, size=bld.i(1, 4))]
        return bld.add(lambda xp, env, P, B: env[k][lst], f"v{k}[{lst}]")
    fn = [lambda xp, t, i: xp.take(t, i), lambda xp, t, i: t[i], lambda xp, t, i: np.take(t, i)][how % 3]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k], idx(B)), f"take(v{k}, int{ishape})")


def op_layer_norm(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1 and v.shape[-1] >= 2)
    if k is None:
        return None
    C = bld.vals[k].shape[-1]
    kw, kb = bld.new_param((C,)), bld.new_param((C,))
    eps = bld.choice([1e-5, 1e-3, 0.1])
    return bld.add(lambda xp, env, P, B: xp.layer_norm(env[k], env[kw], env[kb], eps=eps),
                   f"layer_norm(v{k}, eps={eps})")


def op_cross_entropy(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1 and v.shape[-1] >= 2)
    if k is None:
        return None
    x = bld.vals[k]
    idx = bld.int_index(x.shape[:-1], x.shape[-1], allow_negative=False)
    return bld.add(lambda xp, env, P, B: xp.cross_entropy(env[k], idx(B)), f"cross_entropy(v{k}, targets)")


def op_attention(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    T = bld.choice([d for d in range(1, min(x.size, 5) + 1) if x.size % d == 0])
    nh, hs = bld.i(1, 2), bld.i(1, 2)
    kw = bld.new_param((x.size // T, 3 * nh * hs))
    return bld.add(lambda xp, env, P, B: xp.causal_attention(xp.reshape(env[k], (1, T, -1)) @ env[kw], nh),
                   f"causal_attention(v{k} as (1,{T},.) @ v{kw}, n_head={nh})")


def op_attention_wide(bld: Builder):
    """Attention at the sizes of the kept kernels (T 8-16, head size 6-10): a (1, T, 3 C) param scaled by
    tanh of a value's sum (bounded, so the scores stay where finite differences are accurate; params of at
    most 480 floats, so the element-by-element finite differences stay cheap)."""
    k = bld.pick()
    T, nh, hs = bld.i(8, 16), 1, bld.i(6, 10)
    kw = bld.new_param((1, T, 3 * nh * hs))
    return bld.add(lambda xp, env, P, B: xp.causal_attention(xp.tanh(xp.sum(env[k])) * env[kw], nh),
                   f"causal_attention(tanh(sum(v{k})) * v{kw}, n_head={nh})")


def op_broadcast_to(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    shape = tuple(d if d != 1 else bld.i(1, 3) for d in x.shape)
    if bld.b() and len(shape) < 4:
        shape = (bld.i(1, 3),) + shape
    return bld.add(lambda xp, env, P, B: xp.broadcast_to(env[k], shape), f"broadcast_to(v{k}, {shape})")


CHAIN_STEPS = ("tanh", "sigmoid", "scale", "shift", "square", "where", "max")


def _chain(xp, v, steps):
    for s, c in steps:
        v = {"tanh": lambda: xp.tanh(v), "sigmoid": lambda: xp.sigmoid(v), "scale": lambda: v * c,
             "shift": lambda: v + c, "square": lambda: v * v * 0.5, "where": lambda: xp.where(v > c, v, v * 0.25),
             "max": lambda: xp.maximum(v, c)}[s]()
    return v


def op_chain(bld: Builder):
    """A long elementwise chain on one value (one fused row forward, one backward); the kinks of where and
    maximum are kept GAP away from every intermediate value."""
    k = bld.pick()
    v, steps = bld.vals[k], []
    for _ in range(bld.i(3, 8)):
        s, c = bld.choice(CHAIN_STEPS), float(np.round(bld.rng.uniform(-1.5, 1.5), 3))
        if s in ("where", "max") and np.abs(v - c).min() < GAP:
            s = "tanh"
        steps.append((s, c))
        v = _chain(NP, v, steps[-1:])
    return bld.add(lambda xp, env, P, B: _chain(xp, env[k], steps), f"chain(v{k}, {steps})", kind="chain")


def _int_ix(xp, i, how, hi):
    if how == "roll":
        return xp.roll(i, 1, 1)
    if how == "slice":
        return i[:, 1:]
    if how == "assign":                            # makemore's MLP context: rolled, a blank token at column 0
        j = xp.roll(i, 1, 1)
        j[:, 0] = hi - 1
        return j
    if how == "stack":
        return xp.stack([i[0], i[-1]], 1)
    return i.T


def op_int_index(bld: Builder):
    """take with an index computed inside the program from an integer input or constant."""
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None or bld.i(0, 2) == 0:
        k = bld.new_param((bld.i(1, 6),) + bld.shape(1))
    rows = bld.vals[k].shape[0]
    idx = bld.int_index((bld.i(1, 3), bld.i(2, 4)), rows, allow_negative=False)
    how = bld.choice(["roll", "slice", "assign", "stack", "transpose"])
    return bld.add(lambda xp, env, P, B: xp.take(env[k], _int_ix(xp, idx(B), how, rows)),
                   f"take(v{k}, {how}(int index))", kind=f"int {how}")


OPS = [op_unary, op_unary, op_binary, op_binary, op_reduce, op_reshape, op_transpose, op_getitem, op_concat,
       op_split, op_matmul, op_softmax, op_where, op_take, op_layer_norm, op_cross_entropy, op_attention,
       op_attention_wide, op_broadcast_to, op_chain, op_int_index]


@st.composite
def programs(draw, max_ops=20):
    bld = Builder(draw)
    for _ in range(draw(st.integers(1, 3), label="initial params")):
        bld.new_param(bld.shape())
    for _ in range(draw(st.integers(1, max_ops), label="ops")):
        OPS[draw(st.integers(0, len(OPS) - 1), label="op")](bld)
    # the loss: a weighted sum over a subset of the values (always the last one), so most values fan out
    n = len(bld.vals)
    chosen = sorted({n - 1} | {k for k in range(n) if draw(st.booleans())})
    weights = {k: bld.rng.normal(size=bld.vals[k].shape) for k in chosen}
    expose = draw(st.booleans(), label="expose intermediates as outputs")
    steps = list(bld.steps)

    def replay(xp, P, batch):
        env = []
        for f in steps:
            out = f(xp, env, P, batch)
            env.extend(out if isinstance(out, list) else [out])
        loss = 0.0
        for k in chosen:
            loss = loss + xp.sum(env[k] * weights[k])
        return loss, env

    def fn(p, *batch):
        loss, env = replay(BT, p, list(batch))
        if not isinstance(loss, btjit.graph.trace.Tracer):   # only constants reached the loss
            loss = btjit.sum(btjit.graph.trace.lift(float(loss)))
        if expose:
            return loss, {f"v{k}": v for k, v in enumerate(env) if isinstance(v, btjit.graph.trace.Tracer)}
        return loss

    event(f"{len(bld.steps) // 5 * 5}-{len(bld.steps) // 5 * 5 + 4} steps")
    note("\n".join(bld.log) + f"\nloss = sum over v{chosen} of weighted sums; expose={expose}")
    return fn, replay, bld.params, bld.batch, expose


# ----------------------------------------------------------------------------- the checks
def _trace(fn, params, batch, dtype):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="btjit: parameter")
        return btjit.trace(fn, {k: v.astype(dtype) for k, v in params.items()}, *batch, dtype=dtype, grad=True)


def _fd_grads(prog, params, batch, eps=1e-5):
    """Central finite differences of the compiled float64 forward, element by element."""
    out = {}
    for name, p0 in params.items():
        view = prog.params[name]
        g = np.zeros(p0.shape)
        for i in np.ndindex(*p0.shape):
            view[...] = p0
            view[i] = p0[i] + eps
            fp = prog.forward(*batch)
            view[i] = p0[i] - eps
            fm = prog.forward(*batch)
            g[i] = (fp - fm) / (2 * eps)
        view[...] = p0
        out[name] = g
    return out


@FUZZ
@given(programs())
def test_random_program_forward_gradient_and_interpretation(prog_spec):
    fn, replay, params, batch, expose = prog_spec
    want_loss, want_env = replay(NP, params, batch)
    prog = _trace(fn, params, batch, "float64")
    note(str(prog.graph))

    # 1. forward vs direct numpy
    loss = prog.value_and_grad(*batch)
    scale = max(1.0, abs(float(want_loss)))
    assert abs(loss - float(want_loss)) <= 1e-9 * scale, (loss, float(want_loss))
    if expose:
        for k, v in enumerate(want_env):
            if f"v{k}" in prog.outputs:
                np.testing.assert_allclose(prog.outputs[f"v{k}"], v, rtol=1e-9, atol=1e-9, err_msg=f"v{k}")

    # 2. gradient vs finite differences
    grads = {k: v.copy() for k, v in prog.grads.items()}
    fd = _fd_grads(prog, params, batch)
    for name in params:
        g, f = grads[name], fd[name]
        tol = 1e-7 * scale + 1e-5 * np.abs(f)
        bad = np.abs(g - f) > tol
        assert not bad.any(), f"gradient of {name}: compiled {g[bad][:4]} vs finite differences {f[bad][:4]}"

    # 3. native forward+backward vs the numpy interpretation of the planned IR
    a_ref, _ = interp.run(prog, *batch, upto="backward")
    prog.value_and_grad(*batch)
    g0, n = prog.plan.grads_start, prog.plan.params_span[1]
    np.testing.assert_allclose(prog.a[g0:g0 + n], a_ref[g0:g0 + n], rtol=1e-9, atol=1e-10 * scale)
    assert abs(a_ref[prog.plan.off[prog.graph.loss.id]] - loss) <= 1e-10 * scale


@FUZZ
@given(programs(max_ops=12))
def test_random_program_float32_matches_float64(prog_spec):
    fn, replay, params, batch, _ = prog_spec
    p64, p32 = _trace(fn, params, batch, "float64"), _trace(fn, params, batch, "float32")
    l64, l32 = p64.value_and_grad(*batch), p32.value_and_grad(*batch)
    assert abs(l32 - l64) <= 1e-3 * max(1.0, abs(l64)), (l32, l64)
    for name in params:
        g64 = p64.grads[name]
        np.testing.assert_allclose(p32.grads[name], g64, rtol=0, atol=2e-3 * max(1.0, np.abs(g64).max()),
                                   err_msg=name)


# ----------------------------------------------------------------------------- regressions found by the fuzzer
def test_regression_ellipsis_with_newaxis():
    """x[..., :, None] inserted the new axis in the wrong place: Ellipsis counted None as an input axis."""
    x = np.arange(6.0).reshape(2, 3)
    for idx in [(Ellipsis, slice(None), None), (None, Ellipsis, 0), (Ellipsis, None), (0, None, Ellipsis)]:
        prog = btjit.trace(lambda p: p["x"][idx] * 1.0, {"x": x}, dtype="float64")
        np.testing.assert_array_equal(prog(), x[idx], err_msg=str(idx))


def test_regression_aliased_registers_are_freed_once():
    """A fused chain reading x and broadcast_to(x) (one register) for the last time in one instruction freed
    that register twice; two later values then shared it (found by the fuzzer: log(y*y + 0.5) of
    y = broadcast_to(x) + x, with y kept for the backward, gave a loss of 0)."""
    from btjit.testing import check_grads
    x = np.array([[0.12573022, -0.13210486], [0.64042265, 0.10490012]])
    w = np.random.default_rng(1).normal(size=(2, 1, 2, 2))

    def f(p):
        v = p["x"][..., :, None, :, None]
        y = btjit.broadcast_to(v, (2, 1, 2, 2)) + v
        return btjit.sum(btjit.log(y * y + 0.5) * w)
    v = x[..., :, None, :, None]
    y = np.broadcast_to(v, (2, 1, 2, 2)) + v
    prog = btjit.trace(f, {"x": x}, dtype="float64", grad=True)
    assert prog.value_and_grad() == pytest.approx(float(np.sum(np.log(y * y + 0.5) * w)), rel=1e-12)
    check_grads(f, {"x": x})


def test_regression_np_take_without_axis_flattens():
    """np.take(x, idx) (axis=None) gathered rows instead of indexing the flattened array, as numpy does."""
    x = np.arange(6.0).reshape(2, 3)
    idx = np.array([[5, 0], [1, 4]])
    prog = btjit.trace(lambda p: np.take(p["x"], idx) * 1.0, {"x": x}, dtype="float64")
    np.testing.assert_array_equal(prog(), np.take(x, idx))
    prog = btjit.trace(lambda p: np.take(p["x"], [1, 0], axis=0) * 1.0, {"x": x}, dtype="float64")
    np.testing.assert_array_equal(prog(), np.take(x, [1, 0], axis=0))
    with pytest.raises(btjit.TraceError, match=r"np.take: only axis=0 or axis=None .*axis=1.*test_fuzz.py:\d+"):
        btjit.trace(lambda p: np.take(p["x"], [1], axis=1), {"x": x}, dtype="float64")


def test_regression_array_exponent():
    """x ** ndarray raised 'exponent must be a number or a traced value'; numpy allows an array exponent."""
    rng = np.random.default_rng(0)
    params = {"x": rng.uniform(0.5, 2.0, (3, 4))}
    e = rng.normal(size=(4,))
    prog = btjit.trace(lambda p: p["x"] ** e, params, dtype="float64")
    np.testing.assert_allclose(prog(), params["x"] ** e, rtol=1e-12)
    from btjit.testing import check_grads
    check_grads(lambda p: btjit.sum(p["x"] ** e + p["x"] ** np.float64(3.0)), params)


def test_regression_constant_index_through_reshape_is_range_checked():
    """An int constant reaching take through a reshape skipped take()'s range check: -1 read the word before
    the table (the forward gave 0.0). Now every constant index is checked once, naming the op and line."""
    w = np.arange(6.0).reshape(3, 2)
    for bad in (np.array([[0, -1]]), np.array([[3, 0]])):
        with pytest.raises(btjit.TraceError, match=r"take: constant index values must be in \[0, 3\).*"
                                                   r"test_fuzz.py:\d+"):
            btjit.trace(lambda p: btjit.sum(btjit.take(p["w"], btjit.reshape(bad, (-1,)))), {"w": w},
                        dtype="float64", grad=True)
    ok = np.array([[2, 0]])
    prog = btjit.trace(lambda p: btjit.sum(btjit.take(p["w"], btjit.reshape(ok, (-1,)))), {"w": w},
                       dtype="float64", grad=True)
    assert prog.value_and_grad() == w[[2, 0]].sum()
