# Neural-net tape kernels, generic over float32/float64 arenas: LayerNorm fwd/bwd, softmax cross-entropy
# fwd/bwd, tanh-GELU fwd/bwd, embedding gather / scatter-add (attention: attn_loops.py, attention.py,
# attn_lanes.py). Row layouts are in each docstring; outputs overwrite.
import math

import numpy as np
from numba import njit

from btjit.kernels.common import FM, cvt, fexp, fexp_in_range, part_range, row
from btjit.kernels.norm import sq_dev, total


# ---------------------------------------------------------------- LayerNorm
@row("ox og ob oy omean orstd M C oeps")
@njit(**FM)
def k_layernorm_fwd(a, ia, r):
    """y = (x - mean) * rstd * g + b over the last dim C (biased variance, like torch).

      x, y: (M, C); g, b: (C,); mean, rstd: (M,) saved for the backward; eps = a[oeps].
    """
    ox = r[1]; og = r[2]; ob = r[3]; oy = r[4]; omean = r[5]; orstd = r[6]; M = r[7]; C = r[8]
    eps = a[r[9]]
    one = cvt(a, 1.0)
    zero = cvt(a, 0.0)
    invC = one / cvt(a, C)
    g = a[og:og + C]
    b = a[ob:ob + C]
    mean = a[omean:omean + M]
    rstd = a[orstd:orstd + M]
    for i in range(M):
        x = a[ox + i * C:ox + i * C + C]
        y = a[oy + i * C:oy + i * C + C]
        mu = total(x, zero) * invC
        rs = one / math.sqrt(sq_dev(x, mu, zero) * invC + eps)
        mean[i] = mu
        rstd[i] = rs
        for c in range(C):
            y[c] = (x[c] - mu) * rs * g[c] + b[c]


@row("ox og omean orstd ody odx odg odb M C oacc")
@njit(**FM)
def k_layernorm_bwd(a, ia, r):
    """LayerNorm backward from the saved mean/rstd.

      x, dy, dx: (M, C); g, dg, db: (C,); mean, rstd: (M,). Writes dx, dg, db (overwrite). oacc > 0: dx =
      acc + the gradient, acc (M, C) at a[oacc:] (another gradient of x: fuse.fuse_grad_accumulation).
    """
    ox = r[1]; og = r[2]; omean = r[3]; orstd = r[4]; ody = r[5]; odx = r[6]; odg = r[7]; odb = r[8]
    M = r[9]; C = r[10]; oacc = r[11]
    zero = cvt(a, 0.0)
    invC = cvt(a, 1.0) / cvt(a, C)
    g = a[og:og + C]
    dg = a[odg:odg + C]
    db = a[odb:odb + C]
    dg[:] = zero
    db[:] = zero
    for i in range(M):
        x = a[ox + i * C:ox + i * C + C]
        dy = a[ody + i * C:ody + i * C + C]
        dx = a[odx + i * C:odx + i * C + C]
        mu = a[omean + i]
        rs = a[orstd + i]
        s1 = zero
        s2 = zero
        for c in range(C):
            gy = dy[c] * g[c]
            s1 += gy
            s2 += gy * (x[c] - mu)
        m1 = s1 * invC
        m2 = s2 * rs * invC
        if oacc > 0:      # two loops: one with `acc[c] + v if oacc > 0 else v` inside ran 114 vs 92 us (E6b64)
            acc = a[oacc + i * C:oacc + i * C + C]
            for c in range(C):
                xh = (x[c] - mu) * rs
                dx[c] = acc[c] + (dy[c] * g[c] - m1 - xh * m2) * rs
                dg[c] += dy[c] * xh
                db[c] += dy[c]
        else:
            for c in range(C):
                xh = (x[c] - mu) * rs
                dx[c] = (dy[c] * g[c] - m1 - xh * m2) * rs
                dg[c] += dy[c] * xh
                db[c] += dy[c]


# ---------------------------------------------------------------- softmax cross-entropy
@row("ol ot oloss op_ M V ign red")
@njit(**FM)
def k_ce_fwd(a, ia, r):
    """Softmax cross-entropy (max-subtracted, fexp), torch's semantics.

      logits, probs: (M, V) in a; targets: int32 ia[ot:ot+M], each in [0, V) or == ign (not checked). Rows
      whose target is ign (use ign = -2**40 for none: no int32 target equals it) add nothing. red 0: a[oloss]
      = the mean over the other rows (NaN if there are none, as torch), 1: their sum. Writes probs (all rows).
    """
    ol = r[1]; ot = r[2]; oloss = r[3]; op_ = r[4]; M = r[5]; V = r[6]; ign = r[7]; red = r[8]
    kept = 0
    zero = cvt(a, 0.0)
    one = cvt(a, 1.0)
    V4 = V - V % 4
    tot = 0.0
    for i in range(M):
        l = a[ol + i * V:ol + i * V + V]
        d = a[op_ + i * V:op_ + i * V + V]
        m0 = l[0]; m1 = m0; m2 = m0; m3 = m0        # 4 independent max chains
        for j in range(0, V4, 4):
            x0 = l[j]; x1 = l[j + 1]; x2 = l[j + 2]; x3 = l[j + 3]
            m0 = x0 if x0 > m0 else m0
            m1 = x1 if x1 > m1 else m1
            m2 = x2 if x2 > m2 else m2
            m3 = x3 if x3 > m3 else m3
        for j in range(V4, V):
            x0 = l[j]
            m0 = x0 if x0 > m0 else m0
        m0 = m0 if m0 > m1 else m1
        m2 = m2 if m2 > m3 else m3
        mx = m0 if m0 > m2 else m2
        s = zero
        for j in range(V):
            e = fexp(l[j] - mx)
            d[j] = e
            s += e
        inv = one / s
        for j in range(V):
            d[j] *= inv
        t = ia[ot + i]
        if t != ign:
            tot += math.log(s) + (mx - l[t])
            kept += 1
    a[oloss] = tot if red == 1 else (tot / kept if kept > 0 else np.nan)


@row("op_ ot og od M V ign red")
@njit(**FM)
def k_ce_bwd(a, ia, r):
    """Cross-entropy backward: dlogits = (probs - onehot(target)) * a[og] / kept (red 0: the mean over the
    kept rows) or * a[og] (red 1: sum), and 0 in rows whose target is ign (overwrite). probs, dlogits: (M, V);
    targets int32 ia[ot:ot+M]; a[og]: the upstream grad of the loss. No kept row: all zero."""
    op_ = r[1]; ot = r[2]; og = r[3]; od = r[4]; M = r[5]; V = r[6]; ign = r[7]; red = r[8]
    kept = 0
    for i in range(M):
        if ia[ot + i] != ign:
            kept += 1
    sc = a[og] if red == 1 else a[og] / cvt(a, max(kept, 1))
    zero = cvt(a, 0.0)
    for i in range(M):
        d = a[od + i * V:od + i * V + V]
        t = ia[ot + i]
        if t == ign:
            for j in range(V):
                d[j] = zero
            continue
        p = a[op_ + i * V:op_ + i * V + V]
        for j in range(V):
            d[j] = p[j] * sc
        d[t] -= sc


# ---------------------------------------------------------------- GELU (tanh approximation)
# 0.5 (1 + tanh(u)) == sigmoid(2u), so gelu(x) = x * sig(t), t = 2u, sig(t) = 1 / (1 + exp(-t)), and
# sig (1 - sig) = e / (1 + e)^2 with e = exp(-t). Branch-free (vectorizes; 1.35x the two-sided form): x is
# clamped to [-9.5, 9.5] inside sig and gelu', so |t| <= 77 keeps e finite in float32 with no range check
# (fexp_in_range: 1.3x fexp here), and at |x| = 9.5 sig is 1 or ~1e-33: exact far below float64 resolution.
# In the far negative tail the result is x e^-77 ~ -1e-33 instead of a smaller tiny number.
@row("ox oy n")
@njit(**FM)
def k_gelu_fwd(a, ia, r):
    """y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (torch gelu(approximate='tanh')).

    x, y: (n,)
    """
    ox = r[1]; oy = r[2]; n = r[3]
    k0 = cvt(a, 1.5957691216057308)                # 2 * sqrt(2/pi)
    k1 = cvt(a, 0.044715)
    lim = cvt(a, 9.5)
    one = cvt(a, 1.0)
    x = a[ox:ox + n]
    y = a[oy:oy + n]
    for i in range(n):
        v = x[i]
        vc = min(max(v, -lim), lim)
        y[i] = v / (one + fexp_in_range(-(k0 * (vc + k1 * vc * vc * vc))))


@row("ox ody odx n")
@njit(**FM)
def k_gelu_bwd(a, ia, r):
    """dx = gelu'(x) * dy  (overwrite), gelu as in k_gelu_fwd.

    x, dy, dx: (n,)
    """
    ox = r[1]; ody = r[2]; odx = r[3]; n = r[4]
    k0 = cvt(a, 1.5957691216057308)                # 2 * sqrt(2/pi)
    k1 = cvt(a, 0.044715)
    k3 = cvt(a, 0.134145)                          # 3 * 0.044715
    lim = cvt(a, 9.5)
    one = cvt(a, 1.0)
    x = a[ox:ox + n]
    dy = a[ody:ody + n]
    dx = a[odx:odx + n]
    for i in range(n):
        v = min(max(x[i], -lim), lim)
        v2 = v * v
        e = fexp_in_range(-(k0 * (v + k1 * v2 * v)))
        inv = one / (one + e)
        # d/dx [x sig(t)] = sig + x sig (1 - sig) dt/dx, sig = inv, sig (1 - sig) = e inv^2
        dx[i] = dy[i] * (inv + v * (e * inv * inv) * k0 * (one + k3 * v2))


# ---------------------------------------------------------------- embedding gather / scatter-add
@row("otable oidx oout n C ints")
@njit(**FM)
def k_gather_rows(a, ia, r):
    """out[i, :] = table[ia[oidx + i], :] for i < n.

    table: (V, C); idx: int32 ia[oidx:oidx+n]; out: (n, C); ints 1: table and out int32, in ia (labels
    indexed by a mask)
    """
    otable = r[1]; oidx = r[2]; oout = r[3]; n = r[4]; C = r[5]
    if r[6]:
        for i in range(n):
            j = ia[oidx + i]
            for c in range(C):
                ia[oout + i * C + c] = ia[otable + j * C + c]
        return
    for i in range(n):
        j = ia[oidx + i]
        src = a[otable + j * C:otable + j * C + C]
        dst = a[oout + i * C:oout + i * C + C]
        for c in range(C):
            dst[c] = src[c]


@row("og oidx odt n V C")
@njit(**FM)
def k_scatter_add_rows(a, ia, r):
    """dtable = 0; dtable[ia[oidx + i], :] += g[i, :] for i < n  (repeated indices accumulate).

    g: (n, C); idx: int32 ia[oidx:oidx+n]; dtable: (V, C)
    """
    og = r[1]; oidx = r[2]; odt = r[3]; n = r[4]; V = r[5]; C = r[6]
    zero = cvt(a, 0.0)
    dt = a[odt:odt + V * C]
    for k in range(V * C):
        dt[k] = zero
    for i in range(n):
        j = ia[oidx + i]
        src = a[og + i * C:og + i * C + C]
        dst = a[odt + j * C:odt + j * C + C]
        for c in range(C):
            dst[c] += src[c]


@row("ot oidx oout B P V N")
@njit(**FM)
def k_take_sum(a, ia, r):
    """out[b, :] = sum_p table[p, idx[b, p], :]: a gather from P stacked tables summed over p (the folded
    embedding -> concat -> matmul of graph/fuse.py).

    table: (P, V, N); idx: int32 (B, P); out: (B, N). A split row's part: its block of columns.
    """
    ot = r[1]; oidx = r[2]; oout = r[3]; B = r[4]; P = r[5]; V = r[6]; N = r[7]
    c0, c1 = part_range(r, N)
    for b in range(B):
        dst = a[oout + b * N + c0:oout + b * N + c1]
        j = ia[oidx + b * P]
        src = a[ot + j * N + c0:ot + j * N + c1]
        for c in range(c1 - c0):
            dst[c] = src[c]
        for p in range(1, P):
            j = ia[oidx + b * P + p]
            src = a[ot + (p * V + j) * N + c0:ot + (p * V + j) * N + c1]
            for c in range(c1 - c0):
                dst[c] += src[c]


@row("og oidx odt B P V N")
@njit(**FM)
def k_take_sum_grad(a, ia, r):
    """dtable = 0; dtable[p, idx[b, p], :] += g[b, :]  (the backward of k_take_sum).

    g: (B, N); idx: int32 (B, P); dtable: (P, V, N). A split row's part: its block of columns.
    """
    og = r[1]; oidx = r[2]; odt = r[3]; B = r[4]; P = r[5]; V = r[6]; N = r[7]
    zero = cvt(a, 0.0)
    c0, c1 = part_range(r, N)
    for k in range(P * V):
        dt = a[odt + k * N + c0:odt + k * N + c1]
        for c in range(c1 - c0):
            dt[c] = zero
    for b in range(B):
        src = a[og + b * N + c0:og + b * N + c1]
        for p in range(P):
            j = ia[oidx + b * P + p]
            dst = a[odt + (p * V + j) * N + c0:odt + (p * V + j) * N + c1]
            for c in range(c1 - c0):
                dst[c] += src[c]
