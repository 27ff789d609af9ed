"""One kernel for every fused elementwise chain: a small interpreter of a program held in the int arena.

btjit/graph/fuse_ew.py turns a maximal chain of elementwise ops (unary, binary with broadcasting, scalar
constants, where, the backward's *_grad ops) into ONE row of k_ew_program, so a new chain compiles nothing.
The program runs over blocks of BLOCK elements of a 4-D iteration space; its registers are blocks of one
stack buffer (allocated SSA-style by the pass: an instruction never writes a register it reads, which keeps
every per-op loop vectorized -- ../shared/COMPILE_NOTES.md §3). Per block: LOAD each operand (strides 1, 0 =
broadcast, or any), run the ops, STORE the outputs.

Program at ia[oprog:] (int32): [ninstr, nops, n0, n1, n2, n3, strides (4 per operand), instructions (5 each:
op, dst, x, y, z)]. Operand k's float-arena offset is the row's o<k>. Opcodes: the unary (U_*) and binary
(B_* + BIN) sub-op codes of btjit/kernels/elementwise.py, WHERE (dst = y where x != 0 else z), LOAD (dst =
operand x), STORE (operand y = register x).
"""
import math

import numpy as np
from numba import carray, njit

from .common import FM, fexp, ftanh, row, stack_buf
from .elementwise import (B_ADD, B_DIV, B_EQ, B_GE, B_GT, B_LE, B_LT, B_MAX, B_MIN, B_MUL, B_NE, B_POW,
                          B_RELU_GRAD, B_SIGMOID_GRAD, B_SUB, B_TANH_GRAD, U_ABS, U_COPY, U_EXP, U_LOG, U_NEG,
                          U_RELU, U_SIGMOID, U_SQRT, U_TANH)

BLOCK = 1024         # elements per register
NREG = 16            # registers (BLOCK * NREG floats of stack: 64 KB in float32)
MAX_OPERANDS = 23    # o0 .. o22 in the row
BIN = 16             # binary opcodes are BIN + B_*
WHERE, LOAD, STORE = 40, 41, 42
HEAD = 6
RSIZE = BLOCK * NREG


def _loop1(f):
    @njit(**FM)
    def loop(d, x, m):
        for j in range(m):
            d[j] = f(x[j])
    return loop


def _loop2(f):
    @njit(**FM)
    def loop(d, x, y, m):
        for j in range(m):
            d[j] = f(x[j], y[j])
    return loop


def _j(f):
    return njit(inline="always", **FM)(f)


_z, _one = np.float32(0.0), np.float32(1.0)
_neg = _loop1(_j(lambda x: -x))
_exp = _loop1(_j(lambda x: fexp(x)))
_log = _loop1(_j(lambda x: math.log(x)))
_tanh = _loop1(_j(lambda x: ftanh(x)))
_relu = _loop1(_j(lambda x: x if x > _z else _z))
_sigmoid = _loop1(_j(lambda x: _one / (_one + fexp(-x))))
_sqrt = _loop1(_j(lambda x: math.sqrt(x)))
_abs = _loop1(_j(lambda x: abs(x)))
_add = _loop2(_j(lambda x, y: x + y))
_sub = _loop2(_j(lambda x, y: x - y))
_mul = _loop2(_j(lambda x, y: x * y))
_div = _loop2(_j(lambda x, y: x / y))
_max = _loop2(_j(lambda x, y: x if x >= y else y))
_min = _loop2(_j(lambda x, y: x if x <= y else y))
_pow = _loop2(_j(lambda x, y: x ** y))
_eq = _loop2(_j(lambda x, y: _one if x == y else _z))
_ne = _loop2(_j(lambda x, y: _one if x != y else _z))
_gt = _loop2(_j(lambda x, y: _one if x > y else _z))
_ge = _loop2(_j(lambda x, y: _one if x >= y else _z))
_lt = _loop2(_j(lambda x, y: _one if x < y else _z))
_le = _loop2(_j(lambda x, y: _one if x <= y else _z))
_tanh_grad = _loop2(_j(lambda y, g: g * (_one - y * y)))
_relu_grad = _loop2(_j(lambda x, g: g if x > _z else g * _z))
_sigmoid_grad = _loop2(_j(lambda y, g: g * y * (_one - y)))


_copy = _loop1(_j(lambda x: x))


@njit(**FM)
def _fill(d, v, m):
    for j in range(m):
        d[j] = v


@njit(**FM)
def _where(d, c, x, y, m):
    for j in range(m):
        d[j] = x[j] if c[j] != 0 else y[j]


@njit(**FM)
def _op(op, d, x, y, m):
    """d[:m] = op(x, y) (unary ops ignore y)."""
    if op == U_COPY:
        _copy(d, x, m)
    elif op == U_NEG:
        _neg(d, x, m)
    elif op == U_EXP:
        _exp(d, x, m)
    elif op == U_LOG:
        _log(d, x, m)
    elif op == U_TANH:
        _tanh(d, x, m)
    elif op == U_RELU:
        _relu(d, x, m)
    elif op == U_SIGMOID:
        _sigmoid(d, x, m)
    elif op == U_SQRT:
        _sqrt(d, x, m)
    elif op == U_ABS:
        _abs(d, x, m)
    elif op == BIN + B_ADD:
        _add(d, x, y, m)
    elif op == BIN + B_SUB:
        _sub(d, x, y, m)
    elif op == BIN + B_MUL:
        _mul(d, x, y, m)
    elif op == BIN + B_DIV:
        _div(d, x, y, m)
    elif op == BIN + B_MAX:
        _max(d, x, y, m)
    elif op == BIN + B_MIN:
        _min(d, x, y, m)
    elif op == BIN + B_POW:
        _pow(d, x, y, m)
    elif op == BIN + B_EQ:
        _eq(d, x, y, m)
    elif op == BIN + B_NE:
        _ne(d, x, y, m)
    elif op == BIN + B_GT:
        _gt(d, x, y, m)
    elif op == BIN + B_GE:
        _ge(d, x, y, m)
    elif op == BIN + B_LT:
        _lt(d, x, y, m)
    elif op == BIN + B_LE:
        _le(d, x, y, m)
    elif op == BIN + B_TANH_GRAD:
        _tanh_grad(d, x, y, m)
    elif op == BIN + B_RELU_GRAD:
        _relu_grad(d, x, y, m)
    elif op == BIN + B_SIGMOID_GRAD:
        _sigmoid_grad(d, x, y, m)


@row("oprog " + " ".join(f"o{k}" for k in range(MAX_OPERANDS)))
@njit(**FM)
def k_ew_program(a, ia, r):
    """Run the fused elementwise program at ia[r[1]:] (layout in the module docstring) over its iteration
    space; operand k lives at a[r[2 + k]:] with the program's strides."""
    oprog = r[1]
    P = ia[oprog:]
    ninstr, nops = P[0], P[1]
    n0, n1, n2, n3 = P[2], P[3], P[4], P[5]
    oi = HEAD + 4 * nops
    R = carray(stack_buf(a, RSIZE), (RSIZE,))
    for i0 in range(n0):
        for i1 in range(n1):
            for i2 in range(n2):
                for j0 in range(0, n3, BLOCK):
                    m = min(BLOCK, n3 - j0)
                    for t in range(ninstr):
                        q = oi + 5 * t
                        op, dr, xr, yr, zr = P[q], P[q + 1], P[q + 2], P[q + 3], P[q + 4]
                        if op == LOAD or op == STORE:
                            k = xr if op == LOAD else yr
                            s = HEAD + 4 * k
                            base = r[2 + k] + i0 * P[s] + i1 * P[s + 1] + i2 * P[s + 2] + j0 * P[s + 3]
                            st = P[s + 3]
                            reg = R[(dr if op == LOAD else xr) * BLOCK:]
                            if op == LOAD and st == 1:
                                _copy(reg, a[base:base + m], m)
                            elif op == LOAD and st == 0:
                                _fill(reg, a[base], m)
                            elif op == LOAD:
                                for j in range(m):
                                    reg[j] = a[base + j * st]
                            elif st == 1:
                                _copy(a[base:base + m], reg, m)
                            else:
                                for j in range(m):
                                    a[base + j * st] = reg[j]
                        elif op == WHERE:
                            _where(R[dr * BLOCK:], R[xr * BLOCK:], R[yr * BLOCK:], R[zr * BLOCK:], m)
                        else:
                            _op(op, R[dr * BLOCK:], R[xr * BLOCK:], R[yr * BLOCK:], m)
