"""The fuzzer's (test_fuzz.py's) numpy side and drawing state: an independent numpy implementation of the
btjit tensor API (NP; BT is btjit itself, the traced side) and Builder, which draws a random program step by
step, evaluating each step in numpy as it is drawn so that domain, kink and size checks see the actual values.
The op builders are in fuzz_ops.py and fuzz_programs.py."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

import btjit


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
    gelu = staticmethod(lambda x, approximate:
                        0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))))
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
