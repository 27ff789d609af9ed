"""Graph fusions. The forward ones run after tracing and before autodiff (so the backward comes from the
fused op's own VJP rule); fuse_grad_accumulation and fuse_scatter_sum run on the backward that autodiff appended. Each rewrite
keeps the graph in SSA form and replaces a pattern whose intermediate value is used nowhere else.

  matmul(x, W) then add(., b)  ->  linear(x, W, b)     (W 2-D, b of shape (N,): bias pre-filled in the GEMM)
  linear(x, W, b) then add(., r)  ->  linear(x, W, b, r)  (r of the output's shape: a residual connection,
                                                          added by the GEMM as it stores)
  linear(...) then relu(.)  ->  linear(..., relu=True)  (the activation, applied by the GEMM as it stores;
                                                       its gradient reads the output, as relu's does)
  conv_gemm(...) then relu(.)  ->  conv_gemm(..., relu=1)  (the same for an implicit-GEMM convolution)
  take(table, idx) -> reshape -> matmul(., W)  ->  take_sum(matmul(table, W as (P, E, N)), idx)
                                                  (an embedding table with fewer rows than the batch)
  q @ k^T * scale, causal masked_fill, softmax, @ v (split / reshape / swapaxes heads)  ->  causal_attention
                                                  (attention written out by hand, as makemore writes it)
  GELU, SiLU written out  ->  gelu(x), gelu_erf(x), silu(x)   (btjit/graph/fuse_act.py)
  backward: slice_scatter(g1) + ... + slice_scatter(gn) tiling one axis  ->  concatenate(g1, ..., gn)
                                                  (the gradient of a value split into pieces: LSTM gates)
  backward: pool2d_grad(x, d) -> dy, then conv_dy(dy, ...)  ->  conv_dy(x, d, ..., pool=1 + mode)
                                                  (a convolution followed by a pooling: the pooling's gradient
                                                   made image by image inside the pass that lays out the
                                                   convolution's output gradient, never stored whole)
  backward: slice(col2im(dcol)), slice(conv_gemm(slice_scatter(dy), flip=1))  ->  the same, cropped
                                                  (a padded convolution's input gradient: col2im with the crop
                                                   as padding, the transposed convolution over dy padded less,
                                                   make the unpadded input's gradient, not the padded one's)
  backward: layernorm_grad(...) -> dx, then add(dx, acc)  ->  layernorm_grad(..., acc)
                                                  (x's other gradient, e.g. from its residual connection,
                                                   added by the LayerNorm backward kernel as it stores)
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from btjit.graph.ir import Eqn, Graph
from btjit.graph.ops.pool import POOL_GEOM
from btjit.graph.optable import TABLE


def _uses(graph: Graph) -> Counter:
    n = Counter(v.id for e in graph.eqns for v in e.ins)
    for v in list(graph.outputs.values()) + [a.value for a in graph.assigns]:
        n[v.id] += 1
    if graph.loss is not None:
        n[graph.loss.id] += 1
    return n


def _into(graph: Graph, op: str, rewrite) -> None:
    """For each eqn e of `op` with an input t made by an eqn p and used only there, rewrite(p, the other
    inputs of e, e) may return the one eqn that replaces both (at e's place), or None to leave them."""
    uses = _uses(graph)
    producer = {e.outs[0].id: e for e in graph.eqns}
    drop, out = set(), []
    for e in graph.eqns:
        if e.op == op:
            for j, t in enumerate(e.ins):
                p = producer.get(t.id)
                rest = e.ins[:j] + e.ins[j + 1:]
                new = rewrite(p, rest, e) if p is not None and uses[t.id] == 1 and id(p) not in drop else None
                if new is not None:
                    drop.add(id(p))
                    e = new
                    break
        out.append(e)
    graph.eqns = [e for e in out if id(e) not in drop]


def fuse_linear(graph: Graph) -> None:
    def rewrite(mm, rest, add):
        if mm.op != "matmul" or mm.attrs["ta"] or mm.attrs["tb"]:
            return None
        W, (b,) = mm.ins[1], rest
        if len(W.shape) == 2 and b.shape == (W.shape[1],) and mm.outs[0].shape == add.outs[0].shape:
            return Eqn("linear", (mm.ins[0], W, b), add.outs, {}, add.src)
    _into(graph, "add", rewrite)


def fuse_residual(graph: Graph) -> None:
    def rewrite(lin, rest, add):
        (r,) = rest
        if lin.op == "linear" and len(lin.ins) == 3 and not lin.attrs.get("relu") \
                and r.shape == add.outs[0].shape == lin.outs[0].shape and r.dtype == lin.outs[0].dtype:
            return Eqn("linear", (*lin.ins, r), add.outs, {}, add.src)
    _into(graph, "add", rewrite)


def fuse_relu(graph: Graph) -> None:
    def rewrite(lin, rest, relu):
        if lin.op == "linear" and not lin.attrs.get("relu"):
            return Eqn("linear", lin.ins, relu.outs, {"relu": True}, relu.src)
        if lin.op == "conv_gemm" and lin.attrs["tout"] and not lin.attrs.get("relu"):    # conv2d, then relu
            return Eqn("conv_gemm", lin.ins, relu.outs, {**lin.attrs, "relu": 1}, relu.src)
    _into(graph, "relu", rewrite)


def fold_embedding_matmul(graph: Graph) -> None:
    """x = take(table (V, E), idx (B, P)) reshaped to (B, P*E), then x @ W with W (P*E, N): when V < B, compute
    the P products table @ W[p*E:(p+1)*E] once per table row and gather-sum them per sample instead,
    take_sum(matmul(table, reshape(W, (P, E, N))), idx). Same function; the forward and both backward
    products then cost P*V*E*N instead of B*P*E*N multiply-adds (E5, the makemore MLP: 28M instead of 67M
    each), and the (B, P*E) gathered activations are never built. The same for x = concatenate of P takes of
    one table along the last axis (makemore's MLP: one take per context position, of rolled indices)."""
    uses = _uses(graph)
    producer = {o.id: e for e in graph.eqns for o in e.outs}
    drop, out = set(), []
    for e in graph.eqns:
        folded = _fold_concatenated_takes(graph, e, producer, uses)
        if folded:
            out += folded[0]
            drop |= folded[1]
            continue
        rs = producer.get(e.ins[0].id) if e.op == "matmul" else None
        tk = producer.get(rs.ins[0].id) if rs is not None and rs.op == "reshape" else None
        if (tk is not None and tk.op == "take" and not e.attrs["ta"] and not e.attrs["tb"]
                and uses[rs.outs[0].id] == 1 and uses[tk.outs[0].id] == 1
                and len(tk.ins[0].shape) == 2 and len(tk.ins[1].shape) == 2 and len(e.ins[1].shape) == 2):
            (table, idx), W = tk.ins, e.ins[1]
            (V, E), (B, P), N = table.shape, idx.shape, W.shape[1]
            if e.ins[0].shape == (B, P * E) and V < B:
                W3, TW = graph.new_var((P, E, N), W.dtype), graph.new_var((P, V, N), e.outs[0].dtype)
                out += [Eqn("reshape", (W,), (W3,), {"shape": (P, E, N)}, e.src),
                        Eqn("matmul", (table, W3), (TW,), {"ta": False, "tb": False}, e.src),
                        Eqn("take_sum", (TW, idx), e.outs, {}, e.src)]
                drop |= {id(rs), id(tk)}
                continue
        out.append(e)
    graph.eqns = [e for e in out if id(e) not in drop]


def _fold_concatenated_takes(graph, e, producer, uses):
    """matmul(concatenate([take(table, i_0), .., take(table, i_P-1)], -1) (S + (P*E,)), W (P*E, N)) ->
    reshape(take_sum(matmul(table, W as (P, E, N)), the i_p stacked as (prod S, P)), S + (N,)); None if e is
    not that, or the table has not fewer rows than prod S. -> (eqns, ids of the eqns it replaces)."""
    cat = producer.get(e.ins[0].id) if e.op == "matmul" else None
    if cat is None or cat.op != "concatenate" or e.attrs["ta"] or e.attrs["tb"] or len(e.ins[1].shape) != 2 \
            or uses[cat.outs[0].id] != 1 or cat.attrs["axis"] != len(cat.outs[0].shape) - 1:
        return None
    tks = [producer.get(v.id) for v in cat.ins]
    if not all(t is not None and t.op == "take" and uses[t.outs[0].id] == 1 for t in tks) \
            or len({id(t) for t in tks}) != len(tks) or len({t.ins[0].id for t in tks}) != 1:
        return None
    table, W = tks[0].ins[0], e.ins[1]
    S, P = tks[0].ins[1].shape, len(tks)
    if len(table.shape) != 2 or any(t.ins[1].shape != S for t in tks):
        return None
    (V, E), N, R = table.shape, W.shape[1], int(np.prod(S, dtype=np.int64))
    if W.shape[0] != P * E or V >= R:
        return None
    cols = [graph.new_var(S + (1,), "i32") for _ in tks]
    idx, idx2 = graph.new_var(S + (P,), "i32"), graph.new_var((R, P), "i32")
    W3, TW = graph.new_var((P, E, N), W.dtype), graph.new_var((P, V, N), e.outs[0].dtype)
    y2 = graph.new_var((R, N), e.outs[0].dtype)
    eqns = [Eqn("reshape", (t.ins[1],), (c,), {"shape": S + (1,)}, e.src) for t, c in zip(tks, cols)]
    eqns += [Eqn("concatenate", tuple(cols), (idx,), {"axis": len(S)}, e.src),
             Eqn("reshape", (idx,), (idx2,), {"shape": (R, P)}, e.src),
             Eqn("reshape", (W,), (W3,), {"shape": (P, E, N)}, e.src),
             Eqn("matmul", (table, W3), (TW,), {"ta": False, "tb": False}, e.src),
             Eqn("take_sum", (TW, idx2), (y2,), {}, e.src),
             Eqn("reshape", (y2,), e.outs, {"shape": e.outs[0].shape}, e.src)]
    return eqns, {id(cat), *(id(t) for t in tks)}


def fuse_grad_accumulation(graph: Graph) -> None:
    uses = _uses(graph)
    pos = {o.id: i for i, e in enumerate(graph.eqns) for o in e.outs}
    fused, drop = {}, set()
    for i, e in enumerate(graph.eqns):
        if e.op != "add" or i < graph.n_forward:
            continue
        for t, acc in (e.ins, e.ins[::-1]):
            ln = graph.eqns[pos[t.id]] if t.id in pos else None
            if (ln is not None and ln.op == "layernorm_grad" and len(ln.ins) == 5 and ln.outs[0] is t
                    and uses[t.id] == 1 and acc.shape == t.shape and pos.get(acc.id, -1) < pos[t.id]
                    and id(ln) not in fused):
                fused[id(ln)] = Eqn("layernorm_grad", (*ln.ins, acc), (e.outs[0], *ln.outs[1:]), ln.attrs, ln.src)
                drop.add(id(e))
                break
    graph.eqns = [fused.get(id(e), e) for e in graph.eqns if id(e) not in drop]


def fuse_pool_grad(graph: Graph) -> None:
    """conv_dy(pool2d_grad(x, d), [y]) -> conv_dy(x, d, [y], pool=1 + mode, the pooling's geometry), its last
    output a scratch of one image per part (graph/ops/conv.py)."""
    def rewrite(pg, rest, e):
        if pg.op != "pool2d_grad" or e.ins[0] is not pg.outs[0] or e.attrs.get("pool", 0):
            return None
        ins = (*pg.ins, *rest)
        attrs = dict(e.attrs, pool=1 + pg.attrs["mode"], **{k: pg.attrs[k] for k in POOL_GEOM})
        types = TABLE["conv_dy"].infer([(v.shape, v.dtype) for v in ins], attrs, graph.float_dtype)
        return Eqn("conv_dy", ins, (*e.outs, graph.new_var(*types[-1])), attrs, e.src)
    _into(graph, "conv_dy", rewrite)


def crop_padded_input_grad(graph: Graph) -> None:
    """backward: slice(dX), the crop of a padded input's gradient dX to the unpadded input's (N, C, H, W) -- which
    an elementwise chain read row by row (its rows W apart, not merged: blocks of W elements) -> dX made cropped:
    col2im(dcol) with the crop as its padding (the patches' entries outside dropped); the transposed convolution
    conv_gemm(slice_scatter(dy), flip=1) over dy padded by the window's reach less what the slice crops."""
    uses = _uses(graph)
    made = {o.id: i for i, e in enumerate(graph.eqns) for o in e.outs}
    new, drop = {}, set()
    for e in graph.eqns[graph.n_forward:]:
        d = graph.eqns[made[e.ins[0].id]] if e.op == "slice" and e.ins[0].id in made else None
        if d is None or d.op not in ("col2im", "conv_gemm") or uses[e.ins[0].id] != 1 or \
                any(k != 1 for k in e.attrs["steps"]) or e.attrs["starts"][:2] != (0, 0) or \
                e.outs[0].shape[:2] != e.ins[0].shape[:2]:
            continue
        a0, b0 = e.attrs["starts"][2:]
        h, w = e.outs[0].shape[2:]
        if d.op == "col2im":
            new[id(d)] = Eqn("col2im", d.ins, e.outs, dict(d.attrs, x_shape=e.outs[0].shape, ph=d.attrs["ph"] + a0,
                                                          pw=d.attrs["pw"] + b0), d.src)
            drop.add(id(e))
            continue
        pad = graph.eqns[made[d.ins[0].id]] if d.ins[0].id in made else None
        if not d.attrs["flip"] or not d.attrs["tout"] or pad is None or pad.op != "slice_scatter" or \
                uses[pad.outs[0].id] != 1:
            continue
        (_, hp, wp, _), (_, t0, l0, _), (_, t1, l1, _) = pad.outs[0].shape, pad.attrs["starts"], pad.attrs["stops"]
        top, left = t0 - a0, l0 - b0                    # dy's padding before and after, less the crop
        bottom, right = hp - t1 - (d.attrs["oh"] - a0 - h), wp - l1 - (d.attrs["ow"] - b0 - w)
        if min(top, left, bottom, right) < 0:
            continue
        dy = pad.ins[0]
        N, oh, ow, O = dy.shape
        gp = graph.new_var((N, oh + top + bottom, ow + left + right, O), dy.dtype)
        new[id(pad)] = Eqn("slice_scatter", (dy,), (gp,), dict(pad.attrs, shape=gp.shape, starts=(0, top, left, 0),
                                                              stops=(N, top + oh, left + ow, O)), pad.src)
        new[id(d)] = Eqn("conv_gemm", (gp,) + d.ins[1:], e.outs, dict(d.attrs, oh=h, ow=w, pt=top), d.src)
        drop.add(id(e))
    graph.eqns = [new.get(id(e), e) for e in graph.eqns if id(e) not in drop]


def fold_transposed_operands(graph: Graph) -> None:
    """matmul(a, transpose(w), tb=True) -> matmul(a, w, tb=False) where the transpose swaps w's last two axes
    (and likewise for a and ta): the backward of x @ w.T (torch's Linear layout, an RNN cell's h @ W_hh^T) reads
    w as the plain product it is, on the fast path, instead of its transpose transposed back. Only flags that
    turn off: a product made transposed (B^T, slower on few rows) is never introduced."""
    prod = {o.id: e for e in graph.eqns for o in e.outs}

    def swapped(v):
        t = prod.get(v.id)
        n = len(v.shape)
        if t is not None and t.op == "transpose" and n >= 2 and \
                tuple(t.attrs["perm"]) == tuple(range(n - 2)) + (n - 1, n - 2):
            return t.ins[0]
        return None
    for i, e in enumerate(graph.eqns):
        if e.op != "matmul":
            continue
        ins, attrs = list(e.ins), dict(e.attrs)
        for k, flag in ((0, "ta"), (1, "tb")):
            src = swapped(ins[k]) if attrs[flag] else None
            if src is not None:
                ins[k], attrs[flag] = src, False
        if attrs != e.attrs:
            graph.eqns[i] = Eqn("matmul", tuple(ins), e.outs, attrs, e.src)


def fuse_scatter_sum(graph: Graph) -> None:
    """backward: the sum of slice_scatters of g_1 .. g_n (each used once) whose regions tile their shape along
    one axis -> concatenate(g_1 .. g_n) along it: the gradient of x split into pieces that are all used (LSTM /
    GRU gates, q | k | v) is one copy of the pieces' gradients instead of n zero-filled arrays and n - 1 adds."""
    uses = _uses(graph)
    parts, inner = {}, {}           # var id -> the slice_scatter eqns summed into it; var id -> its add eqn
    for e in graph.eqns[graph.n_forward:]:
        o = e.outs[0]
        if e.op == "slice_scatter":
            parts[o.id] = [e]
        elif e.op == "add" and e.ins[0].id != e.ins[1].id and all(
                v.id in parts and uses[v.id] == 1 and v.shape == o.shape for v in e.ins):
            parts[o.id] = parts[e.ins[0].id] + parts[e.ins[1].id]
            inner[o.id] = e
    absorbed = {v.id for e in inner.values() for v in e.ins}
    replace, drop = {}, set()
    for vid, e in inner.items():
        axis = None if vid in absorbed else _tiling_axis(parts[vid])
        if axis is None:
            continue
        ps = sorted(parts[vid], key=lambda q: q.attrs["starts"][axis])
        replace[id(e)] = Eqn("concatenate", tuple(q.ins[0] for q in ps), e.outs, {"axis": axis}, e.src)
        todo = list(e.ins)
        while todo:                                      # the scatters and inner adds it replaces
            v = todo.pop()
            q = inner.get(v.id) or parts[v.id][0]
            drop.add(id(q))
            todo += list(q.ins) if q.op == "add" else []
    # each concatenation as early as its inputs allow (right after the last is made), so that the elementwise
    # group computing them can write it before any product reads another concatenation of theirs (GRU)
    made = {o.id: i for i, e in enumerate(graph.eqns) for o in e.outs}
    at: dict = {}
    for c in replace.values():
        at.setdefault(max([graph.n_forward - 1] + [made.get(v.id, -1) for v in c.ins]), []).append(c)
    graph.eqns = [x for i, e in enumerate(graph.eqns)
                  for x in ([e] if id(e) not in drop and id(e) not in replace else []) + at.get(i, [])]


def _tiling_axis(scatters):
    """The axis along which the slice_scatters' regions (step 1) tile their whole shape, else None."""
    shape = scatters[0].attrs["shape"]
    regions = [(q.attrs["starts"], q.attrs["stops"], q.attrs["steps"]) for q in scatters]
    if any(q.attrs["shape"] != shape or any(s != 1 for s in st) for q, (_, _, st) in zip(scatters, regions)):
        return None
    cut = [d for d in range(len(shape)) if any((lo[d], hi[d]) != (0, shape[d]) for lo, hi, _ in regions)]
    if len(cut) != 1:
        return None
    d = cut[0]
    spans = sorted((lo[d], hi[d]) for lo, hi, _ in regions)
    ok = spans[0][0] == 0 and spans[-1][1] == shape[d] and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    return d if ok else None


def fuse_attention(graph: Graph, table) -> None:
    """Causal self-attention written out by hand, as makemore and nanoGPT's slow path write it --
        q, k, v = split(qkv (B, T, 3C), 3, axis=2), each reshaped to (B, T, nh, hs) and swapped to (B, nh, T, hs)
        att = (q @ k.swapaxes(-2, -1)) * (1 / sqrt(hs))        (or / sqrt(hs))
        att = masked_fill(att, causal mask == 0, -inf); att = softmax(att, -1)
        y = (att @ v).swapaxes(1, 2).reshape(B, T, C)
    -- becomes one causal_attention(qkv) (its kernels, its VJP), when every intermediate is used only in the
    pattern, the mask is a constant that hides exactly the future, and the scale is 1/sqrt(hs). `table`: the
    op table (for the fused op's output types)."""
    import math
    uses = _uses(graph)
    producer = {o.id: e for e in graph.eqns for o in e.outs}
    consts = {v.id: np.asarray(c) for v, c in graph.consts.items()}
    replace, drop = {}, set()

    def single(v, op):
        e = producer.get(v.id)
        return e if e is not None and e.op == op and uses[v.id] == 1 else None

    def head_split(v, perm, which):            # v = transpose(reshape(slice(qkv, block `which`)))
        tr = single(v, "transpose")
        rs = single(tr.ins[0], "reshape") if tr is not None and tr.attrs["perm"] == perm else None
        sl = single(rs.ins[0], "slice") if rs is not None else None
        if sl is None or len(sl.ins[0].shape) != 3 or any(s != 1 for s in sl.attrs["steps"]):
            return None
        B, T_, C3 = sl.ins[0].shape
        C = C3 // 3
        if C3 % 3 or sl.attrs["starts"] != (0, 0, which * C) or sl.attrs["stops"] != (B, T_, (which + 1) * C) \
                or len(rs.attrs["shape"]) != 4 or rs.attrs["shape"][:2] != (B, T_):
            return None
        return sl.ins[0], rs.attrs["shape"][2], [tr, rs, sl]

    def const_value(v):
        c = consts.get(v.id)
        return float(c.ravel()[0]) if c is not None and c.size == 1 else None

    for e in graph.eqns:
        out = e.outs[0]
        if e.op != "reshape" or len(out.shape) != 3:
            continue
        tr = single(e.ins[0], "transpose")
        mm2 = single(tr.ins[0], "matmul") if tr is not None and tr.attrs["perm"] == (0, 2, 1, 3) else None
        sm = single(mm2.ins[0], "softmax") if mm2 is not None and not (mm2.attrs["ta"] or mm2.attrs["tb"]) else None
        wh = single(sm.ins[0], "where") if sm is not None else None
        if wh is None:
            continue
        cond, a, b = wh.ins
        mask = consts.get(cond.id)
        inf_first = const_value(a) == -math.inf
        scores = b if inf_first else a
        if mask is None or not (inf_first or const_value(b) == -math.inf) or len(mask.shape) < 2:
            continue
        sc = producer.get(scores.id) if uses[scores.id] == 1 else None
        if sc is None or sc.op not in ("mul", "div") or const_value(sc.ins[1]) is None:
            continue
        mm1 = single(sc.ins[0], "matmul")
        if mm1 is None or mm1.attrs["ta"] or mm1.attrs["tb"]:
            continue
        kt = single(mm1.ins[1], "transpose")
        parts = [head_split(mm1.ins[0], (0, 2, 1, 3), 0),
                 head_split(kt.ins[0], (0, 2, 1, 3), 1) if kt is not None and kt.attrs["perm"] == (0, 1, 3, 2) else None,
                 head_split(mm2.ins[1], (0, 2, 1, 3), 2)]
        if any(p is None for p in parts) or len({id(p[0]) for p in parts}) != 1 or len({p[1] for p in parts}) != 1:
            continue
        qkv, nh = parts[0][0], parts[0][1]
        B, T_, C3 = qkv.shape
        hs = C3 // 3 // nh
        scale = const_value(sc.ins[1]) if sc.op == "mul" else 1.0 / const_value(sc.ins[1])
        future = np.triu(np.ones((T_, T_), bool), 1)
        hidden = (mask != 0) if inf_first else (mask == 0)
        if out.shape != (B, T_, C3 // 3) or not math.isclose(scale, 1.0 / math.sqrt(hs), rel_tol=1e-6) \
                or hidden.shape[-2:] != (T_, T_) or not (np.broadcast_to(hidden, hidden.shape) == future).all():
            continue
        types = table["causal_attention"].infer([(qkv.shape, qkv.dtype)], {"n_head": nh}, qkv.dtype)
        outs = (out,) + tuple(graph.new_var(s, d) for s, d in types[1:])
        replace[id(e)] = Eqn("causal_attention", (qkv,), outs, {"n_head": nh}, e.src)
        drop |= {id(x) for x in (tr, mm2, sm, wh, sc, mm1, kt)} | {id(x) for p in parts for x in p[2]}
    graph.eqns = [replace.get(id(e), e) for e in graph.eqns if id(e) not in drop]
