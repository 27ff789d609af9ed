# Linear-algebra tape kernels: batched (optionally broadcast) row-major matmul through direct BLAS
# (sgemm for float32 arenas, dgemm for float64) via btjit.kernels.common.gemm, and float32 products with a
# small B (the GPT's 24-96 wide layers) through the register micro-kernels of btjit/kernels/micro.py: 8 rows
# x 48 columns of C in registers over a loop on K. They run at 50-58 G multiply-adds/s on 512-row products (sgemm: 32-52)
# and avoid sgemm's per-call work on 8-row ones (E6 batch 1: 0.1-0.4 us each).
import numpy as np
from numba import carray, njit

from btjit.kernels.common import FM, gemm, part_of, row, stack_buf, tile8, transpose
from btjit.kernels.micro import MR, micro as _micro

WT_MAX = 16384       # floats of the B (or block of B's rows) a B^T product copies transposed onto the stack (64 KB)
COPY_MIN_ROWS = 64   # ... and the fewest rows of C it does that for (at 8 rows the copy costs 2x the GEMM)
MICRO_B_MAX = 65536  # floats of B (K x N) a micro-kernel product may read: it is re-read per MR rows (L2)
KC_N_MAX = 512       # B wider than this is never read in blocks of rows (gemm_micro_kc: >= 128 rows each)
NT_MACS = 40_000     # B^T products on fewer rows than COPY_MIN_ROWS: micro-kernels up to this size


_micro48, _micro32, _micro24 = _micro((16, 16, 16)), _micro((16, 16)), _micro((16, 8))
_micro16, _micro8 = _micro((16,)), _micro((8,))
_micro8t, _micro16t = _micro((8,), True), _micro((8,), True, 16)


@njit(**FM)
def gemm_micro(a, b, oA, sar, sak, oB, ldb, oC, ldc, M, N, K, obias, osum, ores, relu):
    """C (M, N) = [bias +] A @ B by micro-kernels (M, N >= 8; A as in _micro, B (K, N) row-major with row
    stride ldb in b, C with row stride ldc in a; obias: the bias row's offset, 0 = none; osum > 0: also
    a[osum:osum+N] = B's column sums, in the first row block; ores > 0: plus R (M, N) at a[ores:], row stride
    ldc; relu > 0: relu of all that). Blocks of MR rows and of 48 columns, 32 where 64 or 32-47 remain (N 128:
    48 + 48 + 32, not 48 + 48 + 24 + 8: 4-13% faster, measured), then 24 / 16 / 8; the last block of each is
    moved back to end at M / N, recomputing a few entries that are stored again unchanged, so there are no
    edge loops (overwrite only)."""
    for i in range(0, M, MR):
        r0 = min(i, M - MR)
        oa, oc, orr = oA + r0 * sar, oC + r0 * ldc, ores + r0 * ldc
        c0 = 0
        while c0 < N:
            rem = N - c0
            w = 32 if rem == 64 or 32 <= rem < 48 else 48 if rem >= 48 else 24 if rem >= 24 else 16 if rem >= 16 else 8
            c0 = min(c0, N - w)
            ob = obias + c0 if obias > 0 else 0
            os = osum + c0 if osum > 0 and i == 0 else 0
            orc = orr + c0 if ores > 0 else 0
            if w == 48:
                _micro48(a, b, oa, sar, sak, oB + c0, ldb, oc + c0, ldc, K, ob, os, orc, relu)
            elif w == 32:
                _micro32(a, b, oa, sar, sak, oB + c0, ldb, oc + c0, ldc, K, ob, os, orc, relu)
            elif w == 24:
                _micro24(a, b, oa, sar, sak, oB + c0, ldb, oc + c0, ldc, K, ob, os, orc, relu)
            elif w == 16:
                _micro16(a, b, oa, sar, sak, oB + c0, ldb, oc + c0, ldc, K, ob, os, orc, relu)
            else:
                _micro8(a, b, oa, sar, sak, oB + c0, ldb, oc + c0, ldc, K, ob, os, orc, relu)
            c0 += w


@njit(**FM)
def gemm_micro_kc(a, oA, sar, sak, oB, oC, M, N, K, kc, obias, osum, ores, relu, ld):
    """gemm_micro on operands in the arena (B and C with row stride ld) in blocks of kc rows of B: each block of
    B stays in cache while every row block of C passes over it (in one, a B beyond L2 is read again from
    memory for every MR rows of C). The first block writes C (bias, the residual), the others add to it (C as
    the residual), the last applies relu; B's column sums (osum) are summed block by block. kc < K only where
    M and N are multiples of 8 (graph/ops/matmul.py): gemm_micro's last row / column block, moved back to end
    at M / N, would add its overlap twice."""
    if M <= 0 or N <= 0:                # an empty part of a split row: nothing, not even B's column sums
        return
    for k0 in range(0, K, kc):
        k1 = min(K, k0 + kc)
        gemm_micro(a, a, oA + k0 * sak, sar, sak, oB + k0 * ld, ld, oC, ld, M, N, k1 - k0, obias if k0 == 0 else 0,
                   osum if k0 == 0 else 0, ores if k0 == 0 else oC, relu if k1 == K else 0)
        if k0 > 0 and osum > 0:
            s = a[osum:osum + N]
            for k in range(k0, k1):
                b = a[oB + k * ld:oB + k * ld + N]
                for j in range(N):
                    s[j] += b[j]


@row("oA oB oC nbatch M N K sA sB sC ta tb beta osc oconst obias nparts")
@njit(**FM)
def k_matmul(a, ia, r):
    """Batched matmul: C_i (M,N) = op(A_i) @ op(B_i)  (+ C_i if beta == 1)  for i in range(nbatch).

      A_i at a[oA + i*sA]: stored row-major (M,K) if ta == 0, else stored (K,M) and used transposed.
      B_i at a[oB + i*sB]: stored row-major (K,N) if tb == 0, else stored (N,K) and used transposed.
      C_i at a[oC + i*sC], row-major (M,N). sA / sB may be 0 (operand broadcast over the batch).
      beta: 0 -> overwrite C, 1 -> accumulate into C.
      osc: offset in ia of 8 * nparts free int32 slots (BLAS int/char arguments).
      oconst: offset in a with a[oconst] == 1.0 and a[oconst+1] == 0.0 (alpha / beta values).
      obias: if > 0, offset of a bias (N,): every row of C_i is first set to it, then accumulated into
             (a fused `x @ W + b`); 0 = no bias.
      nparts: each product is computed as nparts column (N >= M) or row blocks of C, one GEMM each --
              on one thread too, where OpenBLAS 0.3.30 handles some shapes much faster in halves (see
              ops.split_gemm); a split row (as many parts) runs them on the thread pool.
    """
    nparts = r[17]
    j, n = part_of(r)                       # a split row: part j of n computes blocks j, j + n, ... (n = nparts)
    for p in range(j, nparts, n):
        _matmul_part(a, ia, r, p, nparts)


@row("oA oB oC nbatch M N K sA sB sC ta tb obias osum ores relu kc by")
@njit(**FM)
def k_matmul_micro(a, ia, r):
    """Batched float32 matmul by the micro-kernels below (ops.micro_gemm says which products):
    C_i (M,N) = op(A_i) @ op(B_i) (+ bias) for i in range(nbatch), overwriting C_i.

    Arguments as in k_matmul (ta and tb never both 1; a B^T product has no bias, residual or relu); ores > 0:
    R_i (M, N) at a[ores + i*sC] is added, C_i = (bias + A_i @ B_i) + R_i, a linear with its residual
    connection; relu > 0: C_i = relu(...), a linear with its activation. kc: B read in blocks of kc rows
    (gemm_micro_kc; kc >= K: at once). M, N >= 8. B^T products from
    COPY_MIN_ROWS rows run on a transposed stack copy of B (N*K <= WT_MAX; above, of nc = WT_MAX/K rounded down to
    16 of its rows at a time, K <= WT_MAX/16), below on gemm_micro_nt. osum > 0
    (nbatch 1, tb 0): also a[osum:osum+N] = the column sums of B (ops' matmul_colsum: dW = X^T dY and db
    together).
    A split row's part j of n (bitwise equal to one thread: every entry of C is the same sequence of multiply-adds;
    each part transposes its own stack copy of B where one is used): by 0, blocks of whole MR-row blocks of C
    (n <= M / MR); by 1, its columns in blocks of multiples of 16 (each >= 16; tb 0): each thread then reads only its
    part of a large B, where row blocks would each read all of it; by 2, whole products (no B read by two threads).
    """
    j, n = part_of(r)
    nbatch = r[4]; M = r[5]; N = r[6]; by = r[18]
    if by == 2:
        _micro_rows(a, r, np.int64(0), M, j * nbatch // n, (j + 1) * nbatch // n)
    elif by == 1:
        ncol = N // 16
        lo = j * ncol // n * 16
        _micro_cols(a, r, lo, (N if j == n - 1 else (j + 1) * ncol // n * 16) - lo)
    else:
        nblk = M // MR
        lo = j * nblk // n * MR
        _micro_rows(a, r, lo, (M if j == n - 1 else (j + 1) * nblk // n * MR) - lo, np.int64(0), nbatch)


@njit(**FM)
def _micro_cols(a, r, lo, n):
    """Columns lo .. lo+n of every product of a k_matmul_micro row whose B is not transposed (n >= 8)."""
    oA = r[1]; oB = r[2]; oC = r[3]; nbatch = r[4]; M = r[5]; N = r[6]; K = r[7]; sA = r[8]; sB = r[9]
    sC = r[10]; ta = r[11]; obias = r[13]; osum = r[14]; ores = r[15]; relu = r[16]; kc = r[17]
    lda = M if ta == 1 else K
    sar, sak = (1, lda) if ta == 1 else (lda, 1)
    for i in range(nbatch):
        gemm_micro_kc(a, oA + i * sA, sar, sak, oB + i * sB + lo, oC + i * sC + lo, M, n, K, kc,
                      obias + lo if obias > 0 else 0, osum + lo if osum > 0 else 0,
                      ores + i * sC + lo if ores > 0 else 0, relu, N)


@njit(**FM)
def _micro_rows(a, r, lo, m, b0, b1):
    """Rows lo .. lo+m of products b0 .. b1-1 of a k_matmul_micro row (m >= MR)."""
    oA = r[1]; oB = r[2]; oC = r[3]; M = r[5]; N = r[6]; K = r[7]; sA = r[8]; sB = r[9]
    sC = r[10]; ta = r[11]; tb = r[12]; obias = r[13]; osum = r[14]; ores = r[15]; relu = r[16]; kc = r[17]
    lda = M if ta == 1 else K
    sar, sak = (1, lda) if ta == 1 else (lda, 1)
    wt = carray(stack_buf(a, WT_MAX), (WT_MAX,))
    one, zero = np.int64(1), np.int64(0)     # not literals: a literal argument compiles gemm_micro a second time
    osum = osum if lo == 0 else 0            # B's column sums: once, by the block with the first rows
    for i in range(b0, b1):
        oa, ob, oc = oA + i * sA + lo * sar, oB + i * sB, oC + i * sC + lo * N
        if tb == 0:
            gemm_micro_kc(a, oa, sar, sak, ob, oc, m, N, K, kc, obias, osum,
                          ores + i * sC + lo * N if ores > 0 else 0, relu, N)
        elif M < COPY_MIN_ROWS:
            gemm_micro_nt(a, oa, K, ob, K, oc, N, m, N, K, wt)
        elif N * K <= WT_MAX:
            if i == b0 or sB != 0:
                transpose(a, ob, wt, 0, N, K)
            gemm_micro(a, wt, oa, K, one, zero, N, oc, N, m, N, K, zero, zero, zero, zero)
        else:                   # column blocks of C: nc rows of B at a time transposed onto the stack
            nc = WT_MAX // K // 16 * 16
            for n in range(0, N, nc):
                n0 = min(n, N - nc)
                transpose(a, ob + n0 * K, wt, 0, nc, K)
                gemm_micro(a, wt, oa, K, one, zero, nc, oc + n0, N, m, nc, K, zero, zero, zero, zero)


@njit(**FM)
def gemm_micro_nt(a, oA, lda, oB, ldb, oC, ldc, M, N, K, wt):
    """C (M, N) = A @ B^T by micro-kernels (M, N >= 8; A (M, K) and B (N, K) row-major in a): per block of MR
    rows of A, its transpose goes to the stack buffer wt (K x 8, by 8 x 8 register tiles) and C^T = B @ that
    is computed for 16 (then 8) rows of B at a time and stored transposed. Blocks move back to end at M / N
    as in gemm_micro (overwrite only)."""
    for i in range(0, M, MR):
        m0 = min(i, M - MR)
        oa = oA + m0 * lda
        if K >= 8:                      # the last tile moved back to end at K
            for k in range(0, K, 8):
                k0 = min(k, K - 8)
                tile8(a, oa + k0, lda, wt, k0 * MR, MR)
        else:
            for k in range(K):
                for m in range(MR):
                    wt[k * MR + m] = a[oa + m * lda + k]
        j = 0
        while j < N:                    # 16 rows of B at a time, then 8 (the last moved back to end at N)
            if N - j >= 16:
                _micro16t(a, wt, oB + j * ldb, ldb, 1, 0, MR, oC + m0 * ldc + j, ldc, K, 0, 0, 0, 0)
                j += 16
            else:
                n0 = min(j, N - 8)
                _micro8t(a, wt, oB + n0 * ldb, ldb, 1, 0, MR, oC + m0 * ldc + n0, ldc, K, 0, 0, 0, 0)
                j += 8


@njit(**FM)
def _matmul_part(a, ia, r, j, nparts):
    """Block j of nparts of every product of a k_matmul row."""
    oA = r[1]; oB = r[2]; oC = r[3]; nbatch = r[4]; M = r[5]; N = r[6]; K = r[7]; sA = r[8]; sB = r[9]
    sC = r[10]; ta = r[11]; tb = r[12]; beta = r[13]; osc = r[14]; oconst = r[15]; obias = r[16]
    lda = M if ta == 1 else K
    ldb = K if tb == 1 else N
    split_n = N >= M
    size = N if split_n else M
    blk = (size + nparts - 1) // nparts
    lo = j * blk
    n = min(blk, size - lo)
    if n <= 0:
        return
    sc = osc + 8 * j
    wt = carray(stack_buf(a, WT_MAX), (WT_MAX,))
    for i in range(nbatch):
        oa, ob, oc = oA + i * sA, oB + i * sB, oC + i * sC
        if split_n:       # C[:, lo:lo+n] = op(A) @ op(B)[:, lo:lo+n]
            ob += lo * K if tb == 1 else lo
            oc += lo
            rows, cols = M, n
        else:             # C[lo:lo+n, :] = op(A)[lo:lo+n, :] @ op(B)
            oa += lo if ta == 1 else lo * K
            oc += lo * N
            rows, cols = n, N
        bt = beta
        copy = tb == 1 and N * K <= WT_MAX and rows >= COPY_MIN_ROWS
        if copy:                          # B^T products (dX = dY @ W^T): on a transposed stack copy of B's
            nr = cols if split_n else N     # rows in use OpenBLAS runs 15-25% faster (E6b64: 31 -> 24 us)
            if i == 0 or sB != 0:
                transpose(a, ob if split_n else oB + i * sB, wt, 0, nr, K)
        if obias > 0:     # row slices, not flat a[i] indexing (its wraparound checks cost 3x)
            bias = a[obias + (lo if split_n else 0):obias + (lo if split_n else 0) + cols]
            for m in range(rows):
                crow = a[oc + m * N:oc + m * N + cols]
                for c in range(cols):
                    crow[c] = bias[c]
            bt = 1
        if copy:
            gemm(a, ia, sc, oconst, ta, 0, rows, cols, K, oa, lda, wt, 0, nr, oc, N, bt)
        else:
            gemm(a, ia, sc, oconst, ta, tb, rows, cols, K, oa, lda, a, ob, ldb, oc, N, bt)
