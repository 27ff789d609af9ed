# Causal multi-head self-attention by whole-head products on the GEMM register micro-kernels
# (linalg.gemm_micro: 8 query rows x up to 48 columns in registers), the probabilities kept for the backward
# (float32 and float64, one library entry per dtype; every size from the row). Per (sequence, head) and block of
# 8 query rows i0..i0+7 (the last block moved back to end at T): S = Q (scale K)^T over the keys 0 .. i0+7 only
# (the blocks above the diagonal skipped), each row's softmax over its keys j <= t in 16-wide vectors, then
# y = P V. The backward from P: dP = dO V^T, D = rowsum(P * dP), dS = scale P (dP - D), dQ = dS K row block by
# row block, then dK = dS^T Q and dV = P^T dO key block by key block, each over the queries from the block on.
# Where it runs instead of the flash kernels (attention.py, which keep only the rows' logsumexps) is
# attention.kind: heads of at least 8 dims up to a measured T, the bytes of P (B*NH*T*Tp floats) then small.
#
# Layouts (as attention.py): qkv (B*T, 3C), q cols [0,C), k [C,2C), v [2C,3C), head h at h*hs..h*hs+hs-1 of
# each; y, dy (B*T, C); P (B, NH, T, Tp), Tp = T rounded up to 16: row t of a head holds its probabilities at
# keys j <= t, zeros from t+1 to Tp. W (fwd scratch): per slot, scale K^T of one head (hs x Tp); S (bwd
# scratch): per slot, V^T of one head (hs x Tp), then dS of one head (T x Tp). A split row runs blocks of
# sequences on the thread pool, one slot each (slots(B) = min(B, MAX_THREADS)).
#
# Dropout on the probabilities (odrop != 0: a[odrop] = p, a[oinv] = 1 / (1 - p)): P keeps the probabilities;
# the forward multiplies a block's rows into D = P * keep / (1 - p) (W's MR x Tp block after K^T) for y = D V;
# the backward draws the same mask again (btjit/kernels/rng.py: element ((b NH + h) T + t) T + j of site
# `site`, as btjit.dropout of the (B, NH, T, T) probabilities would), writes D for dV = D^T dO (S's third
# part, T x Tp) and scales dP = dO V^T by the mask before dS; D = rowsum(P * dP) is unchanged.
import numpy as np
from numba import njit

from btjit.kernels.attention import _tr, _up
from btjit.kernels.common import FM, MAX_THREADS, cvt, part_of, row
from btjit.kernels.linalg import MR, gemm_micro
from btjit.kernels.rng import first, key, uniform_at
from btjit.kernels.tiles import dscore_row, softmax_norm_row


def padded(T) -> int:
    """Tp: the row length of P."""
    return _up(T)


def slots(B) -> int:
    """Scratch slots: one per block of sequences a split row runs at once (one thread uses the first)."""
    return min(B, MAX_THREADS)


def fwd_scratch(B, T, C, NH) -> int:
    return slots(B) * ((C // NH + MR) * _up(T))


def bwd_scratch(B, T, C, NH, dropout=False) -> int:
    return slots(B) * (C // NH * _up(T) + (2 if dropout else 1) * T * _up(T))


@njit(**FM)
def drop_row(a, osrc, odst, ograd, n, nv, e0, p, s, k0, k1, c2, c3):
    """Dropout of one row of probabilities: keep_j = (the uniform number of element e0 + j >= p);
    a[odst + j] = a[osrc + j] * keep_j * s for j < nv, 0 for nv <= j < n; with ograd, a[ograd + j] is
    multiplied by keep_j * s too (j < nv)."""
    src = a[osrc:osrc + nv]
    dst = a[odst:odst + n]
    zero = cvt(a, 0.0)
    if ograd:
        g = a[ograd:ograd + nv]
        for j in range(nv):
            m = s if uniform_at(a, e0 + j, k0, k1, c2, c3) >= p else zero
            dst[j] = src[j] * m
            g[j] *= m
    else:
        for j in range(nv):
            dst[j] = src[j] * (s if uniform_at(a, e0 + j, k0, k1, c2, c3) >= p else zero)
    for j in range(nv, n):
        dst[j] = zero


def blocks(B, threads) -> int:
    """Blocks of sequences of a split row: one per thread, at most slots(B)."""
    return min(threads, slots(B))


@njit(**FM)
def _fwd_head(a, oqkv, oy, oP, oW, b, h, B, T, C, NH, scale, ia, okey, site, odrop, oinv):
    one, nil = np.int64(1), np.int64(0)     # not literals: each literal pattern compiles a helper again
    hs = C // NH
    Tp = _up(T)
    C3 = 3 * C
    oq = oqkv + b * T * C3 + h * hs
    _tr(a, oq + C, C3, oW, Tp, T, hs)                   # K^T, then scaled
    kt = a[oW:oW + hs * Tp]
    for c in range(hs * Tp):
        kt[c] *= scale
    oPh = oP + (b * NH + h) * T * Tp
    oD = oW + hs * Tp                                    # the dropped block's rows (dropout only)
    k0, k1, c2, c3 = key(ia, okey, site)
    e0 = first(ia, okey, B * NH * T * T) + (b * NH + h) * T * T
    for i in range(0, T, MR):
        i0 = min(i, T - MR)
        n = i0 + MR                                      # keys 0 .. i0+7
        gemm_micro(a, a, oq + i0 * C3, C3, one, oW, Tp, oPh + i0 * Tp, Tp, MR, n, hs, nil, nil, nil, nil)
        for t in range(i0, n):
            softmax_norm_row(a, oPh + t * Tp, _up(t + 1), t + 1, Tp)
            if odrop:
                drop_row(a, oPh + t * Tp, oD + (t - i0) * Tp, nil, n, t + 1, e0 + t * T, a[odrop], a[oinv],
                         k0, k1, c2, c3)
        gemm_micro(a, a, oD if odrop else oPh + i0 * Tp, Tp, one, oq + 2 * C, C3, oy + (b * T + i0) * C + h * hs, C,
                   MR, hs, n, nil, nil, nil, nil)


@row("oqkv oy oP oW B T C NH oscale okey site odrop oinv")
@njit(**FM)
def k_attn_fwd_kept(a, ia, r):
    """Causal self-attention forward (see the top of the file): writes y, P (B, NH, T, Tp) and W
    (fwd_scratch floats). T >= 8, head size >= 8. Dropout on the probabilities if odrop != 0."""
    oqkv = r[1]; oy = r[2]; oP = r[3]; oW = r[4]; B = r[5]; T = r[6]; C = r[7]; NH = r[8]
    scale = a[r[9]]
    okey = r[10]; site = r[11]; odrop = r[12]; oinv = r[13]
    j, n = part_of(r)                       # split: the sequences in n blocks, block j on scratch slot j
    oW += j * (C // NH + MR) * _up(T)
    for b in range(j * B // n, (j + 1) * B // n):
        for h in range(NH):
            _fwd_head(a, oqkv, oy, oP, oW, b, h, B, T, C, NH, scale, ia, okey, site, odrop, oinv)


@njit(**FM)
def _bwd_head(a, oqkv, oP, ody, odqkv, oS, b, h, B, T, C, NH, scale, ia, okey, site, odrop, oinv):
    one, nil = np.int64(1), np.int64(0)     # not literals: each literal pattern compiles a helper again
    hs = C // NH
    Tp = _up(T)
    C3 = 3 * C
    oq = oqkv + b * T * C3 + h * hs
    odq = odqkv + b * T * C3 + h * hs
    og = ody + b * T * C + h * hs
    oPh = oP + (b * NH + h) * T * Tp
    odS = oS + hs * Tp
    oD = odS + T * Tp                                   # D = the dropped probabilities (dropout only)
    k0, k1, c2, c3 = key(ia, okey, site)
    e0 = first(ia, okey, B * NH * T * T) + (b * NH + h) * T * T
    _tr(a, oq + 2 * C, C3, oS, Tp, T, hs)               # V^T
    for i in range(0, T, MR):
        i0 = min(i, T - MR)
        n = i0 + MR
        gemm_micro(a, a, og + i0 * C, C, one, oS, Tp, odS + i0 * Tp, Tp, MR, n, hs, nil, nil, nil, nil)   # dP
        for t in range(i0, n):
            if odrop:
                drop_row(a, oPh + t * Tp, oD + t * Tp, odS + t * Tp, Tp, t + 1, e0 + t * T, a[odrop], a[oinv],
                         k0, k1, c2, c3)
            dscore_row(a, oPh + t * Tp, odS + t * Tp, _up(t + 1), Tp, scale)
        gemm_micro(a, a, odS + i0 * Tp, Tp, one, oq + C, C3, odq + i0 * C3, C3, MR, hs, n, nil, nil, nil, nil)  # dQ
    for k in range(0, T, MR):
        k0 = min(k, T - MR)                              # keys k0..k0+7, over the queries k0 .. T-1
        gemm_micro(a, a, odS + k0 * Tp + k0, one, Tp, oq + k0 * C3, C3, odq + C + k0 * C3, C3, MR, hs, T - k0,
                   nil, nil, nil, nil)                                                                       # dK
        gemm_micro(a, a, (oD if odrop else oPh) + k0 * Tp + k0, one, Tp, og + k0 * C, C, odq + 2 * C + k0 * C3, C3,
                   MR, hs, T - k0, nil, nil, nil, nil)                                                       # dV


@row("oqkv oP ody odqkv oS B T C NH oscale okey site odrop oinv")
@njit(**FM)
def k_attn_bwd_kept(a, ia, r):
    """Backward of k_attn_fwd_kept from qkv and its P; writes dqkv (B*T, 3C) (overwrite) and S (bwd_scratch
    floats)."""
    oqkv = r[1]; oP = r[2]; ody = r[3]; odqkv = r[4]; oS = r[5]; B = r[6]; T = r[7]; C = r[8]; NH = r[9]
    scale = a[r[10]]
    okey = r[11]; site = r[12]; odrop = r[13]; oinv = r[14]
    j, n = part_of(r)                       # split: the sequences in n blocks, block j on scratch slot j
    oS += j * (C // NH * _up(T) + (2 if odrop else 1) * T * _up(T))
    for b in range(j * B // n, (j + 1) * B // n):
        for h in range(NH):
            _bwd_head(a, oqkv, oP, ody, odqkv, oS, b, h, B, T, C, NH, scale, ia, okey, site, odrop, oinv)

