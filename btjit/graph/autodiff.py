"""Reverse-mode autodiff as a graph-to-graph transform.

Walks the forward equations in reverse, calls each op's VJP rule from the op table (the rules emit new
equations through the tracer API), sums fan-out contributions, and reduces broadcast gradients back to the
input's shape in ONE place (`unbroadcast`). Only values that depend on a parameter and reach the loss get
gradients; a final dead-code pass drops what no output needs.
"""
from __future__ import annotations

from btjit.graph import trace as T
from btjit.graph.ir import Graph
from btjit.graph.ops import TABLE


def unbroadcast(g: T.Tracer, shape: tuple) -> T.Tracer:
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    if axes:
        g = T.sum(g, axis=axes)
    return T.reshape(g, shape)


def _depends_on(graph: Graph, sources) -> set:
    dep = {v.id for v in sources}
    for e in graph.eqns:
        if not TABLE[e.op].nondiff and any(v.id in dep for v in e.ins):
            dep.update(o.id for o in e.outs)
    return dep


def _reaches(graph: Graph, sinks) -> set:
    need = {v.id for v in sinks}
    for e in reversed(graph.eqns):
        if any(o.id in need for o in e.outs):
            need.update(v.id for v in e.ins)
    return need


def differentiate(graph: Graph) -> dict:
    """Append backward equations for d graph.loss / d params; returns {param name: grad Var} for the params
    the loss depends on (the others have zero gradient)."""
    forward = list(graph.eqns)
    active = _depends_on(graph, graph.params.values()) & _reaches(graph, [graph.loss])
    ct = {}   # var id -> gradient tracer
    with T.building(graph):
        ct[graph.loss.id] = T.lift(1.0)
        for e in reversed(forward):
            if TABLE[e.op].nondiff or not any(o.id in ct for o in e.outs):
                continue
            gs = [ct.get(o.id) for o in e.outs]
            if gs[0] is None:
                continue
            with T.source(e.src):
                xs = [T.Tracer(v, graph) for v in e.ins]
                outs = [T.Tracer(v, graph) for v in e.outs]
                rule = TABLE[e.op].vjp
                if rule is None:
                    raise T.TraceError(f"{e.op}: no gradient rule — {e.src}")
                for v, g in zip(e.ins, rule(gs, xs, outs, e.attrs)):
                    if g is None or v.id not in active or v.dtype == "i32":
                        continue
                    g = unbroadcast(g, v.shape)
                    ct[v.id] = ct[v.id] + g if v.id in ct else g
    return {name: ct[v.id].node for name, v in graph.params.items() if v.id in ct}


def eliminate_dead_code(graph: Graph, keep) -> None:
    need = {v.id for v in keep}
    kept = []
    for e in reversed(graph.eqns):
        if any(o.id in need for o in e.outs):
            kept.append(e)
            need.update(v.id for v in e.ins)
    fwd_ids = {id(e) for e in graph.eqns[:graph.n_forward]}
    bwd_ids = {id(e) for e in graph.eqns[:graph.n_backward or len(graph.eqns)]}
    graph.eqns = list(reversed(kept))
    graph.n_forward = sum(1 for e in graph.eqns if id(e) in fwd_ids)
    graph.n_backward = sum(1 for e in graph.eqns if id(e) in bwd_ids)
