"""The bounds of a program's integer indices: which batch inputs are used as indices (each checked against its
bound by a check row before the tape runs), and the integer constants used as indices, checked once at trace time.
"""
from __future__ import annotations

from btjit.graph import trace as T
from btjit.graph.memory import storage_roots


def index_bounds(graph) -> dict:
    """For integer batch inputs used as indices: input position -> (exclusive upper bound, a value allowed
    besides or None: an ignore_index every use of the input ignores). Integer constants used as indices (also
    through a reshape) are checked here, once: a TraceError naming the op and line."""
    pos = {v.id: i for i, v in enumerate(graph.inputs)}
    consts = {v.id: c for v, c in graph.consts.items() if v.dtype == "i32"}
    root = storage_roots(graph)
    bounds = {}
    for e in graph.eqns:
        hi, idx, ok = None, None, None
        if e.op == "take":
            hi, idx = e.ins[0].shape[0], e.ins[1]
        elif e.op == "take_sum":
            hi, idx = e.ins[0].shape[1], e.ins[1]
        elif e.op == "cross_entropy":
            hi, idx, ok = e.ins[0].shape[-1], e.ins[1], e.attrs.get("ignore_index")
        elif e.op == "check_index":
            hi, idx, ok = e.attrs["hi"], e.ins[0], e.attrs.get("ok")
        if idx is not None:
            r = root.get(idx.id, idx.id)
            i = pos.get(r)
            if i is not None:
                h, o = bounds.get(i, (hi, ok))
                bounds[i] = (min(h, hi), o if o == ok else None)
            c = consts.get(r)
            c = c[c != ok] if c is not None and ok is not None else c
            if c is not None and c.size and (c.min() < 0 or c.max() >= hi):
                raise T.TraceError(f"{e.op}: constant index values must be in [0, {hi}), got min {c.min()} "
                                   f"max {c.max()} — {e.src}")
    return bounds
