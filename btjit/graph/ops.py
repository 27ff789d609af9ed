"""THE op table. Each op is defined once, here: shape rule, VJP rule (written with the tracer API, so it
emits IR), numpy reference, lowering to kernel rows, and gradient-check cases. Tests are parametrized over
TABLE; adding an op = adding an entry.

Lowering uses a context `L` (graph/lower.py): L.off(var) arena offset, L.const(x) offset of a float
constant, L.scratch int32 scratch offset, L.row(kernel_name, name=value...) builds one tape row from the
kernel's row declaration (`@row` in btjit/kernels).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from btjit.kernels import attention, attn_lanes, linalg
from btjit.kernels import elementwise as EW
from btjit.kernels.common import MAX_THREADS
from btjit.kernels.nn import BL_MIN_B, attn_blocks, attn_bwd_scratch_size, attn_scratch_size
from btjit.kernels.reduce import R_MAX, R_SUM
from btjit.graph import trace as T


class ShapeError(Exception):
    pass


@dataclass
class Case:
    """A gradient-check case: args are ("f", shape, domain) or ("i", shape, high); domain in
    normal | pos | away (|x| >= 0.3, off kinks)."""
    args: tuple
    attrs: dict = field(default_factory=dict)
    tol: float = 1e-6


@dataclass
class OpDef:
    name: str
    infer: object                  # (types [(shape, dtype)], attrs, float_dtype) -> [(shape, dtype)]
    ref: object                    # (numpy inputs, attrs) -> tuple of numpy outputs
    lower: object                  # (eqn, L) -> list of rows
    vjp: object = None             # (gs, xs, outs, attrs) -> [tracer | None per input]
    cases: list = field(default_factory=list)
    view: bool = False             # output aliases the input's storage (reshape)
    nondiff: bool = False          # outputs carry no gradient (comparisons)
    internal: bool = False         # emitted by autodiff only


TABLE: dict[str, OpDef] = {}


def op(name, **kw):
    TABLE[name] = OpDef(name, **kw)


F = lambda *shape, dom="normal": ("f", tuple(shape), dom)  # noqa: E731


# ----------------------------------------------------------------------------- shape-rule helpers
def _float(types, name):
    for i, (_, d) in enumerate(types):
        if d == "i32":
            raise ShapeError(f"input {i} is an integer array where floats are needed")


def _bcast_shape(*shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError("shapes do not broadcast") from None


def same_as_input(types, attrs, fd):
    _float(types, "")
    return [(types[0][0], fd)]


def elementwise_rule(types, attrs, fd):
    _float(types, "")
    s0 = types[0][0]
    if all(s == s0 for s, _ in types):
        return [(s0, fd)]
    return [(_bcast_shape(*(s for s, _ in types)), fd)]


def _int_rule(out_int):
    """Elementwise over integers too: all-integer operands give an integer (out_int: add, sub, mul, maximum,
    minimum) or a 0/1 float mask (the comparisons); float operands as elementwise_rule; no mixing."""
    def rule(types, attrs, fd):
        if not all(d == "i32" for _, d in types):
            return elementwise_rule(types, attrs, fd)
        return [(_bcast_shape(*(s for s, _ in types)), "i32" if out_int else fd)]
    return rule


def cstrides(shape):
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return tuple(reversed(st))


def bstrides(shape, out_shape):
    """Strides of `shape` broadcast against out_shape (0 where broadcast)."""
    st = cstrides(shape)
    pad = len(out_shape) - len(shape)
    return tuple([0] * pad + [0 if shape[i] == 1 and out_shape[pad + i] != 1 else st[i] for i in range(len(shape))])


def loop_nest(shape, operands, depth):
    """Collapse a loop nest over `shape` for operands [(offset, strides)]: size-1 dims dropped, adjacent dims
    merged where every operand is contiguous across them. Yields (offsets, inner) per row: the innermost
    `depth` dims [(n, [stride per operand])] (front-padded with size 1) run in one kernel row; the outer
    dims beyond those are unrolled into one row each, with the operands' offsets advanced."""
    k = len(operands)
    merged = []
    for i, n in enumerate(shape):
        if n == 1:
            continue
        st = [s[1][i] for s in operands]
        if merged and all(ps == s * n for ps, s in zip(merged[-1][1], st)):
            merged[-1] = [merged[-1][0] * n, st]
        else:
            merged.append([n, st])
    while len(merged) < depth:
        merged.insert(0, [1, [0] * k])
    outer, inner = merged[:-depth], merged[-depth:]
    for idx in np.ndindex(*[n for n, _ in outer]) if outer else [()]:
        offs = [o for o, _ in operands]
        for (n, st), i in zip(outer, idx):
            offs = [o + i * s for o, s in zip(offs, st)]
        yield offs, inner


def strided_rows(L, sub, shape, out, ins, ints=False):
    """Rows of k_strided (k_int_strided for integer operands: ints): out = (off, strides); ins = up to three
    (two with ints) (off, strides); 4-D loops per row."""
    kernel, k = ("k_int_strided", 2) if ints else ("k_strided", 3)
    ops_ = [out] + list(ins) + [(out[0], (0,) * len(shape))] * (k - len(ins))
    rows = []
    for offs, inner in loop_nest(shape, ops_, 4):
        args = dict(zip(("oo", "o1", "o2", "o3"), offs))
        for d, (n, st) in enumerate(inner):
            args.update({f"n{d}": n, **{f"{p}{d}": st[j] for j, p in enumerate(("so", "p", "q", "t")[:k + 1])}})
        rows.append(L.row(kernel, sub=sub, **args))
    return rows


def copy_rows(L, e, out_off, out_strides, in_off, in_strides, shape=None):
    """Rows copying e.ins[0]'s elements (at in_off with in_strides) to out_off / out_strides, in its arena."""
    return strided_rows(L, EW.B_COPY, shape or e.outs[0].shape, (out_off, out_strides), [(in_off, in_strides)],
                        ints=e.ins[0].dtype == "i32")


def _row_broadcast(v, shape) -> bool:
    """Whether v, broadcast to `shape`, is one row repeated: its shape (leading 1s dropped) ends `shape`."""
    s = tuple(v.shape)
    while s and s[0] == 1:
        s = s[1:]
    return 0 < len(s) <= len(shape) and tuple(shape[len(shape) - len(s):]) == s


def lower_elementwise(sub, eqn, L):
    """The common arithmetic on whole operands or one broadcast row -> k_binary_rows; other same-size or
    scalar operands -> one flat k_binary loop; anything else (and integers) -> k_strided."""
    out = eqn.outs[0]
    n = out.size
    if eqn.ins[0].dtype == "i32":
        return strided_rows(L, sub, out.shape, (L.off(out), cstrides(out.shape)),
                            [(L.off(v), bstrides(v.shape, out.shape)) for v in eqn.ins], ints=True)
    if len(eqn.ins) == 2 and sub in EW.ROWS_SUBS and n > 0:
        x, y = eqn.ins
        whole = [v.size == n for v in (x, y)]
        if all(whole) or (whole[0] and _row_broadcast(y, out.shape)) or (whole[1] and _row_broadcast(x, out.shape)):
            cols = n if all(whole) else min(x.size, y.size)
            return [L.row("k_binary_rows", sub=sub, oout=L.off(out), o1=L.off(x), o2=L.off(y), rows=n // cols,
                          cols=cols, sx=cols if whole[0] else 0, sy=cols if whole[1] else 0)]
    if len(eqn.ins) == 2 and all(v.size in (n, 1) for v in eqn.ins):
        x, y = eqn.ins
        mode = 0 if x.size == n and y.size == n else (1 if x.size == n else 2)
        return [L.row("k_binary", sub=sub, oout=L.off(out), o1=L.off(x), o2=L.off(y), n=n, mode=mode)]
    return strided_rows(L, sub, out.shape, (L.off(out), cstrides(out.shape)),
                        [(L.off(v), bstrides(v.shape, out.shape)) for v in eqn.ins])


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
_binary("maximum", EW.B_MAX, np.maximum,
        lambda g, x, o, a: [g[0] * T.emit("ge", (x[0], x[1])), g[0] * T.emit("lt", (x[0], x[1]))],
        [Case((F(3, 4), F(3, 4))), Case((F(3, 4), F(4)))], ints=True)
_binary("minimum", EW.B_MIN, np.minimum,
        lambda g, x, o, a: [g[0] * T.emit("le", (x[0], x[1])), g[0] * T.emit("gt", (x[0], x[1]))],
        [Case((F(3, 4), F(3, 4)))], ints=True)
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


def _unary(name, sub, fn, vjp, dom="normal", tol=1e-6):
    op(name, infer=same_as_input, ref=lambda xs, at, fn=fn: (fn(xs[0], at),),
       lower=lambda e, L, sub=sub: [L.row("k_unary", sub=sub, oout=L.off(e.outs[0]), oin=L.off(e.ins[0]),
                                          n=e.outs[0].size, oc=L.const(e.attrs.get("p", 0.0)))],
       vjp=vjp, cases=[Case((F(3, 5, dom=dom),), tol=tol), Case((F(dom=dom),), tol=tol)])


_sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
_unary("copy", EW.U_COPY, lambda x, a: x.copy(), lambda g, x, o, a: [g[0]])
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
_unary("abs", EW.U_ABS, lambda x, a: np.abs(x), lambda g, x, o, a: [g[0] * T.emit("gt", (x[0], T.lift(0.0))) -
                                                                      g[0] * T.emit("lt", (x[0], T.lift(0.0)))],
       dom="away")
_unary("pow", EW.U_POW, lambda x, a: np.power(x, a["p"]), lambda g, x, o, a: [g[0] * a["p"] * x[0] ** (a["p"] - 1)],
       dom="pos")
TABLE["pow"].cases = [Case((F(3, 5, dom="pos"),), {"p": 3.0}), Case((F(4, dom="pos"),), {"p": -1.5})]


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


# ----------------------------------------------------------------------------- layout ops
def _reshape_rule(types, attrs, fd):
    (s, d), = types
    if int(np.prod(attrs["shape"])) != int(np.prod(s)) or any(n < 0 for n in attrs["shape"]):
        raise ShapeError(f"cannot reshape {s} into {attrs['shape']}")
    return [(tuple(attrs["shape"]), d)]


op("reshape", infer=_reshape_rule, ref=lambda xs, a: (xs[0].reshape(a["shape"]),), lower=lambda e, L: [],
   view=True, vjp=lambda g, x, o, a: [T.reshape(g[0], x[0].shape)], cases=[Case((F(3, 4),), {"shape": (2, 6)})])


def _bcast_to_rule(types, attrs, fd):
    (s, d), = types
    try:
        ok = np.broadcast_shapes(s, attrs["shape"]) == tuple(attrs["shape"])
    except ValueError:
        ok = False
    if not ok:
        raise ShapeError(f"cannot broadcast {tuple(s)} to {tuple(attrs['shape'])}")
    return [(tuple(attrs["shape"]), d)]


op("broadcast_to", infer=_bcast_to_rule, ref=lambda xs, a: (np.broadcast_to(xs[0], a["shape"]).copy(),),
   lower=lambda e, L: copy_rows(L, e, L.off(e.outs[0]), cstrides(e.outs[0].shape), L.off(e.ins[0]),
                                bstrides(e.ins[0].shape, e.outs[0].shape)),
   vjp=lambda g, x, o, a: [g[0]],   # autodiff's unbroadcast sums it back to the input shape
   cases=[Case((F(3, 1),), {"shape": (2, 3, 4)})])


def _transpose_rule(types, attrs, fd):
    (s, d), = types
    if sorted(attrs["perm"]) != list(range(len(s))):
        raise ShapeError(f"bad axes {attrs['perm']} for a {len(s)}-d input")
    return [(tuple(s[p] for p in attrs["perm"]), d)]


def _lower_transpose(e, L):
    st = cstrides(e.ins[0].shape)
    return copy_rows(L, e, L.off(e.outs[0]), cstrides(e.outs[0].shape), L.off(e.ins[0]),
                     tuple(st[p] for p in e.attrs["perm"]))


op("transpose", infer=_transpose_rule, ref=lambda xs, a: (np.transpose(xs[0], a["perm"]).copy(),),
   lower=_lower_transpose, vjp=lambda g, x, o, a: [T.transpose(g[0], tuple(np.argsort(a["perm"])))],
   cases=[Case((F(2, 3, 4),), {"perm": (2, 0, 1)}), Case((F(2, 3, 4, 5),), {"perm": (0, 2, 1, 3)})])


def _slice_rule(types, attrs, fd):
    (s, d), = types
    return [(tuple(len(range(a, b, c)) for a, b, c in zip(attrs["starts"], attrs["stops"], attrs["steps"])), d)]


def _slice_view(shape, a):
    st = cstrides(shape)
    return int(np.dot(a["starts"], st)), tuple(s * k for s, k in zip(st, a["steps"]))


def _slices(a):
    return tuple(slice(*t) for t in zip(a["starts"], a["stops"], a["steps"]))


def _lower_slice(e, L):
    off, st = _slice_view(e.ins[0].shape, e.attrs)
    return copy_rows(L, e, L.off(e.outs[0]), cstrides(e.outs[0].shape), L.off(e.ins[0]) + off, st)


def _slice_scatter_ref(xs, a):
    out = np.zeros(a["shape"], xs[0].dtype)
    out[_slices(a)] = xs[0]
    return (out,)


def _lower_slice_scatter(e, L):
    off, st = _slice_view(e.outs[0].shape, e.attrs)
    return [L.row("k_fill", oout=L.off(e.outs[0]), n=e.outs[0].size, oc=L.const(0.0))] + strided_rows(
        L, EW.B_COPY, e.ins[0].shape, (L.off(e.outs[0]) + off, st), [(L.off(e.ins[0]), cstrides(e.ins[0].shape))])


_sl = {"starts": (1, 0), "stops": (4, 5), "steps": (2, 2)}
op("slice", infer=_slice_rule, ref=lambda xs, a: (xs[0][_slices(a)].copy(),), lower=_lower_slice,
   vjp=lambda g, x, o, a: [T.emit("slice_scatter", (g[0],), shape=x[0].shape, **a)],
   cases=[Case((F(4, 5),), _sl), Case((F(3, 4, 5),), {"starts": (0, 1, 0), "stops": (3, 3, 5), "steps": (1, 1, 1)})])
op("slice_scatter", infer=lambda t, a, fd: [(tuple(a["shape"]), fd)], ref=_slice_scatter_ref,
   lower=_lower_slice_scatter, internal=True, cases=[Case((F(2, 3),), dict(_sl, shape=(4, 5)))])


def _slice_set_rule(types, attrs, fd):
    """x with x[slices] = v (v broadcast to the region): Tracer.__setitem__, for floats and integers."""
    (s, d), (sv, dv) = types
    if d != dv:
        raise ShapeError("the assigned value must have the array's kind (both float or both integer)")
    region = _slice_rule([(s, d)], attrs, fd)[0][0]
    if _bcast_shape(sv, region) != region:
        raise ShapeError(f"a value of shape {sv} cannot be assigned to a region of shape {region}")
    return [(tuple(s), d)]


def _slice_set_ref(xs, a):
    out = xs[0].copy()
    out[_slices(a)] = xs[1]
    return (out,)


def _lower_slice_set(e, L):
    (x, v), out = e.ins, e.outs[0]
    off, st = _slice_view(x.shape, e.attrs)
    region = _slice_rule([(x.shape, x.dtype)], e.attrs, None)[0][0]
    return copy_rows(L, e, L.off(out), cstrides(x.shape), L.off(x), cstrides(x.shape), x.shape) + strided_rows(L, EW.B_COPY, region, (L.off(out) + off, st), [(L.off(v), bstrides(v.shape, region))],
                               ints=x.dtype == "i32")


def _slice_set_vjp(g, x, o, a):
    region = T.emit("slice", (g[0],), **a)
    return [T.emit("slice_set", (g[0], T.lift(0.0)), **a), region]      # v's share is unbroadcast by autodiff


op("slice_set", infer=_slice_set_rule, ref=_slice_set_ref, lower=_lower_slice_set, vjp=_slice_set_vjp,
   cases=[Case((F(4, 5), F(2, 3)), _sl), Case((F(4, 5), F(3)), _sl), Case((F(3, 4), F()), {"starts": (0, 1),
                                                                                        "stops": (3, 2), "steps": (1, 1)})])
op("to_float", infer=lambda t, a, fd: [(t[0][0], fd)], ref=lambda xs, a: (xs[0].astype(np.float64),), nondiff=True,
   lower=lambda e, L: strided_rows(L, EW.S_TO_FLOAT, e.outs[0].shape, (L.off(e.outs[0]), cstrides(e.outs[0].shape)),
                                   [(L.off(e.ins[0]), cstrides(e.ins[0].shape))], ints=True),
   cases=[Case((("i", (3, 4), 5),))])


def _concat_rule(types, attrs, fd):
    ax = attrs["axis"]
    s0, d0 = types[0]
    for s, d in types:
        if d != d0:
            raise ShapeError("cannot concatenate integer and float arrays")
        if len(s) != len(s0) or s[:ax] + s[ax + 1:] != s0[:ax] + s0[ax + 1:]:
            raise ShapeError(f"all inputs must agree except along axis {ax}")
    return [(s0[:ax] + (sum(s[ax] for s, _ in types),) + s0[ax + 1:], d0 if d0 == "i32" else fd)]


def _lower_concat(e, L):
    out, ax, rows, pos = e.outs[0], e.attrs["axis"], [], 0
    ost = cstrides(out.shape)
    for v in e.ins:
        rows += strided_rows(L, EW.B_COPY, v.shape, (L.off(out) + pos * ost[ax], ost),
                             [(L.off(v), cstrides(v.shape))], ints=v.dtype == "i32")
        pos += v.shape[ax]
    return rows


def _concat_vjp(g, x, o, a):
    bounds = np.cumsum([v.shape[a["axis"]] for v in x])[:-1]
    return T.split(g[0], list(bounds), a["axis"])


op("concatenate", infer=_concat_rule, ref=lambda xs, a: (np.concatenate(xs, a["axis"]),), lower=_lower_concat,
   vjp=_concat_vjp, cases=[Case((F(2, 3), F(2, 4)), {"axis": 1}), Case((F(1, 3), F(2, 3), F(3, 3)), {"axis": 0})])


# ----------------------------------------------------------------------------- matmul
def _matmul_rule(types, attrs, fd):
    _float(types, "")
    (sa, _), (sb, _) = types
    if len(sa) < 2 or len(sb) < 2:
        raise ShapeError("operands must be at least 2-d")
    M, K = (sa[-1], sa[-2]) if attrs["ta"] else sa[-2:]
    K2, N = (sb[-1], sb[-2]) if attrs["tb"] else sb[-2:]
    if K != K2:
        raise ShapeError(f"shapes {sa} and {sb} do not align ({K} != {K2})")
    return [(_bcast_shape(sa[:-2], sb[:-2]) + (M, N), fd)]


def _mm_ref(xs, a):
    x, y = xs
    x = np.swapaxes(x, -1, -2) if a["ta"] else x
    y = np.swapaxes(y, -1, -2) if a["tb"] else y
    return (np.matmul(x, y),)


PAR_GEMM_MACS = 200_000   # from this many multiply-adds a GEMM is split over the threads (launch ~2-4 us)


def split_gemm(nb, M, N, K) -> int:
    """Blocks one thread computes a GEMM row in. OpenBLAS 0.3.30 (SkylakeX kernels on this Zen 4) ran products
    of >= 1M multiply-adds 1.2-2x faster in two halves (E5: 16 x (27,1024,64) 1066 -> 662 us; E6b64 dW
    (96,24,512) 43 -> 23 us, fc (512,96,24) 28 -> 22 us) and smaller ones no faster. (B^T products split
    this way were 2-6% slower; k_matmul runs them on a transposed copy of B, where halves win too.)"""
    return 2 if nb * M * N * K >= 1_000_000 else 1


def micro_gemm(M, N, K, ta, tb, beta, bias, float_dtype) -> bool:
    """Whether a product runs on k_matmul_micro's register micro-kernels instead of sgemm: float32, C
    overwritten and at least 8 x 8, B (K x N) at most linalg.MICRO_B_MAX floats. They win every E6 product
    (512 rows: 50-58 against sgemm's 32-52 G multiply-adds/s; 8 rows: no per-call work; B^T on 8 rows:
    8 x 96 x 24 0.41 against 1.15 us, 8 x 24 x 72 0.33 against 0.40, 8 x 24 x 96 even at 0.45 against 0.43);
    a B^T product never has a bias (fuse_linear)."""
    if float_dtype != "f32" or beta or M < linalg.MR or N < 8 or K * N > linalg.MICRO_B_MAX or (ta and tb):
        return False
    if not tb:
        return True
    if M >= linalg.COPY_MIN_ROWS:
        return N * K <= linalg.WT_MAX and not bias
    return not bias and M * N * K <= linalg.NT_MACS


def par_gemm(macs, threads) -> bool:
    """Whether a product of `macs` multiply-adds in all runs split over the thread pool (k_matmul_par)."""
    return min(threads, MAX_THREADS) > 1 and macs >= PAR_GEMM_MACS


def _lower_matmul(e, L, beta=0, bias=0, osum=0, res=None, relu=False):
    """Rows of a matmul (C = op(A) @ op(B), + bias row, and the column sums osum of B for matmul_colsum);
    res: a var of C's shape added to it (a linear's residual connection); relu: C = relu(all that) (a linear's
    activation). Both by the micro-kernels as they store C, else by add / relu rows after the product."""
    A, B = e.ins
    C = e.outs[0]
    M, N = C.shape[-2:]
    ta, tb = int(e.attrs["ta"]), int(e.attrs["tb"])
    K = A.shape[-2] if ta else A.shape[-1]
    batch = C.shape[:-2]
    nb_total = int(np.prod(batch, dtype=np.int64))
    threads = min(L.threads, MAX_THREADS)
    par = par_gemm(M * N * K * nb_total, threads)

    def micro(m):
        return not par and micro_gemm(m, N, K, ta, tb, beta, bias, C.dtype)

    def row(oa, ob, oc, nb, m, sa_, sb_, sc_):
        args = dict(oA=oa, oB=ob, oC=oc, nbatch=nb, M=m, N=N, K=K, sA=sa_, sB=sb_, sC=sc_, ta=ta, tb=tb)
        if micro(m):
            return L.row("k_matmul_micro", **args, obias=bias, osum=osum, relu=int(relu),
                         ores=L.off(res) + oc - L.off(C) if res is not None else 0)
        kernel, parts = ("k_matmul_par", threads) if par else ("k_matmul", split_gemm(nb, m, N, K))
        return L.row(kernel, **args, beta=beta, osc=L.scratch, oconst=L.one_zero, obias=bias, nparts=parts)
    if len(B.shape) == 2 and not ta:      # fold A's batch dims into M: one GEMM
        rows = [row(L.off(A), L.off(B), L.off(C), 1, nb_total * M, 0, 0, 0)]
        if not micro(nb_total * M):
            rows += TABLE["add"].lower(type(e)("add", (C, res), (C,), {}), L) if res is not None else []
            rows += TABLE["relu"].lower(type(e)("relu", (C,), (C,), {}), L) if relu else []
        return rows
    assert res is None and not relu, "a residual or relu needs B 2-D and A untransposed (graph/fuse.py)"
    sa = bstrides(A.shape[:-2] or (1,), batch or (1,))
    sb = bstrides(B.shape[:-2] or (1,), batch or (1,))
    ma, mb = A.shape[-2] * A.shape[-1], B.shape[-2] * B.shape[-1]
    ops_ = [(L.off(C), tuple(s * M * N for s in cstrides(batch or (1,)))),
            (L.off(A), tuple(s * ma for s in sa)), (L.off(B), tuple(s * mb for s in sb))]
    # the innermost collapsed batch run is the kernel's nbatch loop; outer batch dims become rows
    return [row(oa, ob, oc, nb, M, sa_, sb_, sc_)
            for (oc, oa, ob), [(nb, (sc_, sa_, sb_))] in loop_nest(batch or (1,), ops_, 1)]


def _matmul_vjp(g, x, o, a):
    A, B = x
    g = g[0]
    ta, tb = a["ta"], a["tb"]
    mm = lambda p, q, t1, t2: T.emit("matmul", (p, q), ta=bool(t1), tb=bool(t2))  # noqa: E731
    if ta:
        dA = mm(B, g, 0, 1) if not tb else mm(B, g, 1, 1)
    elif A.ndim == 2 and B.ndim > 2 and not tb:
        # A broadcast over B's batch (the embedding fold's table @ W-blocks): dA = (sum_i B_i @ g_i^T)^T. The
        # GEMMs written this way round ran 1.28x faster than g_i @ B_i^T (E5: 1.11 vs 1.42 ms, OpenBLAS 0.3.30).
        dA = T.transpose(T.sum(mm(B, g, 0, 1), axis=tuple(range(B.ndim - 2))))
    else:
        dA = mm(g, B, 0, not tb)
    if A.ndim > 2 and B.ndim == 2 and not ta:   # dW of x @ W: fold the batch into one GEMM
        A2, g2 = T.reshape(A, (-1, A.shape[-1])), T.reshape(g, (-1, g.shape[-1]))
        dB = mm(A2, g2, 1, 0) if not tb else mm(g2, A2, 1, 0)
    elif not tb:
        dB = mm(A, g, not ta, 0) if not ta else mm(A, g, 0, 0)
    else:
        dB = mm(g, A, 1, 0) if not ta else mm(g, A, 1, 1)
    return [dA, dB]


op("matmul", infer=_matmul_rule, ref=_mm_ref, lower=_lower_matmul, vjp=_matmul_vjp,
   cases=[Case((F(3, 4), F(4, 5)), {"ta": False, "tb": False}), Case((F(2, 3, 4), F(4, 5)), {"ta": False, "tb": False}),
          Case((F(2, 3, 4), F(2, 4, 5)), {"ta": False, "tb": False}), Case((F(3, 4), F(2, 4, 5)), {"ta": False, "tb": False}),
          Case((F(4, 3), F(4, 5)), {"ta": True, "tb": False}), Case((F(3, 4), F(5, 4)), {"ta": False, "tb": True}),
          Case((F(2, 4, 3), F(2, 5, 4)), {"ta": True, "tb": True}), Case((F(2, 1, 3, 4), F(3, 4, 2)), {"ta": False, "tb": False})])


# ----------------------------------------------------------------------------- gather
def _take_rule(types, attrs, fd):
    (st, dt), (si, di) = types
    if dt == "i32" or di != "i32":
        raise ShapeError("take needs a float table and an integer index array")
    if not st:
        raise ShapeError("cannot index a 0-d value")
    return [(tuple(si) + tuple(st[1:]), fd)]


def _row_len(shape):
    return int(np.prod(shape[1:], dtype=np.int64))


op("take", infer=_take_rule, ref=lambda xs, a: (xs[0][xs[1]],),
   lower=lambda e, L: L.index_check(e, e.ins[1], e.ins[0].shape[0]) + [
       L.row("k_gather_rows", otable=L.off(e.ins[0]), oidx=L.off(e.ins[1]), oout=L.off(e.outs[0]), n=e.ins[1].size,
             C=_row_len(e.ins[0].shape))],
   vjp=lambda g, x, o, a: [T.emit("take_grad", (g[0], x[1]), rows=x[0].shape[0]), None],
   cases=[Case((F(5, 3), ("i", (4, 2), 5))), Case((F(6), ("i", (7,), 6)))])


def _take_grad_ref(xs, a):
    g, idx = xs
    out = np.zeros((a["rows"],) + g.shape[idx.ndim:], g.dtype)
    np.add.at(out, idx, g)
    return (out,)


op("take_grad", infer=lambda t, a, fd: [((a["rows"],) + tuple(t[0][0][len(t[1][0]):]), fd)], ref=_take_grad_ref,
   internal=True, cases=[Case((F(4, 2, 3), ("i", (4, 2), 5)), {"rows": 5})],
   lower=lambda e, L: [L.row("k_scatter_add_rows", og=L.off(e.ins[0]), oidx=L.off(e.ins[1]), odt=L.off(e.outs[0]),
                             n=e.ins[1].size, V=e.attrs["rows"], C=_row_len(e.outs[0].shape))])


def _take_sum_rule(types, attrs, fd):
    (st, dt), (si, di) = types
    if dt == "i32" or di != "i32" or len(st) != 3 or len(si) != 2 or si[1] != st[0]:
        raise ShapeError("take_sum needs a float (P, V, N) table and an integer (B, P) index array")
    return [((si[0], st[2]), fd)]


def _take_sum_ref(xs, a):
    table, idx = xs
    return (table[np.arange(table.shape[0]), idx].sum(1),)


def _take_sum_grad_ref(xs, a):
    g, idx = xs
    B, P = idx.shape
    out = np.zeros((P, a["rows"], g.shape[1]), g.dtype)
    np.add.at(out, (np.broadcast_to(np.arange(P), (B, P)), idx), g[:, None, :])
    return (out,)


def _take_sum_lower(kernel):
    def lower(e, L):
        B, P = e.ins[1].shape
        P_, V, N = (e.ins[0] if kernel == "k_take_sum" else e.outs[0]).shape
        table, out = ("ot", "oout") if kernel == "k_take_sum" else ("og", "odt")
        return L.index_check(e, e.ins[1], V) + [L.row(kernel, **{table: L.off(e.ins[0]), out: L.off(e.outs[0])}, oidx=L.off(e.ins[1]), B=B, P=P,
                      V=V, N=N)]
    return lower


# take_sum(table (P, V, N), idx (B, P))[b] = sum_p table[p, idx[b, p]]: made by graph/fuse.py from
# take -> reshape -> matmul (not a public tensor function; gradient-checked like one).
op("take_sum", infer=_take_sum_rule, ref=_take_sum_ref, lower=_take_sum_lower("k_take_sum"),
   vjp=lambda g, x, o, a: [T.emit("take_sum_grad", (g[0], x[1]), rows=x[0].shape[1]), None],
   cases=[Case((F(3, 5, 4), ("i", (6, 3), 5))), Case((F(1, 2, 3), ("i", (4, 1), 2)))])
op("take_sum_grad", infer=lambda t, a, fd: [((t[1][0][1], a["rows"], t[0][0][1]), fd)], ref=_take_sum_grad_ref,
   internal=True, lower=_take_sum_lower("k_take_sum_grad"),
   cases=[Case((F(6, 4), ("i", (6, 3), 5)), {"rows": 5})])


# ----------------------------------------------------------------------------- softmax family
def _offs(L, names, vs):
    """{name: offset} for the space-separated names and vars vs, in order."""
    return {n: L.off(v) for n, v in zip(names.split(), vs, strict=True)}


def _rows(v, names="MN"):
    """A value as rows: {M: rows, N: row length} (other names for other kernels' rows)."""
    return {names[0]: v.size // v.shape[-1], names[1]: v.shape[-1]}


def _softmax_ref(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _logsoftmax_ref(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _softmax_op(name, sub, ref, gref):
    op(name, infer=same_as_input, ref=lambda xs, a: (ref(xs[0]),),
       lower=lambda e, L: [L.row("k_softmax", sub=sub, oout=L.off(e.outs[0]), oin=L.off(e.ins[0]),
                                 **_rows(e.ins[0]))],
       vjp=lambda g, x, o, a: [T.emit(name + "_grad", (o[0], g[0]))], cases=[Case((F(3, 5),)), Case((F(2, 3, 4),))])
    op(name + "_grad", infer=same_as_input, ref=lambda xs, a: (gref(*xs),), internal=True,
       lower=lambda e, L: [L.row("k_softmax_bwd", sub=sub, odx=L.off(e.outs[0]), oout=L.off(e.ins[0]),
                                 og=L.off(e.ins[1]), **_rows(e.ins[0]))], cases=[Case((F(3, 5), F(3, 5)))])


_softmax_op("softmax", 0, _softmax_ref, lambda y, g: y * (g - (g * y).sum(-1, keepdims=True)))
_softmax_op("log_softmax", 1, _logsoftmax_ref, lambda y, g: g - np.exp(y) * g.sum(-1, keepdims=True))


def _ce_rule(types, attrs, fd):
    (sl, dl), (st, dt) = types
    if dl == "i32" or dt != "i32":
        raise ShapeError("cross_entropy needs float logits and integer targets")
    if tuple(sl[:-1]) != tuple(st):
        raise ShapeError(f"targets shape {st} must equal logits shape {sl} without its last axis")
    return [((), fd), (tuple(sl), fd)]


IGNORE_NONE = -2 ** 40     # the row's ignore value when nothing is ignored: no int32 target equals it


def ce_ignore(a) -> int:
    return IGNORE_NONE if a.get("ignore_index") is None else int(a["ignore_index"])


def _ce_kept(t, a):
    keep = t.ravel() != ce_ignore(a)
    return keep, (1.0 if a.get("reduction") == "sum" else (1.0 / keep.sum() if keep.any() else np.nan))


def _ce_ref(xs, a):
    logits, t = xs
    lp = _logsoftmax_ref(logits).reshape(-1, logits.shape[-1])
    keep, scale = _ce_kept(t, a)
    rows = np.flatnonzero(keep)
    return (np.asarray(-lp[rows, t.ravel()[rows]].sum() * scale), np.exp(lp).reshape(logits.shape))


def _ce_grad_ref(xs, a):
    p, t, g = xs
    keep, scale = _ce_kept(t, a)
    p2 = p.reshape(-1, p.shape[-1]).copy()
    rows = np.flatnonzero(keep)
    p2[rows, t.ravel()[rows]] -= 1
    p2[~keep] = 0
    return ((p2 * g * (scale if keep.any() else 0.0)).reshape(p.shape),)


def _lower_ce(e, L):
    ign, red = ce_ignore(e.attrs), int(e.attrs.get("reduction") == "sum")
    if e.op == "cross_entropy":
        return L.index_check(e, e.ins[1], e.ins[0].shape[-1], e.attrs.get("ignore_index")) + [L.row("k_ce_fwd", ol=L.off(e.ins[0]), ot=L.off(e.ins[1]), oloss=L.off(e.outs[0]),
                      op_=L.off(e.outs[1]), **_rows(e.ins[0], "MV"), ign=ign, red=red)]
    return [L.row("k_ce_bwd", op_=L.off(e.ins[0]), ot=L.off(e.ins[1]), og=L.off(e.ins[2]), od=L.off(e.outs[0]),
                  **_rows(e.ins[0], "MV"), ign=ign, red=red)]


_ce_cases = [{}, {"ignore_index": 2}, {"ignore_index": 2, "reduction": "sum"}, {"reduction": "sum"}]
op("cross_entropy", infer=_ce_rule, ref=_ce_ref, lower=_lower_ce,
   vjp=lambda g, x, o, a: [T.emit("cross_entropy_grad", (o[1], x[1], g[0]), **a), None],
   cases=[Case((F(4, 5), ("i", (4,), 5))), Case((F(2, 3, 7), ("i", (2, 3), 7)))] +
   [Case((F(9, 5), ("i", (9,), 5)), at) for at in _ce_cases[1:]])
op("cross_entropy_grad", infer=lambda t, a, fd: [(t[0][0], fd)], ref=_ce_grad_ref, internal=True,
   lower=_lower_ce, cases=[Case((F(4, 5), ("i", (4,), 5), F()), at) for at in _ce_cases])


# ----------------------------------------------------------------------------- fused transformer ops
def _ln_rule(types, attrs, fd):
    _float(types, "")
    (sx, _), (sw, _), (sb, _) = types
    if not sx or tuple(sw) != sx[-1:] or tuple(sb) != sx[-1:]:
        raise ShapeError(f"weight and bias must have shape ({sx[-1] if sx else '?'},)")
    m = int(np.prod(sx[:-1], dtype=np.int64))
    return [(tuple(sx), fd), ((m,), fd), ((m,), fd)]


def _ln_ref(xs, a):
    x, w, b = xs
    mu = x.mean(-1, keepdims=True)
    rs = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + a["eps"])
    return ((x - mu) * rs * w + b, mu.ravel(), rs.ravel())


def _ln_grad_ref(xs, a):
    x, w, mu, rs, gy = xs[:5]
    C = x.shape[-1]
    x2, g2 = x.reshape(-1, C), gy.reshape(-1, C)
    xh = (x2 - mu[:, None]) * rs[:, None]
    gx = g2 * w
    dx = rs[:, None] * (gx - gx.mean(-1, keepdims=True) - xh * (gx * xh).mean(-1, keepdims=True))
    return (dx.reshape(x.shape) + (xs[5] if len(xs) > 5 else 0), (g2 * xh).sum(0), g2.sum(0))


def _ln_grad_rule(types, attrs, fd):
    """(x, w, mean, rstd, dy[, acc]) -> (dx [+ acc], dw, db): acc, of x's shape, is another gradient of x
    (fuse.fuse_grad_accumulation)."""
    if len(types) > 5 and tuple(types[5][0]) != tuple(types[0][0]):
        raise ShapeError(f"layernorm_grad: acc must have x's shape {types[0][0]}, got {types[5][0]}")
    return [(types[0][0], fd), (types[1][0], fd), (types[1][0], fd)]


op("layernorm", infer=_ln_rule, ref=_ln_ref,
   lower=lambda e, L: [L.row("k_layernorm_fwd", **_offs(L, "ox og ob", e.ins), **_offs(L, "oy omean orstd", e.outs),
                             **_rows(e.ins[0], "MC"), oeps=L.const(e.attrs["eps"]))],
   vjp=lambda g, x, o, a: list(T.emit("layernorm_grad", (x[0], x[1], o[1], o[2], g[0]), **a)),
   cases=[Case((F(3, 6), F(6), F(6)), {"eps": 1e-5}), Case((F(2, 3, 5), F(5), F(5)), {"eps": 1e-5})])
op("layernorm_grad", infer=_ln_grad_rule, ref=_ln_grad_ref, internal=True,
   lower=lambda e, L: [L.row("k_layernorm_bwd", **_offs(L, "ox og omean orstd ody", e.ins[:5]),
                             **_offs(L, "odx odg odb", e.outs), **_rows(e.ins[0], "MC"),
                             oacc=L.off(e.ins[5]) if len(e.ins) > 5 else 0)],
   cases=[Case((F(3, 6), F(6), F(3), F(3, dom="pos"), F(3, 6)), {"eps": 1e-5}),
          Case((F(3, 6), F(6), F(3), F(3, dom="pos"), F(3, 6), F(3, 6)), {"eps": 1e-5})])


def _attn_flash(qkv_shape, nh) -> bool:
    return attention.flash(qkv_shape[1], qkv_shape[2] // 3 // nh)


def _attn_rule(types, attrs, fd):
    """(qkv) -> (y, P, W). P: the probabilities (B, nh, T, T), or with the flash kernels the rows' logsumexps
    (B, nh, T); W: the forward's scratch, kept for the backward (its size depends on the kernels)."""
    _float(types, "")
    (s, _), = types
    nh = attrs["n_head"]
    if len(s) != 3 or s[2] % 3 or (s[2] // 3) % nh:
        raise ShapeError(f"qkv must be (B, T, 3*C) with C divisible by n_head={nh}")
    B, T_, C3 = s
    if _attn_flash(s, nh):
        return [((B, T_, C3 // 3), fd), ((B, nh, T_), fd), ((attention.fwd_scratch(B, T_, C3 // 3, nh),), fd)]
    return [((B, T_, C3 // 3), fd), ((B, nh, T_, T_), fd), ((attn_scratch_size(B, T_, C3 // 3, nh, fd),), fd)]


def _fd(x):
    return "f32" if x.dtype == np.float32 else "f64"


def _attn_probs(qkv, nh):
    """q, k, v (B, nh, T, hs) and the scaled, masked scores and probabilities (B, nh, T, T)."""
    B, T_, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T_, nh, C // nh).transpose(0, 2, 1, 3) for i in range(3))
    att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // nh)
    att = np.where(np.tril(np.ones((T_, T_), bool)), att, -np.inf)
    return q, k, v, att, _softmax_ref(att)


def _attn_ref(xs, a):
    qkv = xs[0]
    B, T_, C3 = qkv.shape
    C, nh = C3 // 3, a["n_head"]
    q, k, v, att, p = _attn_probs(qkv, nh)
    y = (p @ v).transpose(0, 2, 1, 3).reshape(B, T_, C)
    if _attn_flash(qkv.shape, nh):
        mx = att.max(-1, keepdims=True)
        lse = (mx + np.log(np.exp(att - mx).sum(-1, keepdims=True)))[..., 0]
        return y, lse, np.zeros(attention.fwd_scratch(B, T_, C, nh))
    return y, p, np.zeros(attn_scratch_size(B, T_, C, nh, _fd(qkv)))


def _attn_grad_rule(types, attrs, fd):
    (s, _) = types[0]
    nh = attrs["n_head"]
    if _attn_flash(s, nh):
        return [(s, fd), ((attention.bwd_scratch(s[0], s[1], s[2] // 3, nh),), fd)]
    return [(s, fd), ((attn_bwd_scratch_size(s[0], s[1], s[2] // 3, nh, fd),), fd)]


def _attn_grad_ref(xs, a):
    """The VJP from the probabilities recomputed from qkv (P itself is the rows' logsumexps when flash)."""
    qkv, _, _, gy = xs
    B, T_, C3 = qkv.shape
    C, nh = C3 // 3, a["n_head"]
    hs = C // nh
    q, k, v, _, p = _attn_probs(qkv, nh)
    gy = gy.reshape(B, T_, nh, hs).transpose(0, 2, 1, 3)
    dv = p.transpose(0, 1, 3, 2) @ gy
    dp = gy @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / math.sqrt(hs)
    dq, dk = ds @ k, ds.transpose(0, 1, 3, 2) @ q
    S = attention.bwd_scratch(B, T_, C, nh) if _attn_flash(qkv.shape, nh) else attn_bwd_scratch_size(B, T_, C, nh, _fd(qkv))
    return (np.concatenate([d.transpose(0, 2, 1, 3).reshape(B, T_, C) for d in (dq, dk, dv)], -1), np.zeros(S))


def _attn_lower(e, L):
    """Where attention.flash(T, hs) (T >= 16 and T*hs >= 256, any batch), the flash kernels
    (btjit/kernels/attention.py: P holds the rows' logsumexps, W a copy of y and per-head scratch); the
    measurement behind the rule (one thread, float32, fwd + bwd against the kernels below) is at FLASH_MIN_T.
    Below that, for fewer than BL_MIN_B sequences the generated "pairs" kernels (lanes over (sequence, head)
    pairs; they keep qkv and the probabilities in their scratch W, and leave P unused) or, where those do not
    apply, the per-head loops; from BL_MIN_B the sequence-vectorized ("bl") pair or its generated twin
    ("lanes"), whose forward saves the transposed qkv in W and the probabilities in P in its own layout for
    the backward. With more than one thread the bl / lanes blocks are split over the thread pool."""
    B, T_ = e.ins[0].shape[:2]
    C, nh = e.ins[0].shape[2] // 3, e.attrs["n_head"]
    dims = dict(B=B, T=T_, C=C, NH=nh, oscale=L.const(1.0 / math.sqrt(C // nh)))
    grad = e.op == "causal_attention_grad"
    kind = "fwd" if not grad else "bwd"
    if grad:
        (qkv, P, W, gy), (dqkv, S) = e.ins, e.outs
        offs = dict(oP=L.off(P), oW=L.off(W), ody=L.off(gy), odqkv=L.off(dqkv), oS=L.off(S))
    else:
        (qkv,), (y, P, W) = e.ins, e.outs
        offs = dict(oqkv=L.off(qkv), oy=L.off(y), oP=L.off(P), oW=L.off(W))
    if _attn_flash(qkv.shape, nh):
        if grad:
            return [L.row("k_attn_bwd_flash", oqkv=L.off(qkv), oL=L.off(P), oW=L.off(W), ody=L.off(gy),
                          odqkv=L.off(dqkv), oS=L.off(S), **dims)]
        return [L.row("k_attn_fwd_flash", oqkv=L.off(qkv), oy=L.off(y), oL=L.off(P), oW=L.off(W), **dims)]
    if B < BL_MIN_B and attn_lanes.pairs_eligible(T_, C // nh, qkv.dtype):
        return [L.row(f"k_attn_{kind}_pairs", shape=(T_, C // nh), **{**offs, "oP": 0}, **dims)]   # P unused
    if B < BL_MIN_B:
        offs = dict(oqkv=L.off(qkv), oP=L.off(P), ody=L.off(gy), odqkv=L.off(dqkv)) if grad else \
            dict(oqkv=L.off(qkv), oy=L.off(y), oP=L.off(P))
        return [L.row(f"k_attn_{kind}", **offs, **dims)]
    par = "_par" if L.threads > 1 else ""
    nb = attn_blocks(B, L.threads)
    if attn_lanes.eligible(T_, C // nh, B, nb, qkv.dtype):    # same rows and layouts, generated per (T, hs)
        return [L.row(f"k_attn_{kind}_lanes{par}", shape=(T_, C // nh), **offs, **dims, nb=nb)]
    return [L.row(f"k_attn_{kind}_bl{par}", **offs, **dims, nb=nb)]


op("causal_attention", infer=_attn_rule, ref=_attn_ref, lower=_attn_lower,
   vjp=lambda g, x, o, a: [T.emit("causal_attention_grad", (x[0], o[1], o[2], g[0]), **a)[0]],
   cases=[Case((F(2, 4, 12),), {"n_head": 2}), Case((F(1, 3, 6),), {"n_head": 1}), Case((F(17, 3, 6),), {"n_head": 2}),
          Case((F(67, 2, 6),), {"n_head": 2}), Case((F(2, 5, 24),), {"n_head": 2})])
op("causal_attention_grad", infer=_attn_grad_rule, ref=_attn_grad_ref, internal=True,
   lower=_attn_lower, cases=[])


# ----------------------------------------------------------------------------- fused linear (graph/fuse.py)
def _linear_rule(types, attrs, fd):
    _float(types, "")
    (sx, _), (sw, _), (sb, _) = types[:3]
    out = tuple(sx[:-1]) + (sw[1],) if len(sw) == 2 and sx else None
    if out is None or sx[-1] != sw[0] or tuple(sb) != (sw[1],) or (len(types) == 4 and tuple(types[3][0]) != out):
        raise ShapeError(f"linear needs x (..., K), w (K, N), b (N,) [, r (..., N)]; got "
                         f"{', '.join(str(t[0]) for t in types)}")
    return [(out, fd)]


def _linear_vjp(g, x, o, a):
    X, W = x[:2]
    g = T.emit("relu_grad", (o[0], g[0])) if a.get("relu") else g[0]
    X2, g2 = T.reshape(X, (-1, X.shape[-1])), T.reshape(g, (-1, g.shape[-1]))
    dX = T.emit("matmul", (g, W), ta=False, tb=True)
    dW, db = T.emit("matmul_colsum", (X2, g2))
    return [dX, dW, db, g][:len(x)]


def _lower_matmul_colsum(e, L):
    """dW = X^T dY and db = dY.sum(0): one micro-kernel row where the product takes them (the column sums
    ride along the loop over dY's rows), else the matmul and sum rows."""
    (X, G), (dW, db) = e.ins, e.outs
    mm = type(e)("matmul", (X, G), (dW,), {"ta": True, "tb": False})
    M, N, K = X.shape[1], G.shape[1], X.shape[0]
    if micro_gemm(M, N, K, 1, 0, 0, 0, X.dtype) and not par_gemm(M * N * K, L.threads):
        return _lower_matmul(mm, L, osum=L.off(db))
    return _lower_matmul(mm, L) + TABLE["sum"].lower(type(e)("sum", (G,), (db,), {"lo": 0, "hi": 1}), L)


op("matmul_colsum", internal=True, lower=_lower_matmul_colsum,
   infer=lambda t, a, fd: [((t[0][0][1], t[1][0][1]), fd), ((t[1][0][1],), fd)],
   ref=lambda xs, a: (xs[0].T @ xs[1], xs[1].sum(0)),
   cases=[Case((F(8, 24), F(8, 72))), Case((F(5, 3), F(5, 4))), Case((F(130, 9), F(130, 50)))])


def _linear_ref(xs, a):
    y = xs[0] @ xs[1] + xs[2] + (xs[3] if len(xs) > 3 else 0)
    return (np.where(y > 0, y, 0.0) if a.get("relu") else y,)


op("linear", infer=_linear_rule, ref=_linear_ref, vjp=_linear_vjp,
   lower=lambda e, L: _lower_matmul(type(e)("matmul", e.ins[:2], e.outs, {"ta": False, "tb": False}), L,
                                    bias=L.off(e.ins[2]), res=e.ins[3] if len(e.ins) > 3 else None,
                                    relu=e.attrs.get("relu", False)),
   cases=[Case((F(5, 3), F(3, 4), F(4))), Case((F(2, 3, 4), F(4, 6), F(6))),
          Case((F(5, 3), F(3, 4), F(4), F(5, 4))), Case((F(2, 8, 24), F(24, 30), F(30), F(2, 8, 30))),
          Case((F(5, 3), F(3, 4), F(4)), {"relu": True}), Case((F(2, 8, 24), F(24, 30), F(30)), {"relu": True}),
          Case((F(2, 8, 24), F(24, 30), F(30), F(2, 8, 30)), {"relu": True}),
          Case((F(9, 5), F(5, 8), F(8), F(9, 8)), {"relu": True})])


# ----------------------------------------------------------------------------- fused elementwise chains
def _ew_ref(xs, a):
    """Evaluate a fused chain's body with the members' own references (xs[0] is its program)."""
    env = dict(zip(a["ins"], xs[1:]))
    for op_, attrs, ins, out in a["body"]:
        env[out] = TABLE[op_].ref([env[i] for i in ins], dict(attrs))[0]
    return tuple(np.broadcast_to(env[o], a["shape"]).copy() for o in a["outs"])


def _lower_ew(e, L):
    """One k_ew_program row per outer index beyond the program's 4 dims (usually one row)."""
    from btjit.kernels.fused import MAX_OPERANDS
    shape = e.attrs["shape"]
    opers = [(L.off(v), bstrides(v.shape, shape) or (0,)) for v in e.ins[1:]] + \
        [(L.off(o), cstrides(shape) or (0,)) for o in e.outs]
    return [L.row("k_ew_program", oprog=L.off(e.ins[0]), **{f"o{k}": offs[k] if k < len(offs) else 0
                                                             for k in range(MAX_OPERANDS)})
            for offs, _ in loop_nest(shape or (1,), opers, 4)]


# made by graph/fuse_ew.py after autodiff: attrs shape (the iteration space), ins / outs (var ids), body
op("ew_fused", internal=True, infer=lambda t, a, fd: [(tuple(a["shape"]), fd)] * len(a["outs"]), ref=_ew_ref,
   lower=_lower_ew)
