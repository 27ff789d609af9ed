# Convolution and pooling tape kernels, generic over float32/float64 arenas and over every shape (all sizes,
# strides, paddings and dilations are runtime row arguments: one compiled entry serves every conv and pool).
#
#   k_im2col    back 0: the patches of x (N, G*Cg, H, W) as rows: col (G, N, OH, OW, Cg, kh, kw), zeros where
#               a patch reaches into the padding; a convolution is then one GEMM per group (graph/ops/conv.py:
#               grouped and bf16 convolutions; the others are implicit GEMMs, btjit/kernels/convgemm.py).
#               back 1: its adjoint col2im: x = the patch rows of col summed back (overwrites x)
#   k_pool2d    back 0: max (mode 0, -inf padding) or average (mode 1, padding counted, as torch's default)
#               pooling of x (NC, H, W) -> y (NC, OH, OW). back 1: their gradient dx (NC, H, W) from x and
#               dy (at oy): max routes dy to the first maximum of each window (torch's choice on ties),
#               average spreads it evenly (overwrites dx)
#   k_dwconv    a depthwise convolution (groups = channels = output channels, one kh x kw filter per channel),
#               direct: mode 0 y = the convolution of x by w, mode 1 dx from dy (the transposed sum), mode 2 dw from
#               x and dy (each overwrites its output); in im2col and one GEMM per channel, a filter is a 1-column
#               product (MobileNet's and ConvNeXt's depthwise layers)
# Forward and backward share one entry each (one library entry to compile and load, not two).
#
# The innermost loops run along an output row for one tap of the window (the columns that fall in the padding
# found once per tap, not tested per element), on 1-D slices of the arena indexed by range variables (numba
# then needs no wraparound test per access: forward max pooling 8.9 -> 2.0 ms on 64 x 64 x 24 x 24); the
# multiply-adds of a convolution all run in the GEMM kernels.
import math

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from btjit.kernels.common import FM, cvt, fill_n, fptr, part_of, row, stack_buf

POOL_MAX = 0
POOL_AVG = 1
DW_PLANE = 32768     # k_dwconv: a plane's padded input and output rows in a stack buffer of this many elements
DW_ROW = 1024        # its row-by-row fallback's dw: a row's products summed down the rows (in that buffer)


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
    entries over the patches reading (ih, iw) (overwrites x). The innermost loop runs along an output row (ow)
    for one tap (c, i, j): x read with stride sw, col with stride K, the columns in the padding found once per tap
    (no test per element). Rows through typed pointers: a slice per row took half the time (col2im of a CIFAR
    ResNet's stride-2 3x3 convolution's gradient, 64 x 16 x 32 x 32: 2.9 -> 1.8 ms on znver4)."""
    zero = cvt(a, 0.0)
    K = Cg * kh * kw
    if back:
        fill_n(fptr(a, ox), zero, N * G * Cg * H * W)
    for g in range(G):
        for n in range(N):
            ocn = ocol + (g * N + n) * OH * OW * K      # col[g, n, oh, ow, kk] at ocn + (oh * OW + ow) * K + kk
            for c in range(Cg):
                oxc = ox + ((n * G + g) * Cg + c) * H * W
                for i in range(kh):
                    for j in range(kw):
                        off = j * dw - pw                   # iw = ow * sw + off
                        lo = max(0, (sw - 1 - off) // sw)   # the first ow with iw >= 0
                        hi = max(lo, min(OW, (W - 1 - off) // sw + 1) if W - 1 - off >= 0 else lo)
                        kk = (c * kh + i) * kw + j
                        for oh in range(OH):
                            ih = oh * sh - ph + i * dh
                            crow = fptr(a, ocn + oh * OW * K + kk)
                            if ih < 0 or ih >= H:
                                if not back:
                                    for ow in range(OW):
                                        crow[ow * K] = zero
                                continue
                            xrow = fptr(a, oxc + ih * W + off)  # x[.., ih, ow * sw + off] at xrow[ow * sw]
                            if back:
                                for ow in range(lo, hi):
                                    xrow[ow * sw] += crow[ow * K]
                            else:
                                for ow in range(lo):
                                    crow[ow * K] = zero
                                for ow in range(lo, hi):
                                    crow[ow * K] = xrow[ow * sw]
                                for ow in range(hi, OW):
                                    crow[ow * K] = zero


@row("back mode ox oy odx NC H W OH OW kh kw sh sw ph pw")
@njit(**FM)
def k_pool2d(a, ia, r):
    """back 0: y[p, oh, ow] = max (mode 0) or mean (mode 1, divisor kh*kw) of x[p] over the window at
    (oh*sh - ph, ow*sw - pw) of kh x kw; back 1: dx from x and dy (at oy)."""
    j, n = part_of(r)                        # split: the NC planes in n parts
    pool_planes(a, r, j * r[6] // n, (j + 1) * r[6] // n)


@njit(**FM)
def pool_planes(a, r, lo, hi):
    """Planes lo .. hi of a k_pool2d row."""
    back = r[1]; mode = r[2]; NC = hi - lo; H = r[7]; W = r[8]; OH = r[9]
    OW = r[10]; kh = r[11]; kw = r[12]; sh = r[13]; sw = r[14]; ph = r[15]; pw = r[16]
    ox, oy, odx = r[3] + lo * H * W, r[4] + lo * OH * OW, r[5] + lo * H * W if back else 0
    if kh == 2 and kw == 2 and sh == 2 and sw == 2 and ph == 0 and pw == 0 and 2 * OH <= H and 2 * OW <= W:
        pool2x2(a, back, mode, ox, oy, odx, NC, H, W, OH, OW)
        return
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


def _pool8(back, avg):
    """Intrinsic pool8(a, ox, W, oy, odx): 8 windows of pool2x2 in 8-lane vectors -- x rows at a[ox:ox+16] and
    a[ox+W:ox+W+16], y (or dy when back) at a[oy:oy+8], dx rows at a[odx:odx+16] and a[odx+W:]. Max: the
    maximum from -inf (forward) and dy to the window's first maximum in row order (backward; a NaN never
    replaces it) as the general loops; avg: the mean, dy / 4 to all four. (A loop over a 12-window row never
    reaches the vectorizer's 16 lanes: it ran scalar, 3-6x slower.)"""
    @intrinsic
    def pool8(typingctx, a, ox, W, oy, odx):
        def impl(context, builder, sig, args):
            ety = context.get_data_type(sig.args[0].dtype)
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            _, ox, W, oy, odx = args
            i32 = ir.IntType(32)
            v8, v16, m8 = ir.VectorType(ety, 8), ir.VectorType(ety, 16), ir.VectorType(i32, 8)

            def ptr(off, vt):
                return builder.bitcast(builder.gep(data, [off]), vt.as_pointer())
            half = lambda v, k: builder.shuffle_vector(v, v, ir.Constant(m8, list(range(k, 16, 2))))  # noqa: E731
            quarter = ir.Constant(v8, [0.25] * 8)
            g = builder.load(ptr(oy, v8), align=4)
            if back and avg:
                d = [builder.fmul(g, quarter)] * 4
            else:
                r0, r1 = builder.load(ptr(ox, v16), align=4), builder.load(ptr(builder.add(ox, W), v16), align=4)
                taps = [half(r0, 0), half(r0, 1), half(r1, 0), half(r1, 1)]
                if avg:
                    s_ = builder.fadd(builder.fadd(builder.fadd(taps[0], taps[1]), taps[2]), taps[3])
                    builder.store(builder.fmul(s_, quarter), ptr(oy, v8), align=4)
                    return context.get_dummy_value()
                m, at = (taps[0], ir.Constant(m8, None)) if back else (ir.Constant(v8, [-math.inf] * 8), None)
                for k in range(1 if back else 0, 4):
                    gt = builder.fcmp_ordered(">", taps[k], m)
                    m = builder.select(gt, taps[k], m)
                    at = builder.select(gt, ir.Constant(m8, [k] * 8), at) if back else None
                if not back:
                    builder.store(m, ptr(oy, v8), align=4)
                    return context.get_dummy_value()
                zero = ir.Constant(v8, None)
                d = [builder.select(builder.icmp_signed("==", at, ir.Constant(m8, [k] * 8)), g, zero) for k in range(4)]
            mix = ir.Constant(ir.VectorType(i32, 16), [x for k in range(8) for x in (k, k + 8)])
            for row, off in ((0, odx), (2, builder.add(odx, W))):
                builder.store(builder.shuffle_vector(d[row], d[row + 1], mix), ptr(off, v16), align=4)
            return context.get_dummy_value()
        return types.void(a, ox, W, oy, odx), impl
    return pool8


_max8, _max8_bwd, _avg8, _avg8_bwd = _pool8(0, 0), _pool8(1, 0), _pool8(0, 1), _pool8(1, 1)


@njit(**FM)
def pool2x2(a, back, mode, ox, oy, odx, NC, H, W, OH, OW):
    """k_pool2d for 2 x 2 windows at stride 2, no padding (max_pool2d(x, 2)): the same results as the general
    loops (max: the first maximum of each window in row order, a NaN never replacing it), 8 windows at a time
    in vectors (pool8) along rows of 8 or more windows."""
    quarter = cvt(a, 0.25)
    zero = cvt(a, 0.0)
    if back and (H != 2 * OH or W != 2 * OW):       # an odd last row or column gets no gradient
        dx = a[odx:odx + NC * H * W]
        for t in range(dx.shape[0]):
            dx[t] = zero
    for p in range(NC):
        if OW >= 8:                 # 8 windows at a time, the last 8 moved back to end at OW (overwrite only)
            for oh in range(OH):
                for t in range(0, OW, 8):
                    t0 = min(t, OW - 8)
                    args = (a, ox + (p * H + 2 * oh) * W + 2 * t0, W, oy + (p * OH + oh) * OW + t0,
                            odx + (p * H + 2 * oh) * W + 2 * t0)
                    if mode == POOL_MAX:
                        _max8_bwd(*args) if back else _max8(*args)
                    else:
                        _avg8_bwd(*args) if back else _avg8(*args)
            continue
        xs = a[ox + p * H * W:ox + (p + 1) * H * W]         # rows too short for vectors: one window at a time,
        ys = a[oy + p * OH * OW:oy + (p + 1) * OH * OW]     # on the plane's slices (y, or dy when back)
        ds = a[odx + p * H * W:odx + (p + 1) * H * W]
        nxt = 0                     # one scalar loop over the plane's windows: nxt = the window's first
        t = 0                       # element in the plane, t = its column
        for k in range(OH * OW):
            i = nxt
            nxt += 2
            t += 1
            if t == OW:
                t = 0
                nxt += 2 * W - 2 * OW
            u, v, w, z = xs[i], xs[i + 1], xs[i + W], xs[i + W + 1]
            if not back:
                if mode == POOL_MAX:
                    m = cvt(a, -np.inf)
                    m = u if u > m else m
                    m = v if v > m else m
                    m = w if w > m else m
                    ys[k] = z if z > m else m
                else:
                    ys[k] = ((u + v) + w + z) * quarter
                continue
            g = ys[k]
            at = 0
            if mode == POOL_MAX:
                m = u
                at = 1 if v > m else at
                m = v if v > m else m
                at = 2 if w > m else at
                m = w if w > m else m
                at = 3 if z > m else at
            else:
                g = g * quarter
            ds[i] = g if at == 0 or mode != POOL_MAX else zero
            ds[i + 1] = g if at == 1 or mode != POOL_MAX else zero
            ds[i + W] = g if at == 2 or mode != POOL_MAX else zero
            ds[i + W + 1] = g if at == 3 or mode != POOL_MAX else zero


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


@row("mode ox ow oy N C H W OH OW kh kw sh sw ph pw dh dw")
@njit(**FM)
def k_dwconv(a, ia, r):
    """Depthwise convolution of x (N, C, H, W) by w (C, 1, kh, kw) into y (N, C, OH, OW), padding ph, pw before
    (and what OH, OW leave after), zeros there. mode 0: y; 1: dx (at ox) from dy (at oy) and w; 2: dw (at ow)
    from x and dy. A split row's part j of n: the channels j*C//n .. (j+1)*C//n-1 (each output is computed the
    same way on any thread count). Stride 1 planes that fit DW_PLANE by _dw_plane, the others row by row."""
    mode = r[1]; ox = r[2]; ow = r[3]; oy = r[4]; N = r[5]; C = r[6]; H = r[7]; W = r[8]; OH = r[9]; OW = r[10]
    kh = r[11]; kw = r[12]; sh = r[13]; sw = r[14]; ph = r[15]; pw = r[16]; dh = r[17]; dw = r[18]
    j, n = part_of(r)
    buf = carray(stack_buf(a, DW_PLANE), (DW_PLANE,))
    Hp, Wp = (OH - 1) * sh + (kh - 1) * dh + 1, (OW - 1) * sw + (kw - 1) * dw + 1
    plane = sh == sw == 1 and (Hp + OH) * Wp <= DW_PLANE
    for c in range(j * C // n, (j + 1) * C // n):
        wc = ow + c * kh * kw
        if mode == 2:
            for t in range(kh * kw):
                a[wc + t] = cvt(a, 0.0)
        for b in range(N):
            xc, yc = ox + (b * C + c) * H * W, oy + (b * C + c) * OH * OW
            if plane:
                _dw_plane(a, buf, mode, xc, wc, yc, H, W, OH, OW, kh, kw, ph, pw, dh, dw, Hp, Wp)
            else:
                _dw_rows(a, buf, mode, xc, wc, yc, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw)


@njit(**FM)
def _dw_plane(a, buf, mode, xc, wc, yc, H, W, OH, OW, kh, kw, ph, pw, dh, dw, Hp, Wp):
    """One (image, channel) plane at stride 1 in the stack buffer: P = the zero-padded input rows the taps reach
    (Hp x Wp), Q = the output in rows of Wp (its first OW columns used; the rest computed and dropped, or zeros of
    dy). Output t = o Wp + q reads P[t + i dh Wp + k dw] at tap (i, k): every tap is one loop over the whole plane
    (at stride 2 the row loops were faster: the strided loops vectorize into gathers and scatters)."""
    zero = cvt(a, 0.0)
    NP, T = Hp * Wp, (OH - 1) * Wp + OW
    P, Q = buf[:NP], buf[NP:NP + T]
    for t in range(NP + T):
        buf[t] = zero
    if mode != 1:                                   # P = x, padded
        for ih in range(min(H, Hp - ph)):
            n = min(W, Wp - pw)
            P[(ih + ph) * Wp + pw:(ih + ph) * Wp + pw + n] = a[xc + ih * W:xc + ih * W + n]
    if mode != 0:                                   # Q = dy, zeros past column OW
        for o in range(OH):
            Q[o * Wp:o * Wp + OW] = a[yc + o * OW:yc + (o + 1) * OW]
    for i in range(kh):
        for k in range(kw):
            acc = _tap(mode, fptr(buf, i * dh * Wp + k * dw), fptr(buf, NP), T, a[wc + i * kw + k], zero)
            if mode == 2:
                a[wc + i * kw + k] += acc
    if mode == 0:
        for o in range(OH):
            a[yc + o * OW:yc + (o + 1) * OW] = Q[o * Wp:o * Wp + OW]
    elif mode == 1:                                 # dx = the interior of P (0 where no tap reaches)
        for ih in range(H):
            for iw in range(W):
                inside = ih + ph < Hp and iw + pw < Wp
                a[xc + ih * W + iw] = P[(ih + ph) * Wp + iw + pw] if inside else zero


@njit(**FM)
def _tap(mode, P, Q, T, wv, zero):
    """One tap of _dw_plane over t < T, P and Q pointers (no wraparound test per access: the loops vectorize, 3x
    faster than as arrays): mode 0 Q[t] += P[t] wv; 1: P[t] += Q[t] wv; 2: returns the sum of P[t] Q[t]."""
    acc = zero
    if mode == 0:
        for t in range(T):
            Q[t] += P[t] * wv
    elif mode == 1:
        for t in range(T):
            P[t] += Q[t] * wv
    else:
        for t in range(T):
            acc += P[t] * Q[t]
    return acc


@njit(**FM)
def _dw_rows(a, sums, mode, xc, wc, yc, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw):
    """_dw_plane's work output row by output row, for planes past DW_PLANE (or unequal strides): per tap, the
    columns in the padding found once; dw's products summed down the rows in `sums` (DW_ROW columns at most)."""
    zero = cvt(a, 0.0)
    out = a[xc:xc + H * W] if mode == 1 else a[yc:yc + OH * OW]
    if mode != 2:
        for t in range(out.shape[0]):
            out[t] = zero
    for i in range(kh):
        for k in range(kw):
            off = k * dw - pw                   # iw = q * sw + off
            lo = max(0, (sw - 1 - off) // sw)   # the first q with iw >= 0, then up to hi
            hi = max(lo, min(OW, (W - 1 - off) // sw + 1) if W - 1 - off >= 0 else lo)
            acc = zero
            wv = a[wc + i * kw + k]
            rows = mode == 2 and hi - lo <= DW_ROW
            for q in range(hi - lo if rows else 0):
                sums[q] = zero
            for o in range(OH):
                ih = o * sh - ph + i * dh
                if ih < 0 or ih >= H or hi == lo:
                    continue
                x = fptr(a, xc + ih * W + lo * sw + off)
                y = fptr(a, yc + o * OW + lo)
                if mode == 0:
                    for q in range(hi - lo):
                        y[q] += x[q * sw] * wv
                elif mode == 1:
                    for q in range(hi - lo):
                        x[q * sw] += y[q] * wv
                elif rows:
                    for q in range(hi - lo):
                        sums[q] += x[q * sw] * y[q]
                else:
                    for q in range(hi - lo):
                        acc += x[q * sw] * y[q]
            for q in range(hi - lo if rows else 0):
                acc += sums[q]
            if mode == 2:
                a[wc + i * kw + k] += acc
