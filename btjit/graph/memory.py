"""Memory planner: every value at a fixed offset in ONE float arena (plus one int32 arena, planned the same way:
[integer consts | integer inputs | BLAS scratch | step counter | planned integer intermediates]).

Float arena layout (llm.c style):
  [16 unused | params | grads (same layout) | optimizer state (k copies of that layout) | buffers |
   hyper-parameters | constants | float inputs | outputs (loss, named outputs, assigned values) | planned
   intermediates]
`pin` first gives the values a run leaves readable (outputs, grads, assigned values) their fixed slots.
A program that shares another's params and buffers (prog.eval's) reads them at the other's offsets and
places everything else from `shared.base` on (past the other's arena: see Program.eval).
(no float value at offset 0: kernel rows use offset 0 for "no bias / residual / ...")
Views (reshape) share their input's storage. Intermediates get offsets by a greedy best-fit over their
lifetimes on the whole forward+backward schedule: two storages share bytes only if their lifetimes
[defining eqn, last use] are disjoint. The update kernels run after the schedule and touch only the fixed
regions. Every buffer starts 16-element aligned (64 bytes in float32). The traced optimizer update reads
graph.regions (a param group's or one param's slices of the params / grads / state regions, hyper-parameter slots) in
place, and its assigned values (graph.assigns, pinned as ("at", region var)) are stored straight into them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from btjit.kernels.common import MAX_THREADS

from btjit.graph import trace as T
from btjit.graph.ir import Graph
from btjit.graph.ops import TABLE

ALIGN = 16


def _al(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Plan:
    off: dict                    # var id -> offset in its arena (float or int by var dtype)
    param_off: dict              # name -> offset
    params_span: tuple           # (start, length) of the params region; grads at start + length
    n_state: int                 # optimizer state copies of the params region
    hyper_off: int               # start of the hyper-parameter slots
    n_hyper: int
    float_size: int
    int_size: int
    scratch: int                 # int32 BLAS scratch (8 slots)
    int_state: int               # int32 key block: [step, index-check flag, seed lo, seed hi, replica] (kernels/rng.py)
    buffer_off: dict = field(default_factory=dict)  # buffer name -> offset
    buffers_span: tuple = (0, 0)                     # (start, length) of the buffers region
    intervals: dict = field(default_factory=dict)   # storage var id -> (def, last use, offset, size) planned
    naive_bytes: int = 0
    min_bytes: int = 0

    @property
    def grads_start(self):
        return self.params_span[0] + self.params_span[1]

    def state_start(self, k):
        return self.params_span[0] + (2 + k) * self.params_span[1]


def storage_roots(graph: Graph) -> dict:
    """var id -> id of the var that owns its storage (views point to their input's root)."""
    root = {}
    for e in graph.eqns:
        for o in e.outs:
            root[o.id] = root.get(e.ins[0].id, e.ins[0].id) if TABLE[e.op].view else o.id
    return root


def lifetimes(graph: Graph, root: dict) -> dict:
    """storage id -> [first def, last use] over the eqn schedule."""
    life = {}
    for i, e in enumerate(graph.eqns):
        for v in e.ins:
            r = root.get(v.id, v.id)
            if r in life:
                life[r][1] = max(life[r][1], i)
        for o in e.outs:
            r = root[o.id]
            if r not in life:
                life[r] = [i, i]
    return life


def place(sizes: dict, life: dict) -> tuple[dict, int]:
    """Greedy best-fit: largest first, lowest offset that overlaps no placed buffer alive at the same time. The
    placed buffers are columns of arrays, so finding those alive at once and the first gap that fits are array
    operations (a 400-step LSTM plans ~10K buffers)."""
    order = sorted(sizes, key=lambda s: (-sizes[s], life[s][0]))
    n = len(order)
    start, end, first, last = (np.zeros(n, np.int64) for _ in range(4))
    offs, top = {}, 0
    for k, s in enumerate(order):
        lo, hi = life[s]
        alive = ~((last[:k] < lo) | (first[:k] > hi))
        b0, b1 = start[:k][alive], end[:k][alive]
        off = 0
        if b0.size:
            at = np.argsort(b0, kind="stable")
            b0, b1 = b0[at], b1[at]
            before = np.concatenate(([0], np.maximum.accumulate(b1)))    # the loop's offset before each interval
            fits = np.flatnonzero(before[:-1] + sizes[s] <= b0)
            off = int(before[fits[0]] if fits.size else before[-1])
        offs[s] = off
        start[k], end[k], first[k], last[k] = off, off + sizes[s], lo, hi
        top = max(top, off + sizes[s])
    return offs, top


@dataclass
class Shared:
    """The params and buffers another program owns (offsets in its arena), and where this one's own begin."""
    param_off: dict
    buffer_off: dict
    base: int


def plan(graph: Graph, pinned: dict, n_state: int, n_hyper: int, shared: Shared | None = None) -> Plan:
    """pinned: storage var id -> ("grad", name) | ("out", name); everything else unpinned is planned."""
    root = storage_roots(graph)
    life = lifetimes(graph, root)
    var = var_index(graph)
    off, ioff = {}, {}
    pos = p0 = ALIGN        # offset 0 stays unused: kernel rows take an offset of 0 to mean "no such operand"
    param_off, buffer_off = {}, {}
    for name, v in graph.params.items():
        param_off[name] = off[v.id] = pos if shared is None else shared.param_off[name]
        pos += _al(v.size)
    plen = pos - p0
    pos = p0 + plen * (2 + n_state)
    b0 = pos
    for name, v in graph.buffers.items():
        buffer_off[name] = off[v.id] = pos if shared is None else shared.buffer_off[name]
        pos += _al(v.size)
    blen = pos - b0
    if shared is not None:
        pos = shared.base
    hyper_off = pos
    pos += _al(n_hyper)
    ipos = 0
    for v, c in graph.consts.items():
        if v.dtype == "i32":
            ioff[v.id], ipos = ipos, ipos + _al(v.size)
        else:
            off[v.id], pos = pos, pos + _al(v.size)
    for v in graph.inputs:
        if v.dtype == "i32":
            ioff[v.id], ipos = ipos, ipos + _al(v.size)
        else:
            off[v.id], pos = pos, pos + _al(v.size)
    scratch, ipos = ipos, ipos + 8 * MAX_THREADS    # 8 int32 BLAS argument slots per thread
    int_state, ipos = ipos, ipos + ALIGN
    if graph.rng_key is not None:               # the random ops' key block: [step, flag, seed, seed]
        ioff[graph.rng_key.id] = int_state
    def region(tag):
        if tag[0] == "hyper":
            return hyper_off + tag[1]
        _, k, first = tag
        return param_off[first] + k * plen
    for v, tag in graph.regions.items():
        off[v.id] = region(tag)
    for r, (kind, name) in pinned.items():
        if kind == "grad":
            off[r] = param_off[name] + plen
        elif kind == "at":
            off[r] = region(graph.regions[name])
        elif var[r].dtype == "i32":                 # an integer output of the traced function
            ioff[r], ipos = ipos, ipos + _al(var[r].size)
        else:
            off[r], pos = pos, pos + _al(var[r].size)
    fixed = set(off) | set(ioff)
    sizes = {r: _al(var[r].size) for r in life if r not in fixed and var[r].dtype != "i32"}
    isizes = {r: _al(var[r].size) for r in life if r not in fixed and var[r].dtype == "i32"}
    rel, top = place(sizes, life)
    for r, o in rel.items():
        off[r] = pos + o
    irel, itop = place(isizes, life)            # integer intermediates: the int arena, by liveness too
    for r, o in irel.items():
        ioff[r] = ipos + o
    intervals = {r: (life[r][0], life[r][1], pos + rel[r], sizes[r]) for r in rel}
    fsize = pos + top
    naive_ints = ipos + sum(isizes.values())
    ipos += itop
    for vid, r in root.items():   # views
        if vid != r:
            (ioff if r in ioff else off)[vid] = (ioff if r in ioff else off)[r]
    p = Plan({**off, **ioff}, param_off, (p0, plen), n_state, hyper_off, n_hyper, fsize, ipos, scratch, int_state,
             buffer_off, (b0, blen), intervals)
    p.naive_bytes = (pos + sum(sizes.values())) * _itemsize(graph) + naive_ints * 4
    p.min_bytes = (plen * (2 + n_state) + blen) * _itemsize(graph)
    return p


def _itemsize(graph):
    return 4 if graph.float_dtype == "f32" else 8


def pin(g: Graph, grads: dict) -> dict:
    """Give each output, grad and assigned value its own storage in its fixed slot, copying where the value's
    storage is fixed (a param, buffer, input, constant) or already pinned."""
    root = storage_roots(g)
    fixed = {v.id for v in list(g.params.values()) + list(g.buffers.values()) + g.inputs + list(g.consts)}
    pinned = {}
    fwd_copies, bwd_copies = [], []

    def own(v, tag, copies):
        r = root.get(v.id, v.id)
        if r in fixed or r in pinned:
            with T.building(g):
                c = T.copy(T.Tracer(v, g))
            copies.append(g.eqns.pop())
            v, r = c.node, c.node.id
        pinned[r] = tag
        return v

    g.outputs = {k: own(v, ("out", k), fwd_copies) for k, v in g.outputs.items()}
    if g.loss is not None:
        g.loss = g.outputs["out"]
    g.grads = {k: own(v, ("grad", k), bwd_copies) for k, v in grads.items()}
    backward = {o.id for e in g.eqns[g.n_forward:] for o in e.outs}   # assigned values of the update: after it
    state = g.state_vars()
    for a in g.assigns:
        a.value = own(a.value, ("out", "assign/%s/%s" % state[a.target.id]),
                      bwd_copies if a.value.id in backward else fwd_copies)
    g.eqns = g.eqns[:g.n_forward] + fwd_copies + g.eqns[g.n_forward:] + bwd_copies
    g.n_forward += len(fwd_copies)
    return pinned


def var_index(graph: Graph) -> dict:
    idx = {v.id: v for v in list(graph.params.values()) + list(graph.buffers.values()) + graph.inputs +
           list(graph.consts) + list(graph.regions)}
    for e in graph.eqns:
        for o in e.outs:
            idx[o.id] = o
    return idx


