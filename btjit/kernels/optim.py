"""Optimizer kernels: one pass over the contiguous param / grad / state slices of the arena.

Each kernel's row is its @row declaration.
  k_clip_scale a[oscale] = min(1, a[omax] / (||g||_2 + 1e-6)), or 1 if a[omax] <= 0;
               NaN if any gradient is NaN/Inf: the optimizer kernels then skip the whole update
  k_sgd        g' = scale*g + wd*p; buf = mom*buf + g' (if has_buf, torch semantics); p -= lr * (buf or g')
  k_adamw      torch.optim.AdamW; the step counter t lives in ia[ostep] and is incremented here.
"""
import math

import numpy as np
from numba import njit

from btjit.kernels.common import FM, row


@row("og n omax oscale")
@njit(**FM)
def k_clip_scale(a, ia, r):
    n = r[2]
    g = a[r[1]:r[1] + n]
    mx = a[r[3]]
    s = np.float64(0.0)
    for i in range(n):
        s += np.float64(g[i]) * np.float64(g[i])
    norm = math.sqrt(s)
    if not math.isfinite(norm):
        a[r[4]] = np.nan
    elif mx <= 0:
        a[r[4]] = 1.0
    else:
        sc = mx / (norm + 1e-6)
        a[r[4]] = sc if sc < 1.0 else 1.0


@row("op_ og obuf n olr omom owd oscale has_buf")
@njit(**FM)
def k_sgd(a, ia, r):
    n = r[4]
    p = a[r[1]:r[1] + n]
    g = a[r[2]:r[2] + n]
    lr, mom, wd, sc = a[r[5]], a[r[6]], a[r[7]], a[r[8]]
    if sc != sc:                      # non-finite gradients: skip the update
        return
    if r[9]:
        buf = a[r[3]:r[3] + n]
        for i in range(n):
            gi = g[i] * sc + wd * p[i]
            b = mom * buf[i] + gi
            buf[i] = b
            p[i] -= lr * b
    else:
        for i in range(n):
            p[i] -= lr * (g[i] * sc + wd * p[i])


@row("op_ og om ov n olr ob1 ob2 oeps owd ostep oscale")
@njit(**FM)
def k_adamw(a, ia, r):
    n = r[5]
    p = a[r[1]:r[1] + n]
    g = a[r[2]:r[2] + n]
    m = a[r[3]:r[3] + n]
    v = a[r[4]:r[4] + n]
    lr, b1, b2, eps, wd, sc = a[r[6]], a[r[7]], a[r[8]], a[r[9]], a[r[10]], a[r[12]]
    if sc != sc:                      # non-finite gradients: skip the update
        return
    t = ia[r[11]] + 1
    ia[r[11]] = t
    bc1 = 1.0 - math.pow(np.float64(b1), t)
    bc2 = 1.0 - math.pow(np.float64(b2), t)
    step = lr / bc1
    rbc2 = 1.0 / math.sqrt(bc2)
    one = np.float32(1.0)
    decay = one - lr * wd
    for i in range(n):
        gi = g[i] * sc
        mi = b1 * m[i] + (one - b1) * gi
        vi = b2 * v[i] + (one - b2) * gi * gi
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay - step * mi / (math.sqrt(vi) * rbc2 + eps)
