"""Graph fusions. The forward ones run after tracing and before autodiff (so the backward comes from the
fused op's own VJP rule); fuse_grad_accumulation runs on the backward that autodiff appended. Each rewrite
keeps the graph in SSA form and replaces a pattern whose intermediate value is used nowhere else.

  matmul(x, W) then add(., b)  ->  linear(x, W, b)     (W 2-D, b of shape (N,): bias pre-filled in the GEMM)
  linear(x, W, b) then add(., r)  ->  linear(x, W, b, r)  (r of the output's shape: a residual connection,
                                                          added by the GEMM as it stores)
  linear(...) then relu(.)  ->  linear(..., relu=True)  (the activation, applied by the GEMM as it stores;
                                                       its gradient reads the output, as relu's does)
  take(table, idx) -> reshape -> matmul(., W)  ->  take_sum(matmul(table, W as (P, E, N)), idx)
                                                  (an embedding table with fewer rows than the batch)
  backward: layernorm_grad(...) -> dx, then add(dx, acc)  ->  layernorm_grad(..., acc)
                                                  (x's other gradient, e.g. from its residual connection,
                                                   added by the LayerNorm backward kernel as it stores)
"""
from __future__ import annotations

from collections import Counter

from .ir import Eqn, Graph


def _uses(graph: Graph) -> Counter:
    n = Counter(v.id for e in graph.eqns for v in e.ins)
    for v in graph.outputs.values():
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
    _into(graph, "relu", rewrite)


def fold_embedding_matmul(graph: Graph) -> None:
    """x = take(table (V, E), idx (B, P)) reshaped to (B, P*E), then x @ W with W (P*E, N): when V < B, compute
    the P products table @ W[p*E:(p+1)*E] once per table row and gather-sum them per sample instead,
    take_sum(matmul(table, reshape(W, (P, E, N))), idx). Same function; the forward and both backward
    products then cost P*V*E*N instead of B*P*E*N multiply-adds (E5, the makemore MLP: 28M instead of 67M
    each), and the (B, P*E) gathered activations are never built."""
    uses = _uses(graph)
    producer = {o.id: e for e in graph.eqns for o in e.outs}
    drop, out = set(), []
    for e in graph.eqns:
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
