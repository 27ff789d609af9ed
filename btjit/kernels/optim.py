"""The optimizer's hand-written kernels: the global gradient norm (for clipping and for skipping a step), and the
built-in SGD, Adam/AdamW and Adadelta in one pass each. Every other update rule is traced equations (btjit/optim/: fused
elementwise passes per param group, or any traced ops per param).
  k_clip_scale a[oscale] = min(1, a[omax] / (||g||_2 + 1e-6)), or 1 if a[omax] <= 0;
               NaN if any gradient is NaN/Inf: the traced update then keeps params and state as they were
"""
import math

import numpy as np
from numba import njit

from btjit.kernels.common import FM, cvt, part_range, row


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


# ------------------------------------------------------------------- the built-ins' update, one pass each
# btjit/graph/ops/optim.py's opt_update rows: torch.optim.SGD, Adam/AdamW and Adadelta over one param group's slice,
# every term in one loop (the traced equations take a pass per op through the fused-chain interpreter: 2-5x slower).
# p and the state at op_ o<state> are updated in place from the gradient at og. Scalars: ot the step t (>= 1),
# olr lr * lr_scale, oscale the clip-by-norm factor (NaN: a non-finite gradient; with SKIP the step then leaves
# every value as it was). The flags say which terms exist.
SCALE, SKIP, WD, DECOUPLED, MOMENTUM, DAMPENING, NESTEROV = 1, 2, 4, 8, 16, 32, 64


@njit(inline="always", **FM)
def _scale(a, oscale, flags):
    """(the factor the gradient is multiplied by: a[oscale] with SCALE, else 1; whether the step is skipped: with
    SKIP, a[oscale] NaN, a non-finite gradient -- every value then stays as it was)."""
    sc = a[oscale]
    return (sc if flags & SCALE else cvt(a, 1.0)), flags & SKIP != 0 and sc != sc


@njit(inline="always", **FM)
def _sgd(a, r, lo, hi):
    op_, og, ob = r[1], r[2], r[3]
    olr, oscale, owd, omom, o1damp, ot, flags = r[5], r[6], r[7], r[8], r[9], r[10], r[11]
    sc, skip = _scale(a, oscale, flags)
    if skip:
        return
    lr, wd, mom, damp1 = a[olr], a[owd], a[omom], a[o1damp]
    p, g, b = a[op_ + lo:op_ + hi], a[og + lo:og + hi], a[ob + lo:ob + hi]
    if flags & MOMENTUM:
        restart = flags & DAMPENING and a[ot] == 1      # torch starts the buffer at the first gradient
        for i in range(hi - lo):
            gi = g[i] * sc + wd * p[i] if flags & WD else g[i] * sc
            bi = gi if restart else mom * b[i] + damp1 * gi
            b[i] = bi
            p[i] = p[i] - lr * (gi + mom * bi if flags & NESTEROV else bi)
    else:
        for i in range(hi - lo):
            p[i] = p[i] - lr * (g[i] * sc + wd * p[i] if flags & WD else g[i] * sc)


@row("op_ og ob n olr oscale owd omom o1damp ot flags")
@njit(**FM)
def k_opt_sgd(a, ia, r):
    """torch.optim.SGD over n elements in one pass."""
    lo, hi = part_range(r, r[4])          # a split row: its run of whole 16-element blocks
    _sgd(a, r, lo, hi)


@njit(inline="always", **FM)
def _adam(a, r, lo, hi):
    op_, og, om, ov = r[1], r[2], r[3], r[4]
    olr, oscale, owd, ob1, o1b1, ob2, o1b2, oeps, ot, flags = (r[6], r[7], r[8], r[9], r[10], r[11], r[12],
                                                              r[13], r[14], r[15])
    sc, skip = _scale(a, oscale, flags)
    if skip:
        return
    lr, wd, eps, c1, b2, c2 = a[olr], a[owd], a[oeps], a[o1b1], a[ob2], a[o1b2]
    # torch's bias corrections, in float64, of beta = 1 - (1 - beta) from the exact 1 - beta slots (a float32
    # arena's beta2 slot holds 0.99900001: 1 - beta2 ** t would be 1.3e-5 off)
    t = np.float64(a[ot])
    step = cvt(a, np.float64(lr) / (1.0 - (1.0 - np.float64(c1)) ** t))
    bc2 = cvt(a, math.sqrt(1.0 - (1.0 - np.float64(c2)) ** t))
    decay = cvt(a, 1.0) - lr * wd if flags & DECOUPLED else cvt(a, 1.0)
    l2 = wd if flags & WD and not flags & DECOUPLED else cvt(a, 0.0)
    p, g, m, v = a[op_ + lo:op_ + hi], a[og + lo:og + hi], a[om + lo:om + hi], a[ov + lo:ov + hi]
    for i in range(hi - lo):
        gi = g[i] * sc + l2 * p[i]
        mi = m[i] + c1 * (gi - m[i])               # torch's lerp
        vi = b2 * v[i] + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay + (-step) * mi / (math.sqrt(vi) / bc2 + eps)


@row("op_ og om ov n olr oscale owd ob1 o1b1 ob2 o1b2 oeps ot flags")
@njit(**FM)
def k_opt_adam(a, ia, r):
    """torch.optim.Adam / AdamW over n elements in one pass."""
    lo, hi = part_range(r, r[5])          # a split row: its run of whole 16-element blocks
    _adam(a, r, lo, hi)


@njit(inline="always", **FM)
def _adadelta(a, r, lo, hi):
    op_, og, osq, oacc = r[1], r[2], r[3], r[4]
    olr, oscale, owd, o1rho, oeps, flags = r[6], r[7], r[8], r[9], r[10], r[11]
    sc, skip = _scale(a, oscale, flags)
    if skip:
        return
    lr, wd, c, eps = a[olr], a[owd], a[o1rho], a[oeps]
    p, g, sq, acc = a[op_ + lo:op_ + hi], a[og + lo:og + hi], a[osq + lo:osq + hi], a[oacc + lo:oacc + hi]
    for i in range(hi - lo):    # rho*s + (1-rho)*x as s + (1-rho)*(x - s): with two products, which one a
        gi = g[i] * sc + wd * p[i] if flags & WD else g[i] * sc     # multiply-add takes may differ between
        si = sq[i] + c * (gi * gi - sq[i])                          # compiles
        di = math.sqrt((acc[i] + eps) / (si + eps)) * gi
        sq[i] = si
        acc[i] = acc[i] + c * (di * di - acc[i])
        p[i] = p[i] - lr * di


@row("op_ og osq oacc n olr oscale owd o1rho oeps flags")
@njit(**FM)
def k_opt_adadelta(a, ia, r):
    """torch.optim.Adadelta over n elements in one pass."""
    lo, hi = part_range(r, r[5])          # a split row: its run of whole 16-element blocks
    _adadelta(a, r, lo, hi)

