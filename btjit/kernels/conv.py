# Convolution and pooling tape kernels, generic over float32/float64 arenas and over every shape (all sizes,
# strides, paddings and dilations are runtime row arguments: one compiled entry serves every conv and pool).
#
#   k_im2col    the patches of x (N, G*Cg, H, W) as rows: col (G, N, OH, OW, Cg, kh, kw), zeros where a
#               patch reaches into the padding; a convolution is then one GEMM per group (graph/ops/conv.py)
#   k_col2im    its adjoint: dx (N, G*Cg, H, W) = the patch rows of dcol summed back (overwrites dx)
#   k_pool2d    max (mode 0, -inf padding) or average (mode 1, padding counted, as torch's default) pooling
#               of x (NC, H, W) -> y (NC, OH, OW)
#   k_pool2d_bwd  their gradient dx (NC, H, W) from x and dy: max routes dy to the first maximum of each
#               window (torch's choice on ties), average spreads it evenly (overwrites dx)
#
# The kernels are direct loops over one image row at a time (1-D slices `a[o:o+W]`); the multiply-adds
# of a convolution all run in the GEMM kernels.
import numpy as np
from numba import njit

from btjit.kernels.common import FM, cvt, row

POOL_MAX = 0
POOL_AVG = 1


@row("ox ocol N G Cg H W OH OW kh kw sh sw ph pw dh dw")
@njit(**FM)
def k_im2col(a, ia, r):
    """col[g, n, oh, ow, c, i, j] = x[n, g*Cg + c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] (0 outside x)."""
    ox = r[1]; ocol = r[2]; N = r[3]; G = r[4]; Cg = r[5]; H = r[6]; W = r[7]; OH = r[8]; OW = r[9]
    kh = r[10]; kw = r[11]; sh = r[12]; sw = r[13]; ph = r[14]; pw = r[15]; dh = r[16]; dw = r[17]
    zero = cvt(a, 0.0)
    K = Cg * kh * kw
    for g in range(G):
        for n in range(N):
            for oh in range(OH):
                for ow in range(OW):
                    base = ocol + (((g * N + n) * OH + oh) * OW + ow) * K
                    col = a[base:base + K]
                    for c in range(Cg):
                        xo = ox + ((n * G + g) * Cg + c) * H * W
                        for i in range(kh):
                            ih = oh * sh - ph + i * dh
                            dst = col[(c * kh + i) * kw:(c * kh + i) * kw + kw]
                            if ih < 0 or ih >= H:
                                for j in range(kw):
                                    dst[j] = zero
                                continue
                            xr = a[xo + ih * W:xo + ih * W + W]
                            for j in range(kw):
                                iw = ow * sw - pw + j * dw
                                dst[j] = xr[iw] if 0 <= iw < W else zero


@row("ocol odx N G Cg H W OH OW kh kw sh sw ph pw dh dw")
@njit(**FM)
def k_col2im(a, ia, r):
    """dx[n, g*Cg + c, ih, iw] = the sum of col[g, n, oh, ow, c, i, j] over the patches reading (ih, iw)."""
    ocol = r[1]; odx = r[2]; N = r[3]; G = r[4]; Cg = r[5]; H = r[6]; W = r[7]; OH = r[8]; OW = r[9]
    kh = r[10]; kw = r[11]; sh = r[12]; sw = r[13]; ph = r[14]; pw = r[15]; dh = r[16]; dw = r[17]
    K = Cg * kh * kw
    dx = a[odx:odx + N * G * Cg * H * W]
    for t in range(dx.shape[0]):
        dx[t] = cvt(a, 0.0)
    for g in range(G):
        for n in range(N):
            for oh in range(OH):
                for ow in range(OW):
                    base = ocol + (((g * N + n) * OH + oh) * OW + ow) * K
                    col = a[base:base + K]
                    for c in range(Cg):
                        xo = odx + ((n * G + g) * Cg + c) * H * W
                        for i in range(kh):
                            ih = oh * sh - ph + i * dh
                            if ih < 0 or ih >= H:
                                continue
                            src = col[(c * kh + i) * kw:(c * kh + i) * kw + kw]
                            xr = a[xo + ih * W:xo + ih * W + W]
                            for j in range(kw):
                                iw = ow * sw - pw + j * dw
                                if 0 <= iw < W:
                                    xr[iw] += src[j]


@row("mode ox oy NC H W OH OW kh kw sh sw ph pw")
@njit(**FM)
def k_pool2d(a, ia, r):
    """y[p, oh, ow] = max (mode 0) or mean (mode 1, divisor kh*kw) of x[p] over the window at
    (oh*sh - ph, ow*sw - pw) of kh x kw."""
    mode = r[1]; ox = r[2]; oy = r[3]; NC = r[4]; H = r[5]; W = r[6]; OH = r[7]; OW = r[8]
    kh = r[9]; kw = r[10]; sh = r[11]; sw = r[12]; ph = r[13]; pw = r[14]
    inv = cvt(a, 1.0) / cvt(a, kh * kw)
    for p in range(NC):
        y = a[oy + p * OH * OW:oy + (p + 1) * OH * OW]
        for oh in range(OH):
            for ow in range(OW):
                acc = cvt(a, -np.inf) if mode == POOL_MAX else cvt(a, 0.0)
                for i in range(kh):
                    ih = oh * sh - ph + i
                    if ih < 0 or ih >= H:
                        continue
                    xr = a[ox + (p * H + ih) * W:ox + (p * H + ih) * W + W]
                    for j in range(kw):
                        iw = ow * sw - pw + j
                        if 0 <= iw < W:
                            v = xr[iw]
                            if mode == POOL_MAX:
                                if v > acc:
                                    acc = v
                            else:
                                acc += v
                y[oh * OW + ow] = acc if mode == POOL_MAX else acc * inv


@row("mode ox ody odx NC H W OH OW kh kw sh sw ph pw")
@njit(**FM)
def k_pool2d_bwd(a, ia, r):
    """dx (NC, H, W) of k_pool2d from x and dy (NC, OH, OW); overwrites dx."""
    mode = r[1]; ox = r[2]; ody = r[3]; odx = r[4]; NC = r[5]; H = r[6]; W = r[7]; OH = r[8]; OW = r[9]
    kh = r[10]; kw = r[11]; sh = r[12]; sw = r[13]; ph = r[14]; pw = r[15]
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
