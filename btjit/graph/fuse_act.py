"""Activations written out by hand become one op (a forward rewrite, before autodiff, as btjit/graph/fuse.py's):

  0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))  ->  gelu(x)        (NewGELU: makemore, minGPT)
  0.5 * x * (1 + erf(x / sqrt(2)))                          ->  gelu_erf(x)    (the exact GELU: BERT's, HF's)
  x * sigmoid(x)                                            ->  silu(x)        (swish)

in any order and association of the products and sums (x**3 traced as products, x / c as a division by a
constant), when the intermediate values are used nowhere else. One op is one fused instruction (or kernel)
forward and one backward; written out, the exact GELU took 4 forward and 11 backward.
"""
from __future__ import annotations

import math

import numpy as np

from btjit.graph.fuse import _uses
from btjit.graph.ir import Eqn, Graph
from btjit.kernels.elementwise import RSQRT2

GELU_C0, GELU_C1 = 0.7978845608028654, 0.044715      # sqrt(2 / pi) and the cubic's coefficient


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-6)


def fuse_activations(graph: Graph) -> None:
    uses = _uses(graph)
    producer = {o.id: e for e in graph.eqns for o in e.outs}
    consts = {v.id: float(np.asarray(c).ravel()[0]) for v, c in graph.consts.items() if np.asarray(c).size == 1}
    replace, drop = {}, set()

    def flat(v, op, inner):
        """v as a product / sum: (the constant factor / term, the other operands, the eqns inside). A division
        by a constant counts as a product by its inverse."""
        e = producer.get(v.id)
        div = op == "mul" and e is not None and e.op == "div" and e.ins[1].id in consts and consts[e.ins[1].id] != 0
        if e is None or (e.op != op and not div) or (inner and uses[v.id] != 1):
            return (consts[v.id], [], []) if v.id in consts else (1.0 if op == "mul" else 0.0, [v], [])
        if div:
            c, rest, eqns = flat(e.ins[0], op, True)
            return c / consts[e.ins[1].id], rest, [e] + eqns
        c, rest, eqns = (1.0 if op == "mul" else 0.0), [], [e]
        for x in e.ins:
            xc, xr, xe = flat(x, op, True)
            c = c * xc if op == "mul" else c + xc
            rest += xr
            eqns += xe
        return c, rest, eqns

    def form(x, s, c):
        """The eqns computing c * x * s beyond x, and the op, if it is a GELU of x; else None."""
        c1, terms, e1 = flat(s, "add", True)                   # s = c1 + c3 * f(u)
        if len(terms) != 1:
            return None
        c3, fs, e3 = flat(terms[0], "mul", True)
        f = producer.get(fs[0].id) if len(fs) == 1 else None
        if f is None or f.op not in ("tanh", "erf") or uses[fs[0].id] != 1 \
                or not (_close(c * c1, 0.5) and _close(c * c3, 0.5)):
            return None
        c2, us, e2 = flat(f.ins[0], "mul", True)
        if f.op == "erf":                                       # u = x / sqrt(2)
            ok = len(us) == 1 and us[0] is x and _close(c2, RSQRT2)
            return (e1 + e3 + [f] + e2, "gelu_erf") if ok else None
        if len(us) != 1 or not _close(c2, GELU_C0):             # u = sqrt(2/pi) * w
            return None
        c4, ws, e4 = flat(us[0], "add", True)                   # w = x + 0.044715 * x^3
        cube = [w for w in ws if w is not x]
        if c4 != 0.0 or len(ws) != 2 or len(cube) != 1:
            return None
        c5, xs, e5 = flat(cube[0], "mul", True)
        if not _close(c5, GELU_C1) or len(xs) != 3 or any(v is not x for v in xs):
            return None
        return e1 + e3 + [f] + e2 + e4 + e5, "gelu"

    for e in graph.eqns:
        if e.op not in ("mul", "div") or id(e) in drop:
            continue
        sig = [producer.get(v.id) for v in e.ins]
        for x, s in ((0, 1), (1, 0)):                           # x * sigmoid(x)
            if e.op == "mul" and sig[s] is not None and sig[s].op == "sigmoid" and sig[s].ins[0] is e.ins[x] \
                    and uses[e.ins[s].id] == 1:
                replace[id(e)] = Eqn("silu", (e.ins[x],), e.outs, {}, e.src)
                drop.add(id(sig[s]))
                break
        if id(e) in replace:
            continue
        c, fs, eqns = flat(e.outs[0], "mul", False)            # c * x * s
        if len(fs) != 2:
            continue
        for x, s in (fs, fs[::-1]):
            found = form(x, s, c)
            if found:
                replace[id(e)] = Eqn(found[1], (x,), e.outs, {}, e.src)
                drop |= {id(q) for q in eqns[1:] + found[0]}
                break
    graph.eqns = [replace.get(id(e), e) for e in graph.eqns if id(e) not in drop]
