"""The optimizer's one hand-written kernel: the global gradient norm, for clipping and for skipping a step.

The update rules themselves are traced equations (btjit/optim/: one fused elementwise pass per param group).
  k_clip_scale a[oscale] = min(1, a[omax] / (||g||_2 + 1e-6)), or 1 if a[omax] <= 0;
               NaN if any gradient is NaN/Inf: the traced update then keeps params and state as they were
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
