"""A pure-numpy interpreter of a planned program: runs each equation's numpy reference (from the op table)
on a copy of the program's arenas, reading and writing at the planned offsets. Used by tests to check
that the native tape computes exactly what the planned IR says (and so that the plan is consistent)."""
from __future__ import annotations

import numpy as np

from btjit.graph.ops import TABLE


def run(prog, *batch, upto: str = "backward"):
    """Returns (float arena, int arena) after running forward (upto="forward") or forward+backward."""
    a, ia = prog.a.copy(), prog.ia.copy()
    for dst, x in zip(prog.graph.inputs, batch):
        arena = ia if dst.dtype == "i32" else a
        arena[prog.plan.off[dst.id]:][:dst.size] = np.asarray(x).ravel()
    n = prog.graph.n_forward if upto == "forward" else prog.graph.n_backward
    for e in prog.graph.eqns[:n]:
        if TABLE[e.op].view:
            continue
        ins = [(ia if v.dtype == "i32" else a)[prog.plan.off[v.id]:][:v.size].reshape(v.shape).copy()
               for v in e.ins]
        outs = TABLE[e.op].ref(ins, e.attrs)
        for v, val in zip(e.outs, outs):
            arena = ia if v.dtype == "i32" else a
            arena[prog.plan.off[v.id]:][:v.size] = np.asarray(val, dtype=arena.dtype).ravel()
    return a, ia
