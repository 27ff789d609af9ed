# Convolution and pooling tape kernels, generic over float32/float64 arenas and over every shape (all sizes,
# strides, paddings and dilations are runtime row arguments: one compiled entry serves every conv and pool).
#
#   k_im2col    back 0: the patches of x (N, G*Cg, H, W) as rows: col (G, N, OH, OW, Cg, kh, kw), zeros where
#               a patch reaches into the padding; a convolution is then one GEMM per group (graph/ops/conv.py).
#               back 1: its adjoint col2im: x = the patch rows of col summed back (overwrites x)
#   k_pool2d    back 0: max (mode 0, -inf padding) or average (mode 1, padding counted, as torch's default)
#               pooling of x (NC, H, W) -> y (NC, OH, OW). back 1: their gradient dx (NC, H, W) from x and
#               dy (at oy): max routes dy to the first maximum of each window (torch's choice on ties),
#               average spreads it evenly (overwrites dx)
# Forward and backward share one entry each (one library entry to compile and load, not two).
#
# The innermost loops run along an output row for one tap of the window (the columns that fall in the padding
# found once per tap, not tested per element), on 1-D slices of the arena indexed by range variables (numba
# then needs no wraparound test per access: forward max pooling 8.9 -> 2.0 ms on 64 x 64 x 24 x 24); the
# multiply-adds of a convolution all run in the GEMM kernels.
import numpy as np
from numba import njit

from btjit.kernels.common import FM, cvt, row

POOL_MAX = 0
POOL_AVG = 1


@row("back ox ocol N G Cg H W OH OW kh kw sh sw ph pw dh dw")
@njit(**FM)
def k_im2col(a, ia, r):
    """back 0: col[g, n, oh, ow, c, i, j] = x[n, g*Cg + c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] (0 outside
    x); back 1: x = the sum of col's entries over the patches reading each pixel."""
    back = r[1]; ox = r[2]; ocol = r[3]; N = r[4]; G = r[5]; Cg = r[6]; H = r[7]; W = r[8]; OH = r[9]
    OW = r[10]; kh = r[11]; kw = r[12]; sh = r[13]; sw = r[14]; ph = r[15]; pw = r[16]; dh = r[17]; dw = r[18]
    patches(a, back, ox, ocol, N, G, Cg, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw)


@njit(**FM)
def patches(a, back, ox, ocol, N, G, Cg, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw):
    """One loop nest over the patches for both directions. back 0 (im2col): col[g, n, oh, ow, c, i, j] = the
    pixel of x it reads, zeros in the padding. back 1 (col2im): x[n, g*Cg + c, ih, iw] = the sum of col's
    entries over the patches reading (ih, iw) (overwrites x). The innermost loop runs along an output row
    (ow) for one tap (c, i, j): x read with stride sw, col with stride K, the columns in the padding found
    once per tap (no test per element)."""
    zero = cvt(a, 0.0)
    K = Cg * kh * kw
    if back:
        dx = a[ox:ox + N * G * Cg * H * W]
        for t in range(dx.shape[0]):
            dx[t] = zero
    for g in range(G):
        for n in range(N):
            colg = a[ocol + (g * N + n) * OH * OW * K:ocol + (g * N + n + 1) * OH * OW * K]
            for c in range(Cg):
                xc = a[ox + ((n * G + g) * Cg + c) * H * W:ox + ((n * G + g) * Cg + c + 1) * H * W]
                for i in range(kh):
                    for j in range(kw):
                        off = j * dw - pw                   # iw = ow * sw + off
                        lo = max(0, (sw - 1 - off) // sw)   # the first ow with iw >= 0
                        hi = max(lo, min(OW, (W - 1 - off) // sw + 1) if W - 1 - off >= 0 else lo)
                        kk = (c * kh + i) * kw + j
                        for oh in range(OH):
                            ih = oh * sh - ph + i * dh
                            crow = colg[oh * OW * K + kk:]  # col[g, n, oh, ow, kk] = crow[ow * K]
                            if ih < 0 or ih >= H:
                                if not back:
                                    for ow in range(OW):
                                        crow[ow * K] = zero
                                continue
                            xrow = xc[ih * W + lo * sw + off:]     # x[.., ih, ow * sw + off] from ow = lo
                            if back:
                                for t in range(hi - lo):
                                    xrow[t * sw] += crow[(lo + t) * K]
                            else:
                                for ow in range(lo):
                                    crow[ow * K] = zero
                                for t in range(hi - lo):
                                    crow[(lo + t) * K] = xrow[t * sw]
                                for ow in range(hi, OW):
                                    crow[ow * K] = zero


@row("back mode ox oy odx NC H W OH OW kh kw sh sw ph pw")
@njit(**FM)
def k_pool2d(a, ia, r):
    """back 0: y[p, oh, ow] = max (mode 0) or mean (mode 1, divisor kh*kw) of x[p] over the window at
    (oh*sh - ph, ow*sw - pw) of kh x kw; back 1: dx from x and dy (at oy)."""
    back = r[1]; mode = r[2]; ox = r[3]; oy = r[4]; odx = r[5]; NC = r[6]; H = r[7]; W = r[8]; OH = r[9]
    OW = r[10]; kh = r[11]; kw = r[12]; sh = r[13]; sw = r[14]; ph = r[15]; pw = r[16]
    if back:
        pool2d_bwd(a, mode, ox, oy, odx, NC, H, W, OH, OW, kh, kw, sh, sw, ph, pw)
        return
    inv = cvt(a, 1.0) / cvt(a, kh * kw)
    start = cvt(a, -np.inf) if mode == POOL_MAX else cvt(a, 0.0)
    for p in range(NC):
        for oh in range(OH):
            y = a[oy + (p * OH + oh) * OW:oy + (p * OH + oh + 1) * OW]     # the output row, the accumulator
            for ow in range(OW):
                y[ow] = start
            for i in range(kh):
                ih = oh * sh - ph + i
                if ih < 0 or ih >= H:
                    continue
                for j in range(kw):
                    off = j - pw                    # iw = ow * sw + off; the columns inside x found once
                    lo = max(0, (sw - 1 - off) // sw)
                    hi = max(lo, min(OW, (W - 1 - off) // sw + 1) if W - 1 - off >= 0 else lo)
                    xs = a[ox + (p * H + ih) * W + lo * sw + off:]
                    ys = y[lo:hi]
                    if mode == POOL_MAX:            # (slices and a select: the loop vectorizes; a NaN never wins)
                        for t in range(hi - lo):
                            v = xs[t * sw]
                            ys[t] = v if v > ys[t] else ys[t]
                    else:
                        for t in range(hi - lo):
                            ys[t] += xs[t * sw]
            if mode != POOL_MAX:
                for ow in range(OW):
                    y[ow] *= inv


@njit(**FM)
def pool2d_bwd(a, mode, ox, ody, odx, NC, H, W, OH, OW, kh, kw, sh, sw, ph, pw):
    """dx (NC, H, W) of k_pool2d from x and dy (NC, OH, OW); overwrites dx."""
    inv = cvt(a, 1.0) / cvt(a, kh * kw)
    dx = a[odx:odx + NC * H * W]
    for t in range(dx.shape[0]):
        dx[t] = cvt(a, 0.0)
    for p in range(NC):
        dy = a[ody + p * OH * OW:ody + (p + 1) * OH * OW]
        for oh in range(OH):
            for ow in range(OW):
                g = dy[oh * OW + ow]
                best = cvt(a, -np.inf)
                at = -1
                for i in range(kh):
                    ih = oh * sh - ph + i
                    if ih < 0 or ih >= H:
                        continue
                    q = (p * H + ih) * W
                    for j in range(kw):
                        iw = ow * sw - pw + j
                        if 0 <= iw < W:
                            if mode == POOL_MAX:
                                v = a[ox + q + iw]
                                if v > best or at < 0:
                                    best = v
                                    at = q + iw
                            else:
                                dx[q + iw] += g * inv
                if mode == POOL_MAX and at >= 0:
                    dx[at] += g
