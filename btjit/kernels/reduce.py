"""Reductions and row-wise softmax kernels.

  k_reduce      r = [op, sub, oout, oin, n0, n1, n2]   in viewed as (n0, n1, n2) -> out (n0, n2), over n1
                sub 0: sum, 1: max
  k_softmax     r = [op, sub, oout, oin, M, N]          row-wise over N; sub 0: softmax, 1: log_softmax
  k_softmax_bwd r = [op, sub, odx, oout, og, M, N]      from the saved output y and upstream g:
                sub 0: dx = y * (g - sum(g*y));  sub 1: dx = g - exp(y) * sum(g)
"""
import math

import numpy as np
from numba import njit

from .common import FM, fexp

R_SUM, R_MAX = 0, 1


@njit(**FM)
def k_reduce(a, ia, r):
    sub = r[1]
    n0, n1, n2 = r[4], r[5], r[6]
    out = a[r[2]:r[2] + n0 * n2].reshape(n0, n2)
    x = a[r[3]:r[3] + n0 * n1 * n2].reshape(n0, n1, n2)
    for i in range(n0):
        o = out[i]
        if n2 == 1:                       # contiguous reduction: scalar accumulator (vectorizes)
            xi = x[i]
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
        else:
            xi = x[i]
            for k in range(n2):
                o[k] = xi[0, k]
            for j in range(1, n1):
                row = xi[j]
                if sub == R_SUM:
                    for k in range(n2):
                        o[k] += row[k]
                else:
                    for k in range(n2):
                        v = row[k]
                        o[k] = v if v > o[k] else o[k]


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
