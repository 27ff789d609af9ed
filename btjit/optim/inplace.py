"""The optimizer's new values written in place (btjit.trace calls `assign_in_place` after fusion): each new
param and state value is computed straight into its place in the arena, or -- when an equation still reads the
old value after the new one is written -- left to the copy that ends the step."""
from __future__ import annotations

from btjit.graph import trace as T
from btjit.graph.fuse_ew import ALIAS, BINARY, UNARY
from btjit.graph.memory import storage_roots

ELEMENTWISE = set(UNARY) | set(BINARY) | {"where"}


def assign_in_place(g, pinned: dict) -> None:
    """The optimizer's assigns (graph.assigns whose target is one of graph.regions), after fusion: each new
    value is computed straight into its target's place (pinned[id] = ("at", target), no copy row) unless the
    old value is still read after the new one is written; then it is pinned as an output and copied into the
    place when the step ends (graph/lower.py: assign_rows), as every other assign is. A value that is not its
    own storage (a region, a view, one value assigned twice) is first copied: a region where the update begins,
    before anything writes it, any other where it is made."""
    root = storage_roots(g)
    fixed = {v.id for v in list(g.params.values()) + list(g.buffers.values()) + g.inputs + list(g.consts) +
             list(g.regions)}
    mine = [a for a in g.assigns if a.target in g.regions]
    claimed = set(pinned)
    for a in mine:
        r = root.get(a.value.id, a.value.id)
        if r != a.value.id or r in fixed or r in claimed:
            with T.building(g):
                c = T.copy(T.Tracer(a.value, g))
            at = next((i + 1 for i in range(len(g.eqns) - 2, g.n_backward - 1, -1) if a.value in g.eqns[i].outs),
                      g.n_backward)
            g.eqns.insert(at, g.eqns.pop())
            a.value = c.node
        claimed.add(a.value.id)
    producer = {o.id: i for i, e in enumerate(g.eqns) for o in e.outs}
    for a in mine:
        if _read_after(g, producer[a.value.id], a.value, a.target, root):
            pinned[a.value.id] = ("out", f"assign/optimizer/{':'.join(map(str, g.regions[a.target]))}")
        else:
            pinned[a.value.id] = ("at", a.target)
            a.in_place = True


def _read_after(g, i, new, old, root) -> bool:
    """Is old (or a view of it) read after eqns[i] writes new? Inside a fused chain, by the members after the
    one computing new; an unfused equation reading old only if it is one elementwise op."""
    reads = lambda e: any(root.get(v.id, v.id) == old.id for v in e.ins)   # noqa: E731
    if any(reads(e) for e in g.eqns[i + 1:]):
        return True
    e = g.eqns[i]
    if not reads(e):
        return False
    if e.op != "ew_fused":                           # one elementwise op works in place, any other may not
        return not (e.op in ELEMENTWISE and old.shape == e.outs[0].shape or e.op == "opt_update")
    body = e.attrs["body"]
    at = next(k for k, m in enumerate(body) if m[3] == new.id)
    alias = {old.id}
    for op, _, ins, out in body:
        if op in ALIAS and ins[0] in alias:
            alias.add(out)
    return any(set(ins) & alias for _, _, ins, _ in body[at + 1:])
