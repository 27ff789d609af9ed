"""Lowering: the planned schedule becomes a kernel tape -- int64 rows [opcode, args..., 0 padding] -- that
the one fixed executor (btjit/executor.py) runs through the kernel library (btjit/kernels/library.py).

Rows are built by name from each kernel's one declaration (`@row` in btjit/kernels, `common.ROWS`): a row
with a missing or unknown argument is an error naming the kernel and the argument.
"""
from __future__ import annotations

import numpy as np

from btjit.kernels import elementwise as EW
from btjit.kernels.common import ROW, ROWS, SPLIT
from btjit.kernels.library import LIBRARY

from btjit.graph.ops import TABLE
from btjit.graph.optable import cstrides, strided_rows


class RowError(ValueError):
    pass


def make_row(kernel, shape=None, split=1, **args) -> list:
    """The tape row of `kernel` (a generated kernel's variant for shape = (T, hs)) with its arguments by name;
    split > 1: run in that many parts on the thread pool (btjit.kernels.common.part_of)."""
    decl = ROWS.get(kernel)
    if decl is None:
        raise RowError(f"no kernel {kernel!r} in the library")
    missing = [n for n in decl.args if n not in args]
    extra = [n for n in args if n not in decl.args]
    if missing or extra:
        what = "; ".join(s for s in (missing and f"missing argument {', '.join(missing)}",
                                     extra and f"unknown argument {', '.join(extra)}") if s)
        raise RowError(f"row of {kernel}: {what} (its row is [op, {', '.join(decl.args)}])")
    r = [LIBRARY.opcode(kernel, shape)] + [int(args[n]) for n in decl.args]
    r += [0] * (ROW - len(r))
    r[SPLIT] = split if split > 1 else 0
    return r


class Lowering:
    """What an op's lower() sees: offsets of vars, a pool of float constants, the int scratch."""

    def __init__(self, plan, const_base, threads=1, checked=(), root=None, flag=0, precision="fp32"):
        self.threads = max(1, threads)      # numba pool threads one run of the tape may use (par kernels if > 1)
        self.precision = precision          # of the products: "fp32" or "bf16" (btjit.trace's precision=)
        self.checked, self.root, self.flag = set(checked), root or {}, flag
        self.computed_checks: list = []     # what each check row of a computed index guards, for the error
        self.plan = plan
        self.const_base = const_base
        self.consts: list = [1.0, 0.0]
        self.one_zero = const_base
        self.scratch = plan.scratch

    def off(self, v):
        return self.plan.off[v.id]

    def const(self, x) -> int:
        x = float(x)
        for i, c in enumerate(self.consts):
            if c == x and np.signbit(c) == np.signbit(x):
                return self.const_base + i
        self.consts.append(x)
        return self.const_base + len(self.consts) - 1

    row = staticmethod(make_row)

    def index_check(self, e, idx, hi, ok=None) -> list:
        """A check row for an integer index computed inside the program (sliced, rolled, assigned...): the
        batch inputs and constants are checked once, before the tape, but a computed one before its use."""
        if self.root.get(idx.id, idx.id) in self.checked:
            return []
        self.computed_checks.append(f"{e.op} at {e.src} needs indices in [0, {hi})" +
                                    (f" or {ok}" if ok is not None else ""))
        return [make_row("k_check_index", oidx=self.off(idx), n=idx.size, hi=hi, oflag=self.flag,
                         ok=0 if ok is None else ok)]


def lower_eqns(eqns, L: Lowering) -> tuple[list, list]:
    """Rows for a list of equations, and the op name each row comes from (for profiles)."""
    rows, labels = [], []
    for e in eqns:
        r = TABLE[e.op].lower(e, L)
        rows += r
        labels += [e.op] * len(r)
    return rows, labels


def assign_rows(graph, L: Lowering, which=None) -> list:
    """The rows that end a step: each assigned value copied into its target's region (graph.assigns, those
    `which(assign)` takes when given), but those computed in place."""
    rows = []
    for a in graph.assigns:
        if a.in_place or (which is not None and not which(a)):
            continue
        st = cstrides(a.target.shape)
        rows += strided_rows(L, EW.B_COPY, a.target.shape, (L.off(a.target), st), [(L.off(a.value), st)],
                             ints=a.target.dtype == "i32")
    return rows
