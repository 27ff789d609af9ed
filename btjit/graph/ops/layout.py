"""Layout and gather ops (reshape, broadcast_to, transpose, slices, concatenate, take): shape rule, VJP,
numpy reference, lowering, gradient cases."""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.kernels import elementwise as EW

from btjit.graph.optable import (Case, F, ShapeError, _bcast_shape, bstrides, copy_rows, cstrides, op, par_parts,
                                 strided_rows)


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
    x, perm, n = e.ins[0], tuple(e.attrs["perm"]), len(e.ins[0].shape)
    if n >= 2 and perm == tuple(range(n - 2)) + (n - 1, n - 2) and x.dtype != "i32" and min(x.shape[-2:]) >= 16:
        nb = x.size // (x.shape[-1] * x.shape[-2])      # a batch of matrices: register tiles
        return [L.row("k_transpose", split=par_parts(L, x.size, nb), oout=L.off(e.outs[0]), oin=L.off(x), nb=nb,
                       rows=x.shape[-2], cols=x.shape[-1])]
    st = cstrides(e.ins[0].shape)
    return copy_rows(L, e, L.off(e.outs[0]), cstrides(e.outs[0].shape), L.off(e.ins[0]),
                     tuple(st[p] for p in e.attrs["perm"]))


op("transpose", infer=_transpose_rule, ref=lambda xs, a: (np.transpose(xs[0], a["perm"]).copy(),),
   lower=_lower_transpose, vjp=lambda g, x, o, a: [T.transpose(g[0], tuple(np.argsort(a["perm"])))],
   cases=[Case((F(2, 3, 4),), {"perm": (2, 0, 1)}), Case((F(2, 3, 4, 5),), {"perm": (0, 2, 1, 3)}),
          Case((F(40, 17),), {"perm": (1, 0)}), Case((F(2, 33, 16),), {"perm": (0, 2, 1)})])


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
    x, y, a = e.ins[0], e.outs[0], e.attrs
    if all(k == 1 for k in a["steps"]) and 0 < len(y.shape) <= 4:      # a zero padding: k_pad, one pass
        lead = (1,) * (4 - len(y.shape))
        e_, d_, s_ = lead + tuple(y.shape), lead + tuple(x.shape), (0,) * (4 - len(y.shape)) + tuple(a["starts"])
        return [L.row("k_pad", split=par_parts(L, y.size, e_[0] * e_[1]), oout=L.off(y), oin=L.off(x),
                       **{f"{c}{i}": v[i] for c, v in (("e", e_), ("d", d_), ("s", s_)) for i in range(4)})]
    off, st = _slice_view(y.shape, a)
    return [L.row("k_fill", oout=L.off(y), n=y.size, oc=L.const(0.0))] + strided_rows(
        L, EW.B_COPY, e.ins[0].shape, (L.off(e.outs[0]) + off, st), [(L.off(e.ins[0]), cstrides(e.ins[0].shape))])


_sl = {"starts": (1, 0), "stops": (4, 5), "steps": (2, 2)}
op("slice", infer=_slice_rule, ref=lambda xs, a: (xs[0][_slices(a)].copy(),), lower=_lower_slice,
   vjp=lambda g, x, o, a: [T.emit("slice_scatter", (g[0],), shape=x[0].shape, **a)],
   cases=[Case((F(4, 5),), _sl), Case((F(3, 4, 5),), {"starts": (0, 1, 0), "stops": (3, 3, 5), "steps": (1, 1, 1)})])
op("slice_scatter", infer=lambda t, a, fd: [(tuple(a["shape"]), fd)], ref=_slice_scatter_ref,
   lower=_lower_slice_scatter, internal=True,
   cases=[Case((F(2, 3),), dict(_sl, shape=(4, 5))),     # strided; then zero paddings (k_pad)
          Case((F(2, 3, 4),), dict(starts=(1, 1, 2), stops=(3, 4, 6), steps=(1, 1, 1), shape=(3, 5, 7))),
          Case((F(2, 2, 3, 4),), dict(starts=(0, 1, 2, 1), stops=(2, 3, 5, 5), steps=(1, 1, 1, 1),
                                      shape=(2, 4, 6, 6)))],
   vjp=lambda g, x, o, a: [T.emit("slice", (g[0],), **{k: a[k] for k in ("starts", "stops", "steps")})])


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


# ----------------------------------------------------------------------------- gather
def _take_rule(types, attrs, fd):
    (st, dt), (si, di) = types
    if di != "i32":
        raise ShapeError("take needs an integer index array")
    if not st:
        raise ShapeError("cannot index a 0-d value")
    return [(tuple(si) + tuple(st[1:]), dt if dt == "i32" else fd)]


def _row_len(shape):
    return int(np.prod(shape[1:], dtype=np.int64))


op("take", infer=_take_rule, ref=lambda xs, a: (xs[0][xs[1]],),
   lower=lambda e, L: L.index_check(e, e.ins[1], e.ins[0].shape[0]) + [
       L.row("k_gather_rows", otable=L.off(e.ins[0]), oidx=L.off(e.ins[1]), oout=L.off(e.outs[0]), n=e.ins[1].size,
             C=_row_len(e.ins[0].shape), ints=int(e.ins[0].dtype == "i32"))],
   vjp=lambda g, x, o, a: [T.emit("take_grad", (g[0], x[1]), rows=x[0].shape[0]), None],
   cases=[Case((F(5, 3), ("i", (4, 2), 5))), Case((F(6), ("i", (7,), 6)))])


def _check_rule(types, attrs, fd):
    (s, d), = types
    if d != "i32":
        raise ShapeError("class ids must be an integer array")
    return [(tuple(s), d)]


# check_index(idx, hi, ok): idx itself (a view), after a check that every id is in [0, hi) or equals ok: a
# batch input once before the tape (core/bounds.py), a computed index by a check row. For an index used
# by ops composed of others (nll_loss's one-hot), whose out-of-range ids would otherwise pick nothing.
op("check_index", infer=_check_rule, ref=lambda xs, a: (xs[0],), view=True, nondiff=True, internal=True,
   lower=lambda e, L: L.index_check(e, e.ins[0], e.attrs["hi"], e.attrs.get("ok")))


def _take_grad_ref(xs, a):
    g, idx = xs
    out = np.zeros((a["rows"],) + g.shape[idx.ndim:], g.dtype)
    np.add.at(out, idx, g)
    return (out,)


op("take_grad", infer=lambda t, a, fd: [((a["rows"],) + tuple(t[0][0][len(t[1][0]):]), fd)], ref=_take_grad_ref,
   internal=True, cases=[Case((F(4, 2, 3), ("i", (4, 2), 5)), {"rows": 5})],
   vjp=lambda g, x, o, a: [T.emit("take", (g[0], x[1])), None],       # (an assignment at traced positions)
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
        split = par_parts(L, B * P * N, (N + 15) // 16)        # blocks of 16 columns on the threads
        return L.index_check(e, e.ins[1], V) + [L.row(kernel, split=split, **{table: L.off(e.ins[0]),
                                                                             out: L.off(e.outs[0])},
                                                      oidx=L.off(e.ins[1]), B=B, P=P, V=V, N=N)]
    return lower


# take_sum(table (P, V, N), idx (B, P))[b] = sum_p table[p, idx[b, p]]: made by graph/fuse.py from
# take -> reshape -> matmul (not a public tensor function; gradient-checked like one).
op("take_sum", infer=_take_sum_rule, ref=_take_sum_ref, lower=_take_sum_lower("k_take_sum"),
   vjp=lambda g, x, o, a: [T.emit("take_sum_grad", (g[0], x[1]), rows=x[0].shape[1]), None],
   cases=[Case((F(3, 5, 4), ("i", (6, 3), 5))), Case((F(1, 2, 3), ("i", (4, 1), 2)))])
op("take_sum_grad", infer=lambda t, a, fd: [((t[1][0][1], a["rows"], t[0][0][1]), fd)], ref=_take_sum_grad_ref,
   internal=True, lower=_take_sum_lower("k_take_sum_grad"),
   cases=[Case((F(6, 4), ("i", (6, 3), 5)), {"rows": 5})])




# ----------------------------------------------------------------------------- sorting
def _argsort_rule(types, attrs, fd):
    (s, d), = types
    if d == "i32" or not s:
        raise ShapeError("argsort needs a float array of at least 1 dim (sorted along its last axis)")
    if not 1 <= attrs["k"] <= s[-1]:
        raise ShapeError(f"k={attrs['k']} must be in [1, {s[-1]}] (the size of the last axis)")
    return [(tuple(s[:-1]) + (attrs["k"],), "i32")]


def _argsort_ref(xs, a):
    x = xs[0]
    key = np.where(np.isnan(x), np.inf, x)       # NaN as the largest (the cases hold no NaN, no inf)
    order = np.argsort(-key if a.get("descending") else key, axis=-1, kind="stable")
    return (order[..., :a["k"]].astype(np.int32),)


def _lower_argsort(e, L):
    x, N = e.ins[0], e.ins[0].shape[-1]
    M = x.size // N if N else 0
    return [L.row("k_argsort", split=par_parts(L, x.size, M), ox=L.off(x), oout=L.off(e.outs[0]), M=M, N=N,
                  K=e.attrs["k"], desc=int(bool(e.attrs.get("descending"))))]


# argsort(x, k, descending): the positions of the first k of each last-axis row of x in sorted order, stable (the
# lower position first among equal values), an int32 array (..., k); sort / argsort / topk (graph/sort_fns.py)
# gather their values by it (take), so the gradient goes back to the positions taken
op("argsort", infer=_argsort_rule, ref=_argsort_ref, lower=_lower_argsort, nondiff=True,
   cases=[Case((F(3, 7),), {"k": 7}), Case((F(2, 3, 9),), {"k": 2, "descending": True}), Case((F(5),), {"k": 1})])
