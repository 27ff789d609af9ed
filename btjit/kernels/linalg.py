# Linear-algebra tape kernels: batched (optionally broadcast) row-major matmul through direct BLAS
# (sgemm for float32 arenas, dgemm for float64) via btjit.kernels.common.gemm, and float32 products with a
# small B (the GPT's 24-96 wide layers) through register micro-kernels generated here: 8 rows x 48 columns
# of C in registers over a loop on K. They run at 50-58 G multiply-adds/s on 512-row products (sgemm: 32-52)
# and avoid sgemm's per-call work on 8-row ones (E6 batch 1: 0.1-0.4 us each).
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from btjit.kernels.common import FM, FM_FLAGS, FM_PAR, gemm, row, stack_buf, tile8, transpose

WT_MAX = 16384       # floats of the B (or block of B's rows) a B^T product copies transposed onto the stack (64 KB)
COPY_MIN_ROWS = 64   # ... and the fewest rows of C it does that for (at 8 rows the copy costs 2x the GEMM)
MR = 8               # rows of C per micro-kernel call
MICRO_B_MAX = 65536  # floats of B (K x N) a micro-kernel product may read: it is re-read per MR rows (L2)
KC_N_MAX = 512       # B wider than this is never read in blocks of rows (gemm_micro_kc: >= 128 rows each)
NT_MACS = 40_000     # B^T products on fewer rows than COPY_MIN_ROWS: micro-kernels up to this size


def _micro(widths, transposed=False, rows=MR, gathered=False):
    """Intrinsic: C[r, c] = init[c] + sum_k A(r, k) * B[k, c] for `rows` rows r and sum(widths) columns c, held
    in rows x len(widths) vector registers (`widths` lanes each) over a loop of K steps. A(r, k) is the scalar at
    a[oA + r*sar + k*sak] (A row-major: sar = lda, sak = 1; A^T: sar = 1, sak = lda); B row k at
    b[oB + k*ldb]; C row r at a[oC + r*ldc]; init = the row a[obias:] if obias > 0, else 0. With osum > 0
    the same loop also sums B's rows (sum_k B[k, c], the bias gradient of a dW = X^T dY product) into
    a[osum:]. With ores > 0 the rows of R at a[ores + r*ldc] are added to the result as it is stored (a
    residual connection, (init + A@B) + R); with relu > 0 the result stored is relu of that (x > 0 ? x : 0,
    as elementwise relu). transposed (widths (8,), rows 8 or 16; no residual, no relu): each 8 x 8 tile of
    the result is transposed in registers and C^T stored: C^T row c at a[oC + c*ldc], C^T column r at r (so
    `rows` rows of B give as many columns of an 8-row product).

    gathered (a convolution's implicit GEMM, btjit/kernels/conv.py): arguments (a, b, tab, oA, oB, ldb, oC, ldc,
    n1, s1, n2, s2, n3, s3, obias, ores, tst); A(r, k) = a[oA + tab[r] + u*s1 + v*s2 + w*s3] for the step
    k = (u*n2 + v)*n3 + w of the loop nest u < n1, v < n2, w < n3 (tab: `rows` integer row offsets; no osum,
    no relu; tst > 0: C stored transposed, its column c at a[oC + c*tst]), B row k at b[oB + k*ldb] as above: a row of C is one output pixel or one tap of a kernel
    window, the steps run over the window or the pixels, and no patch matrix is ever written."""
    assert not transposed or (widths == (8,) and rows % 8 == 0)
    assert not gathered or not transposed
    offs = [sum(widths[:j]) for j in range(len(widths))]

    def impl(context, builder, sig, args):
        ety = context.get_data_type(sig.args[0].dtype)
        vts = [ir.VectorType(ety, w) for w in widths]
        ad = context.make_array(sig.args[0])(context, builder, args[0]).data
        bd = context.make_array(sig.args[1])(context, builder, args[1]).data
        i64 = ir.IntType(64)
        c = lambda x: ir.Constant(i64, x)  # noqa: E731
        J = range(len(widths))
        if gathered:
            td = context.make_array(sig.args[2])(context, builder, args[2]).data
            _, _, _, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, obias, ores, tst = args
            osum, relu = c(0), c(0)
            tv = [builder.load(builder.gep(td, [c(r)])) for r in range(rows)]
            rowbase = [builder.add(oA, t if t.type.width == 64 else builder.sext(t, i64)) for t in tv]

            def steps(step):    # the loop nest: B's rows one after another, A's columns at u*s1 + v*s2 + w*s3
                with cgutils.for_range(builder, n1) as l1:
                    with cgutils.for_range(builder, n2) as l2:
                        uv = builder.add(builder.mul(l1.index, s1), builder.mul(l2.index, s2))
                        k0 = builder.mul(builder.add(builder.mul(l1.index, n2), l2.index), n3)
                        with cgutils.for_range(builder, n3) as l3:
                            col = builder.add(uv, builder.mul(l3.index, s3))
                            step(builder.add(oB, builder.mul(builder.add(k0, l3.index), ldb)),
                                 lambda r: builder.add(rowbase[r], col))
        else:
            _, _, oA, sar, sak, oB, ldb, oC, ldc, K, obias, osum, ores, relu = args

            def steps(step):
                with cgutils.for_range(builder, K) as loop:
                    k = loop.index
                    acol = builder.add(oA, builder.mul(k, sak))
                    step(builder.add(oB, builder.mul(k, ldb)), lambda r: builder.add(acol, builder.mul(c(r), sar)))

        def load(data, off, j):
            return builder.load(builder.bitcast(builder.gep(data, [builder.add(off, c(offs[j]))]),
                                                vts[j].as_pointer()), align=4)

        acc = [[cgutils.alloca_once(builder, vts[j]) for j in J] for _ in range(rows)]
        with builder.if_else(builder.icmp_signed(">", obias, c(0))) as (then, otherwise):
            with then:
                init = [load(ad, obias, j) for j in J]
                for r in range(rows):
                    for j in J:
                        builder.store(init[j], acc[r][j])
            with otherwise:
                for r in range(rows):
                    for j in J:
                        builder.store(ir.Constant(vts[j], None), acc[r][j])

        def k_loop(sums):
            def step(brow, xat):
                bv = [load(bd, brow, j) for j in J]
                for r in range(rows):
                    x = builder.load(builder.gep(ad, [xat(r)]))
                    for j in J:
                        w = widths[j]
                        undef = ir.Constant(vts[j], ir.Undefined)
                        xv = builder.shuffle_vector(builder.insert_element(undef, x, c(0)), undef,
                                                    ir.Constant(ir.VectorType(ir.IntType(32), w), [0] * w))
                        builder.store(builder.fadd(builder.load(acc[r][j]), builder.fmul(xv, bv[j], flags=FM_FLAGS),
                                                   flags=FM_FLAGS), acc[r][j])
                for j in J if sums else ():
                    builder.store(builder.fadd(builder.load(sums[j]), bv[j], flags=FM_FLAGS), sums[j])
            steps(step)

        sums = [cgutils.alloca_once(builder, vts[j]) for j in J]
        with builder.if_else(builder.icmp_signed(">", osum, c(0))) as (then, otherwise):
            with then:
                for j in J:
                    builder.store(ir.Constant(vts[j], None), sums[j])
                k_loop(sums)
                for j in J:
                    builder.store(builder.load(sums[j]), builder.bitcast(
                        builder.gep(ad, [builder.add(osum, c(offs[j]))]), vts[j].as_pointer()), align=4)
            with otherwise:
                k_loop(None)
        if not transposed:
            with builder.if_then(builder.icmp_signed(">", ores, c(0))):
                for r in range(rows):
                    rrow = builder.add(ores, builder.mul(c(r), ldc))
                    for j in J:
                        builder.store(builder.fadd(builder.load(acc[r][j]), load(ad, rrow, j), flags=FM_FLAGS),
                                      acc[r][j])
            with builder.if_then(builder.icmp_signed(">", relu, c(0))):
                for r in range(rows):
                    for j in J:
                        x, zero = builder.load(acc[r][j]), ir.Constant(vts[j], None)
                        builder.store(builder.select(builder.fcmp_ordered(">", x, zero), x, zero), acc[r][j])
        out = [[builder.load(acc[r][j]) for j in J] for r in range(rows)]
        v8 = ir.VectorType(ety, 8)
        mask = [ir.Constant(ir.VectorType(ir.IntType(32), 8), [x for k in h for x in (k, k + 8)])
                for h in (range(4), range(4, 8))]

        def store8x8(tile, at):     # 3 rounds of perfect shuffles of rows k and k+4 transpose an 8 x 8 tile
            for _ in range(3):
                tile = [builder.shuffle_vector(tile[k // 2], tile[k // 2 + 4], mask[k % 2]) for k in range(8)]
            for r in range(8):
                builder.store(tile[r], builder.bitcast(builder.gep(ad, [at(r)]), v8.as_pointer()), align=4)

        def store_rows():
            for r in range(rows):
                crow = builder.add(oC, builder.mul(c(r), ldc))
                for j in J:
                    builder.store(out[r][j], builder.bitcast(builder.gep(ad, [builder.add(crow, c(offs[j]))]),
                                                             vts[j].as_pointer()), align=4)
        if transposed:              # rows g..g+7 become columns g..g+7 of C's 8 rows
            for g in range(0, rows, 8):
                store8x8([o[0] for o in out[g:g + 8]], lambda r: builder.add(builder.add(oC, c(g)), builder.mul(c(r), ldc)))
        elif gathered:              # tst > 0: C^T stored, its row c (C's column) at oC + c*tst
            with builder.if_else(builder.icmp_signed(">", tst, c(0))) as (then, otherwise):
                with then:
                    for j in J:
                        for h in range(widths[j] // 8):
                            sel = ir.Constant(ir.VectorType(ir.IntType(32), 8), list(range(8 * h, 8 * h + 8)))
                            tile = [builder.shuffle_vector(out[r][j], out[r][j], sel) for r in range(8)]
                            store8x8(tile, lambda k: builder.add(oC, builder.mul(c(offs[j] + 8 * h + k), tst)))
                with otherwise:
                    store_rows()
        else:
            store_rows()
        return context.get_dummy_value()

    if gathered:
        @intrinsic
        def micro(typingctx, a, b, tab, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, obias, ores, tst):
            return types.void(a, b, tab, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, obias, ores, tst), impl
    else:
        @intrinsic
        def micro(typingctx, a, b, oA, sar, sak, oB, ldb, oC, ldc, K, obias, osum, ores, relu):
            return types.void(a, b, oA, sar, sak, oB, ldb, oC, ldc, K, obias, osum, ores, relu), impl
    return micro


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
              ops.split_gemm); k_matmul_par runs the blocks on the thread pool.
    """
    nparts = r[17]
    for j in range(nparts):
        _matmul_part(a, ia, r, j, nparts)


@row("oA oB oC nbatch M N K sA sB sC ta tb obias osum ores relu kc")
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
    """
    _micro_rows(a, r, 0, r[5])


@row("oA oB oC nbatch M N K sA sB sC ta tb obias osum ores relu kc nparts")
@njit(**FM_PAR)
def k_matmul_micro_par(a, ia, r):
    """k_matmul_micro with C's rows cut into nparts blocks (multiples of MR rows; nparts <= M / MR) computed on the
    thread pool, or with nparts < 0 its columns into -nparts blocks (multiples of 16, each >= 16; tb 0): each
    thread then reads only its part of a large B, where row blocks would each read all of it. Every entry of C
    is the same sequence of multiply-adds as on one thread, so the result is bitwise equal to
    k_matmul_micro's; each block transposes its own stack copy of B where one is used."""
    M = r[5]; N = r[6]; nparts = r[18]
    if nparts < 0:
        ncol = N // 16
        for j in prange(-nparts):
            lo = j * ncol // -nparts * 16
            hi = N if j == -nparts - 1 else (j + 1) * ncol // -nparts * 16
            _micro_cols(a, r, lo, hi - lo)
        return
    nblk = M // MR
    for j in prange(nparts):               # nparts <= M // MR (the lowering's): every block has >= MR rows
        lo = j * nblk // nparts * MR
        hi = M if j == nparts - 1 else (j + 1) * nblk // nparts * MR
        _micro_rows(a, r, lo, hi - lo)


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
def _micro_rows(a, r, lo, m):
    """Rows lo .. lo+m of every product of a k_matmul_micro row (m >= MR)."""
    oA = r[1]; oB = r[2]; oC = r[3]; nbatch = r[4]; M = r[5]; N = r[6]; K = r[7]; sA = r[8]; sB = r[9]
    sC = r[10]; ta = r[11]; tb = r[12]; obias = r[13]; osum = r[14]; ores = r[15]; relu = r[16]; kc = r[17]
    lda = M if ta == 1 else K
    sar, sak = (1, lda) if ta == 1 else (lda, 1)
    wt = carray(stack_buf(a, WT_MAX), (WT_MAX,))
    one, zero = np.int64(1), np.int64(0)     # not literals: a literal argument compiles gemm_micro a second time
    osum = osum if lo == 0 else 0            # B's column sums: once, by the block with the first rows
    for i in range(nbatch):
        oa, ob, oc = oA + i * sA + lo * sar, oB + i * sB, oC + i * sC + lo * N
        if tb == 0:
            gemm_micro_kc(a, oa, sar, sak, ob, oc, m, N, K, kc, obias, osum,
                          ores + i * sC + lo * N if ores > 0 else 0, relu, N)
        elif M < COPY_MIN_ROWS:
            gemm_micro_nt(a, oa, K, ob, K, oc, N, m, N, K, wt)
        elif N * K <= WT_MAX:
            if i == 0 or sB != 0:
                transpose(a, ob, wt, 0, N, K)
            gemm_micro(a, wt, oa, K, one, zero, N, oc, N, m, N, K, zero, zero, zero, zero)
        else:                   # column blocks of C: nc rows of B at a time transposed onto the stack
            nc = WT_MAX // K // 16 * 16
            for n in range(0, N, nc):
                n0 = min(n, N - nc)
                transpose(a, ob + n0 * K, wt, 0, nc, K)
                gemm_micro(a, wt, oa, K, one, zero, nc, oc + n0, N, m, nc, K, zero, zero, zero, zero)


@row("oA oB oC nbatch M N K sA sB sC ta tb beta osc oconst obias nparts")
@njit(**FM_PAR)
def k_matmul_par(a, ia, r):
    """k_matmul with the nparts blocks of every product on the thread pool, each a single-threaded GEMM: all
    parallelism goes through numba's one thread pool (OpenBLAS threads spinning beside it on the same
    cores cost 30x, measured). Same row as k_matmul."""
    nparts = r[17]
    for j in prange(nparts):
        _matmul_part(a, ia, r, j, nparts)


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
