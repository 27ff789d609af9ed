"""Values near 1 in a float32 update (betas and what schedules make of them) that keep `1 - value` accurate.

A float32 arena rounds beta2 = 0.999 to 0.99900001 and 0.9999 to 0.99989998: `1 - beta` from it is 1.3e-5 and
1.7e-4 off, relatively, where torch, whose Python floats are float64, is exact; an EMA that starts at zero, or a
bias correction, inherits that error whole. So in a float32 program each hyper-parameter is traced as a `Near1`
value that carries its complement 1 - value (the host fills a slot with it in float64), and the operations
schedules are written with carry one on: hp ** step (exp(step * log1p(-c))), hp ** 2, np.log(hp) (log1p(-c)),
np.exp(y) and b ** y of a 0-d y (-expm1 Kahan's way), np.minimum / np.maximum, np.where, the product of two, a
number added or taken. `1 - value` reads the complement. btjit/optim/build.py traces an update inside `scalars()`.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from btjit.graph import trace as T


def _one(o) -> bool:
    return isinstance(o, (int, float)) and not isinstance(o, bool) and o == 1


def _f32(*xs) -> bool:
    """Is any of xs a float32 traced value (where the complements are kept; float64 is exact enough)?"""
    return any(isinstance(x, T.Tracer) and x.node.dtype == "f32" for x in xs)


def _number(o) -> bool:
    return isinstance(o, (int, float, np.floating, np.integer)) and not isinstance(o, bool)


def complement(x):
    """1 - x: accurate for a Near1 x, else computed."""
    return x.complement() if isinstance(x, Near1) else 1.0 - T.lift(x)


class Near1(T.Tracer):
    """A traced value u that keeps 1 - u: complement() traces it (an accurate computation, made only if read)."""
    __slots__ = ("complement",)

    def __init__(self, u, complement):
        super().__init__(u.node, u.graph)
        self.complement = complement

    def plain(self):
        return T.Tracer(self.node, self.graph)

    def __rsub__(self, o):
        return self.complement() if _one(o) else super().__rsub__(o)

    def __add__(self, o):
        if not (_number(o) and _f32(self)):
            return super().__add__(o)
        return Near1(self.plain() + float(o), lambda: self.complement() - float(o))

    def __radd__(self, o):
        if not (_number(o) and _f32(self)):
            return super().__radd__(o)
        return Near1(float(o) + self.plain(), lambda: self.complement() - float(o))

    def __sub__(self, o):
        if not (_number(o) and _f32(self)):
            return super().__sub__(o)
        return Near1(self.plain() - float(o), lambda: self.complement() + float(o))

    def __mul__(self, o):
        if not (isinstance(o, Near1) and _f32(self)):
            return super().__mul__(o)
        return Near1(self.plain() * o.plain(), lambda: _product_complement(self, o))

    def __pow__(self, e):
        """u ** e for a traced e (the step), where 1 - u <= 0.125: exp(e * log1p(-(1 - u))) (a float32 0.99900001 **
        step is 1.3e-5 * step off, relatively); other bases (0.5 ** step, exact in float32, or (-1) ** step) take
        pow's own. u ** a number is pow's, its 1 - (u ** e) -expm1(e * log1p(-(1 - u)))."""
        if not _f32(self) or not isinstance(e, T.Tracer) and not _number(e):
            return super().__pow__(e)
        if not isinstance(e, T.Tracer):
            u = super().__pow__(e)
            return Near1(u, lambda: _one_minus_exp(float(e) * T.log1p(-self.complement()), u))
        c = self.complement()
        near = T.logical("and", c >= 0.0, c <= 0.125)
        y = e * T.log1p(-c)
        u = T.where(near, T.exp(y), super().__pow__(e))
        return Near1(u, lambda: T.where(near, _kahan(u, y), 1.0 - u))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "__call__" and not kwargs and _f32(*inputs):
            if ufunc is np.log:
                c = complement(inputs[0])
                return T.where(c < 0.5, T.log1p(-c), T.log(inputs[0].plain()))
            if ufunc in (np.minimum, np.maximum):
                a, b = inputs
                pick, other = (T.minimum, T.maximum) if ufunc is np.minimum else (T.maximum, T.minimum)
                return Near1(pick(_plain(a), _plain(b)), lambda: other(complement(a), complement(b)))
            if ufunc in (np.multiply, np.add, np.subtract):
                a, b = inputs
                op = {np.multiply: "__mul__", np.add: "__add__", np.subtract: "__sub__"}[ufunc]
                return getattr(a, op)(b) if isinstance(a, Near1) else getattr(b, "__r" + op[2:])(a)
        return super().__array_ufunc__(ufunc, method, *inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.where and len(args) == 3 and not kwargs and _f32(*args):      # a schedule's two pieces
            cond, a, b = args
            return Near1(T.where(cond, _plain(a), _plain(b)), lambda: T.where(cond, complement(a), complement(b)))
        return super().__array_function__(func, types, args, kwargs)


def _product_complement(a, b):
    """1 - a * b = (1 - a) + (1 - b) - (1 - a) * (1 - b)."""
    ca, cb = a.complement(), b.complement()
    return ca + cb - ca * cb


def _plain(x):
    return x.plain() if isinstance(x, Near1) else x


def _kahan(u, y):
    """1 - u for u = exp(y) as computed: -expm1(y) Kahan's way, (1 - u) * y / log(u), accurate to a few ulps where
    1 - u alone keeps only the digits of u's rounding."""
    return T.where(u == 1.0, -y, T.where(u > 0.5, (1.0 - u) * y / T.log(u), 1.0 - u))


class Hyper(Near1):
    """A hyper-parameter's slot, its complement the slot of 1 - value the host fills in float64."""
    __slots__ = ()

    def __init__(self, var, graph, one_minus):
        super().__init__(T.Tracer(var, graph), lambda: one_minus)


def _exp(x):
    """np.exp in an update: of a 0-d value, a Near1 (1 - exp(y) is -expm1(y))."""
    u = T.exp(x)
    if u.shape != () or not _f32(u):
        return u
    y = T.lift(x)
    return Near1(u, lambda: _kahan(u, y))


def _rpow(self, b):
    """b ** y for a number b > 0 and a 0-d traced y in an update: pow's value, and 1 - it as -expm1(y * log(b))."""
    u = _PLAIN_RPOW(self, b)
    if not (_number(b) and b > 0 and u.shape == () and _f32(u)):
        return u
    return Near1(u, lambda: _one_minus_exp(self * float(math.log(b)), u))


def _one_minus_exp(y, u):
    """1 - u for u = exp(y) computed otherwise (pow): Kahan's from exp(y) where that is > 0.5, else 1 - u."""
    v = T.exp(y)
    return T.where(v > 0.5, _kahan(v, y), 1.0 - u)


_PLAIN_RPOW = T.Tracer.__rpow__


@contextlib.contextmanager
def scalars():
    """Inside: np.exp and b ** y of 0-d values give Near1s (an update is being traced)."""
    before = T.UFUNCS["exp"]
    T.UFUNCS["exp"], T.Tracer.__rpow__ = _exp, _rpow
    try:
        yield
    finally:
        T.UFUNCS["exp"], T.Tracer.__rpow__ = before, _PLAIN_RPOW
