# Neural-net tape kernels, generic over float32/float64 arenas: LayerNorm fwd/bwd, fused causal multi-head
# self-attention fwd/bwd (q,k,v as column blocks of one qkv buffer), softmax cross-entropy fwd/bwd,
# tanh-GELU fwd/bwd, embedding gather / scatter-add. Row layouts are in each docstring; outputs overwrite.
import math

import numpy as np
from numba import njit, prange

from btjit.kernels import attn_lanes
from btjit.kernels.common import FM, FM_PAR, cvt, fexp, fexp_in_range, row, transpose



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
        s = zero
        for c in range(C):
            s += x[c]
        mu = s * invC
        v = zero
        for c in range(C):
            d = x[c] - mu
            v += d * d
        rs = one / math.sqrt(v * invC + eps)
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
    for c in range(C):
        dg[c] = zero
        db[c] = zero
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


# ---------------------------------------------------------------- causal multi-head self-attention
@row("oqkv oy oP B T C NH oscale")
@njit(**FM)
def k_attn_fwd(a, ia, r):
    """Causal multi-head self-attention forward, one (sequence, head, query) row at a time: one pass for
    the scores and their max, one for exp, the sum and the weighted sum of v (hs == 4 fully unrolled).

      qkv: (B*T, 3C), q cols [0,C), k [C,2C), v [2C,3C); head h uses cols h*hs..h*hs+hs-1 of each block,
      hs = C // NH. y: (B*T, C), y[b*T+t, h*hs+d]. P: (B*NH*T, T) saved softmax probabilities, row
      (b*NH+h)*T+t, zeros above the diagonal. scale = a[oscale] (the caller stores 1/sqrt(hs)).
    """
    oqkv = r[1]; oy = r[2]; oP = r[3]; B = r[4]; T = r[5]; C = r[6]; NH = r[7]
    scale = a[r[8]]
    hs = C // NH
    C3 = 3 * C
    BT = B * T
    zero = cvt(a, 0.0)
    one = cvt(a, 1.0)
    QKV = a[oqkv:oqkv + BT * C3].reshape(BT, C3)
    Y = a[oy:oy + BT * C].reshape(BT, C)
    P = a[oP:oP + B * NH * T * T].reshape(B * NH * T, T)
    for b in range(B):
        r0 = b * T
        for h in range(NH):
            qo = h * hs
            ko = C + qo
            vo = 2 * C + qo
            pr = (b * NH + h) * T
            for t in range(T):
                p = P[pr + t]
                q = QKV[r0 + t]
                y = Y[r0 + t]
                mx = -np.inf
                if hs == 4:
                    q0 = q[qo] * scale; q1 = q[qo + 1] * scale; q2 = q[qo + 2] * scale; q3 = q[qo + 3] * scale
                    for s in range(t + 1):
                        k = QKV[r0 + s]
                        sc = q0 * k[ko] + q1 * k[ko + 1] + q2 * k[ko + 2] + q3 * k[ko + 3]
                        p[s] = sc
                        mx = sc if sc > mx else mx
                    tot = zero
                    y0 = zero; y1 = zero; y2 = zero; y3 = zero
                    for s in range(t + 1):
                        e = fexp(p[s] - mx)
                        p[s] = e
                        tot += e
                        v = QKV[r0 + s]
                        y0 += e * v[vo]; y1 += e * v[vo + 1]; y2 += e * v[vo + 2]; y3 += e * v[vo + 3]
                    inv = one / tot
                    y[qo] = y0 * inv; y[qo + 1] = y1 * inv; y[qo + 2] = y2 * inv; y[qo + 3] = y3 * inv
                else:
                    for s in range(t + 1):
                        k = QKV[r0 + s]
                        sc = zero
                        for d in range(hs):
                            sc += q[qo + d] * k[ko + d]
                        sc *= scale
                        p[s] = sc
                        mx = sc if sc > mx else mx
                    tot = zero
                    for d in range(hs):
                        y[qo + d] = zero
                    for s in range(t + 1):
                        e = fexp(p[s] - mx)
                        p[s] = e
                        tot += e
                        v = QKV[r0 + s]
                        for d in range(hs):
                            y[qo + d] += e * v[vo + d]
                    inv = one / tot
                    for d in range(hs):
                        y[qo + d] *= inv
                for s in range(t + 1):
                    p[s] *= inv
                for s in range(t + 1, T):
                    p[s] = zero


@row("oqkv oP ody odqkv B T C NH oscale")
@njit(**FM)
def k_attn_bwd(a, ia, r):
    """Causal multi-head self-attention backward from the saved probabilities P (hs == 4 unrolled).

      layouts as in k_attn_fwd; dy: (B*T, C). Writes dqkv (B*T, 3C) (overwrite).
    """
    oqkv = r[1]; oP = r[2]; ody = r[3]; odqkv = r[4]; B = r[5]; T = r[6]; C = r[7]; NH = r[8]
    BT = B * T
    QKV = a[oqkv:oqkv + BT * 3 * C].reshape(BT, 3 * C)
    DQKV = a[odqkv:odqkv + BT * 3 * C].reshape(BT, 3 * C)
    DY = a[ody:ody + BT * C].reshape(BT, C)
    P = a[oP:oP + B * NH * T * T].reshape(B * NH * T, T)
    for b in range(B):
        _attn_bwd_seq(QKV, DQKV, DY, P, b, T, C, NH, a[r[9]])


@njit(**FM)
def _attn_bwd_seq(QKV, DQKV, DY, P, b, T, C, NH, scale):
    """The attention backward of sequence b: zeroes and writes dqkv rows b*T .. b*T+T-1."""
    hs = C // NH
    C3 = 3 * C
    zero = QKV[0, 0] * 0
    r0 = b * T
    for i in range(r0, r0 + T):
        row = DQKV[i]
        for c in range(C3):
            row[c] = zero
    for h in range(NH):
        qo = h * hs
        ko = C + qo
        vo = 2 * C + qo
        pr = (b * NH + h) * T
        for t in range(T):
            p = P[pr + t]
            dy = DY[r0 + t]
            q = QKV[r0 + t]
            dq = DQKV[r0 + t]
            if hs == 4:
                g0 = dy[qo]; g1 = dy[qo + 1]; g2 = dy[qo + 2]; g3 = dy[qo + 3]
                dot = zero
                for s in range(t + 1):          # dv_s += p_s dy_t ; dot = sum_s p_s <dy_t, v_s>
                    ps = p[s]
                    v = QKV[r0 + s]
                    dv = DQKV[r0 + s]
                    dot += ps * (g0 * v[vo] + g1 * v[vo + 1] + g2 * v[vo + 2] + g3 * v[vo + 3])
                    dv[vo] += ps * g0; dv[vo + 1] += ps * g1; dv[vo + 2] += ps * g2; dv[vo + 3] += ps * g3
                q0 = q[qo] * scale; q1 = q[qo + 1] * scale; q2 = q[qo + 2] * scale; q3 = q[qo + 3] * scale
                a0 = zero; a1 = zero; a2 = zero; a3 = zero
                for s in range(t + 1):          # dS_s = p_s (<dy_t, v_s> - dot); dq_t, dk_s
                    kv = QKV[r0 + s]
                    dk = DQKV[r0 + s]
                    ds = p[s] * (g0 * kv[vo] + g1 * kv[vo + 1] + g2 * kv[vo + 2] + g3 * kv[vo + 3] - dot)
                    a0 += ds * kv[ko]; a1 += ds * kv[ko + 1]; a2 += ds * kv[ko + 2]; a3 += ds * kv[ko + 3]
                    dk[ko] += ds * q0; dk[ko + 1] += ds * q1; dk[ko + 2] += ds * q2; dk[ko + 3] += ds * q3
                dq[qo] += a0 * scale; dq[qo + 1] += a1 * scale; dq[qo + 2] += a2 * scale
                dq[qo + 3] += a3 * scale
                continue
            # pass 1: dv_s += p_s * dy_t ; dot = sum_s p_s * <dy_t, v_s>
            dot = zero
            for s in range(t + 1):
                ps = p[s]
                v = QKV[r0 + s]
                dv = DQKV[r0 + s]
                gs = zero
                for d in range(hs):
                    gs += dy[qo + d] * v[vo + d]
                    dv[vo + d] += ps * dy[qo + d]
                dot += gs * ps
            # pass 2: dS_s = p_s * (<dy_t, v_s> - dot) * scale ; dq_t += dS_s k_s ; dk_s += dS_s q_t
            for s in range(t + 1):
                kv = QKV[r0 + s]
                dk = DQKV[r0 + s]
                gs = zero
                for d in range(hs):
                    gs += dy[qo + d] * kv[vo + d]
                ds = p[s] * (gs - dot) * scale
                for d in range(hs):
                    dq[qo + d] += ds * kv[ko + d]
                    dk[ko + d] += ds * q[qo + d]


LMAX = 64        # most sequences one lane block holds
BL_MIN_B = 16    # from this batch up the sequence-vectorized kernels win (measured 2.3x at 64, slower at <= 8)


# The "bl" kernels (KERNEL_NOTES §3): blocks of L sequences are transposed so that every inner loop runs
# over the L lanes. The block of sequences b0 .. b0+L-1 keeps, from the forward to the backward,
#   X  = its qkv transposed, X[t*3C + c, l]    at W[b0*T*3C:]          (W: the forward's scratch output)
#   PL = its probabilities,  PL[(h*T + t)*T + s, l] (s <= t only) at P[b0*NH*T*T:]
# so P's layout in this mode is private to the pair k_attn_fwd_bl / k_attn_bwd_bl. Blocks: nb of them,
# Lb = ceil(B / nb) sequences each (the last may be shorter); the _par variants run one block per thread.
@njit(**FM)
def bl_span(B, nb, i):
    """First sequence and lane count of block i of nb (Lb = ceil(B / nb) each; the last may be shorter)."""
    Lb = (B + nb - 1) // nb
    b0 = i * Lb
    return b0, min(Lb, B - b0)


@njit(**FM)
def bl_in(a, osrc, odst, b0, L, n):
    """Rows b0 .. b0+L-1 of the (B, n) matrix at osrc, transposed to (n, L) at odst + b0*n."""
    transpose(a, osrc + b0 * n, a, odst + b0 * n, L, n)


@njit(**FM)
def bl_out(a, osrc, odst, b0, L, n):
    """The inverse of bl_in: the (n, L) matrix at osrc + b0*n into rows b0 .. b0+L-1 of the (B, n) matrix at
    odst."""
    transpose(a, osrc + b0 * n, a, odst + b0 * n, n, L)


@njit(**FM)
def pairs_copy(a, orows, opairs, B, T, NH, hs, parts, Lp, to_pairs):
    """Between the (B, T, parts*C) rows at orows (C = NH*hs; part p, head h, element d at column
    p*C + h*hs + d) and the pairs layout of the generated small-batch attention (attn_lanes.py) at opairs:
    row (t*parts + p)*hs + d, lane q = b*NH + h of a (T*parts*hs, Lp) matrix. to_pairs: rows -> pairs, with
    lanes B*NH .. Lp-1 zeroed; else pairs -> rows."""
    C = NH * hs
    n = parts * C
    if to_pairs:
        for row in range(T * parts * hs):
            for q in range(B * NH, Lp):
                a[opairs + row * Lp + q] = 0
    for b in range(B):
        for t in range(T):
            rows = a[orows + (b * T + t) * n:orows + (b * T + t + 1) * n]
            for p in range(parts):
                for h in range(NH):
                    lanes = a[opairs + (t * parts + p) * hs * Lp + b * NH + h:]
                    for d in range(hs):
                        if to_pairs:
                            lanes[d * Lp] = rows[p * C + h * hs + d]
                        else:
                            rows[p * C + h * hs + d] = lanes[d * Lp]


@njit(**FM)
def _attn_bl_fwd_block(a, r, i):
    """Block i of a k_attn_fwd_bl(_par) row: sequences b0 .. b0+L-1."""
    oqkv = r[1]; oy = r[2]; oP = r[3]; oW = r[4]; B = r[5]; T = r[6]; C = r[7]; NH = r[8]
    scale = a[r[9]]
    b0, L = bl_span(B, r[10], i)
    if L <= 0:
        return
    hs = C // NH
    C3 = 3 * C
    zero = cvt(a, 0.0)
    one = cvt(a, 1.0)
    bl_in(a, oqkv, oW, b0, L, T * C3)
    X = a[oW + b0 * T * C3:oW + (b0 + L) * T * C3].reshape(T * C3, L)
    PL = a[oP + b0 * NH * T * T:oP + (b0 + L) * NH * T * T].reshape(NH * T * T, L)
    Y = a[oy + b0 * T * C:oy + (b0 + L) * T * C].reshape(L, T * C)
    mx = a[oW + B * T * C3 + 2 * b0:oW + B * T * C3 + 2 * b0 + L]
    acc = a[oW + B * T * C3 + 2 * b0 + L:oW + B * T * C3 + 2 * b0 + 2 * L]
    for h in range(NH):
        qo = h * hs
        ko = C + qo
        vo = 2 * C + qo
        for t in range(T):
            pt = (h * T + t) * T
            jq = t * C3 + qo
            for s in range(t + 1):          # scores
                sr = PL[pt + s]
                jk = s * C3 + ko
                if hs == 4:                 # one fused pass (the GPT's head size)
                    q0 = X[jq]; q1 = X[jq + 1]; q2 = X[jq + 2]; q3 = X[jq + 3]
                    k0 = X[jk]; k1 = X[jk + 1]; k2 = X[jk + 2]; k3 = X[jk + 3]
                    for l in range(L):
                        sr[l] = q0[l] * k0[l] + q1[l] * k1[l] + q2[l] * k2[l] + q3[l] * k3[l]
                    continue
                for l in range(L):
                    sr[l] = zero
                for d in range(hs):
                    xq = X[jq + d]
                    xk = X[jk + d]
                    for l in range(L):
                        sr[l] += xq[l] * xk[l]
            s0 = PL[pt]
            for l in range(L):
                mx[l] = s0[l]
            for s in range(1, t + 1):
                sr = PL[pt + s]
                for l in range(L):
                    v = sr[l]
                    mx[l] = v if v > mx[l] else mx[l]
            for l in range(L):
                acc[l] = zero
            for s in range(t + 1):          # exp and its sum
                sr = PL[pt + s]
                for l in range(L):
                    e = fexp((sr[l] - mx[l]) * scale)
                    sr[l] = e
                    acc[l] += e
            for l in range(L):
                acc[l] = one / acc[l]
            for s in range(t + 1):
                sr = PL[pt + s]
                for l in range(L):
                    sr[l] *= acc[l]
            for d in range(hs):             # y = P v
                for l in range(L):
                    mx[l] = zero
                for s in range(t + 1):
                    sr = PL[pt + s]
                    xv = X[s * C3 + vo + d]
                    for l in range(L):
                        mx[l] += sr[l] * xv[l]
                for l in range(L):
                    Y[l, t * C + qo + d] = mx[l]


@njit(**FM)
def _attn_bl_bwd_block(a, r, i):
    """Block i of a k_attn_bwd_bl(_par) row: sequences b0 .. b0+L-1."""
    oP = r[1]; oW = r[2]; ody = r[3]; odqkv = r[4]; oS = r[5]; B = r[6]; T = r[7]; C = r[8]; NH = r[9]
    scale = a[r[10]]
    b0, L = bl_span(B, r[11], i)
    if L <= 0:
        return
    hs = C // NH
    C3 = 3 * C
    zero = cvt(a, 0.0)
    X = a[oW + b0 * T * C3:oW + (b0 + L) * T * C3].reshape(T * C3, L)
    PL = a[oP + b0 * NH * T * T:oP + (b0 + L) * NH * T * T].reshape(NH * T * T, L)
    G = a[oS + b0 * T * C:oS + (b0 + L) * T * C].reshape(T * C, L)
    o2 = oS + B * T * C
    D = a[o2 + b0 * T * C3:o2 + (b0 + L) * T * C3].reshape(T * C3, L)
    o3 = o2 + B * T * C3
    DP = a[o3 + b0 * (T + 1):o3 + (b0 + L) * (T + 1)].reshape(T + 1, L)
    dot = DP[T]
    bl_in(a, ody, oS, b0, L, T * C)         # dy transposed in
    for j in range(T * C3):
        dr = D[j]
        for l in range(L):
            dr[l] = zero
    for h in range(NH):
        qo = h * hs
        ko = C + qo
        vo = 2 * C + qo
        for t in range(T):
            pt = (h * T + t) * T
            for l in range(L):
                dot[l] = zero
            jg = t * C + qo
            jq = t * C3 + qo
            # every lane loop below touches few enough rows (<= 9) for LLVM's runtime alias checks, so
            # all of them vectorize; one loop with all rows fused measured 10% slower (left scalar).
            for s in range(t + 1):          # dp_s = <dy_t, v_s>; dot = sum_s p_s dp_s; dv_s += p_s dy_t
                p = PL[pt + s]
                dp = DP[s]
                jv = s * C3 + vo
                if hs == 4:
                    g0 = G[jg]; g1 = G[jg + 1]; g2 = G[jg + 2]; g3 = G[jg + 3]
                    v0 = X[jv]; v1 = X[jv + 1]; v2 = X[jv + 2]; v3 = X[jv + 3]
                    for l in range(L):
                        dp[l] = g0[l] * v0[l] + g1[l] * v1[l] + g2[l] * v2[l] + g3[l] * v3[l]
                else:
                    for l in range(L):
                        dp[l] = zero
                    for d in range(hs):
                        g = G[jg + d]
                        xv = X[jv + d]
                        for l in range(L):
                            dp[l] += g[l] * xv[l]
                for l in range(L):
                    dot[l] += p[l] * dp[l]
                for d in range(hs):
                    g = G[jg + d]
                    dv = D[jv + d]
                    for l in range(L):
                        dv[l] += p[l] * g[l]
            for s in range(t + 1):          # ds = p_s (dp_s - dot) scale; dq_t += ds k_s; dk_s += ds q_t
                p = PL[pt + s]
                dp = DP[s]
                for l in range(L):
                    dp[l] = p[l] * (dp[l] - dot[l]) * scale
                jk = s * C3 + ko
                for d in range(hs):
                    dq = D[jq + d]
                    xk = X[jk + d]
                    dk = D[jk + d]
                    xq = X[jq + d]
                    for l in range(L):
                        dq[l] += dp[l] * xk[l]
                        dk[l] += dp[l] * xq[l]
    bl_out(a, o2, odqkv, b0, L, T * C3)     # dqkv transposed out


@row("oqkv oy oP oW B T C NH oscale nb")
@njit(**FM)
def k_attn_fwd_bl(a, ia, r):
    """Causal self-attention forward vectorized across sequences (layouts above the helpers).
    W: attn_scratch_size(B, T, C, ...) floats."""
    for i in range(r[10]):
        _attn_bl_fwd_block(a, r, i)


@row("oqkv oy oP oW B T C NH oscale nb")
@njit(**FM_PAR)
def k_attn_fwd_bl_par(a, ia, r):
    """k_attn_fwd_bl with one block per thread-pool task (same row)."""
    for i in prange(r[10]):
        _attn_bl_fwd_block(a, r, i)


@row("oP oW ody odqkv oS B T C NH oscale nb")
@njit(**FM)
def k_attn_bwd_bl(a, ia, r):
    """Backward of k_attn_fwd_bl from its saved X (in W) and PL (in P); writes dqkv (overwrite).
    S: attn_bwd_scratch_size(B, T, C, ...) floats."""
    for i in range(r[11]):
        _attn_bl_bwd_block(a, r, i)


@row("oP oW ody odqkv oS B T C NH oscale nb")
@njit(**FM_PAR)
def k_attn_bwd_bl_par(a, ia, r):
    """k_attn_bwd_bl with one block per thread-pool task (same row)."""
    for i in prange(r[11]):
        _attn_bl_bwd_block(a, r, i)


def attn_blocks(B, threads):
    """Lane blocks of the bl kernels: at most LMAX sequences each, at least one per thread."""
    return max(-(-B // LMAX), threads if threads > 1 else 1)


def attn_scratch_size(B, T, C, NH, float_dtype):
    """Floats of the forward's scratch output W: in bl mode (B >= BL_MIN_B) X, then two (B,) rows; below,
    the generated pairs kernels' scratch where they apply (attn_lanes.pairs_scratch), else none."""
    if B >= BL_MIN_B:
        return B * T * 3 * C + 2 * B
    return attn_lanes.pairs_scratch(B, T, C, NH)[0] if attn_lanes.pairs_eligible(T, C // NH, float_dtype) else 0


def attn_bwd_scratch_size(B, T, C, NH, float_dtype):
    """Floats of the backward's scratch output S: in bl mode dy^T, dqkv^T, T+1 rows of L; below BL_MIN_B as
    attn_scratch_size."""
    if B >= BL_MIN_B:
        return B * (T * C + T * 3 * C + T + 1)
    return attn_lanes.pairs_scratch(B, T, C, NH)[1] if attn_lanes.pairs_eligible(T, C // NH, float_dtype) else 0


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
@row("otable oidx oout n C")
@njit(**FM)
def k_gather_rows(a, ia, r):
    """out[i, :] = table[ia[oidx + i], :] for i < n.

    table: (V, C); idx: int32 ia[oidx:oidx+n]; out: (n, C)
    """
    otable = r[1]; oidx = r[2]; oout = r[3]; n = r[4]; C = r[5]
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

    table: (P, V, N); idx: int32 (B, P); out: (B, N)
    """
    ot = r[1]; oidx = r[2]; oout = r[3]; B = r[4]; P = r[5]; V = r[6]; N = r[7]
    for b in range(B):
        dst = a[oout + b * N:oout + b * N + N]
        j = ia[oidx + b * P]
        src = a[ot + j * N:ot + j * N + N]
        for c in range(N):
            dst[c] = src[c]
        for p in range(1, P):
            j = ia[oidx + b * P + p]
            src = a[ot + (p * V + j) * N:ot + (p * V + j) * N + N]
            for c in range(N):
                dst[c] += src[c]


@row("og oidx odt B P V N")
@njit(**FM)
def k_take_sum_grad(a, ia, r):
    """dtable = 0; dtable[p, idx[b, p], :] += g[b, :]  (the backward of k_take_sum).

    g: (B, N); idx: int32 (B, P); dtable: (P, V, N)
    """
    og = r[1]; oidx = r[2]; odt = r[3]; B = r[4]; P = r[5]; V = r[6]; N = r[7]
    zero = cvt(a, 0.0)
    dt = a[odt:odt + P * V * N]
    for k in range(P * V * N):
        dt[k] = zero
    for b in range(B):
        src = a[og + b * N:og + b * N + N]
        for p in range(P):
            j = ia[oidx + b * P + p]
            dst = a[odt + (p * V + j) * N:odt + (p * V + j) * N + N]
            for c in range(N):
                dst[c] += src[c]
