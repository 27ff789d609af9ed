"""The op table's machinery: OpDef, the TABLE every op module registers into, and the shape-rule and
lowering helpers the op modules share (broadcast strides, loop nests, elementwise rows)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from btjit.kernels import elementwise as EW
from btjit.kernels.common import MAX_THREADS


PAR_EW_ELEMENTS = 65536    # a memory-bound op over this many elements is split over the threads (launch ~2-4 us)


def par_parts(L, size, units) -> int:
    """How many parts a memory-bound op over `size` elements in `units` independent pieces (planes, matrices)
    splits into on L's threads: 1 below PAR_EW_ELEMENTS."""
    return min(L.threads, MAX_THREADS, units) if size >= PAR_EW_ELEMENTS else 1


class ShapeError(Exception):
    pass


@dataclass
class Case:
    """A gradient-check case: args are ("f", shape, domain) or ("i", shape, high); domain in
    normal | pos | away (|x| >= 0.3, off kinks)."""
    args: tuple
    attrs: dict = field(default_factory=dict)
    tol: float = 1e-6


@dataclass
class OpDef:
    name: str
    infer: object                  # (types [(shape, dtype)], attrs, float_dtype) -> [(shape, dtype)]
    ref: object                    # (numpy inputs, attrs) -> tuple of numpy outputs
    lower: object                  # (eqn, L) -> list of rows
    vjp: object = None             # (gs, xs, outs, attrs) -> [tracer | None per input]
    cases: list = field(default_factory=list)
    view: bool = False             # output aliases the input's storage (reshape)
    nondiff: bool = False          # outputs carry no gradient (comparisons)
    internal: bool = False         # emitted by autodiff only


TABLE: dict[str, OpDef] = {}


def op(name, **kw):
    TABLE[name] = OpDef(name, **kw)


F = lambda *shape, dom="normal": ("f", tuple(shape), dom)  # noqa: E731


# ----------------------------------------------------------------------------- shape-rule helpers
def _float(types, name):
    for i, (_, d) in enumerate(types):
        if d == "i32":
            raise ShapeError(f"input {i} is an integer array where floats are needed (x.float() converts it)")


def _bcast_shape(*shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError("shapes do not broadcast") from None


def same_as_input(types, attrs, fd):
    _float(types, "")
    return [(types[0][0], fd)]


def elementwise_rule(types, attrs, fd):
    _float(types, "")
    s0 = types[0][0]
    if all(s == s0 for s, _ in types):
        return [(s0, fd)]
    return [(_bcast_shape(*(s for s, _ in types)), fd)]


def _int_rule(out_int):
    """Elementwise over integers too: all-integer operands give an integer (out_int: add, sub, mul, maximum,
    minimum) or a 0/1 float mask (the comparisons); float operands as elementwise_rule; no mixing."""
    def rule(types, attrs, fd):
        if not all(d == "i32" for _, d in types):
            return elementwise_rule(types, attrs, fd)
        return [(_bcast_shape(*(s for s, _ in types)), "i32" if out_int else fd)]
    return rule


def cstrides(shape):
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return tuple(reversed(st))


def bstrides(shape, out_shape):
    """Strides of `shape` broadcast against out_shape (0 where broadcast)."""
    st = cstrides(shape)
    pad = len(out_shape) - len(shape)
    return tuple([0] * pad + [0 if shape[i] == 1 and out_shape[pad + i] != 1 else st[i] for i in range(len(shape))])


def loop_nest(shape, operands, depth):
    """Collapse a loop nest over `shape` for operands [(offset, strides)]: size-1 dims dropped, adjacent dims
    merged where every operand is contiguous across them. Yields (offsets, inner) per row: the innermost
    `depth` dims [(n, [stride per operand])] (front-padded with size 1) run in one kernel row; the outer
    dims beyond those are unrolled into one row each, with the operands' offsets advanced."""
    k = len(operands)
    merged = []
    for i, n in enumerate(shape):
        if n == 1:
            continue
        st = [s[1][i] for s in operands]
        if merged and all(ps == s * n for ps, s in zip(merged[-1][1], st)):
            merged[-1] = [merged[-1][0] * n, st]
        else:
            merged.append([n, st])
    while len(merged) < depth:
        merged.insert(0, [1, [0] * k])
    outer, inner = merged[:-depth], merged[-depth:]
    for idx in np.ndindex(*[n for n, _ in outer]) if outer else [()]:
        offs = [o for o, _ in operands]
        for (n, st), i in zip(outer, idx):
            offs = [o + i * s for o, s in zip(offs, st)]
        yield offs, inner


def strided_rows(L, sub, shape, out, ins, ints=False):
    """Rows of k_strided (k_int_strided for integer operands: ints; a float copy: k_copy): out = (off, strides);
    ins = up to three (two with ints) (off, strides); 4-D loops per row."""
    copy = sub == EW.B_COPY and not ints
    kernel, k = ("k_copy", 1) if copy else ("k_int_strided", 2) if ints else ("k_strided", 3)
    ops_ = [out] + list(ins) + [(out[0], (0,) * len(shape))] * (k - len(ins))
    rows = []
    for offs, inner in loop_nest(shape, ops_, 4):
        args = dict(zip(("oo", "o1", "o2", "o3"), offs))
        for d, (n, st) in enumerate(inner):
            args.update({f"n{d}": n, **{f"{p}{d}": st[j] for j, p in enumerate(("so", "p", "q", "t")[:k + 1])}})
        rows.append(L.row(kernel, **args) if copy else L.row(kernel, sub=sub, **args))
    return rows


def copy_rows(L, e, out_off, out_strides, in_off, in_strides, shape=None):
    """Rows copying e.ins[0]'s elements (at in_off with in_strides) to out_off / out_strides, in its arena."""
    return strided_rows(L, EW.B_COPY, shape or e.outs[0].shape, (out_off, out_strides), [(in_off, in_strides)],
                        ints=e.ins[0].dtype == "i32")


def _row_broadcast(v, shape) -> bool:
    """Whether v, broadcast to `shape`, is one row repeated: its shape (leading 1s dropped) ends `shape`."""
    s = tuple(v.shape)
    while s and s[0] == 1:
        s = s[1:]
    return 0 < len(s) <= len(shape) and tuple(shape[len(shape) - len(s):]) == s


def lower_elementwise(sub, eqn, L):
    """The common arithmetic on whole operands or one broadcast row -> k_binary_rows; other same-size or
    scalar operands -> one flat k_binary loop; anything else (and integers) -> k_strided."""
    out = eqn.outs[0]
    n = out.size
    if eqn.ins[0].dtype == "i32":
        return strided_rows(L, sub, out.shape, (L.off(out), cstrides(out.shape)),
                            [(L.off(v), bstrides(v.shape, out.shape)) for v in eqn.ins], ints=True)
    if len(eqn.ins) == 2 and sub in EW.ROWS_SUBS and n > 0:
        x, y = eqn.ins
        whole = [v.size == n for v in (x, y)]
        if all(whole) or (whole[0] and _row_broadcast(y, out.shape)) or (whole[1] and _row_broadcast(x, out.shape)):
            cols = n if all(whole) else min(x.size, y.size)
            rows = n // cols
            return [L.row("k_binary_rows", split=par_parts(L, n, rows if rows >= L.threads else (cols + 15) // 16),
                           sub=sub, oout=L.off(out), o1=L.off(x), o2=L.off(y), rows=rows, cols=cols,
                           sx=cols if whole[0] else 0, sy=cols if whole[1] else 0)]
    if len(eqn.ins) == 2 and all(v.size in (n, 1) for v in eqn.ins):
        x, y = eqn.ins
        mode = 0 if x.size == n and y.size == n else (1 if x.size == n else 2)
        if mode == 2 and sub in (EW.B_MUL, EW.B_ADD):     # s * x as x * s: the vectorized loop of one number
            x, y, mode = y, x, 1
        return [L.row("k_binary", sub=sub, oout=L.off(out), o1=L.off(x), o2=L.off(y), n=n, mode=mode)]
    return strided_rows(L, sub, out.shape, (L.off(out), cstrides(out.shape)),
                        [(L.off(v), bstrides(v.shape, out.shape)) for v in eqn.ins])


