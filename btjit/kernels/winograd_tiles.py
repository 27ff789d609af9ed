"""The tile transforms of kernels/winograd.py's convolutions (Lavin and Gray, arXiv 1509.09308): an m x m output tile
from an input tile of n x n pixels, n = m + r - 1, T = n^2 rows, for r x r windows --
  F(2x2, 3x3): B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], A^T = [[1, 1, 1, 0], [0, 1, -1, -1]],
               written out element by element (_in3, _out3, _dy3);
  F(4x4, 3x3) and F(2x2, 5x5), n = 6: on the points 0, 1, -1, 2, -2 and infinity, one B^T = [[4, 0, -5, 0, 1, 0],
               [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0],
               [0, 4, 0, -5, 0, 1]]; A^T = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 1]] (m = 2) or [[1, 1, 1, 1, 1, 0],
               [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]] (m = 4); each 2-D transform two passes
               of its 1-D one (_bt; _at, _a; _at4, _a4): the columns from the arena into the stack buffer, then the
               rows out of it (_in6, _out6, _dy6).
The input tile B^T d B (tile_in), the products' A^T m A to outputs (tile_out), the output gradient's A dY A^T
(tile_dy). Every transform runs along rows of channels (pixel rows, channels inner) and through the one stack
buffer of its function (common.stack_buf: its loops load from the arena and store to the stack, or the reverse,
so they vectorize with no runtime alias checks)."""
from numba import carray, njit

from btjit.kernels.common import FM, copy_n, cvt, fptr, stack_buf
# F(4, 3)'s 1-D output transforms round as written: under FM's reassociation, numba's in-process code and the object
# code it caches (what other processes and exports run) rounded _at4's sums differently (1 ulp; znver4)
EXACT = dict(FM, fastmath=False)

WBUF = 8192       # elements of a stack buffer: a tile's T rows of up to WBUF / T channels


@njit(**FM)
def _in3(a, o, q, s, C, ov):
    """The 4x4 input tile whose pixel (i, j) is the row of C channels at o + i*s + j*q transformed, B^T d B, into
    its 16 rows of C at ov (row k at ov + k*C): made in a stack buffer, then copied in one pass."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    d00, d01, d02, d03 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    o += s
    d10, d11, d12, d13 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    o += s
    d20, d21, d22, d23 = fptr(a, o), fptr(a, o + q), fptr(a, o + 2 * q), fptr(a, o + 3 * q)
    o += s
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
def _out3(a, om, O, d, ds, ob, relu):
    """The 16 product rows of O at om (row k at om + k*O) of one tile to its 2x2 outputs, A^T m A + the bias row at
    ob [relu], output (i, j) stored at d + i*ds + j*O. The rows are read from a stack buffer's copy."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    copy_n(sb, fptr(a, om), 16 * O)
    y00, y01 = fptr(a, d), fptr(a, d + O)
    y10, y11 = fptr(a, d + ds), fptr(a, d + ds + O)
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


@njit(**FM)
def _dy3(a, o, q, s, O, ot):
    """The 2x2 output gradient (the row of O of pixel (i, j) at o + i*s + j*q) as its 16 rows A dY A^T of O at ot
    (row k at ot + k*O), made in a stack buffer."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    y00, y01, y10, y11 = fptr(a, o), fptr(a, o + q), fptr(a, o + s), fptr(a, o + s + q)
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
def _bt(d0, d1, d2, d3, d4, d5, k2, k4, k5):
    """B^T (n = 6) along a line of six."""
    e, f = d4 - d2, k2 * (d3 - d1)
    return (k4 * d0 - k5 * d2 + d4, d3 + d4 - k4 * (d1 + d2), d4 - d3 + k4 * (d1 - d2), e + f, e - f,
            k4 * d1 - k5 * d3 + d5)


@njit(**FM)
def _at(m0, m1, m2, m3, m4, m5, k2):
    """A^T of F(2, 5): six to two."""
    return m0 + m1 + m2 + m3 + m4, m1 - m2 + k2 * (m3 - m4) + m5


@njit(**FM)
def _a(y0, y1, k2):
    """A of F(2, 5): two to six (the adjoint of _at)."""
    f = k2 * y1
    return y0, y0 + y1, y0 - y1, y0 + f, y0 - f, y1


@njit(**EXACT)
def _at4(m0, m1, m2, m3, m4, m5, k2, k4, k8):
    """A^T of F(4, 3): six to four."""
    p, q, u, v = m1 + m2, m1 - m2, m3 + m4, m3 - m4
    return m0 + p + u, q + k2 * v, p + k4 * u, q + k8 * v + m5


@njit(**EXACT)
def _a4(y0, y1, y2, y3, k2, k4, k8):
    """A of F(4, 3): four to six (the adjoint of _at4)."""
    e, f, g, h = y0 + y2, y1 + y3, y0 + k4 * y2, k2 * y1 + k8 * y3
    return y0, e + f, e - f, g + h, g - h, y3


@njit(**FM)
def _in6(a, src, q, s, C, ov):
    """_in3 for n = 6: the 6x6 input tile's 36 rows B^T d B, columns into the stack buffer, then rows to ov."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    k2, k4, k5 = cvt(a, 2.0), cvt(a, 4.0), cvt(a, 5.0)
    for j in range(6):
        o = src + j * q
        d0, d1, d2, d3, d4, d5 = fptr(a, o), fptr(a, o + s), fptr(a, o + 2 * s), fptr(a, o + 3 * s), \
            fptr(a, o + 4 * s), fptr(a, o + 5 * s)
        t0, t1, t2, t3, t4, t5 = fptr(sb, j * C), fptr(sb, (6 + j) * C), fptr(sb, (12 + j) * C), \
            fptr(sb, (18 + j) * C), fptr(sb, (24 + j) * C), fptr(sb, (30 + j) * C)
        for c in range(C):
            t0[c], t1[c], t2[c], t3[c], t4[c], t5[c] = _bt(d0[c], d1[c], d2[c], d3[c], d4[c], d5[c], k2, k4, k5)
    for i in range(6):
        o = 6 * i * C
        s0, s1, s2, s3, s4, s5 = fptr(sb, o), fptr(sb, o + C), fptr(sb, o + 2 * C), fptr(sb, o + 3 * C), \
            fptr(sb, o + 4 * C), fptr(sb, o + 5 * C)
        o += ov
        v0, v1, v2, v3, v4, v5 = fptr(a, o), fptr(a, o + C), fptr(a, o + 2 * C), fptr(a, o + 3 * C), \
            fptr(a, o + 4 * C), fptr(a, o + 5 * C)
        for c in range(C):
            v0[c], v1[c], v2[c], v3[c], v4[c], v5[c] = _bt(s0[c], s1[c], s2[c], s3[c], s4[c], s5[c], k2, k4, k5)


@njit(**FM)
def _out6(a, om, O, d, ds, ob, relu, m):
    """_out3 for n = 6, m = 2 or 4: the 36 product rows' columns to m rows (A^T m) in the stack buffer (row i,
    column j at (i*6 + j)*O), then each of those to m outputs (+ bias [relu])."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    k2, k4, k8 = cvt(a, 2.0), cvt(a, 4.0), cvt(a, 8.0)
    for j in range(6):
        o = om + j * O
        m0, m1, m2, m3, m4, m5 = fptr(a, o), fptr(a, o + 6 * O), fptr(a, o + 12 * O), fptr(a, o + 18 * O), \
            fptr(a, o + 24 * O), fptr(a, o + 30 * O)
        u0, u1, u2, u3 = fptr(sb, j * O), fptr(sb, (6 + j) * O), fptr(sb, (12 + j) * O), fptr(sb, (18 + j) * O)
        if m == 2:
            for c in range(O):
                u0[c], u1[c] = _at(m0[c], m1[c], m2[c], m3[c], m4[c], m5[c], k2)
        else:
            for c in range(O):
                u0[c], u1[c], u2[c], u3[c] = _at4(m0[c], m1[c], m2[c], m3[c], m4[c], m5[c], k2, k4, k8)
    b = fptr(a, ob)
    z = cvt(a, 0.0)
    for i in range(m):
        o = 6 * i * O
        s0, s1, s2, s3, s4, s5 = fptr(sb, o), fptr(sb, o + O), fptr(sb, o + 2 * O), fptr(sb, o + 3 * O), \
            fptr(sb, o + 4 * O), fptr(sb, o + 5 * O)
        o = d + i * ds
        y0, y1, y2, y3 = fptr(a, o), fptr(a, o + O), fptr(a, o + 2 * O), fptr(a, o + 3 * O)
        if m == 2:
            for c in range(O):
                t0, t1 = _at(s0[c], s1[c], s2[c], s3[c], s4[c], s5[c], k2)
                t0, t1 = t0 + b[c], t1 + b[c]
                if relu:
                    t0, t1 = max(t0, z), max(t1, z)
                y0[c], y1[c] = t0, t1
        else:
            for c in range(O):
                t0, t1, t2, t3 = _at4(s0[c], s1[c], s2[c], s3[c], s4[c], s5[c], k2, k4, k8)
                t0, t1, t2, t3 = t0 + b[c], t1 + b[c], t2 + b[c], t3 + b[c]
                if relu:
                    t0, t1, t2, t3 = max(t0, z), max(t1, z), max(t2, z), max(t3, z)
                y0[c], y1[c], y2[c], y3[c] = t0, t1, t2, t3


@njit(**FM)
def _dy6(a, o, q, s, O, ot, m):
    """_dy3 for n = 6, m = 2 or 4: the m x m output gradient's 36 rows A dY A^T at ot (columns into the stack
    buffer, row i of column j at (i*m + j)*O, then rows)."""
    sb = carray(stack_buf(a, WBUF), (WBUF,))
    k2, k4, k8 = cvt(a, 2.0), cvt(a, 4.0), cvt(a, 8.0)
    for j in range(m):
        y0, y1, y2, y3 = fptr(a, o + j * q), fptr(a, o + s + j * q), fptr(a, o + 2 * s + j * q), \
            fptr(a, o + 3 * s + j * q)
        z0, z1, z2, z3, z4, z5 = fptr(sb, j * O), fptr(sb, (m + j) * O), fptr(sb, (2 * m + j) * O), \
            fptr(sb, (3 * m + j) * O), fptr(sb, (4 * m + j) * O), fptr(sb, (5 * m + j) * O)
        if m == 2:
            for c in range(O):
                z0[c], z1[c], z2[c], z3[c], z4[c], z5[c] = _a(y0[c], y1[c], k2)
        else:
            for c in range(O):
                z0[c], z1[c], z2[c], z3[c], z4[c], z5[c] = _a4(y0[c], y1[c], y2[c], y3[c], k2, k4, k8)
    for i in range(6):
        p0, p1, p2, p3 = fptr(sb, m * i * O), fptr(sb, (m * i + 1) * O), fptr(sb, (m * i + 2) * O), \
            fptr(sb, (m * i + 3) * O)
        o2 = ot + 6 * i * O
        z0, z1, z2, z3, z4, z5 = fptr(a, o2), fptr(a, o2 + O), fptr(a, o2 + 2 * O), fptr(a, o2 + 3 * O), \
            fptr(a, o2 + 4 * O), fptr(a, o2 + 5 * O)
        if m == 2:
            for c in range(O):
                z0[c], z1[c], z2[c], z3[c], z4[c], z5[c] = _a(p0[c], p1[c], k2)
        else:
            for c in range(O):
                z0[c], z1[c], z2[c], z3[c], z4[c], z5[c] = _a4(p0[c], p1[c], p2[c], p3[c], k2, k4, k8)


@njit(**FM)
def _gather(a, src, ps, H, W, oz, opatch, h0, w0, n, C):
    """The n x n pixels from (h0, w0) of the pixel rows at src (pixel (h, w) at src + (h*W + w)*ps, C channels) as
    n*n rows of C at opatch, zeros (the row at oz) outside H x W."""
    for k in range(n * n):
        h, w = h0 + k // n, w0 + k % n
        copy_n(fptr(a, opatch + k * C), fptr(a, src + (h * W + w) * ps if h < H and w < W else oz), C)


@njit(**FM)
def tile_in(a, r, m, src, ps, H, W, oz, opatch, h0, w0, C, ov):
    """The n x n input tile (n = m + r - 1) at pixel (h0, w0) of the pixel rows at src (pixel (h, w) at
    src + (h*W + w)*ps, C channels), B^T d B, as its T rows of C at ov (row k at ov + k*C); a tile over the edge
    first gathered at opatch (zeros outside H x W: the row at oz)."""
    n = m + r - 1
    if h0 + n > H or w0 + n > W:
        _gather(a, src, ps, H, W, oz, opatch, h0, w0, n, C)
        src, ps, W, h0, w0 = opatch, C, n, 0, 0
    o = src + (h0 * W + w0) * ps
    if n == 4:
        _in3(a, o, ps, W * ps, C, ov)
    else:
        _in6(a, o, ps, W * ps, C, ov)


@njit(**FM)
def tile_out(a, r, m, om, O, dst, OW, h0, w0, OH, ob, relu, opatch):
    """The T product rows of O at om (row k at om + k*O) of one tile to its m x m outputs, A^T m A + the bias row at
    ob [relu], stored as pixel rows at dst (pixel (h, w) at dst + (h*OW + w)*O); over the edge made at opatch first
    and only the pixels inside OH x OW stored."""
    edge = h0 + m > OH or w0 + m > OW
    d, ds = (opatch, m * O) if edge else (dst + (h0 * OW + w0) * O, OW * O)
    if m + r - 1 == 4:
        _out3(a, om, O, d, ds, ob, relu)
    else:
        _out6(a, om, O, d, ds, ob, relu, m)
    if edge:
        for k in range(m * m):
            h, w = h0 + k // m, w0 + k % m
            if h < OH and w < OW:
                copy_n(fptr(a, dst + (h * OW + w) * O), fptr(a, opatch + k * O), O)


@njit(**FM)
def tile_dy(a, r, m, src, OH, OW, O, oz, opatch, h0, w0, ot):
    """The m x m output gradient at (h0, w0) of the pixel rows at src (zeros outside OH x OW: the row at oz) as its
    T rows A dY A^T of O at ot (row k at ot + k*O); over the edge first gathered at opatch."""
    if h0 + m > OH or w0 + m > OW:
        _gather(a, src, O, OH, OW, oz, opatch, h0, w0, m, O)
        o, s = opatch, m * O
    else:
        o, s = src + (h0 * OW + w0) * O, OW * O
    if m + r - 1 == 4:
        _dy3(a, o, O, s, O, ot)
    else:
        _dy6(a, o, O, s, O, ot, m)
