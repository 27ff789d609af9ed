# Causal multi-head self-attention as loop kernels, generic over float32/float64 arenas (q, k, v as column
# blocks of one qkv buffer): the per-sequence pair (k_attn_fwd / k_attn_bwd, any batch) and the
# sequence-vectorized "bl" pair (batch >= BL_MIN_B: sequences in the vector lanes, a lane-major copy of qkv in
# scratch), with the layout changes the generated lanes kernels of attn_lanes.py run around them and the
# scratch sizes the lowering reserves. Long sequences run the flash kernels of attention.py instead (the rule
# in attention.flash).

import numpy as np
from numba import njit

from btjit.kernels import attn_lanes
from btjit.kernels.common import FM, cvt, fexp, part_of, row, transpose


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
# Lb = ceil(B / nb) sequences each (the last may be shorter); a split row runs one block per part.
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


# the layout changes around the generated lanes kernels (attn_lanes.py), rows of their own
@row("osrc odst B n nb out")
@njit(**FM)
def k_attn_bl_move(a, ia, r):
    """For each of the nb lane blocks: bl_in (out 0: the (B, n) matrix at osrc into the bl layout at odst) or
    bl_out (out 1: the inverse)."""
    osrc = r[1]; odst = r[2]; B = r[3]; n = r[4]; nb = r[5]; out = r[6]
    for i in range(nb):
        b0, L = bl_span(B, nb, i)
        if out:
            bl_out(a, osrc, odst, b0, L, n)
        else:
            bl_in(a, osrc, odst, b0, L, n)

@njit(**FM)
def _attn_bl_fwd_block(a, r, i):
    """Block i of a k_attn_fwd_bl row: sequences b0 .. b0+L-1."""
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
    """Block i of a k_attn_bwd_bl row: sequences b0 .. b0+L-1."""
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
    W: attn_scratch_size(B, T, C, ...) floats. A split row: part j of n runs blocks j*nb//n .. (j+1)*nb//n."""
    j, n = part_of(r)
    for i in range(j * r[10] // n, (j + 1) * r[10] // n):
        _attn_bl_fwd_block(a, r, i)


@row("oP oW ody odqkv oS B T C NH oscale nb")
@njit(**FM)
def k_attn_bwd_bl(a, ia, r):
    """Backward of k_attn_fwd_bl from its saved X (in W) and PL (in P); writes dqkv (overwrite).
    S: attn_bwd_scratch_size(B, T, C, ...) floats. Split as k_attn_fwd_bl."""
    j, n = part_of(r)
    for i in range(j * r[11] // n, (j + 1) * r[11] // n):
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
