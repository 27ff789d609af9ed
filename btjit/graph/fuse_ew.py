"""Elementwise fusion: maximal chains of elementwise equations become ONE `ew_fused` equation, lowered to one
row of the program-interpreting kernel (btjit/kernels/fused.py), so a new chain compiles nothing; a lone unary
op (a tanh between two products) runs there too, so no program compiles a kernel of its own for it.

Runs on the whole schedule after autodiff. A group is a set of float elementwise equations (unary, binary
with broadcasting, where, the *_grad ops, broadcast_to and copy of an operand, a slice of a value made outside
the group: read in place with the slice's offset and strides) with one output shape, the iteration space,
inside one region (forward, backward or the optimizer update), and concatenations of its values, which the group
writes straight into their regions (an LSTM's gate gradients into one (B, 4H) array). Equations join in schedule
order; a group closes
as soon as an equation outside it reads one of its values (the fused equation sits at its last member's
place, so every reader must come later). A backward group that needs a value computed inside a forward group
recomputes it from that group's operands (up to REMAT equations) instead of reading it: the forward group
then need not store it. Values read outside the group (and the program's outputs, loss and grads) are the
fused equation's outputs; the others live only in registers. A `rand` member draws its numbers in the
registers (a dropout mask the backward needs is drawn again there, not stored).
"""
from __future__ import annotations

import numpy as np

from btjit.kernels import elementwise as EW
from btjit.kernels.fused import BIN, FMA, FMA2, FMS, FMS2, FNMA, LOAD, LOADC, MAX_OPERANDS, NREG, RAND, WHERE, WIDTH

from btjit.graph.ir import Eqn, Graph
from btjit.graph.ops import bstrides, cstrides, loop_nest
from btjit.graph.ops.layout import _slice_view

UNARY = {"neg": EW.U_NEG, "exp": EW.U_EXP, "log": EW.U_LOG, "tanh": EW.U_TANH, "relu": EW.U_RELU,
         "sigmoid": EW.U_SIGMOID, "sqrt": EW.U_SQRT, "abs": EW.U_ABS, "erf": EW.U_ERF, "log1p": EW.U_LOG1P,
         "sign": EW.U_SIGN, "sin": EW.U_SIN, "cos": EW.U_COS, "gelu_erf": EW.U_GELU,
         "silu": EW.U_SILU}
BINARY = {"add": EW.B_ADD, "sub": EW.B_SUB, "mul": EW.B_MUL, "div": EW.B_DIV, "maximum": EW.B_MAX,
          "minimum": EW.B_MIN, "pow2": EW.B_POW, "eq": EW.B_EQ, "gt": EW.B_GT, "ge": EW.B_GE, "lt": EW.B_LT,
          "le": EW.B_LE, "ne": EW.B_NE, "tanh_grad": EW.B_TANH_GRAD, "relu_grad": EW.B_RELU_GRAD,
          "sigmoid_grad": EW.B_SIGMOID_GRAD, "gelu_erf_grad": EW.B_GELU_GRAD,
          "silu_grad": EW.B_SILU_GRAD}
LONE = set(UNARY) | {"gelu_erf_grad", "silu_grad"}   # run in the interpreter on their own (k_binary: no loop for them)
ALIAS = {"copy", "stop_gradient", "broadcast_to"}   # no instruction: the operand's register (broadcast strides)
MAX_MEMBERS = 24
REMAT = 16


def _fusable(e: Eqn) -> bool:
    if e.op == "rand":                  # one instruction drawing in registers (its key block is the row's)
        return True
    if e.op not in UNARY and e.op not in BINARY and e.op not in ALIAS and e.op not in ("where", "pow", "slice"):
        return False
    return all(v.dtype != "i32" for v in e.ins + e.outs) and len(e.outs) == 1


def _sink(e: Eqn, producer, group_of, groups, closed, region):
    """The open groups (one shape, one region) making the values a concatenate joins, which it can join: the
    merged group then writes them into the concatenation's regions (the gradient of split gates); else None."""
    if e.op != "concatenate" or e.outs[0].dtype == "i32":
        return None
    ks = sorted({group_of.get(producer.get(v.id)) for v in e.ins} - {None})
    if not ks or any(k in closed or groups[k]["region"] != region for k in ks):
        return None
    ok = all(v.shape == groups[ks[0]]["shape"] for v in e.ins)
    return ks if ok and sum(len(groups[k]["members"]) for k in ks) < MAX_MEMBERS else None


def _merge(groups, group_of, closed, remat, ks, readers):
    """Merge the open groups ks into the first (safe: nothing outside has read their values yet)."""
    k = ks[0]
    for other in ks[1:]:
        groups[k]["members"] += groups[other]["members"]
        _add_reads(groups, readers, k, groups[other]["reads"])
        groups[k]["sib"] |= groups[other]["sib"]
        for j in groups[other]["members"]:
            group_of[j] = k
        groups[other]["members"] = []
        remat.setdefault(k, set()).update(remat.pop(other, ()))
        closed.add(other)
    return k


def _add_reads(groups, readers, k, ids):
    """Group k reads the arrays ids (readers: array id -> the groups reading it, for the sibling join)."""
    groups[k]["reads"] |= ids
    for v in ids:
        readers.setdefault(v, set()).add(k)


def fuse_elementwise(g: Graph) -> None:
    if not _fuse(g, siblings=True):      # a sibling join that does not fit the kernel: group without them
        _fuse(g, siblings=False)


def _fuse(g: Graph, siblings: bool) -> bool:
    """Groups and fuses g's equations; False (g untouched) if siblings is set and a group joined by one
    no longer fits the kernel."""
    eqns = g.eqns
    n_fwd, n_bwd = g.n_forward, g.n_backward or len(eqns)
    producer = {o.id: i for i, e in enumerate(eqns) for o in e.outs}
    group_of, groups, closed = {}, [], set()
    remat: dict = {}                     # group -> [forward eqn indices recomputed in it]
    readers: dict = {}                   # array id -> the groups reading it whole
    for i, e in enumerate(eqns):
        region = 0 if i < n_fwd else 1 if i < n_bwd else 2
        src_groups = {group_of[producer[v.id]] for v in e.ins if producer.get(v.id) in group_of}
        ks = _sink(e, producer, group_of, groups, closed, region)
        if ks is not None:
            k = _merge(groups, group_of, closed, remat, ks, readers)
            groups[k]["members"].append(i)
            group_of[i] = k
            closed.update(src_groups - {k})
            continue
        if not _fusable(e) or (e.op in ALIAS or e.op == "slice") and any(producer.get(v.id) in group_of for v in e.ins):
            closed.update(src_groups)
            continue
        shape = e.outs[0].shape
        join = [k for k in src_groups if k not in closed and groups[k]["shape"] == shape and
                groups[k]["region"] == region]
        for k in src_groups - set(join):
            closed.add(k)
        full = {v.id for v in e.ins if v.shape == shape}
        sib = sorted({k for v in full for k in readers.get(v, ()) if siblings and k not in closed and k not in join
                      and groups[k]["shape"] == shape and groups[k]["region"] == region})
        if sum(len(groups[k]["members"]) for k in join + sib) < MAX_MEMBERS:
            join += sib                  # open groups reading the same array: one pass over it, not two
        else:
            sib = []
        if join and sum(len(groups[k]["members"]) for k in join) < MAX_MEMBERS:
            k = _merge(groups, group_of, closed, remat, join, readers)
        else:
            closed.update(join)
            k = len(groups)
            groups.append({"shape": shape, "region": region, "members": [], "reads": set(), "sib": False})
        groups[k]["members"].append(i)
        _add_reads(groups, readers, k, full)
        groups[k]["sib"] |= bool(sib)
        group_of[i] = k
        if region:                                       # recompute forward values instead of reading them
            for v in e.ins:
                j = producer.get(v.id)
                if j is not None and j in group_of and groups[group_of[j]]["region"] == 0:
                    cone = _cone(eqns, producer, group_of, groups, j, shape)
                    if cone is not None:
                        remat.setdefault(k, set()).update(cone)
    keep = {o.id for o in g.kept()}
    lone_unary = lambda m: len(m) == 1 and eqns[m[0]].op in LONE     # noqa: E731 -- runs there too
    body = {k: sorted(set(grp["members"]) | remat.get(k, set())) for k, grp in enumerate(groups)
            if len(grp["members"]) + len(remat.get(k, ())) >= 2 or lone_unary(grp["members"])}
    readers: dict = {}
    for i, e in enumerate(eqns):
        for v in e.ins:
            readers.setdefault(v.id, []).append(i)

    def needed(v) -> bool:
        """Whether a value must be stored: read by an equation whose fused group does not compute it."""
        return v.id in keep or any(group_of.get(i) not in body or producer[v.id] not in body[group_of[i]]
                                   for i in readers.get(v.id, ()))
    while True:                                         # groups the kernel cannot hold stay unfused
        bad = [k for k in body if _fused_eqn(g, eqns, body[k], groups[k]["members"], needed, groups[k]["shape"],
                                             dry=True) is None]
        if not bad:
            break
        if any(groups[k]["sib"] for k in bad):
            return False
        for k in bad:
            del body[k]
    new, n_new_fwd, n_new_bwd = [], 0, 0
    for i, e in enumerate(eqns):
        k = group_of.get(i)
        if k in body:
            if i != max(groups[k]["members"]):
                continue
            out = [_fused_eqn(g, eqns, body[k], groups[k]["members"], needed, groups[k]["shape"])]
        else:
            out = [e]
        new += out
        n_new_fwd += len(out) if i < n_fwd else 0
        n_new_bwd += len(out) if i < n_bwd else 0
    g.eqns = new
    g.n_forward, g.n_backward = n_new_fwd, n_new_bwd
    return True


def _cone(eqns, producer, group_of, groups, j, shape):
    """The forward group members computing eqns[j]'s value from that group's operands, if all have the
    iteration shape and there are at most REMAT of them; else None (the value is read from memory)."""
    cone, todo = set(), [j]
    k = group_of[j]
    while todo:
        t = todo.pop()
        if t in cone:
            continue
        if eqns[t].outs[0].shape != shape or eqns[t].op in ALIAS and eqns[t].ins[0].shape != shape \
                or eqns[t].op == "concatenate":
            return None
        cone.add(t)
        if len(cone) > REMAT:
            return None
        todo += [producer[v.id] for v in eqns[t].ins if group_of.get(producer.get(v.id)) == k]
    return cone


def _fused_eqn(g, eqns, body, members, needed, shape, dry=False):
    """The ew_fused equation computing eqns[body] (in order) over `shape`, storing the values of its members
    `needed` outside (the other body equations are recomputed forward values: their own group stores what is
    needed); None if it needs more registers or operands than the kernel has (dry: only whether it fits).

    Operands: a value read (its strides broadcast to the shape) or a slice's region of one, read in place
    (iview: offset and strides per input operand); a value written, or one region of a concatenation
    (oview: output index, offset and strides per output operand)."""
    members = set(members)
    es = [Eqn("pow2", (e.ins[0], g.const(np.asarray(e.attrs["p"]), g.float_dtype)), e.outs) if e.op == "pow" else e
          for e in (eqns[j] for j in body)]
    ins, outs, oview, made = [], [], [], set()      # ins: (value id, var, offset, strides)
    keys = [e.ins[0] for e in es if e.op == "rand"][:1]          # the key block: the row's, not an operand
    for j, e in zip(body, es):
        o = e.outs[0]
        need = j in members and needed(o)
        if e.op == "slice":                             # keyed -1 - id: the slice's value may be an output too
            ins.append((-1 - o.id, e.ins[0], *_slice_view(e.ins[0].shape, e.attrs)))
        else:
            ins += [(v.id, v, 0, bstrides(v.shape, shape)) for v in e.ins
                    if v.id not in made and all(v.id != w[0] for w in ins) and all(v.id != k.id for k in keys)]
        made.add(o.id)
        if need and e.op == "concatenate":
            st, ax, lo = cstrides(o.shape), e.attrs["axis"], 0
            for v in e.ins:
                oview.append((len(outs), lo * st[ax], st))
                lo += v.shape[ax]
        elif need:
            oview.append((len(outs), 0, cstrides(shape)))
        if need:
            outs.append(o)
    if len(ins) + len(oview) > MAX_OPERANDS or not outs:
        return None
    opers = [(0, st or (0,)) for *_, st in ins] + [(0, st or (0,)) for *_, st in oview]
    (_, inner), *_ = loop_nest(shape or (1,), opers, 4)
    if any(inner[-1][1][k] != 1 for k in range(len(ins), len(opers))) and inner[-1][0] > 1:
        return None                     # an output is written in place, so its innermost stride must be 1
    code = {vid: -1 - k for k, (vid, *_) in enumerate(ins) if inner[-1][1][k] == 1}     # read in place
    region = {}                                   # (concat eqn index, input position) -> its output operand code
    q = 0
    for t, e in enumerate(es):
        if e.op == "concatenate" and e.outs[0] in outs:
            for p in range(len(e.ins)):
                region[t, p] = -1 - len(ins) - q
                q += 1
        elif e.outs[0] in outs:
            code[e.outs[0].id] = -1 - len(ins) - q                                          # written in place
            q += 1
    computed = {e.outs[0].id for e in es if e.op not in ALIAS and e.op not in ("slice", "concatenate")}
    for (t, p), c in region.items():       # a value computed here for one region only: written there directly
        v = es[t].ins[p]
        if v.id in computed and v.id not in code and sum(v.id == w.id for e in es for w in e.ins) == 1:
            code[v.id] = c
    scalars = [k for k in range(len(ins)) if all(st[k] == 0 for _, st in inner)]
    # the scalar operands hoisted (LOADC) if the registers allow
    instrs = multiply_add(_registers(es, ins, code, region, scalars) or _registers(es, ins, code, region, []))
    if instrs is None:                                   # out of registers
        return None
    if dry:
        return True
    prog = [len(instrs), len(opers), *[n for n, _ in inner]] + \
        [st[q] for q in range(len(opers)) for _, st in inner] + [x for q in instrs for x in (*q, 0, 0)[:WIDTH]]
    pvar = g.const(np.array(prog, np.int64).astype(np.int32), "i32")
    return Eqn("ew_fused", (pvar, *[w[1] for w in ins], *keys), tuple(outs),
               {"shape": shape, "outs": tuple(o.id for o in outs), "ins": tuple(w[1].id for w in ins) + tuple(k.id for k in keys),
                "oshapes": tuple(o.shape for o in outs), "iview": tuple((off, st) for _, _, off, st in ins),
                "oview": tuple(oview),
                "body": tuple((eqns[j].op, tuple(sorted(eqns[j].attrs.items())), tuple(v.id for v in eqns[j].ins),
                               eqns[j].outs[0].id) for j in body)}, eqns[body[-1]].src)


def _registers(es, ins, code, region, scalars):
    """The instructions computing es with registers allocated SSA-style (None if NREG are too few). Operands
    read in place and outputs written in place are in `code`, a concatenation's output regions in `region`; the
    scalar operands (every stride 0) `scalars` get registers of their own, filled once per row (LOADC) instead
    of at every block."""
    code = dict(code)
    last = {v.id: t for t, e in enumerate(es) for v in e.ins}
    free, instrs, kept = list(range(NREG - 1, -1, -1)), [], set()
    try:
        for k in scalars:
            code[ins[k][0]] = r = free.pop()
            kept.add(r)
            instrs.append((LOADC, r, k, 0, 0))
        for t, e in enumerate(es):
            o = e.outs[0]
            if e.op == "rand":
                if o.id not in code:
                    code[o.id] = free.pop()
                instrs.append((RAND, code[o.id], e.attrs["site"], e.attrs["kind"], 0))
                continue
            if e.op == "slice":
                key = -1 - o.id
                if key not in code:                      # strided: into a register
                    code[key] = free.pop()
                    instrs.append((LOAD, code[key], next(k for k, w in enumerate(ins) if w[0] == key), 0, 0))
                if o.id in code:                         # a needed slice: copied out, later reads from there
                    instrs.append((EW.U_COPY, code[o.id], code[key], code[key], 0))
                    if code[key] >= 0 and code[key] not in kept:
                        free.append(code[key])
                else:
                    code[o.id] = code[key]
                continue
            for v in e.ins:
                if v.id not in code:                     # broadcast / strided operand: into a register
                    code[v.id] = free.pop()
                    instrs.append((LOAD, code[v.id], next(k for k, w in enumerate(ins) if w[0] == v.id), 0, 0))
            srcs = [code[v.id] for v in e.ins]
            if e.op == "concatenate":
                instrs += [(EW.U_COPY, region[t, p], c, c, 0) for p, c in enumerate(srcs)
                           if (t, p) in region and c != region[t, p]]
            elif e.op in ALIAS:
                if o.id in code:                         # a needed alias: copied out
                    instrs.append((EW.U_COPY, code[o.id], srcs[0], srcs[0], 0))
                else:
                    code[o.id] = srcs[0]
            else:
                if o.id not in code:        # not a register the two instructions before read: a sum can then
                    avoid = {c for q in instrs[-2:] for c in _reads(q)}      # take their products (multiply_add)
                    code[o.id] = next((r for r in reversed(free) if r not in avoid), free[-1])
                    free.remove(code[o.id])
                op_ = UNARY.get(e.op, BIN + BINARY.get(e.op, 0))
                instrs.append((WHERE, code[o.id], *srcs) if e.op == "where" else (op_, code[o.id], srcs[0], srcs[-1], 0))
            for v in set(e.ins):                         # registers read for the last time are free again
                r = code[v.id]                           # (once: aliases, e.g. x and broadcast_to(x), share one)
                if r >= 0 and r not in free and r not in kept and last[v.id] == t \
                        and not any(c == r and last.get(w, -1) > t for w, c in code.items()):
                    free.append(r)
    except IndexError:
        return None
    return instrs


def _reads(ins) -> tuple:
    """The registers or operands an instruction reads (LOAD, LOADC and RAND read none of either)."""
    op = ins[0]
    if op in (LOAD, LOADC, RAND):
        return ()
    return ins[2:6] if op >= FMA2 else ins[2:5] if op == WHERE or op >= FMA else ins[2:4]


def multiply_add(instrs):
    """A product into a register read only by the add or subtract right after it -> one FMA (x*y + z), FMS
    (x*y - z) or FNMA (z - x*y) instruction: one pass over the block instead of two (an optimizer's b * m +
    (1 - b) * g, a gate's sigmoid(f) * c + sigmoid(i) * tanh(g)); then _fold_products. Not where the sum's
    destination is one of the product's operands (the loop would then run in place)."""
    if instrs is None:
        return None
    mul, add, sub = BIN + EW.B_MUL, BIN + EW.B_ADD, BIN + EW.B_SUB
    out, t = [], 0
    while t < len(instrs):
        a, b = instrs[t], instrs[t + 1] if t + 1 < len(instrs) else None
        p = a[1]
        if b is not None and a[0] == mul and p >= 0 and b[0] in (add, sub) and (b[2] == p) != (b[3] == p) \
                and b[1] not in (a[2], a[3]) and _dead(instrs[t + 2:], p):
            z = b[3] if b[2] == p else b[2]
            op = FMA if b[0] == add else (FMS if b[2] == p else FNMA)
            out.append((op, b[1], a[2], a[3], z))
            t += 2
            continue
        out.append(a)
        t += 1
    return _fold_products(out)


def _fold_products(instrs):
    """An FMA / FMS / FNMA whose addend is a product made earlier (right before it, as b * m + (1 - b) * g, or
    with other instructions in between, as p * (1 - lr * wd) - lr * sign(c)) -> one FMA2 (x*y + z*w) / FMS2
    (x*y - z*w), the product dropped: where nothing in between reads the product or writes its factors, or writes
    the arena at all if a factor is read from there (an in-place update of that factor)."""
    mul = BIN + EW.B_MUL
    out = list(instrs)
    for k, c in enumerate(out):
        if c is None or c[0] not in (FMA, FMS, FNMA) or c[4] < 0:
            continue
        i = next((i for i in range(k - 1, -1, -1) if out[i] is not None and out[i][1] == c[4]), None)
        if i is None or out[i][0] != mul or c[1] in out[i][2:4] or c[4] in c[2:4] or not _dead(out[k + 1:], c[4]):
            continue
        u, v = out[i][2:4]
        between = [q for q in out[i + 1:k] if q is not None]
        if any(c[4] in _reads(q) or q[1] in (u, v) or (q[1] < 0 and min(u, v) < 0) for q in between):
            continue
        out[k] = (FMA2, c[1], c[2], c[3], u, v) if c[0] == FMA else \
            (FMS2, c[1], c[2], c[3], u, v) if c[0] == FMS else (FMS2, c[1], u, v, c[2], c[3])
        out[i] = None
    return [q for q in out if q is not None]


def _dead(rest, r) -> bool:
    """Is register r written again (or never used) before any of `rest` reads it?"""
    for ins in rest:
        if r in _reads(ins):
            return False
        if ins[1] == r:
            return True
    return True
