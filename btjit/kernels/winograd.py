# Winograd F(2x2, 3x3) convolutions (Lavin and Gray, arXiv 1509.09308): a 3x3, stride-1 convolution as 16
# products of (tiles x C) by (C x O) -- 16 multiply-adds per 2x2 output tile and channel pair instead of 36 --
# on the register micro-kernels (btjit/kernels/micro.py's gathered form), between transforms of the 4x4 input
# tiles (B^T d B), of the weights (G g G^T) and of the 16 products (A^T m A):
#   B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
#   G   = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
#   A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]
# The weight gradient is the same products' adjoint: dU = sum over tiles of (B^T d B) (x) (A dY A^T), dW = G^T dU G.
# Tiles go in blocks whose transforms and products stay in L2 (a part's arena scratch, tile-major, their strides
# off multiples of 4 KB); each tile's transform is made in a stack buffer (its stores alias no load from the
# arena, so the loop vectorizes with no runtime checks), then copied out in one pass. An NCHW image is first
# transposed to pixel rows (channels inner), so every transform runs along a contiguous row of channels. Hot
# loops index typed pointers (common.fptr) by their range variable alone (an offset index into a slice costs
# numba's negative-index test: a gather per load). k_wino_dw, the weight gradient, is its own entry (two entries
# compile in parallel: 4.9 and 2.6 s here, against 8.3 s as one).
# graph/ops/winograd.py puts these kernels in place of the implicit GEMMs where they are measured faster.
from numba import carray, njit

from btjit.kernels.common import FM, MAX_THREADS, copy_n, cvt, fill_n, fptr, part_of, row, stack_buf, transpose
from btjit.kernels.convgemm import _gtile
from btjit.kernels.micro import MR

WBUF = 8192       # elements of a tile's stack buffer: its 16 rows of up to 512 channels
PAD = 16          # elements between the blocks' tiles: their rows' strides not a multiple of 4 KB (L1 set conflicts)


def wino_tb(C, O):
    """Tiles per block: the block's transforms and products, 16*tb*(C + O) elements in the arena, ~384 KB."""
    return max(MR, min(128, 6144 // (C + O) // MR * MR))


def wino_parts(dw, N, C):
    """The most parts a row splits into: images (k_wino), blocks of MR channels (dw: k_wino_dw)."""
    return min(MAX_THREADS, C // MR if dw else N)


def wino_chans(C, parts, j):
    """[c0, c1): part j's channels of a weight gradient row in `parts` parts (whole blocks of MR)."""
    nb = C // MR
    return j * nb // parts * MR, (j + 1) * nb // parts * MR


def wino_scratch(dw, C, H, W, O, OH, OW, nhwc, tout, parts):
    """Elements of one part's arena scratch in a k_wino row (dw: k_wino_dw) of `parts` parts (_layout): the image
    as pixel rows (NCHW input), the output image before its transpose (tout), the block's input transforms and
    products (or dy's transforms), U (or dU), a tile over the edge and a zero row."""
    cp = -(-(C // MR) // parts) * MR if dw else C       # the part's most channels
    return (H * W * cp if nhwc == 0 else 0) + (OH * OW * O if tout else 0) + \
        wino_tb(C, O) * (16 * (cp + O) + 2 * PAD) + 16 * cp * O + 17 * max(C, O) + 16


_tb, _chans = njit(inline="always")(wino_tb), njit(inline="always")(wino_chans)


@njit(**FM)
def _tile_in(a, src, ps, H, W, oz, opatch, h0, w0, C, ov):
    """The 4x4 input tile at pixel (h0, w0) of the pixel rows at src (pixel (h, w) at src + (h*W + w)*ps, C
    channels) transformed, B^T d B, into its 16 rows of C at ov (row k at ov + k*C): made in a stack buffer,
    then copied in one pass. A tile over the edge is first gathered at opatch (zeros outside H x W: row oz)."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    q = ps
    if h0 + 3 >= H or w0 + 3 >= W:
        for k in range(16):
            h, w = h0 + k // 4, w0 + k % 4
            o = src + (h * W + w) * ps if h < H and w < W else oz
            d, p = fptr(a, o), fptr(a, opatch + k * C)
            for c in range(C):
                p[c] = d[c]
        src, W, h0, w0, q = opatch, 4, 0, 0, C
    o = src + (h0 * W + w0) * q
    d00, d01, d02, d03 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    o += W * q
    d10, d11, d12, d13 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    o += W * q
    d20, d21, d22, d23 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    o += W * q
    d30, d31, d32, d33 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    v00, v01, v02, v03 = fptr(sb, 0), fptr(sb, C), fptr(sb, 2 * C), fptr(sb, 3 * C)
    v10, v11, v12, v13 = fptr(sb, 4 * C), fptr(sb, 5 * C), fptr(sb, 6 * C), fptr(sb, 7 * C)
    v20, v21, v22, v23 = fptr(sb, 8 * C), fptr(sb, 9 * C), fptr(sb, 10 * C), fptr(sb, 11 * C)
    v30, v31, v32, v33 = fptr(sb, 12 * C), fptr(sb, 13 * C), fptr(sb, 14 * C), fptr(sb, 15 * C)
    for c in range(C):
        e0, e1, e2, e3 = d00[c] - d02[c], d10[c] - d12[c], d20[c] - d22[c], d30[c] - d32[c]   # column 0 of d B
        v00[c], v10[c], v20[c], v30[c] = e0 - e2, e1 + e2, e2 - e1, e1 - e3                     # B^T of it
        e0, e1, e2, e3 = d01[c] + d02[c], d11[c] + d12[c], d21[c] + d22[c], d31[c] + d32[c]
        v01[c], v11[c], v21[c], v31[c] = e0 - e2, e1 + e2, e2 - e1, e1 - e3
        e0, e1, e2, e3 = d02[c] - d01[c], d12[c] - d11[c], d22[c] - d21[c], d32[c] - d31[c]
        v02[c], v12[c], v22[c], v32[c] = e0 - e2, e1 + e2, e2 - e1, e1 - e3
        e0, e1, e2, e3 = d01[c] - d03[c], d11[c] - d13[c], d21[c] - d23[c], d31[c] - d33[c]
        v03[c], v13[c], v23[c], v33[c] = e0 - e2, e1 + e2, e2 - e1, e1 - e3
    copy_n(fptr(a, ov), sb, 16 * C)


@njit(**FM)
def _tile_out(a, om, O, dst, OW, h0, w0, OH, ob, relu, opatch):
    """The 16 product rows of O at om (row k at om + k*O) of one tile back to its 2x2 outputs, A^T m A + the bias
    row at ob [relu], stored as pixel rows at dst (pixel (h, w) at dst + (h*OW + w)*O); over the edge made at
    opatch first and only the pixels inside OH x OW stored. The rows are read from a stack buffer's copy."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    copy_n(sb, fptr(a, om), 16 * O)
    edge = h0 + 1 >= OH or w0 + 1 >= OW
    o = opatch if edge else dst + (h0 * OW + w0) * O
    y00, y01 = fptr(a, o), fptr(a, o + O)
    o = opatch + 2 * O if edge else dst + ((h0 + 1) * OW + w0) * O
    y10, y11 = fptr(a, o), fptr(a, o + O)
    m00, m01, m02, m03 = fptr(sb, 0), fptr(sb, O), fptr(sb, 2 * O), fptr(sb, 3 * O)
    m10, m11, m12, m13 = fptr(sb, 4 * O), fptr(sb, 5 * O), fptr(sb, 6 * O), fptr(sb, 7 * O)
    m20, m21, m22, m23 = fptr(sb, 8 * O), fptr(sb, 9 * O), fptr(sb, 10 * O), fptr(sb, 11 * O)
    m30, m31, m32, m33 = fptr(sb, 12 * O), fptr(sb, 13 * O), fptr(sb, 14 * O), fptr(sb, 15 * O)
    b = fptr(a, ob)
    z = cvt(a, 0.0)
    for c in range(O):
        u0, u1, u2, u3 = m00[c] + m10[c] + m20[c], m01[c] + m11[c] + m21[c], m02[c] + m12[c] + m22[c], \
            m03[c] + m13[c] + m23[c]
        v0, v1, v2, v3 = m10[c] - m20[c] - m30[c], m11[c] - m21[c] - m31[c], m12[c] - m22[c] - m32[c], \
            m13[c] - m23[c] - m33[c]
        t00, t01, t10, t11 = u0 + u1 + u2 + b[c], u1 - u2 - u3 + b[c], v0 + v1 + v2 + b[c], v1 - v2 - v3 + b[c]
        if relu:
            t00, t01, t10, t11 = max(t00, z), max(t01, z), max(t10, z), max(t11, z)
        y00[c], y01[c], y10[c], y11[c] = t00, t01, t10, t11
    if edge:
        for k in range(4):
            h, w = h0 + k // 2, w0 + k % 2
            if h < OH and w < OW:
                y, p = fptr(a, dst + (h * OW + w) * O), fptr(a, opatch + k * O)
                for c in range(O):
                    y[c] = p[c]


@njit(**FM)
def _tile_dy(a, src, OH, OW, O, oz, h0, w0, ot):
    """The 2x2 output gradient at (h0, w0) of the pixel rows at src (zeros outside OH x OW: the row at oz) as its
    16 rows A dY A^T of O at ot (row k at ot + k*O), made in a stack buffer."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    o0 = src + (h0 * OW + w0) * O
    o1 = o0 + O if w0 + 1 < OW else oz
    o2 = o0 + OW * O if h0 + 1 < OH else oz
    o3 = o0 + (OW + 1) * O if h0 + 1 < OH and w0 + 1 < OW else oz
    y00, y01, y10, y11 = fptr(a, o0), fptr(a, o1), fptr(a, o2), fptr(a, o3)
    z00, z01, z02, z03 = fptr(sb, 0), fptr(sb, O), fptr(sb, 2 * O), fptr(sb, 3 * O)
    z10, z11, z12, z13 = fptr(sb, 4 * O), fptr(sb, 5 * O), fptr(sb, 6 * O), fptr(sb, 7 * O)
    z20, z21, z22, z23 = fptr(sb, 8 * O), fptr(sb, 9 * O), fptr(sb, 10 * O), fptr(sb, 11 * O)
    z30, z31, z32, z33 = fptr(sb, 12 * O), fptr(sb, 13 * O), fptr(sb, 14 * O), fptr(sb, 15 * O)
    for c in range(O):      # each row's columns (y_0, y_0 + y_1, y_0 - y_1, -y_1): p of row 0, q of row 1
        p0, q0 = y00[c], y10[c]
        p1, q1 = y00[c] + y01[c], y10[c] + y11[c]
        p2, q2 = y00[c] - y01[c], y10[c] - y11[c]
        p3, q3 = -y01[c], -y11[c]
        z00[c], z01[c], z02[c], z03[c] = p0, p1, p2, p3
        z10[c], z11[c], z12[c], z13[c] = p0 + q0, p1 + q1, p2 + q2, p3 + q3
        z20[c], z21[c], z22[c], z23[c] = p0 - q0, p1 - q1, p2 - q2, p3 - q3
        z30[c], z31[c], z32[c], z33[c] = -q0, -q1, -q2, -q3
    copy_n(fptr(a, ot), sb, 16 * O)


@njit(**FM)
def _wrow(ow, C, O, taps, flip, c, i, j):
    """The offset of row (c, i, j) of wt (9*C, O) at ow in the taps' order (0: (c, i, j); 1: (i, j, c)), flipped."""
    ii, jj = (2 - i, 2 - j) if flip else (i, j)
    return ow + ((c * 9 + ii * 3 + jj) if taps == 0 else ((ii * 3 + jj) * C + c)) * O


@njit(**FM)
def _weights(a, ow, ou, C, O, taps, flip):
    """U[k] (C, O) at ou = G g G^T of each (c, o) filter g of wt (9*C, O) at ow, rows in the taps' order;
    flip: the filter reversed (a transposed convolution's). A channel's 16 rows made in a stack buffer, then
    copied (stored in place, 16 rows C*O apart, their lines conflicted in L1: 50x slower at 64 channels)."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    h = cvt(a, 0.5)
    for c in range(C):
        g00, g01, g02 = fptr(a, _wrow(ow, C, O, taps, flip, c, 0, 0)), fptr(a, _wrow(ow, C, O, taps, flip, c, 0, 1)), \
            fptr(a, _wrow(ow, C, O, taps, flip, c, 0, 2))
        g10, g11, g12 = fptr(a, _wrow(ow, C, O, taps, flip, c, 1, 0)), fptr(a, _wrow(ow, C, O, taps, flip, c, 1, 1)), \
            fptr(a, _wrow(ow, C, O, taps, flip, c, 1, 2))
        g20, g21, g22 = fptr(a, _wrow(ow, C, O, taps, flip, c, 2, 0)), fptr(a, _wrow(ow, C, O, taps, flip, c, 2, 1)), \
            fptr(a, _wrow(ow, C, O, taps, flip, c, 2, 2))
        u00, u01, u02, u03 = fptr(sb, 0), fptr(sb, O), fptr(sb, 2 * O), fptr(sb, 3 * O)
        u10, u11, u12, u13 = fptr(sb, 4 * O), fptr(sb, 5 * O), fptr(sb, 6 * O), fptr(sb, 7 * O)
        u20, u21, u22, u23 = fptr(sb, 8 * O), fptr(sb, 9 * O), fptr(sb, 10 * O), fptr(sb, 11 * O)
        u30, u31, u32, u33 = fptr(sb, 12 * O), fptr(sb, 13 * O), fptr(sb, 14 * O), fptr(sb, 15 * O)
        for o in range(O):          # the rows of G g: g_0, (g_0 + g_1 + g_2)/2, (g_0 - g_1 + g_2)/2, g_2; then G^T
            e0, e1, e2 = g00[o], g01[o], g02[o]
            u00[o], u01[o], u02[o], u03[o] = e0, h * (e0 + e1 + e2), h * (e0 - e1 + e2), e2
            e0, e1, e2 = h * (g00[o] + g10[o] + g20[o]), h * (g01[o] + g11[o] + g21[o]), h * (g02[o] + g12[o] + g22[o])
            u10[o], u11[o], u12[o], u13[o] = e0, h * (e0 + e1 + e2), h * (e0 - e1 + e2), e2
            e0, e1, e2 = h * (g00[o] - g10[o] + g20[o]), h * (g01[o] - g11[o] + g21[o]), h * (g02[o] - g12[o] + g22[o])
            u20[o], u21[o], u22[o], u23[o] = e0, h * (e0 + e1 + e2), h * (e0 - e1 + e2), e2
            e0, e1, e2 = g20[o], g21[o], g22[o]
            u30[o], u31[o], u32[o], u33[o] = e0, h * (e0 + e1 + e2), h * (e0 - e1 + e2), e2
        for k in range(16):
            copy_n(fptr(a, ou + (k * C + c) * O), fptr(sb, k * O), O)


@njit(**FM)
def _dweights(a, odu, odw, C, O, c0, cp, taps):
    """dW rows of channels c0 .. c0+cp-1 (in the taps' order) = G^T dU G of dU (16, cp, O) at odu: a channel's nine
    rows made in a stack buffer, then copied."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    h = cvt(a, 0.5)
    for c in range(cp):
        u = odu + c * O
        s = cp * O
        u00, u01, u02, u03 = fptr(a, u), fptr(a, u + s), fptr(a, u + 2 * s), fptr(a, u + 3 * s)
        u10, u11, u12, u13 = fptr(a, u + 4 * s), fptr(a, u + 5 * s), fptr(a, u + 6 * s), fptr(a, u + 7 * s)
        u20, u21, u22, u23 = fptr(a, u + 8 * s), fptr(a, u + 9 * s), fptr(a, u + 10 * s), fptr(a, u + 11 * s)
        u30, u31, u32, u33 = fptr(a, u + 12 * s), fptr(a, u + 13 * s), fptr(a, u + 14 * s), fptr(a, u + 15 * s)
        w00, w01, w02, w10, w11, w12 = fptr(sb, 0), fptr(sb, O), fptr(sb, 2 * O), fptr(sb, 3 * O), fptr(sb, 4 * O), \
            fptr(sb, 5 * O)
        w20, w21, w22 = fptr(sb, 6 * O), fptr(sb, 7 * O), fptr(sb, 8 * O)
        for o in range(O):          # G^T of (dU G) = (u0 + (u1 + u2)/2, (u1 - u2)/2, (u1 + u2)/2 + u3) per row
            t00, t01, t02 = u00[o] + h * (u01[o] + u02[o]), h * (u01[o] - u02[o]), h * (u01[o] + u02[o]) + u03[o]
            t10, t11, t12 = u10[o] + h * (u11[o] + u12[o]), h * (u11[o] - u12[o]), h * (u11[o] + u12[o]) + u13[o]
            t20, t21, t22 = u20[o] + h * (u21[o] + u22[o]), h * (u21[o] - u22[o]), h * (u21[o] + u22[o]) + u23[o]
            t30, t31, t32 = u30[o] + h * (u31[o] + u32[o]), h * (u31[o] - u32[o]), h * (u31[o] + u32[o]) + u33[o]
            w00[o], w10[o], w20[o] = t00 + h * (t10 + t20), h * (t10 - t20), h * (t10 + t20) + t30
            w01[o], w11[o], w21[o] = t01 + h * (t11 + t21), h * (t11 - t21), h * (t11 + t21) + t31
            w02[o], w12[o], w22[o] = t02 + h * (t12 + t22), h * (t12 - t22), h * (t12 + t22) + t32
        for i in range(3):
            for j in range(3):
                copy_n(fptr(a, _wrow(odw, C, O, taps, 0, c0 + c, i, j)), fptr(sb, (3 * i + j) * O), O)


@njit(**FM)
def _gemms(a, tab, oA, ka, rs, ks, K, oB, kb, ldb, oC, kc, ldc, rows, O, acc):
    """The 16 products of a block, k < 16: C_k [+]= A_k @ B_k, with A_k (rows, K) at oA + k*ka (A_k(r, s) at
    + r*rs + s*ks), B_k (K, O) at oB + k*kb (row s at + s*ldb), C_k (rows, O) at oC + k*kc (row r at + r*ldc);
    rows in whole MR blocks (those past `rows` are the block's spare rows)."""
    for k in range(16):
        for r0 in range(0, rows, MR):
            for q in range(MR):
                tab[q] = (r0 + q) * rs
            _gtile(a, a, tab, oA + k * ka, oB + k * kb, ldb, oC + k * kc + r0 * ldc, ldc, 1, 0, 1, 0, K, ks, O, 0,
                   acc, 0, 0)


@njit(**FM)
def _layout(C, O, H, W, OH, OW, cp, nhwc, ys, us, oscr):
    """(tb, oxs, oys, ov, sv, om, sm, ou, opatch, oz): a part's scratch at oscr -- the image as pixel rows (NCHW
    input), the output image's pixel rows (ys), a block of tb tiles' input transforms (tile stride sv) and its
    products or dy's transforms (sm), U or dU (us elements), a tile over the edge, a zero row."""
    tb = _tb(C, O)          # of the whole row: a part sums its channels' tiles as one thread would (bitwise)
    oys = oscr + (H * W * cp if nhwc == 0 else 0)
    ov = oys + ys
    sv, sm = 16 * cp + PAD, 16 * O + PAD
    om = ov + tb * sv
    odu = om + tb * sm
    opatch = odu + us
    return tb, oscr, oys, ov, sv, om, sm, odu, opatch, opatch + 16 * max(C, O)


@njit(**FM)
def _tile(a, t, NT, TW, nhwc, ox, oxs, C, H, W, c0, cp, cur):
    """(img, h0, w0, src, ps, cur) of the block's tile t (of NT an image, TW a row): its image, first pixel, and
    where that image's pixel rows are (an NCHW image transposed to oxs when first met: cur is the one there)."""
    img = t // NT
    ty = (t - img * NT) // TW
    if nhwc == 0 and img != cur:
        transpose(a, ox + (img * C + c0) * H * W, a, oxs, cp, H * W)
    src, ps = (oxs, cp) if nhwc == 0 else (ox + img * H * W * C + c0, C)
    return img, 2 * ty, 2 * (t - img * NT - ty * TW), src, ps, img


@row("ox ow oy obias oscr N C H W O OH OW nhwc taps flip tout relu sc")
@njit(**FM)
def k_wino(a, ia, r):
    """Winograd F(2x2, 3x3) convolution, stride 1, no dilation (padding made beforehand): x (N, C, H, W) at ox
    (nhwc 1: (N, H, W, C)) by wt (9*C, O) at ow, rows in the taps' order (taps 0: (c, i, j); 1: (i, j, c); flip 1:
    each filter reversed, a transposed convolution), OH = H - 2, OW = W - 2, C and O multiples of MR, at most
    WBUF / 16: y at oy = [bias at obias +] the convolution, as pixel rows (N*OH*OW, O), or (N, O, OH, OW) with
    tout 1; relu 1: relu of it. Part j of a split row: its images, with sc elements of scratch at oscr + j*sc
    (wino_scratch), where it first makes its own copy of the weights' transforms U (16, C, O): no cache line of U
    moves between the cores from one step to the next (one copy written by one thread and read by both took
    ~0.7 ms for 64 x 64 channels on two cores of this machine, a third of the convolution)."""
    ox = r[1]; ow = r[2]; oy = r[3]; obias = r[4]; oscr = r[5]; N = r[6]; C = r[7]; H = r[8]; W = r[9]; O = r[10]
    OH = r[11]; OW = r[12]; nhwc = r[13]; taps = r[14]; flip = r[15]; tout = r[16]; relu = r[17]; sc = r[18]
    j, n = part_of(r)
    tab = carray(stack_buf(r, MR), (MR,))
    TW = (OW + 1) // 2
    NT = (OH + 1) // 2 * TW
    n0, n1 = j * N // n, (j + 1) * N // n
    tb, oxs, oys, ov, sv, om, sm, ou, opatch, oz = _layout(C, O, H, W, OH, OW, C, nhwc, OH * OW * O if tout else 0,
                                                           16 * C * O, oscr + j * sc)
    _weights(a, ow, ou, C, O, taps, flip)
    fill_n(fptr(a, oz), cvt(a, 0.0), max(C, O) + 16)
    fill_n(fptr(a, ov), cvt(a, 0.0), tb * sv)
    cur = -1
    for t0 in range(n0 * NT, n1 * NT, tb):      # blocks of tb tiles, over the images' edges
        tn = min(tb, n1 * NT - t0)
        for tl in range(tn):
            img, h0, w0, src, ps, cur = _tile(a, t0 + tl, NT, TW, nhwc, ox, oxs, C, H, W, 0, C, cur)
            _tile_in(a, src, ps, H, W, oz, opatch, h0, w0, C, ov + tl * sv)
        _gemms(a, tab, ov, C, sv, 1, C, ou, C * O, O, om, O, sm, tn, O, 0)     # M[tl, k] = V[tl, k] @ U[k]
        for tl in range(tn):        # then each tile's outputs; an image's last one moves it to y (tout)
            img = (t0 + tl) // NT
            tt = t0 + tl - img * NT
            h0, w0 = 2 * (tt // TW), 2 * (tt % TW)
            _tile_out(a, om + tl * sm, O, oys if tout else oy + img * OH * OW * O, OW, h0, w0, OH,
                      obias if obias > 0 else oz, relu, opatch)
            if tout and tt == NT - 1:
                transpose(a, oys, a, oy + img * O * OH * OW, OH * OW, O)


@row("ox ody odw oscr N C H W O OH OW taps sc")
@njit(**FM)
def k_wino_dw(a, ia, r):
    """The weight gradient of k_wino's convolution: dW (9*C, O) at odw, rows in the taps' order (0: (c, i, j);
    1: (i, j, c)), from x (N, C, H, W) at ox and dy (N*OH*OW, O) at ody: dU[k] = the sum over the tiles of
    V[:, k]^T Z[:, k] (the input tiles' and dy's transforms), then G^T dU G. Part j of a split row: its blocks of
    MR channels, with sc elements of scratch at oscr + j*sc (wino_scratch)."""
    ox = r[1]; ody = r[2]; odw = r[3]; oscr = r[4]; N = r[5]; C = r[6]; H = r[7]; W = r[8]; O = r[9]; OH = r[10]
    OW = r[11]; taps = r[12]; sc = r[13]
    j, n = part_of(r)
    tab = carray(stack_buf(r, MR), (MR,))
    TW = (OW + 1) // 2
    NT = (OH + 1) // 2 * TW
    c0, c1 = _chans(C, n, j)
    cp = c1 - c0
    tb, oxs, _, ov, sv, om, sm, odu, opatch, oz = _layout(C, O, H, W, OH, OW, cp, 0, 0, 16 * cp * O, oscr + j * sc)
    fill_n(fptr(a, oz), cvt(a, 0.0), max(C, O) + 16)
    fill_n(fptr(a, odu), cvt(a, 0.0), 16 * cp * O)
    cur = -1
    for t0 in range(0, N * NT, tb):
        tn = min(tb, N * NT - t0)
        for tl in range(tn):
            img, h0, w0, src, ps, cur = _tile(a, t0 + tl, NT, TW, 0, ox, oxs, C, H, W, c0, cp, cur)
            _tile_in(a, src, ps, H, W, oz, opatch, h0, w0, cp, ov + tl * sv)
            _tile_dy(a, ody + img * OH * OW * O, OH, OW, O, oz, h0, w0, om + tl * sm)
        _gemms(a, tab, ov, cp, 1, sv, tn, om, O, sm, odu, cp * O, O, cp, O, 1)    # dU[k] += V[:, k]^T @ Z[:, k]
    _dweights(a, odu, odw, C, O, c0, cp, taps)
