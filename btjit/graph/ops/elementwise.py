"""Elementwise and reduction ops: shape rule, VJP, numpy reference, lowering, gradient cases."""
from __future__ import annotations

import math

import numpy as np

from btjit.graph import trace as T
from btjit.kernels import elementwise as EW
from btjit.kernels.reduce import R_MAX, R_SUM

from btjit.graph.optable import (TABLE, Case, F, ShapeError, _bcast_shape, _float, _int_rule, bstrides, cstrides,
                                 elementwise_rule, lower_elementwise, op, same_as_input, strided_rows)


# ----------------------------------------------------------------------------- elementwise ops
def _binary(name, sub, fn, vjp=None, cases=(), nondiff=False, internal=False, ints=None):
    rule = same_as_input if internal else elementwise_rule if ints is None else _int_rule(ints)
    op(name, infer=rule, ref=lambda xs, at, fn=fn: (fn(*xs),),
       lower=lambda e, L, sub=sub: lower_elementwise(sub, e, L), vjp=vjp, cases=list(cases),
       nondiff=nondiff, internal=internal)


_bc = [F(3, 4), F(4)], [F(2, 1, 3), F(4, 1)], [F(), F(3, 2)], [F(1, 4), F(2, 3, 4)], [F(2, 3), F(2, 3)]
_binary("add", EW.B_ADD, np.add, lambda g, x, o, a: [g[0], g[0]], [Case(c) for c in _bc], ints=True)
_binary("sub", EW.B_SUB, np.subtract, lambda g, x, o, a: [g[0], -g[0]], [Case(c) for c in _bc], ints=True)
_binary("mul", EW.B_MUL, np.multiply, lambda g, x, o, a: [g[0] * x[1], g[0] * x[0]], [Case(c) for c in _bc],
        ints=True)
_binary("div", EW.B_DIV, np.divide, lambda g, x, o, a: [g[0] / x[1], -g[0] * o[0] / x[1]],
        [Case((F(3, 4), F(4, dom="pos"))), Case((F(2, 1, 3), F(4, 1, dom="pos"))), Case((F(), F(3, 2, dom="pos")))])
def _minmax_vjp(wins, strict):
    """maximum's / minimum's VJP: x's share of g is 1 where x wins strictly; at a tie, 1/2 each (torch's rule:
    (ge + gt) / 2), or all of it to x (ties "first", clamp's rule) or to y ("second", hardtanh's)."""
    def vjp(g, x, o, a):
        if a.get("ties"):
            m = T.emit(wins if a["ties"] == "first" else strict, (x[0], x[1]))
        else:
            m = (T.emit(wins, (x[0], x[1])) + T.emit(strict, (x[0], x[1]))) * 0.5
        gx = g[0] * m
        return [gx, g[0] - gx]
    return vjp


_binary("maximum", EW.B_MAX, np.maximum, _minmax_vjp("ge", "gt"),
        [Case((F(3, 4), F(3, 4))), Case((F(3, 4), F(4)))], ints=True)
_binary("minimum", EW.B_MIN, np.minimum, _minmax_vjp("le", "lt"), [Case((F(3, 4), F(3, 4)))], ints=True)
_binary("pow2", EW.B_POW, np.power,
        lambda g, x, o, a: [g[0] * x[1] * x[0] ** (x[1] - 1.0), g[0] * o[0] * T.log(x[0])],
        [Case((F(3, 4, dom="pos"), F(3, 4))), Case((F(3, 4, dom="pos"), F()))])
for _n, _s, _f in [("eq", EW.B_EQ, np.equal), ("gt", EW.B_GT, np.greater), ("ge", EW.B_GE, np.greater_equal),
                   ("lt", EW.B_LT, np.less), ("le", EW.B_LE, np.less_equal), ("ne", EW.B_NE, np.not_equal)]:
    _binary(_n, _s, lambda x, y, f=_f: f(x, y).astype(np.result_type(x, y, np.float32)), nondiff=True,
            cases=[Case((F(3, 4), F(4))), Case((("i", (3, 4), 3), ("i", (4,), 3)))], ints=False)
_binary("tanh_grad", EW.B_TANH_GRAD, lambda y, g: g * (1 - y * y), internal=True, cases=[Case((F(3, 4), F(3, 4)))])
_binary("relu_grad", EW.B_RELU_GRAD, lambda x, g: g * (x > 0), internal=True, cases=[Case((F(3, 4), F(3, 4)))])
_binary("sigmoid_grad", EW.B_SIGMOID_GRAD, lambda y, g: g * y * (1 - y), internal=True,
        cases=[Case((F(3, 4), F(3, 4)))])
_binary("gelu_erf_grad", EW.B_GELU_GRAD, lambda x, g: g * (_phi(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)),
        internal=True, cases=[Case((F(3, 4), F(3, 4)))])
_binary("silu_grad", EW.B_SILU_GRAD, lambda x, g: g * _sig(x) * (1 + x * (1 - _sig(x))), internal=True,
        cases=[Case((F(3, 4), F(3, 4)))])


def _unary(name, sub, fn, vjp, dom="normal", tol=1e-6, nondiff=False):
    op(name, infer=same_as_input, nondiff=nondiff, ref=lambda xs, at, fn=fn: (fn(xs[0], at),),
       lower=lambda e, L, sub=sub: [L.row("k_unary", sub=sub, oout=L.off(e.outs[0]), oin=L.off(e.ins[0]),
                                          n=e.outs[0].size, oc=L.const(e.attrs.get("p", 0.0)))],
       vjp=vjp, cases=[Case((F(3, 5, dom=dom),), tol=tol), Case((F(dom=dom),), tol=tol)])


_sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
_erf_ref = np.vectorize(math.erf, otypes=[np.float64])     # numpy has no erf; math.erf is libm's (correctly
#                                                           rounded to within an ulp in float64)
_phi = lambda x: 0.5 + 0.5 * _erf_ref(x / math.sqrt(2))   # noqa: E731 -- the standard normal CDF
_unary("copy", EW.U_COPY, lambda x, a: x.copy(), lambda g, x, o, a: [g[0]])
_unary("stop_gradient", EW.U_COPY, lambda x, a: x.copy(), None, nondiff=True)      # torch's x.detach()
_unary("neg", EW.U_NEG, lambda x, a: -x, lambda g, x, o, a: [-g[0]])
_unary("exp", EW.U_EXP, lambda x, a: np.exp(x), lambda g, x, o, a: [g[0] * o[0]])
_unary("log", EW.U_LOG, lambda x, a: np.log(x), lambda g, x, o, a: [g[0] / x[0]], dom="pos")
_unary("tanh", EW.U_TANH, lambda x, a: np.tanh(x), lambda g, x, o, a: [T.emit("tanh_grad", (o[0], g[0]))])
# relu's gradient reads its output (> 0 exactly where the input is), so the input need not live until the
# backward: E6 batch 64 keeps one (512, 96) activation less per layer (arena 7.0 -> 5.9 MB)
_unary("relu", EW.U_RELU, lambda x, a: np.maximum(x, 0), lambda g, x, o, a: [T.emit("relu_grad", (o[0], g[0]))],
       dom="away")
_unary("sigmoid", EW.U_SIGMOID, lambda x, a: _sig(x), lambda g, x, o, a: [T.emit("sigmoid_grad", (o[0], g[0]))])
_unary("sqrt", EW.U_SQRT, lambda x, a: np.sqrt(x), lambda g, x, o, a: [g[0] * 0.5 / o[0]], dom="pos")
_unary("sign", EW.U_SIGN, lambda x, a: np.sign(x), None, dom="away", nondiff=True)     # zero gradient, as torch's
_unary("abs", EW.U_ABS, lambda x, a: np.abs(x), lambda g, x, o, a: [g[0] * T.emit("sign", (x[0],))], dom="away")
_unary("erf", EW.U_ERF, lambda x, a: _erf_ref(x), lambda g, x, o, a: [g[0] * 1.1283791670955126 * T.exp(-x[0] * x[0])])
# torch's nn.GELU(): x * Phi(x), one instruction each way (as x * (0.5 + 0.5 * erf(x / sqrt 2)) it took 4 forward
# and 11 backward, the erf computed again there)
_unary("gelu_erf", EW.U_GELU, lambda x, a: x * _phi(x), lambda g, x, o, a: [T.emit("gelu_erf_grad", (x[0], g[0]))])
_unary("silu", EW.U_SILU, lambda x, a: x * _sig(x), lambda g, x, o, a: [T.emit("silu_grad", (x[0], g[0]))])
_unary("log1p", EW.U_LOG1P, lambda x, a: np.log1p(x), lambda g, x, o, a: [g[0] / (1.0 + x[0])], dom="pos")
_unary("sin", EW.U_SIN, lambda x, a: np.sin(x), lambda g, x, o, a: [g[0] * T.emit("cos", (x[0],))])
_unary("cos", EW.U_COS, lambda x, a: np.cos(x), lambda g, x, o, a: [-g[0] * T.emit("sin", (x[0],))])
_unary("pow", EW.U_POW, lambda x, a: np.power(x, a["p"]), lambda g, x, o, a: [g[0] * a["p"] * x[0] ** (a["p"] - 1)],
       dom="pos")
TABLE["pow"].cases = [Case((F(3, 5, dom="pos"),), {"p": 3.0}), Case((F(4, dom="pos"),), {"p": -1.5})]


# ----------------------------------------------------------------------------- rounding (k_rounding)
def _rounding_rule(types, attrs, fd):
    out = elementwise_rule(types, attrs, fd)
    n = int(np.prod(out[0][0], dtype=np.int64))
    if any(int(np.prod(s, dtype=np.int64)) not in (n, 1) for s, _ in types):
        raise ShapeError("each operand must have the output's shape or be one value (broadcast it first)")
    return out


def _lower_rounding(sub):
    def lower(e, L):
        out, (x, y) = e.outs[0], (e.ins * 2)[:2]
        mode = 0 if x.size == y.size == out.size else (1 if x.size == out.size else 2)
        return [L.row("k_rounding", sub=sub, oout=L.off(out), o1=L.off(x), o2=L.off(y), n=out.size, mode=mode)]
    return lower


for _n, _s, _f in [("floor", EW.R_FLOOR, np.floor), ("ceil", EW.R_CEIL, np.ceil), ("round", EW.R_ROUND, np.round),
                   ("trunc", EW.R_TRUNC, np.trunc)]:          # zero gradient, as torch's
    op(_n, infer=_rounding_rule, ref=lambda xs, a, f=_f: (f(xs[0]),), lower=_lower_rounding(_s), nondiff=True,
       cases=[Case((F(3, 5),)), Case((F(),))])


def _mod_vjp(rounded):
    """torch's: d/dx = 1, d/dy = -floor(x / y) (remainder) or -trunc(x / y) (fmod)."""
    return lambda g, x, o, a: [g[0], -g[0] * T.emit(rounded, (x[0] / x[1],))]


_mcases = [Case((F(3, 4, dom="away"), F(3, 4, dom="away"))), Case((F(3, 4, dom="away"), F(dom="away"))),
           Case((F(dom="away"), F(3, 4, dom="away")))]
op("remainder", infer=_rounding_rule, ref=lambda xs, a: (np.mod(*xs),), lower=_lower_rounding(EW.R_REMAINDER),
   vjp=_mod_vjp("floor"), cases=_mcases)
op("fmod", infer=_rounding_rule, ref=lambda xs, a: (np.fmod(*xs),), lower=_lower_rounding(EW.R_FMOD),
   vjp=_mod_vjp("trunc"), cases=_mcases)


def _gelu_ref(x, a):
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def _gelu_grad_ref(x, g):
    u = 0.7978845608028654 * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x))


op("gelu", infer=same_as_input, ref=lambda xs, a: (_gelu_ref(xs[0], a),),
   lower=lambda e, L: [L.row("k_gelu_fwd", ox=L.off(e.ins[0]), oy=L.off(e.outs[0]), n=e.outs[0].size)],
   vjp=lambda g, x, o, a: [T.emit("gelu_grad", (x[0], g[0]))], cases=[Case((F(3, 5),))])
op("gelu_grad", infer=same_as_input, ref=lambda xs, a: (_gelu_grad_ref(*xs),), internal=True,
   lower=lambda e, L: [L.row("k_gelu_bwd", ox=L.off(e.ins[0]), ody=L.off(e.ins[1]), odx=L.off(e.outs[0]),
                             n=e.outs[0].size)],
   cases=[Case((F(3, 5), F(3, 5)))])


def _where_rule(types, attrs, fd):
    _float(types, "")
    return [(_bcast_shape(*(s for s, _ in types)), fd)]


op("where", infer=_where_rule,
   ref=lambda xs, a: (np.where(xs[0] != 0, xs[1], xs[2]).astype(np.result_type(xs[1], xs[2])),),
   lower=lambda e, L: strided_rows(L, EW.S_SELECT, e.outs[0].shape, (L.off(e.outs[0]), cstrides(e.outs[0].shape)),
                                   [(L.off(v), bstrides(v.shape, e.outs[0].shape)) for v in e.ins]),
   vjp=lambda g, x, o, a: [None, T.where(x[0], g[0], 0.0), T.where(x[0], 0.0, g[0])],
   cases=[Case((("mask", (3, 4)), F(3, 4), F(4))), Case((("mask", (4,)), F(3, 4), F()))])


# ----------------------------------------------------------------------------- reductions
def _reduce_rule(types, attrs, fd):
    _float(types, "")
    s = types[0][0]
    return [(s[:attrs["lo"]] + s[attrs["hi"]:], fd)]


def _lower_reduce(sub):
    def lower(e, L):
        s, lo, hi = e.ins[0].shape, e.attrs["lo"], e.attrs["hi"]
        n0, n1, n2 = (int(np.prod(s[:lo])), int(np.prod(s[lo:hi])), int(np.prod(s[hi:])))
        if sub == R_SUM and n0 == 1 and n1 > 1 and n2 > 1:        # leading axes: k_sum_rows (elementwise.py)
            return [L.row("k_sum_rows", oout=L.off(e.outs[0]), oin=L.off(e.ins[0]), rows=n1, cols=n2)]
        return [L.row("k_reduce", sub=sub, oout=L.off(e.outs[0]), oin=L.off(e.ins[0]), n0=n0, n1=n1, n2=n2)]
    return lower


def _keep(g, x, a):
    """g reshaped to x's rank with the reduced axes kept as size 1."""
    s = x.shape
    return T.reshape(g, s[:a["lo"]] + (1,) * (a["hi"] - a["lo"]) + s[a["hi"]:])


def _max_vjp(g, x, o, a):
    mask = T.emit("eq", (x[0], T.broadcast_to(_keep(o[0], x[0], a), x[0].shape)))
    count = _keep(T.emit("sum", (mask,), **a), x[0], a)
    return [mask * T.broadcast_to(_keep(g[0], x[0], a) / count, x[0].shape)]


_rcases = [Case((F(3, 4, 5),), {"lo": 1, "hi": 2}), Case((F(3, 4, 5),), {"lo": 0, "hi": 3}),
           Case((F(3, 4, 5),), {"lo": 2, "hi": 3}), Case((F(6, 4),), {"lo": 0, "hi": 1}),
           # k_reduce's paths: rows folded m at a time plus leftovers (70x3, 5x33x7), column blocks (130 > 128)
           Case((F(70, 3),), {"lo": 0, "hi": 1}), Case((F(5, 33, 7),), {"lo": 1, "hi": 2}),
           Case((F(2, 3, 130),), {"lo": 1, "hi": 2}), Case((F(2, 70, 3),), {"lo": 1, "hi": 2})]
op("sum", infer=_reduce_rule, ref=lambda xs, a: (xs[0].sum(axis=tuple(range(a["lo"], a["hi"]))),),
   lower=_lower_reduce(R_SUM), cases=_rcases,
   vjp=lambda g, x, o, a: [T.broadcast_to(_keep(g[0], x[0], a), x[0].shape)])
op("max", infer=_reduce_rule, ref=lambda xs, a: (xs[0].max(axis=tuple(range(a["lo"], a["hi"]))),),
   lower=_lower_reduce(R_MAX), cases=_rcases, vjp=_max_vjp)


