# Implicit-GEMM convolution (graph/ops/conv.py's conv_gemm / conv_wgrad): the register micro-kernels' gathered
# form (btjit/kernels/micro.py) reads each patch straight from the image -- a row of the product is an output
# pixel (forward) or a tap of the window (the weight gradient), its steps run over the window or the pixels --
# so no patch matrix is written or summed back. One entry serves every shape, stride, dilation and layout
# (NCHW or NHWC input, output by pixel rows or (N, O, OH*OW)); a split row shares it over the threads. k_conv_dy
# makes the output gradient into the pixel rows the two backward products read (from a max or average pooling's
# output gradient where the pooling follows the convolution: its gradient made image by image in L2).
from numba import carray, njit

from btjit.kernels.common import FM, cvt, part_of, row, stack_buf, transpose
from btjit.kernels.conv import pool2d_bwd, pool2x2
from btjit.kernels.micro import MR, micro

_g48, _g32 = micro((16, 16, 16), gathered=True), micro((16, 16), gathered=True)
_g16, _g8 = micro((16,), gathered=True), micro((8,), gathered=True)


@njit(**FM)
def _gtile(a, b, tab, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, O, obias, acc, tst, relu):
    """C[r, :O] = [bias +] [C +] sum over the loop nest of A(r, .) B(., :O) for MR gathered rows (micro.micro's
    gathered form), in column blocks of 48 / 32 / 16 / 8 (O a multiple of 8: no block overlaps another, so
    acc > 0 may add to C); tst > 0: stored transposed, C[r, c] at a[oC + c*tst + r]; relu > 0: relu of it.
    A, C and the bias are in array a, B in b."""
    c0 = 0
    while c0 < O:
        rem = O - c0
        w = 32 if rem == 64 or 32 <= rem < 48 else 48 if rem >= 48 else 16 if rem >= 16 else 8
        ob = obias + c0 if obias > 0 else 0
        orr = oC + c0 if acc > 0 else 0
        oc = oC + c0 * tst if tst > 0 else oC + c0
        if w == 48:
            _g48(a, b, tab, oA, oB + c0, ldb, oc, ldc, n1, s1, n2, s2, n3, s3, ob, orr, tst, relu)
        elif w == 32:
            _g32(a, b, tab, oA, oB + c0, ldb, oc, ldc, n1, s1, n2, s2, n3, s3, ob, orr, tst, relu)
        elif w == 16:
            _g16(a, b, tab, oA, oB + c0, ldb, oc, ldc, n1, s1, n2, s2, n3, s3, ob, orr, tst, relu)
        else:
            _g8(a, b, tab, oA, oB + c0, ldb, oc, ldc, n1, s1, n2, s2, n3, s3, ob, orr, tst, relu)
        c0 += w


@njit(**FM)
def _taps(C, H, W, kh, kw, dh, dw, nhwc, flip):
    """The window's loop nest in the weights' row order -- nhwc 0: NCHW input, taps (c, i, j); 1: NHWC input,
    taps (i, j, c); 2: NCHW input, taps (i, j, c) -- as (base, n1, s1, n2, s2, n3, s3), offsets in x; flip: taps
    (kh-1-i, kw-1-j) (a transposed convolution)."""
    sC, sH, sW = (1, W * C, C) if nhwc == 1 else (H * W, W, 1)
    si, sj = dh * sH, dw * sW
    base = 0
    if flip:
        base = (kh - 1) * si + (kw - 1) * sj
        si, sj = -si, -sj
    if nhwc:
        return base, kh, si, kw, sj, C, sC
    return base, C, sC, kh, si, kw, sj


@njit(**FM)
def conv_part(a, r, part, nparts):
    """Part `part` of nparts of a k_conv row (pixel blocks of the output for mode 0, tap blocks of dW for 1)."""
    mode = r[1]; ox = r[2]; ob = r[3]; oc = r[4]; obias = r[5]; N = r[6]; C = r[7]; H = r[8]; W = r[9]
    O = r[10]; kh = r[11]; kw = r[12]; sh = r[13]; sw = r[14]; dh = r[15]; dw = r[16]; OH = r[17]; OW = r[18]
    nhwc = r[19]; flip = r[20]; tout = r[21]; pt = r[22]; vh = r[23]; relu = r[24]
    tab = carray(stack_buf(r, MR), (MR,))
    sN, sH, sW = H * W * C, (W * C if nhwc == 1 else W), (C if nhwc == 1 else 1)
    P = OH * OW
    if mode == 0:           # y = [b +] patches @ wt: a row of C per output pixel, (N*OH*OW, O) or (N, O, OH*OW)
        base, n1, s1, n2, s2, n3, s3 = _taps(C, H, W, kh, kw, dh, dw, nhwc, flip)
        per = (P + MR - 1) // MR if tout else 1         # blocks per image (tout: each in one image)
        nblk = N * per if tout else (N * P + MR - 1) // MR
        for blk in range(part * nblk // nparts, (part + 1) * nblk // nparts):
            p0 = blk // per * P + min(blk % per * MR, P - MR) if tout else min(blk * MR, N * P - MR)
            n = p0 // P                 # the block's first pixel (n, oh, ow); the others counted up from it
            oh = (p0 - n * P) // OW     # (64-bit divisions per pixel cost ~1/3 of a K = 9 convolution)
            qn, qh, qw = n, oh, p0 - n * P - oh * OW
            for q in range(MR):
                tab[q] = qn * sN + qh * sh * sH + qw * sw * sW
                qw += 1
                if qw == OW:
                    qw, qh = 0, qh + 1
                    if qh == OH:
                        qh, qn = 0, qn + 1
            at = oc + n * O * P + p0 - n * P if tout else oc + p0 * O
            i0, i1 = 0, n1
            if vh > 0 and nhwc and (p0 + MR - 1) // P == n:    # only the taps reaching x's rows pt .. pt+vh-1
                y0, y1 = (p0 - n * P) // OW * sh, (p0 + MR - 1 - n * P) // OW * sh
                lo, hi = max(0, -((y1 - pt) // dh)), min(kh - 1, (pt + vh - 1 - y0) // dh)   # window rows
                i0, i1 = (kh - 1 - hi, kh - lo) if flip else (lo, hi + 1)
                i1 = max(i0, i1)
            _gtile(a, a, tab, ox + base + i0 * s1, ob + i0 * kw * C * O, O, at, O, i1 - i0, s1, n2, s2, n3, s3, O,
                   obias, 0, P if tout else 0, relu)
        return
    K = C * kh * kw         # dW (Kpad, O) = patches^T @ dy: a row per tap (rows K.. repeat tap K-1), by images
    nblk = (K + MR - 1) // MR
    per = max(1, 256 // P)  # images per call: at least 256 pixels summed between C's loads and stores
    base, n1, s1, n2, s2, n3, s3 = _taps(C, H, W, kh, kw, dh, dw, nhwc, flip)
    for n0 in range(0, N, per):
        ni = min(per, N - n0)
        for blk in range(part * nblk // nparts, (part + 1) * nblk // nparts):
            t = min(blk * MR, K - 1)        # the block's first tap (u, v, w) in the nest; then counted up
            u, v, w = t // (n2 * n3), t // n3 % n2, t % n3
            for q in range(MR):
                tab[q] = base + u * s1 + v * s2 + w * s3
                if t < K - 1:
                    t, w = t + 1, w + 1
                    if w == n3:
                        w, v = 0, v + 1
                        if v == n2:
                            v, u = 0, u + 1
            _gtile(a, a, tab, ox + n0 * sN, ob + n0 * P * O, O, oc + blk * MR * O, O, ni, sN, OH, sh * sH, OW, sw * sW,
                   O, 0, n0, 0, 0)


@row("mode ox ob oc obias N C H W O kh kw sh sw dh dw OH OW nhwc flip tout pt vh relu")
@njit(**FM)
def k_conv(a, ia, r):
    """Implicit-GEMM convolution, no patch matrix (stride, dilation any; padding made beforehand). x (N, C, H, W)
    at ox (nhwc 1: (N, H, W, C)); O a multiple of 8, at least MR output pixels and C*kh*kw >= 1.
    mode 0: y (N*OH*OW, O) at oc = [bias at obias +] the patches of x @ wt (C*kh*kw, O) at ob (rows in the taps'
    order: (c, i, j) for NCHW, (i, j, c) for NHWC and for NCHW with nhwc 2; flip 1: the window reversed, a
    transposed convolution);
    tout 1 (OH*OW >= MR): y stored (N, O, OH*OW) instead, each 8 x 8 tile transposed in registers. vh > 0
    (NHWC): x's rows outside pt .. pt+vh-1 are zeros (padding) and a block of pixels skips the window rows that
    only reach them. relu 1 (mode 0): relu of y stored (a convolution with its activation).
    mode 1: dW (Kpad, O) at oc = the patches^T @ dy (N*OH*OW, O) at ob, Kpad = K rounded up to MR (rows from K
    are a copy of row K-1's). Overwrites its output."""
    j, n = part_of(r)                       # split: the pixel blocks (mode 0) or tap blocks (mode 1) in n parts
    conv_part(a, r, j, n)


@njit(**FM)
def dy_part(a, r, n0, n1, j):
    """Images n0 .. n1-1 of a k_conv_dy row (part j: pool > 0 makes each image's dy in part j's scratch first)."""
    og = r[1]; oy = r[2]; ogt = r[3]; odb = r[4]; O = r[6]; P = r[7]; relu = r[8]; bias = r[9]
    pool = r[10]; ox = r[11]; H = r[12]; W = r[13]; OH = r[14]; OW = r[15]; kh = r[16]; kw = r[17]; sh = r[18]
    sw = r[19]; ph = r[20]; pw = r[21]; oscr = r[22] + j * O * P
    z = cvt(a, 0.0)
    for n in range(n0, n1):
        gt = ogt + n * P * O
        src = og + n * O * P
        if pool:                # dy = the pooling's gradient of image n, made in L2-sized scratch, not the arena's
            src = oscr          # whole (N, O, H, W) written and read back
            mode = pool - 1
            if kh == 2 and kw == 2 and sh == 2 and sw == 2 and ph == 0 and pw == 0 and 2 * OH <= H and 2 * OW <= W:
                pool2x2(a, 1, mode, ox + n * O * P, og + n * O * OH * OW, oscr, O, H, W, OH, OW)
            else:
                pool2d_bwd(a, mode, ox + n * O * P, og + n * O * OH * OW, oscr, O, H, W, OH, OW, kh, kw, sh, sw, ph, pw)
        transpose(a, src, a, gt, O, P, oy + n * O * P if relu else -1)
        if bias:
            db = a[odb + n * O:odb + (n + 1) * O]
            for o in range(O):
                db[o] = z
            for p in range(P):
                x = a[gt + p * O:gt + (p + 1) * O]
                for o in range(O):
                    db[o] += x[o]


@row("og oy ogt odb N O P relu bias pool ox H W OH OW kh kw sh sw ph pw oscr")
@njit(**FM)
def k_conv_dy(a, ia, r):
    """A convolution's output gradient dy (N, O, P) at og as the pixel rows its two backward products read, in one
    pass per image: gt (N*P, O) at ogt (relu 1: relu's gradient, masked by the convolution's output y at oy);
    bias 1: each image's column sums of gt, (N, O) at odb (the bias gradient's terms).
    pool > 0: dy is the gradient of a pooling (mode pool - 1, kernels/conv.py's k_pool2d) of x (N, O, H, W) at
    ox (P = H*W) whose output gradient (N, O, OH, OW) is at og; each image's dy is made in a part's O*P floats of
    the scratch at oscr (one block per part), then read from there."""
    j, n = part_of(r)                      # split: the images in n parts
    dy_part(a, r, j * r[5] // n, (j + 1) * r[5] // n, j)
