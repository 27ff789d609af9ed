"""Reductions and row-wise softmax kernels (each kernel's row is its @row declaration).

  k_reduce      in viewed as (n0, n1, n2) -> out (n0, n2), over n1
                sub 0: sum, 1: max
  k_softmax     row-wise over N; sub 0: softmax, 1: log_softmax
  k_softmax_bwd from the saved output y and upstream g:
                sub 0: dx = y * (g - sum(g*y));  sub 1: dx = g - exp(y) * sum(g)
"""
import math

import numpy as np
from numba import carray, njit

from btjit.kernels.common import FM, cvt, fexp, row, stack_buf

R_SUM, R_MAX = 0, 1


@row("sub oout oin n0 n1 n2")
@njit(**FM)
def k_reduce(a, ia, r):
    sub = r[1]
    n0, n1, n2 = r[4], r[5], r[6]
    out = a[r[2]:r[2] + n0 * n2].reshape(n0, n2)
    x = a[r[3]:r[3] + n0 * n1 * n2].reshape(n0, n1, n2)
    acc = carray(stack_buf(a, 128), (128,))   # one stack accumulator: its loops need no alias checks
    for i in range(n0):
        o = out[i]
        xi = x[i]
        if n2 == 1:                       # contiguous reduction: scalar accumulator (vectorizes)
            if sub == R_SUM:
                s = xi[0, 0] * np.float32(0.0)
                for j in range(n1):
                    s += xi[j, 0]
                o[0] = s
            else:
                m = xi[0, 0]
                for j in range(1, n1):
                    v = xi[j, 0]
                    m = v if v > m else m
                o[0] = m
        elif sub == R_SUM and n2 <= 64:   # narrow rows (bias gradients): m rows per pass, folded at the end
            m = 128 // n2
            w = m * n2
            flat = a[r[3] + i * n1 * n2:r[3] + (i + 1) * n1 * n2]
            for k in range(w):
                acc[k] = cvt(a, 0.0)
            ng = n1 // m
            for q in range(ng):
                blk = flat[q * w:q * w + w]
                for k in range(w):
                    acc[k] += blk[k]
            for j in range(ng * m, n1):
                row = xi[j]
                for k in range(n2):
                    acc[k] += row[k]
            for q in range(1, m):
                for k in range(n2):
                    acc[k] += acc[q * n2 + k]
            for k in range(n2):
                o[k] = acc[k]
        else:                             # column blocks of 128 through the accumulator
            for k0 in range(0, n2, 128):
                nk = min(128, n2 - k0)
                for k in range(nk):
                    acc[k] = xi[0, k0 + k]
                for j in range(1, n1):
                    row = xi[j, k0:k0 + nk]
                    if sub == R_SUM:
                        for k in range(nk):
                            acc[k] += row[k]
                    else:
                        for k in range(nk):
                            v = row[k]
                            acc[k] = v if v > acc[k] else acc[k]
                for k in range(nk):
                    o[k0 + k] = acc[k]


@row("sub oout oin M N")
@njit(**FM)
def k_softmax(a, ia, r):
    sub = r[1]
    M, N = r[4], r[5]
    out = a[r[2]:r[2] + M * N].reshape(M, N)
    x = a[r[3]:r[3] + M * N].reshape(M, N)
    for i in range(M):
        xi = x[i]
        yi = out[i]
        mx = xi[0]
        for j in range(1, N):
            v = xi[j]
            mx = v if v > mx else mx
        s = mx * np.float32(0.0)
        for j in range(N):
            e = fexp(xi[j] - mx)
            yi[j] = e
            s += e
        if sub == 0:
            inv = np.float32(1.0) / s
            for j in range(N):
                yi[j] *= inv
        else:
            lse = mx + math.log(s)
            for j in range(N):
                yi[j] = xi[j] - lse


@row("sub odx oout og M N")
@njit(**FM)
def k_softmax_bwd(a, ia, r):
    sub = r[1]
    M, N = r[5], r[6]
    dx = a[r[2]:r[2] + M * N].reshape(M, N)
    y = a[r[3]:r[3] + M * N].reshape(M, N)
    g = a[r[4]:r[4] + M * N].reshape(M, N)
    for i in range(M):
        yi = y[i]
        gi = g[i]
        di = dx[i]
        s = yi[0] * np.float32(0.0)
        if sub == 0:
            for j in range(N):
                s += gi[j] * yi[j]
            for j in range(N):
                di[j] = yi[j] * (gi[j] - s)
        else:
            for j in range(N):
                s += gi[j]
            for j in range(N):
                di[j] = gi[j] - fexp(yi[j]) * s
