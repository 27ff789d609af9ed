"""Layout kernels: batched matrix transposes and zero-padded copies (graph/ops/layout.py's transpose and
slice_scatter, where they apply); a split row (common.part_of) computes its part of the matrices / planes as
one thread does.
  k_transpose  out[b] = in[b]^T for b < nb: (nb, rows, cols) -> (nb, cols, rows)
  k_pad        out (e0, e1, e2, e3) = zeros with in (d0, d1, d2, d3) at [s0:s0+d0, s1:s1+d1, s2:s2+d2,
               s3:s3+d3]: a padding (a slice_scatter with unit steps), each row of out written once
  k_copy       a strided 4-D copy (slices, concatenations, strided views made contiguous): k_strided's copy
               alone, which compiles in a tenth of k_strided's time (its binary ops' loops are not in it)
  k_argsort    the positions of the first K elements of each row of in (M, N) in sorted order, ascending or
               descending (desc), into the int arena: sort, argsort and topk (graph/ops/layout.py's argsort)
"""
from numba import njit

from btjit.kernels.common import FM, cvt, part_of, row, transpose


@row("oout oin nb rows cols")
@njit(**FM)
def k_transpose(a, ia, r):
    """out[b] = in[b]^T for b < nb, by common.transpose's 16 x 16 register tiles (the strided copy's element
    loops were 2-3x slower on a 512 x 128 weight)."""
    oout, oin, nb, rows, cols = r[1], r[2], r[3], r[4], r[5]
    j, n = part_of(r)
    for b in range(j * nb // n, (j + 1) * nb // n):
        transpose(a, oin + b * rows * cols, a, oout + b * rows * cols, rows, cols)


@njit(**FM)
def pad_part(a, r, u0, u1):
    """Rows (i0, i1) = divmod(u, e1) for u0 <= u < u1 of a k_pad row's output (each e2 x e3)."""
    oout, oin = r[1], r[2]
    e1, e2, e3, d0, d1, d2, d3, s0, s1, s2, s3 = r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13], r[14]
    z = cvt(a, 0.0)
    for u in range(u0, u1):
        j0, j1 = u // e1 - s0, u % e1 - s1
        inside = 0 <= j0 < d0 and 0 <= j1 < d1
        for i2 in range(e2):    # loops over whole views from 0 (LLVM makes them memset / memcpy: measured 2x
            o = oout + (u * e2 + i2) * e3           # the loops over index ranges of `a`)
            j2 = i2 - s2
            n = s3 if inside and 0 <= j2 < d2 else e3
            left = a[o:o + n]
            for k in range(n):
                left[k] = z
            if n < e3:
                src = oin + ((j0 * d1 + j1) * d2 + j2) * d3
                mid, x, right = a[o + s3:o + s3 + d3], a[src:src + d3], a[o + s3 + d3:o + e3]
                for k in range(d3):
                    mid[k] = x[k]
                for k in range(e3 - s3 - d3):
                    right[k] = z


@row("oout oin e0 e1 e2 e3 d0 d1 d2 d3 s0 s1 s2 s3")
@njit(**FM)
def k_pad(a, ia, r):
    """out (e0, e1, e2, e3) at oout = zeros, with in (d0, d1, d2, d3) at oin placed from (s0, s1, s2, s3)."""
    j, n = part_of(r)
    nu = r[3] * r[4]
    pad_part(a, r, j * nu // n, (j + 1) * nu // n)


@row("oo o1 n0 n1 n2 n3 so0 so1 so2 so3 p0 p1 p2 p3")
@njit(**FM)
def k_copy(a, ia, r):
    """a[oo + i.so] = a[o1 + i.p] over the 4-D index i < (n0, n1, n2, n3) (strides so / p in elements)."""
    oo, o1, n0, n1, n2, n3 = r[1], r[2], r[3], r[4], r[5], r[6]
    so0, so1, so2, so3, p0, p1, p2, p3 = r[7], r[8], r[9], r[10], r[11], r[12], r[13], r[14]
    for i0 in range(n0):
        for i1 in range(n1):
            for i2 in range(n2):
                bo = oo + i0 * so0 + i1 * so1 + i2 * so2
                b1 = o1 + i0 * p0 + i1 * p1 + i2 * p2
                if so3 == 1 and p3 == 1:            # contiguous runs: a vectorized copy
                    dst = a[bo:bo + n3]
                    src = a[b1:b1 + n3]
                    for i3 in range(n3):
                        dst[i3] = src[i3]
                else:
                    for i3 in range(n3):
                        a[bo + i3 * so3] = a[b1 + i3 * p3]


@njit(inline="always", **FM)
def _before(x, i, j, desc):
    """Whether x[i] comes before x[j]: the smaller (the larger if desc) first, NaN as the largest value, the lower
    position first among equal values (a total order: the sort is stable)."""
    xi, xj = x[i], x[j]
    ni, nj = xi != xi, xj != xj
    if ni or nj:
        return i < j if ni and nj else ni == desc
    if xi == xj:
        return i < j
    return (xi > xj) == desc


@njit(inline="always", **FM)
def _sift(x, h, k, end, desc):
    """Restore the heap h[:end] below slot k: each parent comes after its children (the root is the last)."""
    while True:
        c = 2 * k + 1
        if c >= end:
            return
        if c + 1 < end and _before(x, h[c], h[c + 1], desc):
            c += 1
        if _before(x, h[c], h[k], desc):
            return
        h[k], h[c] = h[c], h[k]
        k = c


@row("ox oout M N K desc")
@njit(**FM)
def k_argsort(a, ia, r):
    """ia[oout + m K + t] = the position in row m of in (M, N) at oout that comes t-th in sorted order (t < K <= N),
    ascending or descending (desc != 0); see _before for ties and NaN. A heap of the K first seen so far (its root
    the last of them): O(N log K), no scratch; then the heap sorted in place."""
    ox, oout, M, N, K, desc = r[1], r[2], r[3], r[4], r[5], r[6]
    j, n = part_of(r)
    d = desc != 0
    for m in range(j * M // n, (j + 1) * M // n):
        x = a[ox + m * N:ox + (m + 1) * N]
        h = ia[oout + m * K:oout + (m + 1) * K]
        for t in range(K):
            h[t] = t
        for t in range(K // 2 - 1, -1, -1):
            _sift(x, h, t, K, d)
        for i in range(K, N):
            if _before(x, i, h[0], d):
                h[0] = i
                _sift(x, h, 0, K, d)
        for end in range(K - 1, 0, -1):
            h[0], h[end] = h[end], h[0]
            _sift(x, h, 0, end, d)
