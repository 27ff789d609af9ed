"""The softmax family, cross-entropy, the fused transformer ops (layernorm, causal attention) and the fused
elementwise chains (graph/fuse_ew.py): shape rule, VJP, numpy reference, lowering, gradient cases."""
from __future__ import annotations

import math
import numpy as np

from btjit.graph import trace as T
from btjit.graph.rng import attn_dropout_in_kernel
from btjit.kernels import attention, attn_kept, attn_lanes, rng
from btjit.kernels.attn_loops import BL_MIN_B, attn_blocks, attn_bwd_scratch_size, attn_scratch_size
from btjit.kernels.common import MAX_THREADS

from btjit.graph.optable import (PAR_EW_ELEMENTS, Case, F, ShapeError, TABLE, _float, bstrides, cstrides, loop_nest, op,
                                 same_as_input)


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


def _attn_kind(qkv_shape, nh, dropout=0.0):
    """attention.kind; with dropout always the kept kernels (graph/rng.py's attn_dropout_in_kernel)."""
    return "kept" if dropout else attention.kind(qkv_shape[1], qkv_shape[2] // 3 // nh)


def _attn_sizes(s, nh, fd, dropout=0.0):
    """(P's shape, W's floats, S's floats) for qkv of shape s: W the forward's scratch, S the backward's."""
    B, T_, C = s[0], s[1], s[2] // 3
    k = _attn_kind(s, nh, dropout)
    if k == "kept":
        K = attn_kept
        return (B, nh, T_, K.padded(T_)), K.fwd_scratch(B, T_, C, nh), K.bwd_scratch(B, T_, C, nh, dropout > 0)
    if k == "flash":
        return (B, nh, T_), attention.fwd_scratch(B, T_, C, nh), attention.bwd_scratch(B, T_, C, nh)
    return (B, nh, T_, T_), attn_scratch_size(B, T_, C, nh, fd), attn_bwd_scratch_size(B, T_, C, nh, fd)


def _attn_rule(types, attrs, fd):
    """(qkv) -> (y, P, W). P: the probabilities (B, nh, T, T) -- with the kept kernels (B, nh, T, Tp), rows
    padded with zeros to a multiple of 16; with the flash kernels the rows' logsumexps (B, nh, T); W: the
    forward's scratch, kept for the backward (its size depends on the kernels)."""
    _float(types[:1], "")
    (s, _) = types[0]
    nh = attrs["n_head"]
    if len(s) != 3 or s[2] % 3 or (s[2] // 3) % nh:
        raise ShapeError(f"qkv must be (B, T, 3*C) with C divisible by n_head={nh}")
    if attrs.get("dropout") and (types[1:] != [((rng.KEY_SIZE,), "i32")] or not attn_dropout_in_kernel(s, nh)):
        raise ShapeError("attention dropout in the kernels takes the key block and T, head size >= 8")
    P, W, _ = _attn_sizes(s, nh, fd, attrs.get("dropout", 0.0))
    return [((s[0], s[1], s[2] // 3), fd), (P, fd), ((W,), fd)]


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


def _drop_mask(p, xs, a):
    """keep / (1 - p) of the probabilities p (B, nh, T, T), as k_attn_*_kept draw it (ones without dropout)."""
    if not a.get("dropout"):
        return np.ones_like(p)
    u = rng.random_np(p.shape, rng.U_UNIFORM, a["site"], xs[-1], p.dtype)
    return (u >= p.dtype.type(a["dropout"])) * (1.0 / (1.0 - a["dropout"]))


def _attn_ref(xs, a):
    qkv = xs[0]
    B, T_, C3 = qkv.shape
    C, nh = C3 // 3, a["n_head"]
    q, k, v, att, p = _attn_probs(qkv, nh)
    y = ((p * _drop_mask(p, xs, a)) @ v).transpose(0, 2, 1, 3).reshape(B, T_, C)
    P, W, _ = _attn_sizes(qkv.shape, nh, _fd(qkv), a.get("dropout", 0.0))
    kind = _attn_kind(qkv.shape, nh, a.get("dropout", 0.0))
    if kind == "flash":
        mx = att.max(-1, keepdims=True)
        p = (mx + np.log(np.exp(att - mx).sum(-1, keepdims=True)))[..., 0]
    elif kind == "kept":
        p = np.concatenate([p, np.zeros(P[:3] + (P[3] - T_,))], -1)
    return y, p, np.zeros(W)


def _attn_grad_rule(types, attrs, fd):
    (s, _) = types[0]
    return [(s, fd), ((_attn_sizes(s, attrs["n_head"], fd, attrs.get("dropout", 0.0))[2],), fd)]


def _attn_grad_ref(xs, a):
    """The VJP from the probabilities recomputed from qkv (P itself is the rows' logsumexps when flash)."""
    qkv, _, _, gy = xs[:4]
    B, T_, C3 = qkv.shape
    C, nh = C3 // 3, a["n_head"]
    hs = C // nh
    q, k, v, _, p = _attn_probs(qkv, nh)
    m = _drop_mask(p, xs, a)
    gy = gy.reshape(B, T_, nh, hs).transpose(0, 2, 1, 3)
    dv = (p * m).transpose(0, 1, 3, 2) @ gy
    dp = (gy @ v.transpose(0, 1, 3, 2)) * m
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / math.sqrt(hs)
    dq, dk = ds @ k, ds.transpose(0, 1, 3, 2) @ q
    S = _attn_sizes(qkv.shape, nh, _fd(qkv), a.get("dropout", 0.0))[2]
    return (np.concatenate([d.transpose(0, 2, 1, 3).reshape(B, T_, C) for d in (dq, dk, dv)], -1), np.zeros(S))


def _attn_lower(e, L):
    """By attention.kind (any batch; the measurements behind it are there): the kept kernels
    (btjit/kernels/attn_kept.py: P holds the probabilities, rows padded to Tp) or the flash kernels
    (btjit/kernels/attention.py: P holds the rows' logsumexps, W a copy of y and per-head scratch). Below both,
    for fewer than BL_MIN_B sequences the generated "pairs" kernels (lanes over (sequence, head)
    pairs; they keep qkv and the probabilities in their scratch W, and leave P unused) or, where those do not
    apply, the per-head loops; from BL_MIN_B the sequence-vectorized ("bl") pair or its generated twin
    ("lanes", one thread), whose forward saves the transposed qkv in W and the probabilities in P in its own
    layout for the backward. With more than one thread the bl loops' blocks and the kept kernels' blocks of
    sequences are split over the thread pool; the lanes and flash kernels run on one."""
    B, T_ = e.ins[0].shape[:2]
    C, nh = e.ins[0].shape[2] // 3, e.attrs["n_head"]
    dims = dict(B=B, T=T_, C=C, NH=nh, oscale=L.const(1.0 / math.sqrt(C // nh)))
    grad = e.op == "causal_attention_grad"
    kind = "fwd" if not grad else "bwd"
    p = e.attrs.get("dropout", 0.0)
    if grad:
        (qkv, P, W, gy), (dqkv, S) = e.ins[:4], e.outs
        offs = dict(oP=L.off(P), oW=L.off(W), ody=L.off(gy), odqkv=L.off(dqkv), oS=L.off(S))
    else:
        (qkv,), (y, P, W) = e.ins[:1], e.outs
        offs = dict(oqkv=L.off(qkv), oy=L.off(y), oP=L.off(P), oW=L.off(W))
    impl = _attn_kind(qkv.shape, nh, p)
    if impl == "kept":
        nb = attn_kept.blocks(B, L.threads)
        drop = dict(okey=L.off(e.ins[-1]), site=e.attrs["site"], odrop=L.const(p), oinv=L.const(1.0 / (1.0 - p))) \
            if p else dict(okey=0, site=0, odrop=0, oinv=0)
        if grad:
            return [L.row("k_attn_bwd_kept", oqkv=L.off(qkv), oP=L.off(P), ody=L.off(gy), odqkv=L.off(dqkv),
                          oS=L.off(S), **dims, **drop, split=nb)]
        return [L.row("k_attn_fwd_kept", oqkv=L.off(qkv), oy=L.off(y), oP=L.off(P), oW=L.off(W), **dims, **drop,
                      split=nb)]
    if impl == "flash":
        if grad:
            return [L.row("k_attn_bwd_flash", oqkv=L.off(qkv), oL=L.off(P), oW=L.off(W), ody=L.off(gy),
                          odqkv=L.off(dqkv), oS=L.off(S), **dims)]
        return [L.row("k_attn_fwd_flash", oqkv=L.off(qkv), oy=L.off(y), oL=L.off(P), oW=L.off(W), **dims)]
    hs = C // nh
    if B < BL_MIN_B and attn_lanes.pairs_eligible(T_, hs, qkv.dtype):    # generated per (T, hs)
        offs = dict(ody=L.off(gy), odqkv=L.off(dqkv), oW=L.off(W), oS=L.off(S)) if grad else \
            dict(oqkv=L.off(qkv), oy=L.off(y), oW=L.off(W))
        return [L.row(f"k_attn_{kind}_pairs", shape=(T_, hs), **offs, **dims)]
    if B < BL_MIN_B:
        offs = dict(oqkv=L.off(qkv), oP=L.off(P), ody=L.off(gy), odqkv=L.off(dqkv)) if grad else \
            dict(oqkv=L.off(qkv), oy=L.off(y), oP=L.off(P))
        return [L.row(f"k_attn_{kind}", **offs, **dims)]
    nb = attn_blocks(B, 1)
    if attn_lanes.eligible(T_, hs, B, nb, qkv.dtype):   # the bl layouts, generated per (T, hs); one thread: 2-2.5x
        if not grad:
            return [L.row("k_attn_bl_move", osrc=L.off(qkv), odst=L.off(W), B=B, n=3 * T_ * C, nb=nb, out=0),
                    L.row("k_attn_fwd_lanes", shape=(T_, hs), oW=L.off(W), oP=L.off(P), oy=L.off(y), **dims, nb=nb)]
        oS = L.off(S)
        oD = oS + B * T_ * C
        return [L.row("k_attn_bl_move", osrc=L.off(gy), odst=oS, B=B, n=T_ * C, nb=nb, out=0),
                L.row("k_attn_bwd_lanes", shape=(T_, hs), oW=L.off(W), oP=L.off(P), oS=oS, oD=oD, **dims, nb=nb),
                L.row("k_attn_bl_move", osrc=oD, odst=L.off(dqkv), B=B, n=3 * T_ * C, nb=nb, out=1)]
    nb = attn_blocks(B, L.threads)              # with threads: one block per part on the thread pool
    return [L.row(f"k_attn_{kind}_bl", **offs, **dims, nb=nb, split=nb if L.threads > 1 else 1)]


op("causal_attention", infer=_attn_rule, ref=_attn_ref, lower=_attn_lower,
   vjp=lambda g, x, o, a: [T.emit("causal_attention_grad", (x[0], o[1], o[2], g[0], *x[1:]), **a)[0], None],
   cases=[Case((F(2, 4, 12),), {"n_head": 2}), Case((F(1, 3, 6),), {"n_head": 1}), Case((F(17, 3, 6),), {"n_head": 2}),
          Case((F(67, 2, 6),), {"n_head": 2}), Case((F(2, 5, 24),), {"n_head": 2}),
          # dropout on the probabilities (the kept kernels; a fixed key block, so a fixed mask)
          Case((F(2, 8, 48), ("i", (rng.KEY_SIZE,), 3)), {"n_head": 2, "dropout": 0.3, "site": 1}),
          Case((F(1, 19, 48), ("i", (rng.KEY_SIZE,), 3)), {"n_head": 2, "dropout": 0.5, "site": 0})])
op("causal_attention_grad", infer=_attn_grad_rule, ref=_attn_grad_ref, internal=True,
   lower=_attn_lower, cases=[])


# ----------------------------------------------------------------------------- fused elementwise chains
def _ew_ref(xs, a):
    """Evaluate a fused chain's body with the members' own references (xs[0] is its program)."""
    env = dict(zip(a["ins"], xs[1:]))
    for op_, attrs, ins, out in a["body"]:
        env[out] = TABLE[op_].ref([env[i] for i in ins], dict(attrs))[0]
    return tuple(np.broadcast_to(env[o], s).copy() for o, s in zip(a["outs"], _oshapes(a)))


def _oshapes(a):
    return a.get("oshapes", (tuple(a["shape"]),) * len(a["outs"]))



def _lower_ew(e, L):
    """One k_ew_program row per outer index beyond the program's 4 dims (usually one row). Operands: the
    inputs (iview: offset and strides each, e.g. a slice's region) then the outputs (oview: output, offset,
    strides each, e.g. a region of a concatenation). A rand member's key block (the only integer input after
    the program) is the row's okey, ebase the row's first element, esize the iteration space's size."""
    from btjit.kernels.fused import MAX_OPERANDS, PF_STREAM
    shape = e.attrs["shape"]
    fins = [v for v in e.ins[1:] if v.dtype != "i32"]
    keys = [v for v in e.ins[1:] if v.dtype == "i32"]
    iview = e.attrs.get("iview") or [(0, bstrides(v.shape, shape)) for v in fins]
    oview = e.attrs.get("oview") or [(k, 0, cstrides(shape)) for k in range(len(e.outs))]
    opers = [(L.off(v) + off, st or (0,)) for v, (off, st) in zip(fins, iview)] + \
        [(L.off(e.outs[k]) + off, st or (0,)) for k, off, st in oview]
    rows = []
    for offs, inner in loop_nest(shape or (1,), opers, 4):
        size = int(np.prod([n for n, _ in inner]))
        big = size * (8 if e.outs[0].dtype == "f64" else 4) * len(opers) > PF_STREAM    # may stream: the program
        stream = -1 if big else 0                         # sets the measured rule once its kernels are loaded
        args = dict(oprog=L.off(e.ins[0]), okey=L.off(keys[0]) if keys else 0, ebase=len(rows) * size,
                    esize=int(np.prod(shape)), stream=stream,
                    **{f"o{k}": offs[k] if k < len(offs) else 0 for k in range(MAX_OPERANDS)})
        threads = min(L.threads, MAX_THREADS)
        split = threads if size >= PAR_EW_ELEMENTS else 1   # runs of blocks: bitwise equal to one thread
        rows.append(L.row("k_ew_program", **args, split=split))
    return rows


# made by graph/fuse_ew.py after autodiff: attrs shape (the iteration space), ins / outs (var ids), oshapes,
# iview / oview (the operands' placement), body
op("ew_fused", internal=True, infer=lambda t, a, fd: [(tuple(s), fd) for s in _oshapes(a)], ref=_ew_ref,
   lower=_lower_ew)
