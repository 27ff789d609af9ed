"""One kernel for every fused elementwise chain: a small interpreter of a program held in the int arena.

btjit/graph/fuse_ew.py turns a maximal chain of elementwise ops (unary, binary with broadcasting, scalar
constants, where, the backward's *_grad ops) into ONE row of k_ew_program, so a new chain compiles nothing.
The program runs over blocks of BLOCK elements of a 4-D iteration space; its registers are blocks of one
stack buffer (allocated SSA-style by the pass: an instruction never writes a register it reads, which keeps
every per-op loop vectorized -- ../shared/COMPILE_NOTES.md §3). Operands whose innermost stride is 1 are
read and written in place in the arena (an instruction's source or destination code -1 - k is operand k);
the others (broadcast, strided) are LOADed into a register first. Outputs are written by the instruction
that computes them, so a single op costs one pass, as a dedicated loop would.

Program at ia[oprog:] (int32): [ninstr, nops, n0, n1, n2, n3, strides (4 per operand), instructions (WIDTH
each: op, dst, x, y, z, w)]. Operand k's float-arena offset is the row's o<k>. Opcodes: the unary (U_*) and binary
(B_* + BIN) sub-op codes of btjit/kernels/elementwise.py, WHERE (dst = y where x != 0 else z), LOAD (register
dst = operand x), FMA / FMS / FNMA (dst = x*y + z, x*y - z, z - x*y), FMA2 / FMS2 (dst = x*y + z*w, x*y - z*w),
RAND (register or output dst = the random numbers of site x, kind y, btjit/kernels/rng.py:
drawn in the block, from the key block at ia[okey:] and the element's C-order index in the iteration space
of esize elements, ebase + its position in the row's loops), LOADC (register dst = scalar operand x, filled at
the first block of a run only: its register is kept; a product, quotient, sum or difference whose factor or addend
is such a scalar runs as a*x + b*y or a*x + b with a and b read once, see _affine).
"""
import math

import numpy as np
from numba import carray, njit

from btjit.kernels.common import FM, copy_n, ferf, fexp, fill_n, fptr, ftanh, part_of, prefetch, row, stack_buf
from btjit.kernels.rng import fill, first, key
from btjit.kernels.elementwise import (B_ADD, B_DIV, B_EQ, B_GE, B_GELU_GRAD, B_GT, B_LE, B_LT, B_MAX, B_MIN, B_MUL,
                                       B_NE, B_POW, B_RELU_GRAD, B_SIGMOID_GRAD, B_SILU_GRAD, B_SUB, B_TANH_GRAD,
                                       U_ABS, U_COPY, U_COS, U_ERF, U_EXP, U_GELU, U_LOG, U_LOG1P, U_NEG, U_RELU,
                                       U_SIGMOID, U_SIGN, U_SILU, U_SIN, U_SQRT, U_TANH, gelu, gelu_grad, silu,
                                       silu_grad)

BLOCK = 1024         # elements per register
NREG = 16            # registers (BLOCK * NREG floats of stack: 64 KB in float32)
MAX_OPERANDS = 23    # o0 .. o22 in the row
BIN = 32             # binary opcodes are BIN + B_* (the unary ones are below)
WHERE, LOAD, RAND, LOADC = 56, 57, 58, 59
FMA, FMS, FNMA = 60, 61, 62   # dst = x*y + z, x*y - z, z - x*y (the highest opcodes: `op >= FMA` below)
FMA2, FMS2 = 63, 64           # dst = x*y + z*w, x*y - z*w
HEAD = 6
PF_LINES = 4         # cache lines of the next block of each operand read in place, prefetched as a block starts
PF_STREAM = 8 << 20  # ... and all of them if the row reads more than this (past a core's share of L3, 4-5 MB) and its
                     # row's field stream is 1 (gemm_rule.ew_stream, measured per machine; -1: not set yet, 0: never)
WIDTH = 6            # ints per instruction
RSIZE = BLOCK * (NREG + 1)   # and one scratch register (in-place destinations, below)


_z, _one = np.float32(0.0), np.float32(1.0)
_BIG = np.float32(3.0e38)


@njit(**FM)
def _where(d, c, x, y, m):
    for j in range(m):
        d[j] = x[j] if c[j] != 0 else y[j]


@njit(**FM)
def _fma(op, d, x, y, z, w, m):
    """d[:m] = x*y + z (FMA), x*y - z (FMS), z - x*y (FNMA), x*y + z*w (FMA2) or x*y - z*w (FMS2): products and
    the sum reading them, one pass."""
    if op == FMA2:
        for j in range(m):
            d[j] = x[j] * y[j] + z[j] * w[j]
    elif op == FMS2:
        for j in range(m):
            d[j] = x[j] * y[j] - z[j] * w[j]
    elif op == FMA:
        for j in range(m):
            d[j] = x[j] * y[j] + z[j]
    elif op == FMS:
        for j in range(m):
            d[j] = x[j] * y[j] - z[j]
    else:
        for j in range(m):
            d[j] = z[j] - x[j] * y[j]


@njit(**FM)
def _op(op, d, x, y, m):
    """d[:m] = op(x, y) (unary ops ignore y). Every op is its own loop written out here: one function with
    31 loops compiles in a fraction of the time of a function per op (closures over a lambda each)."""
    z, one = _z, _one
    if op == U_COPY:
        for j in range(m):
            d[j] = x[j]
    elif op == U_NEG:
        for j in range(m):
            d[j] = -x[j]
    elif op == U_EXP:
        for j in range(m):
            d[j] = fexp(x[j])
    elif op == U_LOG:
        for j in range(m):
            d[j] = math.log(x[j])
    elif op == U_TANH:
        for j in range(m):
            d[j] = ftanh(x[j])
    elif op == U_RELU:
        for j in range(m):
            d[j] = x[j] if x[j] > z else z
    elif op == U_SIGMOID:
        for j in range(m):
            d[j] = one / (one + fexp(-x[j]))
    elif op == U_SQRT:
        for j in range(m):
            d[j] = math.sqrt(x[j])
    elif op == U_ABS:
        for j in range(m):
            d[j] = abs(x[j])
    elif op == U_ERF:
        for j in range(m):
            d[j] = ferf(x[j])
    elif op == U_LOG1P:
        for j in range(m):
            d[j] = math.log1p(x[j])
    elif op == U_SIGN:
        for j in range(m):
            d[j] = one if x[j] > z else -one if x[j] < z else x[j]
    elif op == U_SIN:
        for j in range(m):
            d[j] = math.sin(x[j])
    elif op == U_COS:
        for j in range(m):
            d[j] = math.cos(x[j])
    elif op == U_GELU:
        for j in range(m):
            d[j] = gelu(x[j])
    elif op == U_SILU:
        for j in range(m):
            d[j] = silu(x[j])
    elif op == BIN + B_ADD:
        for j in range(m):
            d[j] = x[j] + y[j]
    elif op == BIN + B_SUB:
        for j in range(m):
            d[j] = x[j] - y[j]
    elif op == BIN + B_MUL:
        for j in range(m):
            d[j] = x[j] * y[j]
    elif op == BIN + B_DIV:
        for j in range(m):
            d[j] = x[j] / y[j]
    elif op == BIN + B_MAX:
        for j in range(m):
            d[j] = x[j] if x[j] >= y[j] else y[j]
    elif op == BIN + B_MIN:
        for j in range(m):
            d[j] = x[j] if x[j] <= y[j] else y[j]
    elif op == BIN + B_POW:
        for j in range(m):
            d[j] = x[j] ** y[j]
    elif op == BIN + B_EQ:
        for j in range(m):
            d[j] = one if x[j] == y[j] else z
    elif op == BIN + B_NE:
        for j in range(m):
            d[j] = one if x[j] != y[j] else z
    elif op == BIN + B_GT:
        for j in range(m):
            d[j] = one if x[j] > y[j] else z
    elif op == BIN + B_GE:
        for j in range(m):
            d[j] = one if x[j] >= y[j] else z
    elif op == BIN + B_LT:
        for j in range(m):
            d[j] = one if x[j] < y[j] else z
    elif op == BIN + B_LE:
        for j in range(m):
            d[j] = one if x[j] <= y[j] else z
    elif op == BIN + B_TANH_GRAD:
        for j in range(m):
            d[j] = y[j] * (one - x[j] * x[j])
    elif op == BIN + B_RELU_GRAD:
        for j in range(m):
            d[j] = y[j] if x[j] > z else y[j] * z
    elif op == BIN + B_SIGMOID_GRAD:
        for j in range(m):
            d[j] = y[j] * x[j] * (one - x[j])
    elif op == BIN + B_GELU_GRAD:
        for j in range(m):
            d[j] = gelu_grad(x[j], y[j])
    elif op == BIN + B_SILU_GRAD:
        for j in range(m):
            d[j] = silu_grad(x[j], y[j])


@njit(**FM)
def _lin(form, d, a, x, b, y, m):
    """d[:m] = a*x + b*y (form 0), a*x + b (form 2), a and b scalars (instructions reading LOADC registers, below);
    forms 1 and 3 write x in place instead of d: one pointer read and written, so the loop vectorizes (with d and
    x two pointers to the same block, LLVM's alias check fails and the loop runs scalar)."""
    if form == 0:
        for j in range(m):
            d[j] = a * x[j] + b * y[j]
    elif form == 1:
        for j in range(m):
            x[j] = a * x[j] + b * y[j]
    elif form == 2:
        for j in range(m):
            d[j] = a * x[j] + b
    else:
        for j in range(m):
            x[j] = a * x[j] + b


@njit(**FM)
def _isc(sc, code):
    """Is code a register holding a scalar (filled by LOADC)?"""
    return code >= 0 and ((sc >> code) & 1) == 1


@njit(**FM)
def _pick(k, x, y, z, w):
    """Source k (0 x, 1 y, 2 z, 3 w) of an instruction."""
    return x if k == 0 else y if k == 1 else z if k == 2 else w


@njit(**FM)
def _affine(op, sc, R, xr, yr, zr, wr, al, d, x, y, z, w, m):
    """Run op as d = a*X + b*Y or d = a*X + b, a and b read from LOADC registers of R (register k's bit of sc is set
    if LOADC filled it) -- the scalar operands of an optimizer's b1*m + (1 - b1)*g, a scale x*c or x/c -- so the
    loop loads one or two blocks, not a block of copies of each scalar; in place where the destination is X or Y
    (al: bit k set if source k, as _pick numbers them, is the destination's block). x y z w: the sources' blocks.
    False (nothing run) if op has no such form with these operands. Not inlined: a call with pointers costs a few
    ns, the code inlined into the interpreter doubled its compile time."""
    one, add, sub = _one, BIN + B_ADD, BIN + B_SUB
    two, cb, ky = op >= FMA, _z, 2               # ky: Y's source
    if op == add or op == sub:                  # x + s, s + x, x - s, s - x
        kx = 0 if _isc(sc, yr) else 1
        if not _isc(sc, yr if kx == 0 else xr):
            return False
        cb = R[(yr if kx == 0 else xr) * BLOCK]
        ca = one if kx == 0 or op == add else -one
        cb = -cb if kx == 0 and op == sub else cb
    elif op == BIN + B_DIV:                     # x / s as x * (1 / s) (the loop's own fast-math arcp would),
        if not _isc(sc, yr):                    # not where 1 / s overflows (s 0, inf, NaN or below ~3e-39)
            return False
        kx, ca = 0, one / R[yr * BLOCK]
        if not (abs(ca) < _BIG and ca != _z):
            return False
    elif op == BIN + B_MUL or two:
        if not (_isc(sc, xr) or _isc(sc, yr)):
            return False
        kx = 1 if _isc(sc, xr) else 0
        ca = R[(xr if kx == 1 else yr) * BLOCK]
        if op == FMA2 or op == FMS2:
            if not (_isc(sc, zr) or _isc(sc, wr)):
                return False
            ky = 3 if _isc(sc, zr) else 2
            cb = R[(zr if ky == 3 else wr) * BLOCK]
            cb = -cb if op == FMS2 else cb
        elif two:                               # FMA x*y + z, FMS x*y - z, FNMA z - x*y
            cb = -one if op == FMS else one
            ca = -ca if op == FNMA else ca
    else:
        return False
    if two and (al >> ky) & 1:                  # the destination is Y: the terms swapped
        kx, ky, ca, cb = ky, kx, cb, ca
    X, Y = _pick(kx, x, y, z, w), _pick(ky, x, y, z, w)
    _lin((0 if two else 2) + ((al >> kx) & 1), d, ca, X, cb, Y, m)
    return True


@njit(**FM)
def _off(P, r, code, i0, i1, i2, j0):
    """Where in the arena operand -1 - code's block starts."""
    s = HEAD + 4 * (-1 - code)
    return r[1 - code] + i0 * P[s] + i1 * P[s + 1] + i2 * P[s + 2] + j0 * P[s + 3]


@njit(inline="always", **FM)
def _at(a, R, P, r, code, i0, i1, i2, j0):
    """A pointer to the block a source or destination code names: register code (>= 0) in R, or operand
    -1 - code read / written in place in the arena (its innermost stride is 1)."""
    return fptr(R, code * BLOCK) if code >= 0 else fptr(a, _off(P, r, code, i0, i1, i2, j0))


@njit(**FM)
def _prefetch(a, P, r, nops, pick, i0, i1, i2, j0, l0, l1, line):
    """Prefetch cache lines l0 .. l1 of the block at j0 of each operand k with bit k of pick set."""
    for k in range(nops):
        s = HEAD + 4 * k
        if (pick >> k) & 1:
            at = r[2 + k] + i0 * P[s] + i1 * P[s + 1] + i2 * P[s + 2] + j0
            for q in range(l0, l1):
                prefetch(a, at + q * line)


@row("oprog " + " ".join(f"o{k}" for k in range(MAX_OPERANDS)) + " okey ebase esize stream")
@njit(**FM)
def k_ew_program(a, ia, r):
    """Run the fused elementwise program at ia[r[1]:] (layout in the module docstring) over its iteration
    space; operand k lives at a[r[2 + k]:] with the program's strides. A split row's part j of n runs blocks
    j*nb//n .. (j+1)*nb//n of the nb, on its own registers: each element is computed by the same instructions as
    on one thread (the random numbers are functions of the element's index), so the result is the same bits."""
    j, n = part_of(r)
    nb = n_blocks(ia, r)
    _blocks(a, ia, r, j * nb // n, (j + 1) * nb // n)


@njit(inline="always", **FM)
def n_blocks(ia, r):
    """Blocks of BLOCK elements along the innermost dim of a k_ew_program row's iteration space, in all."""
    P = ia[r[1]:]
    return P[2] * P[3] * P[4] * ((P[5] + BLOCK - 1) // BLOCK)


@njit(inline="always", **FM)     # inlined: E6 batch 1 runs ~50 small chains a step, a call each cost ~2%
def _blocks(a, ia, r, lo, hi):
    """Blocks lo .. hi of the row's iteration space (in C order, BLOCK elements along the innermost dim each);
    the scalar operands' registers (LOADC) are filled at the first."""
    oprog = r[1]
    okey = r[MAX_OPERANDS + 2]; ebase = r[MAX_OPERANDS + 3]; esize = r[MAX_OPERANDS + 4]; stream = r[MAX_OPERANDS + 5]
    P = ia[oprog:]
    ninstr, nops = P[0], P[1]
    n1, n2, n3 = P[3], P[4], P[5]
    nb3 = (n3 + BLOCK - 1) // BLOCK
    oi = HEAD + 4 * nops
    R = carray(stack_buf(a, RSIZE), (RSIZE,))
    sc = np.int64(0)                        # bit k: register k holds a scalar (LOADC)
    for t in range(ninstr):
        if P[oi + WIDTH * t] == LOADC:
            sc |= np.int64(1) << P[oi + WIDTH * t + 1]
    jb, t = lo % nb3, lo // nb3             # block lo's place (i0, i1, i2, jb); then counted up block by block
    i2, t = t % n2, t // n2                 # (not divided out per block: 64-bit divisions cost ~1.5 us per
    i1, i0 = t % n1, t // n1                # 45 blocks, a tenth of E6 batch 1's update)
    line = 64 // a.itemsize                # elements per cache line; nl lines a block
    nl = BLOCK // line
    pick, npick = np.int64(0), 0            # operands read or written in place (innermost stride 1), each
    for k in range(nops if nb3 > 1 else 0):     # array once (an output written over its input is one array)
        new = P[HEAD + 4 * k + 3] == 1
        for k2 in range(k):
            if (pick >> k2) & 1 and r[2 + k2] == r[2 + k]:
                new = False
        if new:
            pick |= np.int64(1) << k
            npick += 1
    streaming = stream > 0 and n_blocks(ia, r) * BLOCK * a.itemsize * npick > PF_STREAM
    for b in range(lo, hi):
        j0 = jb * BLOCK
        m = min(BLOCK, n3 - j0)
        pf = jb + 1 < nb3
        if pf:                              # the next block's first lines of each operand read in place: a
            _prefetch(a, P, r, nops, pick, i0, i1, i2, j0 + BLOCK, 0, PF_LINES, line)   # block is a 4 KB page,
        for t in range(ninstr):             # where the CPU's own prefetchers stop, and the instructions read the
            if pf and streaming:            # operands in turns; a row streaming from memory fetches the rest
                l0 = PF_LINES + t * (nl - PF_LINES) // ninstr      # too, a share before each instruction (Lion's
                l1 = PF_LINES + (t + 1) * (nl - PF_LINES) // ninstr    # update, 1M: 1.3-1.45x -> 1.0-1.2x AdamW;
                _prefetch(a, P, r, nops, pick, i0, i1, i2, j0 + BLOCK, l0, l1, line)     # 256K: 1.2x slower)
            q = oi + WIDTH * t
            op, dr, xr, yr, zr, wr = P[q], P[q + 1], P[q + 2], P[q + 3], P[q + 4], P[q + 5]
            d = _at(a, R, P, r, dr, i0, i1, i2, j0)
            if op == LOAD:                   # operand xr (stride 0 or > 1) into register dr
                s = HEAD + 4 * xr
                base = r[2 + xr] + i0 * P[s] + i1 * P[s + 1] + i2 * P[s + 2] + j0 * P[s + 3]
                st = P[s + 3]
                if st == 0:
                    fill_n(d, a[base], m)
                else:
                    for j in range(m):
                        d[j] = a[base + j * st]
            elif op == RAND:                 # fill takes an array: a slice, built for this rare instruction
                k0, k1, c2, c3 = key(ia, okey, xr)
                e = first(ia, okey, esize) + ebase + ((i0 * n1 + i1) * n2 + i2) * n3 + j0
                fill(R[dr * BLOCK:] if dr >= 0 else a[_off(P, r, dr, i0, i1, i2, j0):], m, e, yr, k0, k1, c2, c3)
            elif op == LOADC:                # a scalar operand xr: its register filled once, for any block
                if b == lo:
                    fill_n(d, a[r[2 + xr]], min(BLOCK, n3))
            elif op == WHERE:
                _where(d, _at(a, R, P, r, xr, i0, i1, i2, j0), _at(a, R, P, r, yr, i0, i1, i2, j0),
                       _at(a, R, P, r, zr, i0, i1, i2, j0), m)
            else:
                x, y = _at(a, R, P, r, xr, i0, i1, i2, j0), _at(a, R, P, r, yr, i0, i1, i2, j0)
                z = _at(a, R, P, r, zr, i0, i1, i2, j0) if op >= FMA else x
                w = _at(a, R, P, r, wr, i0, i1, i2, j0) if op >= FMA2 else x
                al = np.int64(0)                 # bit k: source k is the destination's block (written in place:
                if dr < 0:                       # LLVM's alias check fails and the loop runs scalar; through the
                    at = _off(P, r, dr, i0, i1, i2, j0)           # scratch register both vectorize)
                    for k, c in enumerate((xr, yr, zr if op >= FMA else xr, wr if op >= FMA2 else xr)):
                        al |= (1 << k) if c < 0 and _off(P, r, c, i0, i1, i2, j0) == at else 0
                if sc != 0 and (op >= FMA or BIN + B_ADD <= op <= BIN + B_DIV) and \
                        _affine(op, sc, fptr(R, 0), xr, yr, zr, wr, al, d, x, y, z, w, m):
                    continue
                inplace = al != 0
                s = fptr(R, NREG * BLOCK) if inplace else d
                if op >= FMA:
                    _fma(op, s, x, y, z, w, m)
                else:
                    _op(op, s, x, y, m)
                if inplace:
                    copy_n(d, s, m)         # not _op(U_COPY, ..): a literal op compiles _op again
        jb += 1
        if jb == nb3:
            jb, i2 = 0, i2 + 1
            if i2 == n2:
                i2, i1 = 0, i1 + 1
                if i1 == n1:
                    i1, i0 = 0, i0 + 1
