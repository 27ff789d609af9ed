"""Forward-graph fusions, run after tracing and before autodiff (so the backward comes from the fused op's
own VJP rule). Each rewrite keeps the graph in SSA form and replaces a pattern whose intermediate value is
used nowhere else.

  matmul(x, W) then add(., b)  ->  linear(x, W, b)     (W 2-D, b of shape (N,): bias pre-filled in the GEMM)
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


def fuse_linear(graph: Graph) -> None:
    uses = _uses(graph)
    producer = {e.outs[0].id: e for e in graph.eqns}
    drop, out = set(), []
    for e in graph.eqns:
        if e.op == "add":
            for t, b in (e.ins, e.ins[::-1]):
                mm = producer.get(t.id)
                if (mm is not None and mm.op == "matmul" and not mm.attrs["ta"] and not mm.attrs["tb"]
                        and len(mm.ins[1].shape) == 2 and b.shape == (mm.ins[1].shape[1],)
                        and uses[t.id] == 1 and t.shape == e.outs[0].shape and id(mm) not in drop):
                    drop.add(id(mm))
                    e = Eqn("linear", (mm.ins[0], mm.ins[1], b), e.outs, {}, e.src)
                    break
        out.append(e)
    graph.eqns = [e for e in out if id(e) not in drop]
