"""The scalar tape of btjit/scalar/lower.py's second backend: packed int32 rows [op, out, in1, in2] over one
register file, run by `tape_many` (an njit interpreter compiled once per float dtype and cached on disk), for
scalar graphs above lower.STRAIGHT_LINE_MAX instructions. Its opcodes and their numpy meaning are lower.py's OPS."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from btjit.kernels.elementwise import R_FLOOR, R_REMAINDER, _rounding
from btjit.scalar.lower import (ABS, ADD, ARG, COPY, DIV, EQ, ERF, EXP, FLOOR, FM, GE, GELU, GELU_ERF,
                                GELU_ERF_GRAD, GELU_GRAD, GT, LE, LOG, LOG1P, LT, MAXIMUM, MINIMUM, MUL, NE, NEG, OPS,
                                POW, RELU, RELU_GRAD, REMAINDER, SIGMOID, SIGMOID_GRAD, SIGN, SILU, SILU_GRAD, SIN, COS,
                                SQRT, SUB, TANH, TANH_GRAD, WHERE, ScalarProgram, _G0, _G1, _RS2, _RS2PI)


class ScalarTape:
    """code int32 (n, 4) rows [op, out, in1, in2] over the register file `regs` (slots 0..n_in-1 = inputs,
    then the constants, then instruction results; a slot is reused once its value is dead). `where` takes
    two rows: [WHERE, out, cond, x] then [ARG, y, 0, 0]. value/grad/named results are read from the slots
    vslots/gslots/nslots after a run."""

    def __init__(self, prog: ScalarProgram):
        self.prog = prog
        n_in = prog.n_in
        consts: dict = {}
        const_vals = []

        def const_slot(x):
            k = (np.float64(x).tobytes())
            if k not in consts:
                consts[k] = n_in + len(const_vals)
                const_vals.append(x)
            return consts[k]

        for op, out, ins in prog.instrs:           # constants first: they occupy fixed slots
            for a in ins:
                if a[0] == "c":
                    const_slot(a[1])
        for a in [*prog.values, *prog.grads, *(a for _, a in prog.named)]:
            if a[0] == "c":
                const_slot(a[1])
        base = n_in + len(const_vals)
        kept = {a[1] for a in [*prog.values, *prog.grads, *(a for _, a in prog.named)] if a[0] == "v"}
        last = {}
        for i, (op, out, ins) in enumerate(prog.instrs):
            for a in ins:
                if a[0] == "v":
                    last[a[1]] = i
        slot: dict = {}
        free: list = []
        n_slots = base
        rows = []

        def where(a):
            kind, x = a
            return x if kind == "x" else (consts[np.float64(x).tobytes()] if kind == "c" else slot[x])

        for i, (op, out, ins) in enumerate(prog.instrs):
            srcs = [where(a) for a in ins]
            for a in ins:                          # values dying here free their slot before the result takes one
                if a[0] == "v" and last.get(a[1]) == i and a[1] not in kept and a[1] in slot:
                    free.append(slot.pop(a[1]))
            if free:
                s = free.pop()
            else:
                s, n_slots = n_slots, n_slots + 1
            slot[out] = s
            code = OPS[op][0]
            if code == WHERE:
                rows.append((WHERE, s, srcs[0], srcs[1]))
                rows.append((ARG, srcs[2], 0, 0))
            else:
                rows.append((code, s, srcs[0], srcs[1] if len(srcs) > 1 else 0))
        self.code = np.array(rows, np.int32).reshape(len(rows), 4)
        self.regs = np.zeros(max(n_slots, 1), prog.np_dtype)
        self.regs[n_in:base] = const_vals
        self.in_slots = np.arange(n_in, dtype=np.int32)
        self.vslots = np.array([where(a) for a in prog.values], np.int32)
        self.gslots = np.array([where(a) for a in prog.grads], np.int32)
        self.nslots = np.array([where(a) for _, a in prog.named], np.int32)
        self.n_slots = n_slots
        self.K = np.array([0.0, 1.0, 0.5, _G0, _G1, 3 * _G1, _RS2, _RS2PI], prog.np_dtype)

    def many(self, X, OV, OG, ON=None):
        """Run every row of X (N, n_in): values -> OV (N, n_out), grads -> OG (N, n_in), named -> ON (N, n_named)
        when given. Shapes and dtypes are the caller's responsibility (no bounds checks inside)."""
        if ON is None:
            ON, nslots = np.empty((X.shape[0], 0), self.regs.dtype), self.nslots[:0]
        else:
            nslots = self.nslots
        assert OV.shape[1] == self.vslots.size and OG.shape[1] == self.gslots.size and ON.shape[1] == nslots.size
        tape_many(self.code, self.regs, self.K, self.in_slots, X, self.vslots, OV, self.gslots, OG, nslots, ON)


assert (FLOOR, REMAINDER) == (R_FLOOR + FLOOR, R_REMAINDER + FLOOR)     # the two orders agree

@njit(**FM, cache=True)
def tape_run(code, r, K):
    """Run the scalar tape once over the register file r. K = [0, 1, 0.5, G0, G1, 3 G1, 1/sqrt 2, 1/sqrt(2 pi)]
    in r's dtype."""
    z = K[0]
    one = K[1]
    half = K[2]
    g0 = K[3]
    g1 = K[4]
    for i in range(code.shape[0]):
        op = code[i, 0]
        o = code[i, 1]
        a = code[i, 2]
        b = code[i, 3]
        if op == ADD:
            r[o] = r[a] + r[b]
        elif op == MUL:
            r[o] = r[a] * r[b]
        elif op == SUB:
            r[o] = r[a] - r[b]
        elif op == DIV:
            r[o] = r[a] / r[b]
        elif op == NEG:
            r[o] = -r[a]
        elif op == TANH:
            r[o] = math.tanh(r[a])
        elif op == TANH_GRAD:
            y = r[a]
            r[o] = r[b] * (one - y * y)
        elif op == RELU:
            x = r[a]
            r[o] = x if not (x <= z) else z
        elif op == RELU_GRAD:
            r[o] = r[b] if r[a] > z else r[b] * z
        elif op == EXP:
            r[o] = math.exp(r[a])
        elif op == LOG:
            r[o] = math.log(r[a])
        elif op == POW:
            r[o] = r[a] ** r[b]
        elif op == SIGMOID:
            r[o] = one / (one + math.exp(-r[a]))
        elif op == SIGMOID_GRAD:
            y = r[a]
            r[o] = r[b] * y * (one - y)
        elif op == SQRT:
            r[o] = math.sqrt(r[a])
        elif op == ERF:
            r[o] = math.erf(r[a])
        elif op == LOG1P:
            r[o] = math.log1p(r[a])
        elif op == ABS:
            r[o] = abs(r[a])
        elif op == SIGN:
            r[o] = one if r[a] > z else (-one if r[a] < z else r[a])
        elif FLOOR <= op <= REMAINDER:       # in k_rounding's order: its rule, R_FLOOR .. R_REMAINDER
            r[o] = _rounding(op - FLOOR, r[a], r[b])
        elif op == SIN:
            r[o] = math.sin(r[a])
        elif op == COS:
            r[o] = math.cos(r[a])
        elif op == COPY:
            r[o] = r[a]
        elif op == MAXIMUM:
            x = r[a]
            y = r[b]
            r[o] = x if (x >= y or x != x) else y
        elif op == MINIMUM:
            x = r[a]
            y = r[b]
            r[o] = x if (x <= y or x != x) else y
        elif op == EQ:
            r[o] = one if r[a] == r[b] else z
        elif op == NE:
            r[o] = one if r[a] != r[b] else z
        elif op == GT:
            r[o] = one if r[a] > r[b] else z
        elif op == GE:
            r[o] = one if r[a] >= r[b] else z
        elif op == LT:
            r[o] = one if r[a] < r[b] else z
        elif op == LE:
            r[o] = one if r[a] <= r[b] else z
        elif op == WHERE:
            r[o] = r[b] if r[a] != z else r[code[i + 1, 1]]
        elif op == GELU:
            x = r[a]
            r[o] = half * x * (one + math.tanh(g0 * (x + g1 * x * x * x)))
        elif op == GELU_GRAD:
            x = r[a]
            t = math.tanh(g0 * (x + g1 * x * x * x))
            r[o] = r[b] * (half * (one + t) + half * x * (one - t * t) * g0 * (one + K[5] * x * x))
        elif op == GELU_ERF:
            x = r[a]
            r[o] = x * (half + half * math.erf(x * K[6]))
        elif op == GELU_ERF_GRAD:
            x = r[a]
            r[o] = r[b] * (half + half * math.erf(x * K[6]) + x * K[7] * math.exp(-half * x * x))
        elif op == SILU:
            r[o] = r[a] / (one + math.exp(-r[a]))
        elif op == SILU_GRAD:
            x = r[a]
            sg = one / (one + math.exp(-x))
            r[o] = r[b] * sg * (one + x * (one - sg))
        # ARG: operand row of the previous WHERE, nothing to do


@njit(**FM, cache=True)
def tape_many(code, r, K, in_slots, X, vslots, OV, gslots, OG, nslots, ON):
    """For each row of X: inputs -> registers, run the tape, read values, grads and named nodes."""
    for i in range(X.shape[0]):
        for k in range(in_slots.size):
            r[in_slots[k]] = X[i, k]
        tape_run(code, r, K)
        for k in range(vslots.size):
            OV[i, k] = r[vslots[k]]
        for k in range(gslots.size):
            OG[i, k] = r[gslots[k]]
        for k in range(nslots.size):
            ON[i, k] = r[nslots[k]]


