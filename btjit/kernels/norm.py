# Batch normalization tape kernels, generic over float32/float64 arenas (btjit.batch_norm, graph/ops/batchnorm.py).
# x is viewed as (P, C, Q): the channel axis C in the middle, every axis before it merged into P and every axis
# after it into Q ((N, C): Q = 1; (N, C, L): P = N, Q = L; (B, T, C) with the channels last: P = B*T, Q = 1).
# Also the sums both normalizations take (total, sq_dev: nn.py's LayerNorm uses them too).
# Statistics run over P and Q, per channel. Q = 1 has its own loops (vectorized along C); outputs overwrite. A
# split row shares the channels over the threads (each channel's sums as on one thread: the same bits).
import math

import numpy as np

from numba import njit

from btjit.kernels.common import FM, cvt, part_of, row


@njit(inline="always", **FM)
def total(x, zero):
    """The sum of x's elements (zero: 0 in the arena's dtype), in order (fast-math: LLVM may reassociate)."""
    s = zero
    for q in range(x.shape[0]):
        s += x[q]
    return s


@njit(inline="always", **FM)
def sq_dev(x, m, zero):
    """The sum of (x[q] - m)^2 over x's elements: the squared deviations from the mean m."""
    s = zero
    for q in range(x.shape[0]):
        d = x[q] - m
        s += d * d
    return s


@njit(**FM)
def bn_fwd(a, r, c0, c1):
    """Channels c0 .. c1-1 of a k_batchnorm_fwd row."""
    ox = r[1]; ow = r[2]; ob = r[3]; oy = r[4]; omean = r[5]; ovar = r[6]; orstd = r[7]; P = r[8]; C = r[9]
    Q = r[10]; eps = a[r[11]]
    zero = cvt(a, 0.0)
    inv_n = cvt(a, 1.0) / cvt(a, P * Q)
    nc = c1 - c0
    w = a[ow + c0:ow + c1]
    b = a[ob + c0:ob + c1]
    mean = a[omean + c0:omean + c1]
    var = a[ovar + c0:ovar + c1]
    rstd = a[orstd + c0:orstd + c1]
    mean[:] = zero
    var[:] = zero
    if Q == 1:
        for p in range(P):
            x = a[ox + p * C + c0:ox + p * C + c1]
            for c in range(nc):
                mean[c] += x[c]
        for c in range(nc):
            mean[c] *= inv_n
        for p in range(P):
            x = a[ox + p * C + c0:ox + p * C + c1]
            for c in range(nc):
                d = x[c] - mean[c]
                var[c] += d * d
    else:
        for p in range(P):
            for c in range(nc):
                o = ox + (p * C + c0 + c) * Q
                mean[c] += total(a[o:o + Q], zero)
        for c in range(nc):
            mean[c] *= inv_n
        for p in range(P):
            for c in range(nc):
                o = ox + (p * C + c0 + c) * Q
                var[c] += sq_dev(a[o:o + Q], mean[c], zero)
    for c in range(nc):     # in float64: a vectorized 1 / sqrt in float32 may be an estimate, so channels in vector
        var[c] *= inv_n     # lanes and in the loop's tail (which depend on the part) would round differently
        rstd[c] = cvt(a, 1.0 / math.sqrt(np.float64(var[c]) + np.float64(eps)))
    if Q == 1:
        for p in range(P):
            x = a[ox + p * C + c0:ox + p * C + c1]
            y = a[oy + p * C + c0:oy + p * C + c1]
            for c in range(nc):
                y[c] = (x[c] - mean[c]) * (rstd[c] * w[c]) + b[c]
    else:
        for p in range(P):
            for c in range(nc):
                o = (p * C + c0 + c) * Q
                x = a[ox + o:ox + o + Q]
                y = a[oy + o:oy + o + Q]
                m = mean[c]
                s = rstd[c] * w[c]
                bc = b[c]
                for q in range(Q):
                    y[q] = (x[q] - m) * s + bc


@row("ox ow ob oy omean ovar orstd P C Q oeps")
@njit(**FM)
def k_batchnorm_fwd(a, ia, r):
    """y = (x - mean) * rstd * w + b per channel, mean and biased var over the P*Q values of each channel
    (two passes: the mean, then the squared deviations), rstd = 1 / sqrt(var + eps), eps = a[oeps].

      x, y: (P, C, Q); w, b, mean, var, rstd: (C,) (mean, var for the running statistics, rstd for the backward).
    """
    j, n = part_of(r)                      # split: the channels in n parts
    bn_fwd(a, r, j * r[9] // n, (j + 1) * r[9] // n)


@njit(**FM)
def bn_bwd(a, r, c0, c1):
    """Channels c0 .. c1-1 of a k_batchnorm_bwd row."""
    ox = r[1]; ow = r[2]; omean = r[3]; orstd = r[4]; ody = r[5]; odx = r[6]; odw = r[7]; odb = r[8]
    P = r[9]; C = r[10]; Q = r[11]
    zero = cvt(a, 0.0)
    inv_n = cvt(a, 1.0) / cvt(a, P * Q)
    nc = c1 - c0
    w = a[ow + c0:ow + c1]
    mean = a[omean + c0:omean + c1]
    rstd = a[orstd + c0:orstd + c1]
    dw = a[odw + c0:odw + c1]
    db = a[odb + c0:odb + c1]
    dw[:] = zero
    db[:] = zero
    if Q == 1:
        for p in range(P):
            x = a[ox + p * C + c0:ox + p * C + c1]
            dy = a[ody + p * C + c0:ody + p * C + c1]
            for c in range(nc):
                db[c] += dy[c]
                dw[c] += dy[c] * (x[c] - mean[c])
        for c in range(nc):
            dw[c] *= rstd[c]
        for p in range(P):
            x = a[ox + p * C + c0:ox + p * C + c1]
            dy = a[ody + p * C + c0:ody + p * C + c1]
            dx = a[odx + p * C + c0:odx + p * C + c1]
            for c in range(nc):
                xh = (x[c] - mean[c]) * rstd[c]
                dx[c] = w[c] * rstd[c] * (dy[c] - db[c] * inv_n - xh * (dw[c] * inv_n))
    else:
        for p in range(P):
            for c in range(nc):
                o = (p * C + c0 + c) * Q
                x = a[ox + o:ox + o + Q]
                dy = a[ody + o:ody + o + Q]
                m = mean[c]
                s1 = zero
                s2 = zero
                for q in range(Q):
                    s1 += dy[q]
                    s2 += dy[q] * (x[q] - m)
                db[c] += s1
                dw[c] += s2
        for c in range(nc):
            dw[c] *= rstd[c]
        for p in range(P):
            for c in range(nc):
                o = (p * C + c0 + c) * Q
                x = a[ox + o:ox + o + Q]
                dy = a[ody + o:ody + o + Q]
                dx = a[odx + o:odx + o + Q]
                m = mean[c]
                rs = rstd[c]
                k = w[c] * rs
                mb = db[c] * inv_n
                mw = dw[c] * inv_n
                for q in range(Q):
                    dx[q] = k * (dy[q] - mb - (x[q] - m) * rs * mw)


@row("ox ow omean orstd ody odx odw odb P C Q")
@njit(**FM)
def k_batchnorm_bwd(a, ia, r):
    """Batch norm backward from the saved mean and rstd, xh = (x - mean) * rstd:
    db = sum dy, dw = sum dy * xh (over P and Q), dx = w * rstd * (dy - db / n - xh * dw / n), n = P * Q.

      x, dy, dx: (P, C, Q); w, mean, rstd, dw, db: (C,).
    """
    j, n = part_of(r)
    bn_bwd(a, r, j * r[10] // n, (j + 1) * r[10] // n)

