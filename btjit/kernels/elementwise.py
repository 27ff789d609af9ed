"""Elementwise kernels: unary maps, same-shape / scalar-operand binary maps, a general strided kernel
(broadcasting, transposes, slices, select) and fills. Sub-op codes below are shared with graph/ops/.

What the rows mean (each kernel's row is its @row declaration; see notes/CONVENTIONS.md):
  k_unary   out = f(in) (a[oc] = exponent for POW)
  k_binary  mode 0: both length n; 1: in2 scalar; 2: in1 scalar
  k_strided 4-D loop nest with element strides for the output and up to three inputs (stride 0 = broadcast).
            sub < 32: binary op of in1, in2 (COPY uses in1 only); SELECT: out = in2 if in1 != 0 else in3.
  k_fill    out[:n] = a[oc]
  k_binary_rows  out (rows x cols) = f(x, y) for the common arithmetic (ROWS_SUBS) with x or y whole or one
            row broadcast over the rows (a bias, a position embedding): a small kernel of its own, so programs
            that need nothing else of k_binary / k_strided do not compile those (measured cold: 9-10 s each,
            this one ~2 s)
  k_sum_rows out (cols) = the sum of the rows of in (rows x cols): the leading-axes reduction (a broadcast's
            gradient), small for the same reason
  k_rounding out = floor / ceil / round (half to even) / trunc of in1, or fmod / remainder (torch's and numpy's:
            the sign of in2) of in1 by in2, modes as k_binary's: an entry of its own, compiled only by programs
            that round
"""
import math

import numpy as np
from numba import njit

from btjit.kernels.common import FM, FM_FLAGS, cvt, ferf, fexp, ftanh, part_of, row

# unary sub-ops
(U_COPY, U_NEG, U_EXP, U_LOG, U_TANH, U_RELU, U_SIGMOID, U_SQRT, U_POW, U_ABS, U_ERF, U_LOG1P, U_SIGN, U_SIN,
 U_COS, U_GELU, U_SILU) = range(17)   # GELU: the exact (erf) x * Phi(x); SILU: x * sigmoid(x). < fused.BIN
# binary sub-ops (also used by k_strided); COPY = unary copy of in1
(B_ADD, B_SUB, B_MUL, B_DIV, B_MAX, B_MIN, B_POW, B_EQ, B_GT, B_GE, B_LT, B_LE, B_NE,
 B_TANH_GRAD, B_RELU_GRAD, B_SIGMOID_GRAD, B_COPY, B_GELU_GRAD, B_SILU_GRAD) = range(19)
# k_rounding's sub-ops
R_FLOOR, R_CEIL, R_ROUND, R_TRUNC, R_FMOD, R_REMAINDER = range(6)
S_SELECT = 32
S_TO_FLOAT = 33   # k_int_strided: out (in a) = float(in1)

_z = np.float32(0.0)
_one = np.float32(1.0)
_half = np.float32(0.5)
# 1 / sqrt(2) and 1 / sqrt(2 pi): the exact GELU's (graph/fuse_act.py and btjit/scalar read them too), cvt to the
# operand's dtype where used
RSQRT2, RSQRT2PI = 0.7071067811865476, 0.3989422804014327


@njit(inline="always", **FM)
def gelu(x):
    """The exact GELU, x * Phi(x) = x (1/2 + erf(x / sqrt 2) / 2), torch's nn.GELU()."""
    return x * (_half + _half * ferf(x * cvt(x, RSQRT2)))


@njit(inline="always", **FM)
def gelu_grad(x, g):
    """g * GELU'(x) = g (Phi(x) + x phi(x)), phi the standard normal density."""
    return g * (_half + _half * ferf(x * cvt(x, RSQRT2)) + x * cvt(x, RSQRT2PI) * fexp(-_half * x * x))


@njit(inline="always", **FM)
def silu(x):
    """SiLU (swish), x * sigmoid(x)."""
    return x / (_one + fexp(-x))


@njit(inline="always", **FM)
def silu_grad(x, g):
    """g * SiLU'(x) = g s (1 + x (1 - s)), s = sigmoid(x)."""
    s = _one / (_one + fexp(-x))
    return g * s * (_one + x * (_one - s))


@njit(inline="always", **FM)
def _unary(sub, x, c):
    if sub == U_COPY:
        return x
    elif sub == U_NEG:
        return -x
    elif sub == U_EXP:
        return fexp(x)
    elif sub == U_LOG:
        return math.log(x)
    elif sub == U_TANH:
        return ftanh(x)
    elif sub == U_RELU:
        return x if x > _z else _z
    elif sub == U_SIGMOID:
        return _one / (_one + fexp(-x))
    elif sub == U_SQRT:
        return math.sqrt(x)
    elif sub == U_POW:
        return x ** c
    elif sub == U_ERF:
        return ferf(x)
    elif sub == U_LOG1P:
        return math.log1p(x)
    elif sub == U_SIGN:
        return _one if x > _z else -_one if x < _z else x     # 0, -0 and NaN kept
    elif sub == U_SIN:
        return math.sin(x)
    elif sub == U_COS:
        return math.cos(x)
    elif sub == U_GELU:
        return gelu(x)
    elif sub == U_SILU:
        return silu(x)
    else:
        return abs(x)


@njit(inline="always", **FM)
def _binary(sub, x, y):
    if sub == B_ADD:
        return x + y
    elif sub == B_SUB:
        return x - y
    elif sub == B_MUL:
        return x * y
    elif sub == B_DIV:
        return x / y
    elif sub == B_MAX:
        return x if x >= y else y
    elif sub == B_MIN:
        return x if x <= y else y
    elif sub == B_POW:
        return x ** y
    elif sub == B_EQ:
        return _one if x == y else _z
    elif sub == B_GT:
        return _one if x > y else _z
    elif sub == B_GE:
        return _one if x >= y else _z
    elif sub == B_LT:
        return _one if x < y else _z
    elif sub == B_LE:
        return _one if x <= y else _z
    elif sub == B_NE:
        return _one if x != y else _z
    elif sub == B_TANH_GRAD:          # x = tanh output, y = upstream grad
        return y * (_one - x * x)
    elif sub == B_RELU_GRAD:          # x = relu input or output (> 0 at the same places), y = upstream grad
        return y if x > _z else y * _z
    elif sub == B_SIGMOID_GRAD:       # x = sigmoid output, y = upstream grad
        return y * x * (_one - x)
    elif sub == B_GELU_GRAD:          # x = GELU input, y = upstream grad
        return gelu_grad(x, y)
    elif sub == B_SILU_GRAD:          # x = SiLU input, y = upstream grad
        return silu_grad(x, y)
    else:                             # B_COPY
        return x


# Compile time is the budget here: every specialized vectorized loop costs ~0.2-0.5 s of cold compile. So
# only the hot ops get one (same-shape operands, mode 0); scalar-operand modes and the cold ops (log,
# sqrt, pow, abs, comparisons) share one scalar loop with the op switch inside. The loops are written out
# (a function per op, as closures over a lambda, took ~2x the compile time: 6.9 s for k_binary).
@njit(**FM)
def _unary_loop(sub, out, x, c):
    n = out.shape[0]
    if sub == U_COPY:
        for i in range(n):
            out[i] = x[i]
    elif sub == U_NEG:
        for i in range(n):
            out[i] = -x[i]
    elif sub == U_EXP:
        for i in range(n):
            out[i] = fexp(x[i])
    elif sub == U_TANH:
        for i in range(n):
            out[i] = ftanh(x[i])
    elif sub == U_RELU:
        for i in range(n):
            out[i] = x[i] if x[i] > _z else _z
    elif sub == U_SIGMOID:
        for i in range(n):
            out[i] = _one / (_one + fexp(-x[i]))
    else:
        for i in range(n):
            out[i] = _unary(sub, x[i], c)


@njit(fastmath=set(FM_FLAGS) - {"arcp"}, error_model="numpy", boundscheck=False)
def _div_by(out, x, v):
    """out = x / v, a true division each (arcp would make it x * (1 / v), off numpy's by an ulp)."""
    for i in range(out.shape[0]):
        out[i] = x[i] / v


@njit(**FM)
def _binary_loop(sub, out, x, y, mode):
    """out = f_sub(x, y) over contiguous slices; mode 1: y is a 1-element slice, 2: x is."""
    n = out.shape[0]
    if mode == 0 and sub == B_ADD:
        for i in range(n):
            out[i] = x[i] + y[i]
    elif mode == 0 and sub == B_SUB:
        for i in range(n):
            out[i] = x[i] - y[i]
    elif mode == 0 and sub == B_MUL:
        for i in range(n):
            out[i] = x[i] * y[i]
    elif mode == 0 and sub == B_DIV:
        for i in range(n):
            out[i] = x[i] / y[i]
    elif mode == 0 and sub == B_MAX:
        for i in range(n):
            out[i] = x[i] if x[i] >= y[i] else y[i]
    elif mode == 0 and sub == B_MIN:
        for i in range(n):
            out[i] = x[i] if x[i] <= y[i] else y[i]
    elif mode == 0 and sub == B_TANH_GRAD:
        for i in range(n):
            out[i] = y[i] * (_one - x[i] * x[i])
    elif mode == 0 and sub == B_RELU_GRAD:
        for i in range(n):
            out[i] = y[i] if x[i] > _z else y[i] * _z
    elif mode == 0 and sub == B_SIGMOID_GRAD:
        for i in range(n):
            out[i] = y[i] * x[i] * (_one - x[i])
    elif mode == 1 and sub == B_MUL:        # a value scaled by a number (attention scores by 1/sqrt(d))
        v = y[0]
        for i in range(n):
            out[i] = x[i] * v
    elif mode == 1 and sub == B_DIV:
        _div_by(out, x, y[0])
    elif mode == 1 and sub == B_ADD:
        v = y[0]
        for i in range(n):
            out[i] = x[i] + v
    elif mode == 1 and sub == B_SUB:
        v = y[0]
        for i in range(n):
            out[i] = x[i] - v
    else:                                   # the others: f_sub per element (not vectorized)
        sx = 0 if mode == 2 else 1
        sy = 0 if mode == 1 else 1
        for i in range(n):
            out[i] = _binary(sub, x[i * sx], y[i * sy])


ROWS_SUBS = (B_ADD, B_SUB, B_MUL, B_RELU_GRAD, B_TANH_GRAD)


@row("sub oout o1 o2 rows cols sx sy")
@njit(**FM)
def k_binary_rows(a, ia, r):
    """A split row's part: its rows, or with fewer rows than parts its columns (blocks of 16)."""
    sub, oout, o1, o2, rows, cols, sx, sy = r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]
    j, n = part_of(r)
    by_rows = rows >= n
    units = rows if by_rows else (cols + 15) // 16
    lo, hi = j * units // n, (j + 1) * units // n
    if by_rows:
        binary_rows(a, sub, oout + lo * cols, o1 + lo * sx, o2 + lo * sy, hi - lo, cols, cols, sx, sy)
    else:
        c0, c1 = lo * 16, min(cols, hi * 16)
        binary_rows(a, sub, oout + c0, o1 + c0, o2 + c0, rows, c1 - c0, cols, sx, sy)


@njit(**FM)
def binary_rows(a, sub, oout, o1, o2, rows, n, ld, sx, sy):
    """out row i (n elements at oout + i*ld) = x row i (at o1 + i*sx) op y row i (at o2 + i*sy)."""
    for i in range(rows):
        out = a[oout + i * ld:oout + i * ld + n]
        x = a[o1 + i * sx:o1 + i * sx + n]
        y = a[o2 + i * sy:o2 + i * sy + n]
        if sub == B_ADD:
            for j in range(n):
                out[j] = x[j] + y[j]
        elif sub == B_SUB:
            for j in range(n):
                out[j] = x[j] - y[j]
        elif sub == B_MUL:
            for j in range(n):
                out[j] = x[j] * y[j]
        elif sub == B_RELU_GRAD:
            for j in range(n):
                out[j] = y[j] if x[j] > _z else y[j] * _z
        else:
            for j in range(n):
                out[j] = y[j] * (_one - x[j] * x[j])


@row("oout oin rows cols")
@njit(**FM)
def k_sum_rows(a, ia, r):
    oout, oin, rows, cols = r[1], r[2], r[3], r[4]
    out = a[oout:oout + cols]
    x = a[oin:oin + rows * cols]
    for j in range(cols):
        out[j] = x[j]
    for i in range(1, rows):
        xi = x[i * cols:(i + 1) * cols]
        for j in range(cols):
            out[j] += xi[j]


@row("sub oout oin n oc")
@njit(**FM)
def k_unary(a, ia, r):
    n = r[4]
    _unary_loop(r[1], a[r[2]:r[2] + n], a[r[3]:r[3] + n], a[r[5]])


@row("sub oout o1 o2 n mode")
@njit(**FM)
def k_binary(a, ia, r):
    n, mode = r[5], r[6]
    _binary_loop(r[1], a[r[2]:r[2] + n], a[r[3]:r[3] + (1 if mode == 2 else n)],
                 a[r[4]:r[4] + (1 if mode == 1 else n)], mode)


@njit(inline="always", **FM)
def _rounding(sub, x, y):
    if sub == R_FLOOR:
        return np.floor(x)
    elif sub == R_CEIL:
        return np.ceil(x)
    elif sub == R_ROUND:
        return np.rint(x)                  # half to even, as numpy's and torch's round
    elif sub == R_TRUNC:
        return np.trunc(x)
    m = np.fmod(x, y)                      # exact
    if sub == R_REMAINDER and m != _z and (m < _z) != (y < _z):
        m += y                             # torch's remainder, numpy's mod: the sign of y
    return m


@row("sub oout o1 o2 n mode")
@njit(**FM)
def k_rounding(a, ia, r):
    """out[i] = f(in1[i], in2[i]) for i < n (unary subs read in1 only); mode 0: both length n; 1: in2 one value;
    2: in1 one value."""
    sub, oout, o1, o2, n, mode = r[1], r[2], r[3], r[4], r[5], r[6]
    out = a[oout:oout + n]
    sx, sy = (0 if mode == 2 else 1), (0 if mode == 1 else 1)
    x, y = a[o1:o1 + (n if sx else 1)], a[o2:o2 + (n if sy else 1)]
    for i in range(n):
        out[i] = _rounding(sub, x[i * sx], y[i * sy])


@row("sub oo o1 o2 o3 n0 n1 n2 n3 so0 so1 so2 so3 p0 p1 p2 p3 q0 q1 q2 q3 t0 t1 t2 t3")
@njit(**FM)
def k_strided(a, ia, r):
    sub = r[1]
    oo, o1, o2, o3 = r[2], r[3], r[4], r[5]
    n0, n1, n2, n3 = r[6], r[7], r[8], r[9]
    so0, so1, so2, so3 = r[10], r[11], r[12], r[13]
    p0, p1, p2, p3 = r[14], r[15], r[16], r[17]
    q0, q1, q2, q3 = r[18], r[19], r[20], r[21]
    t0, t1, t2, t3 = r[22], r[23], r[24], r[25]
    for i0 in range(n0):
        for i1 in range(n1):
            for i2 in range(n2):
                bo = oo + i0 * so0 + i1 * so1 + i2 * so2
                b1 = o1 + i0 * p0 + i1 * p1 + i2 * p2
                b2 = o2 + i0 * q0 + i1 * q1 + i2 * q2
                if sub == B_COPY and so3 == 1 and p3 == 1:      # contiguous runs (slices, transposes, concat)
                    dst = a[bo:bo + n3]
                    src = a[b1:b1 + n3]
                    for i3 in range(n3):
                        dst[i3] = src[i3]
                elif sub == S_SELECT:
                    b3 = o3 + i0 * t0 + i1 * t1 + i2 * t2
                    for i3 in range(n3):
                        a[bo + i3 * so3] = a[b2 + i3 * q3] if a[b1 + i3 * p3] != _z else a[b3 + i3 * t3]
                elif so3 == 1 and p3 <= 1 and q3 <= 1 and not (p3 == 0 and q3 == 0):
                    mode = 0 if p3 == 1 and q3 == 1 else (1 if p3 == 1 else 2)
                    _binary_loop(sub, a[bo:bo + n3], a[b1:b1 + (n3 if p3 else 1)], a[b2:b2 + (n3 if q3 else 1)],
                                 mode)
                elif sub == B_COPY:
                    for i3 in range(n3):
                        a[bo + i3 * so3] = a[b1 + i3 * p3]
                else:
                    for i3 in range(n3):
                        a[bo + i3 * so3] = _binary(sub, a[b1 + i3 * p3], a[b2 + i3 * q3])


@row("oout n oc")
@njit(**FM)
def k_fill(a, ia, r):
    n = r[2]
    out = a[r[1]:r[1] + n]
    v = a[r[3]]
    for i in range(n):
        out[i] = v


@row("oidx n hi oflag ok", stop="oflag")
@njit(**FM)
def k_check_index(a, ia, r):
    """ia[oflag] = 1 + (first i with ia[oidx+i] outside [0, hi) and != ok), else 0 (ok: a value allowed
    besides, e.g. cross_entropy's ignore_index; 0 allows nothing more).
    The executor stops the tape right after a failed check, so no kernel ever reads outside the arena."""
    idx = ia[r[1]:r[1] + r[2]]
    hi = r[3]
    ok = r[5]
    ia[r[4]] = 0
    for i in range(r[2]):
        v = idx[i]
        if (v < 0 or v >= hi) and v != ok:
            ia[r[4]] = i + 1
            return


@njit(inline="always", **FM)
def _int_binary(sub, x, y):
    if sub == B_ADD:
        return x + y
    elif sub == B_SUB:
        return x - y
    elif sub == B_MUL:
        return x * y
    elif sub == B_MAX:
        return x if x > y else y
    elif sub == B_MIN:
        return x if x < y else y
    return x                          # B_COPY


@njit(inline="always", **FM)
def _int_compare(sub, x, y):
    if sub == B_EQ:
        return x == y
    elif sub == B_GT:
        return x > y
    elif sub == B_GE:
        return x >= y
    elif sub == B_LT:
        return x < y
    elif sub == B_LE:
        return x <= y
    return x != y                     # B_NE


@row("sub oo o1 o2 n0 n1 n2 n3 so0 so1 so2 so3 p0 p1 p2 p3 q0 q1 q2 q3")
@njit(**FM)
def k_int_strided(a, ia, r):
    """k_strided's loop nest over integer values: in1, in2 in ia; out in ia for COPY and the arithmetic
    sub-ops (ADD, SUB, MUL, MAX, MIN), in a for the comparisons (EQ ... NE: a 0/1 float mask) and TO_FLOAT."""
    sub = r[1]
    oo, o1, o2 = r[2], r[3], r[4]
    n0, n1, n2, n3 = r[5], r[6], r[7], r[8]
    so0, so1, so2, so3 = r[9], r[10], r[11], r[12]
    p0, p1, p2, p3 = r[13], r[14], r[15], r[16]
    q0, q1, q2, q3 = r[17], r[18], r[19], r[20]
    cmp = B_EQ <= sub <= B_NE
    tofloat = sub == S_TO_FLOAT
    one, zero = cvt(a, 1.0), cvt(a, 0.0)
    for i0 in range(n0):
        for i1 in range(n1):
            for i2 in range(n2):
                bo = oo + i0 * so0 + i1 * so1 + i2 * so2
                b1 = o1 + i0 * p0 + i1 * p1 + i2 * p2
                b2 = o2 + i0 * q0 + i1 * q1 + i2 * q2
                if tofloat:
                    for i3 in range(n3):
                        a[bo + i3 * so3] = cvt(a, ia[b1 + i3 * p3])
                elif cmp:
                    for i3 in range(n3):
                        a[bo + i3 * so3] = one if _int_compare(sub, ia[b1 + i3 * p3], ia[b2 + i3 * q3]) else zero
                else:
                    for i3 in range(n3):
                        ia[bo + i3 * so3] = _int_binary(sub, ia[b1 + i3 * p3], ia[b2 + i3 * q3])
