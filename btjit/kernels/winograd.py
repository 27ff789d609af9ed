# Winograd F(2x2, 3x3), F(4x4, 3x3) and F(2x2, 5x5) convolutions (Lavin and Gray, arXiv 1509.09308): an r x r,
# stride-1 convolution (r = 3 or 5) as T = (m+r-1)^2 products of (tiles x C) by (C x O) -- T multiply-adds per m x m
# output tile and channel pair instead of m*m*r*r: 16 for 36, 36 for 144, 36 for 100 -- on the register micro-kernels
# (btjit/kernels/micro.py's gathered form), between transforms of the input tiles (B^T d B), of the weights (G g G^T:
# _sandwich) and of the T products (A^T m A), the tiles' in winograd_tiles.py. The weight gradient is the same
# products' adjoint: dU = sum over tiles of (B^T d B) (x) (A dY A^T), dW = G^T dU G. Tiles go in blocks whose
# transforms and products stay in L2 (a part's arena scratch, tile-major, their strides off multiples of 4 KB). An
# NCHW image is first transposed to pixel rows (channels inner), so every transform runs along a contiguous row of
# channels. Hot loops index typed pointers (common.fptr) by their range variable alone (an offset index into a slice
# costs numba's negative-index test: a gather per load). k_wino_dw, the weight gradient, is its own entry (two
# entries: ~9 and ~5 s to compile in one process, sharing the transforms). graph/ops/winograd.py puts these kernels in
# place of the implicit GEMMs where they are measured faster.
import numpy as np
from numba import carray, njit

from btjit.kernels.common import FM, MAX_THREADS, cvt, fill_n, fptr, part_of, row, stack_buf, transpose
from btjit.kernels.convgemm import _gtile
from btjit.kernels.micro import MR
from btjit.kernels.winograd_tiles import WBUF, tile_dy, tile_in, tile_out

G3 = np.array([[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]])    # F(2x2, 3x3)'s G
G5 = np.array([[1 / 4, 0, 0, 0, 0], [-1 / 6] * 5, [-1 / 6, 1 / 6, -1 / 6, 1 / 6, -1 / 6],       # F(2x2, 5x5)'s
               [1 / 24, 1 / 12, 1 / 6, 1 / 3, 2 / 3], [1 / 24, -1 / 12, 1 / 6, -1 / 3, 2 / 3], [0, 0, 0, 0, 1]])
G43 = np.array([[1 / 4, 0, 0], [-1 / 6] * 3, [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],       # F(4x4, 3x3)'s
                [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]])
G3T, G43T, G5T = G3.T.copy(), G43.T.copy(), G5.T.copy()
PAD = 16          # elements between the blocks' tiles: their rows' strides not a multiple of 4 KB (L1 set conflicts)


def wino_tb(C, O, T):
    """Tiles per block: the block's transforms and products, T*tb*(C + O) elements in the arena, ~384 KB."""
    return max(MR, min(128, 98304 // T // (C + O) // MR * MR))


def wino_parts(dw, N, C):
    """The most parts a row splits into: images (k_wino), blocks of MR channels (dw: k_wino_dw)."""
    return min(MAX_THREADS, C // MR if dw else N)


def wino_chans(C, parts, j):
    """[c0, c1): part j's channels of a weight gradient row in `parts` parts (whole blocks of MR)."""
    nb = C // MR
    return j * nb // parts * MR, (j + 1) * nb // parts * MR


def wino_scratch(dw, r, m, C, H, W, O, OH, OW, nhwc, tout, parts):
    """Elements of one part's arena scratch in a k_wino row (dw: k_wino_dw) of `parts` parts (_layout): the image
    as pixel rows (NCHW input), the output image before its transpose (tout), the block's input transforms and
    products (or dy's transforms), U (or dU), a tile over the edge (or a filter's transform) and a zero row."""
    cp = -(-(C // MR) // parts) * MR if dw else C       # the part's most channels
    T = (m + r - 1) ** 2
    return (H * W * cp if nhwc == 0 else 0) + (OH * OW * O if tout else 0) + \
        wino_tb(C, O, T) * (T * (cp + O) + 2 * PAD) + T * cp * O + (T + 1) * max(C, O) + 16


_tb, _chans = njit(inline="always")(wino_tb), njit(inline="always")(wino_chans)


@njit(**FM)
def _sandwich(a, M, src, si, sj, dst, di, dj, O):
    """Y = M X M^T over rows of O: X n x n rows (row (i, j) at src + i*si + j*sj), M (m, n) constants, Y m x m rows
    (at dst + i*di + j*dj); M X into the stack buffer, then its rows by M^T. A filter's transform, once a step: one
    loop for every window size and direction (written out, each cost ~1 s to compile)."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    m, n = M.shape
    z = cvt(a, 0.0)
    for i in range(m):
        for j in range(n):
            t = fptr(sb, (i * n + j) * O)
            fill_n(t, z, O)
            for k in range(n):
                f, x = cvt(a, M[i, k]), fptr(a, src + k * si + j * sj)
                if f != z:
                    for o in range(O):
                        t[o] += f * x[o]
    for i in range(m):
        for j in range(m):
            y = fptr(a, dst + i * di + j * dj)
            fill_n(y, z, O)
            for k in range(n):
                f, t = cvt(a, M[j, k]), fptr(sb, (i * n + k) * O)
                if f != z:
                    for o in range(O):
                        y[o] += f * t[o]


@njit(**FM)
def _taps(ow, C, O, r, taps, flip, c):
    """(base, si, sj): row (c, i, j) of an r x r filter bank wt (r*r*C, O) at ow is at base + i*si + j*sj, rows in
    the taps' order (0: (c, i, j); 1: (i, j, c)); flip: the filter reversed (a transposed convolution's)."""
    si, sj = (r * O, O) if taps == 0 else (r * C * O, C * O)
    base = ow + (c * r * r if taps == 0 else c) * O
    return (base + (r - 1) * (si + sj), -si, -sj) if flip else (base, si, sj)


@njit(**FM)
def _weights(a, r, m, ow, ou, C, O, taps, flip):
    """U[k] (C, O) at ou = G g G^T of each (c, o) filter g of wt (r*r*C, O) at ow (_taps' order)."""
    q = m + r - 1
    for c in range(C):
        b, si, sj = _taps(ow, C, O, r, taps, flip, c)
        _sandwich(a, G5 if r == 5 else G3 if m == 2 else G43, b, si, sj, ou + c * O, q * C * O, C * O, O)


@njit(**FM)
def _dweights(a, r, m, odu, odw, C, O, c0, cp, taps):
    """dW rows of channels c0 .. c0+cp-1 (_taps' order) = G^T dU G of dU (T, cp, O) at odu."""
    q = m + r - 1
    for c in range(cp):
        b, si, sj = _taps(odw, C, O, r, taps, 0, c0 + c)
        _sandwich(a, G5T if r == 5 else G3T if m == 2 else G43T, odu + c * O, q * cp * O, cp * O, b, si, sj, O)


@njit(**FM)
def _gemms(a, tab, T, oA, ka, rs, ks, K, oB, kb, ldb, oC, kc, ldc, rows, O, acc):
    """The T products of a block, k < T: C_k [+]= A_k @ B_k, with A_k (rows, K) at oA + k*ka (A_k(r, s) at
    + r*rs + s*ks), B_k (K, O) at oB + k*kb (row s at + s*ldb), C_k (rows, O) at oC + k*kc (row r at + r*ldc);
    rows in whole MR blocks (those past `rows` are the block's spare rows)."""
    for k in range(T):
        for r0 in range(0, rows, MR):
            for q in range(MR):
                tab[q] = (r0 + q) * rs
            _gtile(a, a, tab, oA + k * ka, oB + k * kb, ldb, oC + k * kc + r0 * ldc, ldc, 1, 0, 1, 0, K, ks, O, 0,
                   acc, 0, 0)


@njit(**FM)
def _layout(T, C, O, H, W, OH, OW, cp, nhwc, ys, us, oscr):
    """(tb, oxs, oys, ov, sv, om, sm, ou, opatch, oz): a part's scratch at oscr -- the image as pixel rows (NCHW
    input), the output image's pixel rows (ys), a block of tb tiles' input transforms (tile stride sv) and its
    products or dy's transforms (sm), U or dU (us elements), a tile over the edge, a zero row."""
    tb = _tb(C, O, T)          # of the whole row: a part sums its channels' tiles as one thread would (bitwise)
    oys = oscr + (H * W * cp if nhwc == 0 else 0)
    ov = oys + ys
    sv, sm = T * cp + PAD, T * O + PAD
    om = ov + tb * sv
    odu = om + tb * sm
    opatch = odu + us
    return tb, oscr, oys, ov, sv, om, sm, odu, opatch, opatch + T * max(C, O)


@njit(**FM)
def _tile(a, t, m, NT, TW, nhwc, ox, oxs, C, H, W, c0, cp, cur):
    """(img, h0, w0, src, ps, cur) of the block's tile t (m x m outputs; NT an image, TW a row): its image, first
    pixel, and where that image's pixel rows are (an NCHW image transposed to oxs when first met: cur is the one
    there)."""
    img = t // NT
    ty = (t - img * NT) // TW
    if nhwc == 0 and img != cur:
        transpose(a, ox + (img * C + c0) * H * W, a, oxs, cp, H * W)
    src, ps = (oxs, cp) if nhwc == 0 else (ox + img * H * W * C + c0, C)
    return img, m * ty, m * (t - img * NT - ty * TW), src, ps, img


@row("ox ow oy obias oscr N C H W O OH OW nhwc taps flip tout relu sc k m")
@njit(**FM)
def k_wino(a, ia, r):
    """Winograd F(m x m, r x r) convolution (r = k: 3 with m = 2 or 4, 5 with m = 2), stride 1, no dilation (padding
    made beforehand): x (N, C, H, W) at ox (nhwc 1: (N, H, W, C)) by wt (r*r*C, O) at ow, rows in the taps' order
    (taps 0: (c, i, j); 1: (i, j, c); flip 1: each filter reversed, a transposed convolution), OH = H - r + 1, OW =
    W - r + 1, C and O multiples of MR, at most WBUF / T: y at oy = [bias at obias +] the convolution, as pixel rows
    (N*OH*OW, O), or (N, O, OH, OW) with tout 1; relu 1: relu of it. Part j of a split row: its images, with sc
    elements of scratch at oscr + j*sc (wino_scratch), where it first makes its own copy of the weights' transforms
    U (T, C, O): no cache line of U moves between the cores from one step to the next (one copy written by one
    thread and read by both took ~0.7 ms for 64 x 64 channels on two cores of this machine, a third of the
    convolution)."""
    ox = r[1]; ow = r[2]; oy = r[3]; obias = r[4]; oscr = r[5]; N = r[6]; C = r[7]; H = r[8]; W = r[9]; O = r[10]
    OH = r[11]; OW = r[12]; nhwc = r[13]; taps = r[14]; flip = r[15]; tout = r[16]; relu = r[17]; sc = r[18]
    k = r[19]; m = r[20]
    T = (m + k - 1) * (m + k - 1)
    j, n = part_of(r)
    tab = carray(stack_buf(r, MR), (MR,))
    TW = (OW + m - 1) // m
    NT = (OH + m - 1) // m * TW
    n0, n1 = j * N // n, (j + 1) * N // n
    tb, oxs, oys, ov, sv, om, sm, ou, opatch, oz = _layout(T, C, O, H, W, OH, OW, C, nhwc,
                                                           OH * OW * O if tout else 0, T * C * O, oscr + j * sc)
    _weights(a, k, m, ow, ou, C, O, taps, flip)
    fill_n(fptr(a, oz), cvt(a, 0.0), max(C, O) + 16)
    fill_n(fptr(a, ov), cvt(a, 0.0), tb * sv)
    cur = -1
    for t0 in range(n0 * NT, n1 * NT, tb):      # blocks of tb tiles, over the images' edges
        tn = min(tb, n1 * NT - t0)
        for tl in range(tn):
            img, h0, w0, src, ps, cur = _tile(a, t0 + tl, m, NT, TW, nhwc, ox, oxs, C, H, W, 0, C, cur)
            tile_in(a, k, m, src, ps, H, W, oz, opatch, h0, w0, C, ov + tl * sv)
        _gemms(a, tab, T, ov, C, sv, 1, C, ou, C * O, O, om, O, sm, tn, O, 0)     # M[tl, k] = V[tl, k] @ U[k]
        for tl in range(tn):        # then each tile's outputs; an image's last one moves it to y (tout)
            img = (t0 + tl) // NT
            tt = t0 + tl - img * NT
            h0, w0 = m * (tt // TW), m * (tt % TW)
            tile_out(a, k, m, om + tl * sm, O, oys if tout else oy + img * OH * OW * O, OW, h0, w0, OH,
                      obias if obias > 0 else oz, relu, opatch)
            if tout and tt == NT - 1:
                transpose(a, oys, a, oy + img * O * OH * OW, OH * OW, O)


@row("ox ody odw oscr N C H W O OH OW taps sc k m")
@njit(**FM)
def k_wino_dw(a, ia, r):
    """The weight gradient of k_wino's convolution (k x k windows, m x m tiles): dW (k*k*C, O) at odw, rows in the taps'
    order (0: (c, i, j); 1: (i, j, c)), from x (N, C, H, W) at ox and dy (N*OH*OW, O) at ody: dU[k] = the sum over
    the tiles of V[:, k]^T Z[:, k] (the input tiles' and dy's transforms), then G^T dU G. Part j of a split row: its
    blocks of MR channels, with sc elements of scratch at oscr + j*sc (wino_scratch)."""
    ox = r[1]; ody = r[2]; odw = r[3]; oscr = r[4]; N = r[5]; C = r[6]; H = r[7]; W = r[8]; O = r[9]; OH = r[10]
    OW = r[11]; taps = r[12]; sc = r[13]; k = r[14]; m = r[15]
    T = (m + k - 1) * (m + k - 1)
    j, n = part_of(r)
    tab = carray(stack_buf(r, MR), (MR,))
    TW = (OW + m - 1) // m
    NT = (OH + m - 1) // m * TW
    c0, c1 = _chans(C, n, j)
    cp = c1 - c0
    tb, oxs, _, ov, sv, om, sm, odu, opatch, oz = _layout(T, C, O, H, W, OH, OW, cp, 0, 0, T * cp * O,
                                                          oscr + j * sc)
    fill_n(fptr(a, oz), cvt(a, 0.0), max(C, O) + 16)
    fill_n(fptr(a, odu), cvt(a, 0.0), T * cp * O)
    cur = -1
    for t0 in range(0, N * NT, tb):
        tn = min(tb, N * NT - t0)
        for tl in range(tn):
            img, h0, w0, src, ps, cur = _tile(a, t0 + tl, m, NT, TW, 0, ox, oxs, C, H, W, c0, cp, cur)
            tile_in(a, k, m, src, ps, H, W, oz, opatch, h0, w0, cp, ov + tl * sv)
            tile_dy(a, k, m, ody + img * OH * OW * O, OH, OW, O, oz, opatch, h0, w0, om + tl * sm)
        _gemms(a, tab, T, ov, cp, 1, sv, tn, om, O, sm, odu, cp * O, O, cp, O, 1)    # dU[k] += V[:, k]^T @ Z[:, k]
    _dweights(a, k, m, odu, odw, C, O, c0, cp, taps)
