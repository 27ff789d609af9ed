"""Random ops: `rand` -- uniform [0, 1) or standard normal numbers of one shape, drawn by the counter-based
generator of btjit/kernels/rng.py from the key block (the program's seed and step count, an i32 value
at the plan's int_state slots) and the op's site number. The tracer's rand_like / randn_like / dropout
(graph/trace.py) build on it; dropout inside the attention probabilities is the causal_attention op's
(graph/ops/nn.py). In a fused elementwise chain (graph/fuse_ew.py) `rand` is one instruction that draws in
registers, so a backward chain recomputes a dropout mask instead of reading it."""
from __future__ import annotations

from btjit.kernels import rng as RNG

from btjit.graph.optable import Case, ShapeError, op


def _rule(types, attrs, fd):
    if len(types) != 1 or types[0] != ((RNG.KEY_SIZE,), "i32"):
        raise ShapeError(f"rand takes the ({RNG.KEY_SIZE},) int32 key block")
    return [(tuple(attrs["shape"]), fd)]


def ref(xs, a):
    """The numbers of site a["site"] under the key block xs[0] (kernels/rng.py)."""
    return (RNG.random_np(tuple(a["shape"]), a["kind"], a["site"], xs[0]),)


def lower(e, L):
    out = e.outs[0]
    return [L.row("k_rand", oout=L.off(out), n=out.size, okey=L.off(e.ins[0]), site=e.attrs["site"],
                  kind=e.attrs["kind"])]


_key = ("i", (RNG.KEY_SIZE,), 3)       # a replica word > 0 too: elements numbered from replica * size
op("rand", infer=_rule, ref=ref, lower=lower, nondiff=True,
   cases=[Case((_key,), {"shape": (3, 5), "site": 3, "kind": RNG.U_UNIFORM}),
          Case((_key,), {"shape": (2, 3, 7), "site": 0, "kind": RNG.U_NORMAL}),
          Case((_key,), {"shape": (), "site": 1, "kind": RNG.U_UNIFORM})])
