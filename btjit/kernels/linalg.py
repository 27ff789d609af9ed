# Linear-algebra tape kernels: batched (optionally broadcast) row-major matmul through direct BLAS
# (sgemm for float32 arenas, dgemm for float64) via btjit.kernels.common.gemm.
from numba import carray, njit, prange

from btjit.kernels.common import FM, FM_PAR, gemm, stack_buf

WT_MAX = 16384       # floats of the largest B a B^T product copies transposed onto the stack (64 KB)
COPY_MIN_ROWS = 64   # ... and the fewest rows of C it does that for (at 8 rows the copy costs 2x the GEMM)


@njit(**FM)
def k_matmul(a, ia, r):
    """Batched matmul: C_i (M,N) = op(A_i) @ op(B_i)  (+ C_i if beta == 1)  for i in range(nbatch).

    r = [op, oA, oB, oC, nbatch, M, N, K, sA, sB, sC, ta, tb, beta, oscratch, oconst, obias, nparts]
      A_i at a[oA + i*sA]: stored row-major (M,K) if ta == 0, else stored (K,M) and used transposed.
      B_i at a[oB + i*sB]: stored row-major (K,N) if tb == 0, else stored (N,K) and used transposed.
      C_i at a[oC + i*sC], row-major (M,N). sA / sB may be 0 (operand broadcast over the batch).
      beta: 0 -> overwrite C, 1 -> accumulate into C.
      oscratch: offset in ia of 8 * nparts free int32 slots (BLAS int/char arguments).
      oconst: offset in a with a[oconst] == 1.0 and a[oconst+1] == 0.0 (alpha / beta values).
      obias: if > 0, offset of a bias (N,): every row of C_i is first set to it, then accumulated into
             (a fused `x @ W + b`); 0 = no bias.
      nparts: each product is computed as nparts column (N >= M) or row blocks of C, one GEMM each --
              on one thread too, where OpenBLAS 0.3.30 handles some shapes much faster in halves (see
              ops.split_gemm); k_matmul_par runs the blocks on the thread pool.
    """
    nparts = r[17]
    for j in range(nparts):
        _matmul_part(a, ia, r, j, nparts)


@njit(**FM_PAR)
def k_matmul_par(a, ia, r):
    """k_matmul with the nparts blocks of every product on the thread pool, each a single-threaded GEMM: all
    parallelism goes through numba's one thread pool (OpenBLAS threads spinning beside it on the same
    cores cost 30x, measured). Same row as k_matmul."""
    nparts = r[17]
    for j in prange(nparts):
        _matmul_part(a, ia, r, j, nparts)


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
                r0 = ob if split_n else oB + i * sB
                Bs = a[r0:r0 + nr * K].reshape(nr, K)
                for k in range(K):
                    for c in range(nr):
                        wt[k * nr + c] = Bs[c, k]
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
