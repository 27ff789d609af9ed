# Flash-style causal multi-head self-attention for any T and head size (float32 and float64, one library
# entry per dtype: every size comes from the row). Per (sequence, head): query tiles of R rows x key tiles
# of up to BK keys, tiles above the diagonal skipped, online softmax (running max and sum); the forward
# saves only the per-row logsumexp (B*NH*T floats) and a copy of y, the backward recomputes the
# probabilities from them (D = rowsum(dO*O), dS = P*(dP - D), dQ += dS K, dK += dS^T Q, dV += P^T dO).
#
# Every product is a 4 x 16 register tile (`mk_set` / `mk_add`, an llvmlite loop over the reduction index:
# one 16-wide row of B, four broadcasts of A, four vector multiply-adds per step; 59 GFLOP/s float32 on a
# 64x64x32 GEMM here, what OpenBLAS sgemm reaches). So the B operands are stored with 16 contiguous
# columns: the head's K and V transposed (KT, VT: hs x Tp, keys contiguous) for S = Q K^T and dP = dO V^T,
# V and K as rows (Tp x hsp, head dims contiguous) for O += P V and dQ += dS K, the query and dO blocks as
# rows for dV += P^T dO and dK += dS^T Q; Tp and hsp are T and hs rounded up to 16, the padding zero. The
# scores / probabilities and dP / dS tiles live in one stack buffer (R x BK each), softmax runs on them.
#
# Layouts (as k_attn_fwd in attn_loops.py): qkv (B*T, 3C), q cols [0,C), k [C,2C), v [2C,3C), head h at
# h*hs..h*hs+hs-1 of each; y, dy (B*T, C); L (B*NH*T) logsumexp of row (b*NH+h)*T+t of the scaled scores.
import math

import numpy as np
from numba import carray, njit

from btjit.kernels.common import FM, cvt, fexp, row, stack_buf, tile16
from btjit.kernels.tiles import R, V, mk_add, mk_set, prob_row, softmax_row

BK = 64             # keys per tile (a multiple of V)
TILE = R * BK       # floats of one stack tile (scores / probabilities, or dP / dS)
FWD_BUF = TILE + 3 * R + 2   # the forward's stack buffer: one tile, the running max and sum of R rows, 2 spare
BWD_BUF = 2 * TILE       # the backward's: the P and dS tiles
# The lowering rule (flash below): T >= 16 and T*hs >= 256. Measured fwd + bwd through the library, one thread,
# float32, old kernels / flash (> 1: flash faster): hs 16: T 16 1.30 (B 32), T 24 1.48, T 32 2.3; hs 32: T 16 5.5
# (B 8), T 32 10.5, T 48 4.7 (B 16), T 64 5.3; hs 4: T 64 1.11, T 128 1.64, T 256 4.9, but T 16 0.22 and T 32 0.49
# (B 64); hs 8, T 16 0.50 (B 32); T 8: hs 32 1.75 at B 8 but 0.65 at B 64, hs 16 0.43 at B 64 (E6, T 8 hs 4, keeps
# its generated kernels).
FLASH_MIN_T = 16
FLASH_MIN_THS = 256
# attn_kept.py's kernels (whole-head products on the GEMM micro-kernels, P kept: B*NH*T*Tp floats) where the
# head has >= 8 dims, T >= 8, T*hs > 64 (at T 8, hs 8 the generated kernels of attn_lanes.py are 1.4-2.5x
# faster at batch 4-64) and P is at most KEPT_MAX_RATIO times qkv's floats (Tp <= 3 hs x that). Measured
# fwd + bwd through the library, one thread, float32, the kernels they replace / kept: flash: hs 16: T 16 2.7
# (B 32), T 32 2.3; hs 32: T 64 1.9 (B 16), T 128 2.0 (B 8); hs 64: T 256 1.55 (B 4), T 1024 2.7 (B 2); hs 8:
# T 32 2.4 (B 32); the small-T kernels: T 8 hs 16 2.4 (B 32), T 8 hs 32 3.5 (B 64), T 12 hs 16 2.1, T 16 hs 8
# 1.9-2.7, T 9 hs 9 1.4 (B 16), T 10 hs 10 0.93 (B 32).
KEPT_MIN_HS = 8
KEPT_MIN_T = 8
KEPT_MIN_THS = 65
KEPT_MAX_RATIO = 8


def flash(T, hs) -> bool:
    """Whether T and hs are in the flash kernels' domain: T >= FLASH_MIN_T and T*hs >= FLASH_MIN_THS."""
    return T >= FLASH_MIN_T and T * hs >= FLASH_MIN_THS


def kind(T, hs) -> str | None:
    """The lowering rule (btjit/graph/ops/nn.py's _attn_lower; any batch): "kept" (attn_kept.py), "flash"
    (this file) or None (the small-T kernels of attn_loops.py / attn_lanes.py)."""
    if hs >= KEPT_MIN_HS and T >= KEPT_MIN_T and T * hs >= KEPT_MIN_THS and _up(T) <= 3 * hs * KEPT_MAX_RATIO:
        return "kept"
    return "flash" if flash(T, hs) else None


@njit(**FM)
def _up(n):
    return (n + V - 1) // V * V


def fwd_scratch(B, T, C, NH) -> int:
    """Floats of the forward's scratch output W: y's copy (B*T*C), then for one head KT (hs x Tp), V's rows
    (Tp x hsp), the scaled q block (R x hs) and the O accumulators (R x hsp)."""
    hs = C // NH
    return B * T * C + hs * _up(T) + _up(T) * _up(hs) + R * hs + R * _up(hs)


def bwd_scratch(B, T, C, NH) -> int:
    """Floats of the backward's scratch output S, for one head: KT, VT (hs x Tp), K's rows, dK, dV
    (Tp x hsp), the scaled q, dO and dQ blocks (R x hsp), D (R)."""
    hs = C // NH
    return 2 * hs * _up(T) + 3 * _up(T) * _up(hs) + 3 * R * _up(hs) + R


@njit(**FM)
def _tr(a, osrc, lds, odst, ldd, nr, nc):
    """a[odst + j*ldd + i] = a[osrc + i*lds + j] for i < nr, j < nc (the two regions do not overlap): 16 x 16
    register tiles, the last of each row / column moved back to end at nr / nc; element loops below 16."""
    if nr >= 16 and nc >= 16:
        for i0 in range(0, nr, 16):
            i = min(i0, nr - 16)
            for j0 in range(0, nc, 16):
                j = min(j0, nc - 16)
                tile16(a, osrc + i * lds + j, lds, a, odst + j * ldd + i, ldd)
        return
    for i in range(nr):
        s = a[osrc + i * lds:osrc + i * lds + nc]
        for j in range(nc):
            a[odst + j * ldd + i] = s[j]


@njit(**FM)
def _rows(a, osrc, lds, nr, nc, sc, odst, ldd, nrp):
    """a[odst + i*ldd + j] = sc * a[osrc + i*lds + j] for i < nr, j < nc; zero for nc <= j < ldd and for the
    rows nr .. nrp-1."""
    zero = cvt(a, 0.0)
    for i in range(nrp):
        d = a[odst + i * ldd:odst + i * ldd + ldd]
        if i < nr:
            s = a[osrc + i * lds:osrc + i * lds + nc]
            for j in range(nc):
                d[j] = s[j] * sc
            for j in range(nc, ldd):
                d[j] = zero
        else:
            for j in range(ldd):
                d[j] = zero


@njit(**FM)
def _keys_t(a, osrc, lds, T, hs, odst):
    """The T x hs block at osrc (row stride lds) transposed into the hs x Tp matrix at odst, columns
    T .. Tp-1 zero."""
    Tp = _up(T)
    _tr(a, osrc, lds, odst, Tp, T, hs)
    zero = cvt(a, 0.0)
    for d in range(hs):
        for j in range(T, Tp):
            a[odst + d * Tp + j] = zero


@njit(**FM)
def _fwd_head(a, oqkv, oy, oL, oW, b, h, B, T, C, NH, scale):
    hs = C // NH
    hsp = _up(hs)
    Tp = _up(T)
    C3 = 3 * C
    okt = oW + B * T * C
    ovn = okt + hs * Tp
    oq = ovn + Tp * hsp
    oo = oq + R * hs
    r0 = b * T
    _keys_t(a, oqkv + r0 * C3 + C + h * hs, C3, T, hs, okt)
    _rows(a, oqkv + r0 * C3 + 2 * C + h * hs, C3, T, hs, cvt(a, 1.0), ovn, hsp, Tp)
    zero = cvt(a, 0.0)
    one = cvt(a, 1.0)
    buf = carray(stack_buf(a, FWD_BUF), (FWD_BUF,))
    m = buf[TILE:TILE + R]
    l = buf[TILE + R:TILE + 2 * R]
    O = a[oo:oo + R * hsp]
    for t0 in range(0, T, R):
        nr = min(R, T - t0)
        _rows(a, oqkv + (r0 + t0) * C3 + h * hs, C3, nr, hs, scale, oq, hs, R)
        for i in range(R):
            m[i] = -np.inf
            l[i] = zero
        for c in range(R * hsp):
            O[c] = zero
        kend = _up(t0 + nr)
        for j0 in range(0, kend, BK):
            n = min(BK, kend - j0)
            for c in range(0, n, V):                # S = (scale Q) K^T
                mk_set(a, oq, hs, 1, a, okt + j0 + c, Tp, hs, buf, c, BK)
            for i in range(R):                      # online softmax of each row
                nv = max(min(t0 + i - j0 + 1, n), 0) if i < nr else 0   # keys j0 + j <= t0 + i
                softmax_row(buf, i * BK, n, nv, m[i], TILE + 3 * R)
                mx = buf[TILE + 3 * R]
                alpha = fexp(m[i] - mx) if nv > 0 else one   # 0 on the first tile (m = -inf)
                l[i] = l[i] * alpha + buf[TILE + 3 * R + 1]
                m[i] = mx if nv > 0 else m[i]
                o = O[i * hsp:i * hsp + hsp]
                for d in range(hsp):
                    o[d] *= alpha
            for d0 in range(0, hsp, V):             # O += P V
                mk_add(buf, 0, BK, 1, a, ovn + j0 * hsp + d0, hsp, n, a, oo + d0, hsp)
        for i in range(nr):
            inv = one / l[i]
            ro = (r0 + t0 + i) * C + h * hs
            y = a[oy + ro:oy + ro + hs]
            ys = a[oW + ro:oW + ro + hs]
            for d in range(hs):
                v = O[i * hsp + d] * inv
                y[d] = v
                ys[d] = v
            a[oL + (b * NH + h) * T + t0 + i] = m[i] + math.log(l[i])


@row("oqkv oy oL oW B T C NH oscale")
@njit(**FM)
def k_attn_fwd_flash(a, ia, r):
    """Causal self-attention forward, flash style (see the top of the file). Writes y, L (B*NH*T
    logsumexps) and W (fwd_scratch(B, T, C, NH) floats: y's copy for the backward, then per-head scratch)."""
    oqkv = r[1]; oy = r[2]; oL = r[3]; oW = r[4]; B = r[5]; T = r[6]; C = r[7]; NH = r[8]
    scale = a[r[9]]
    for b in range(B):
        for h in range(NH):
            _fwd_head(a, oqkv, oy, oL, oW, b, h, B, T, C, NH, scale)


@njit(**FM)
def _bwd_head(a, oqkv, oL, oW, ody, odqkv, oS, b, h, B, T, C, NH, scale):
    hs = C // NH
    hsp = _up(hs)
    Tp = _up(T)
    C3 = 3 * C
    okt = oS
    ovt = okt + hs * Tp
    okn = ovt + hs * Tp
    odk = okn + Tp * hsp
    odv = odk + Tp * hsp
    oq = odv + Tp * hsp
    og = oq + R * hsp
    odq = og + R * hsp
    Dr = a[odq + R * hsp:odq + R * hsp + R]
    DQ = a[odq:odq + R * hsp]
    r0 = b * T
    one = cvt(a, 1.0)
    zero = cvt(a, 0.0)
    _keys_t(a, oqkv + r0 * C3 + C + h * hs, C3, T, hs, okt)
    _keys_t(a, oqkv + r0 * C3 + 2 * C + h * hs, C3, T, hs, ovt)
    _rows(a, oqkv + r0 * C3 + C + h * hs, C3, T, hs, one, okn, hsp, Tp)
    for c in range(2 * Tp * hsp):
        a[odk + c] = zero
    buf = carray(stack_buf(a, BWD_BUF), (BWD_BUF,))
    for t0 in range(0, T, R):
        nr = min(R, T - t0)
        _rows(a, oqkv + (r0 + t0) * C3 + h * hs, C3, nr, hs, scale, oq, hsp, R)
        _rows(a, ody + (r0 + t0) * C + h * hs, C, nr, hs, one, og, hsp, R)
        for i in range(R):                          # D = rowsum(dO * O)
            s = zero
            if i < nr:
                o = a[oW + (r0 + t0 + i) * C + h * hs:oW + (r0 + t0 + i) * C + h * hs + hs]
                g = a[og + i * hsp:og + i * hsp + hs]
                for d in range(hs):
                    s += g[d] * o[d]
            Dr[i] = s
        for c in range(R * hsp):
            DQ[c] = zero
        kend = _up(t0 + nr)
        for j0 in range(0, kend, BK):
            n = min(BK, kend - j0)
            for c in range(0, n, V):
                mk_set(a, oq, hsp, 1, a, okt + j0 + c, Tp, hs, buf, c, BK)           # S = (scale Q) K^T
                mk_set(a, og, hsp, 1, a, ovt + j0 + c, Tp, hs, buf, TILE + c, BK)    # dP = dO V^T
            for i in range(R):
                nv = max(min(t0 + i - j0 + 1, n), 0) if i < nr else 0
                lse = a[oL + (b * NH + h) * T + t0 + i] if i < nr else zero
                prob_row(buf, i * BK, TILE + i * BK, n, nv, lse, Dr[i])     # P and dS = P (dP - D)
            for k0 in range(0, n, R):               # keys k0 .. k0+3 of the tile: dV += P^T dO, dK += dS^T Q
                ok = (j0 + k0) * hsp
                for d0 in range(0, hsp, V):
                    mk_add(buf, k0, 1, BK, a, og + d0, hsp, R, a, odv + ok + d0, hsp)
                    mk_add(buf, TILE + k0, 1, BK, a, oq + d0, hsp, R, a, odk + ok + d0, hsp)
            for d0 in range(0, hsp, V):             # dQ += dS K
                mk_add(buf, TILE, BK, 1, a, okn + j0 * hsp + d0, hsp, n, a, odq + d0, hsp)
        for i in range(nr):
            dq = a[odqkv + (r0 + t0 + i) * C3 + h * hs:odqkv + (r0 + t0 + i) * C3 + h * hs + hs]
            for d in range(hs):
                dq[d] = DQ[i * hsp + d] * scale
    for s in range(T):
        dk = a[odqkv + (r0 + s) * C3 + C + h * hs:odqkv + (r0 + s) * C3 + C + h * hs + hs]
        dv = a[odqkv + (r0 + s) * C3 + 2 * C + h * hs:odqkv + (r0 + s) * C3 + 2 * C + h * hs + hs]
        for d in range(hs):
            dk[d] = a[odk + s * hsp + d]
            dv[d] = a[odv + s * hsp + d]


@row("oqkv oL oW ody odqkv oS B T C NH oscale")
@njit(**FM)
def k_attn_bwd_flash(a, ia, r):
    """Backward of k_attn_fwd_flash from qkv, its L and W; writes dqkv (B*T, 3C) (overwrite) and S
    (bwd_scratch(B, T, C, NH) floats)."""
    oqkv = r[1]; oL = r[2]; oW = r[3]; ody = r[4]; odqkv = r[5]; oS = r[6]; B = r[7]; T = r[8]; C = r[9]
    NH = r[10]
    scale = a[r[11]]
    for b in range(B):
        for h in range(NH):
            _bwd_head(a, oqkv, oL, oW, ody, odqkv, oS, b, h, B, T, C, NH, scale)
