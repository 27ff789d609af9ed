# The register micro-kernel generator of the float32/float64 products (btjit/kernels/linalg.py) and the
# implicit-GEMM convolutions (btjit/kernels/convgemm.py): LLVM IR through numba intrinsics, `rows` rows of C
# by up to 48 columns held in vector registers over a loop on K, one instance per tile shape.
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from btjit.kernels.common import FM_FLAGS

MR = 8               # rows of C per micro-kernel call


def micro(widths, transposed=False, rows=MR, gathered=False):
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
    n1, s1, n2, s2, n3, s3, obias, ores, tst, relu); A(r, k) = a[oA + tab[r] + u*s1 + v*s2 + w*s3] for the step
    k = (u*n2 + v)*n3 + w of the loop nest u < n1, v < n2, w < n3 (tab: `rows` integer row offsets; no osum;
    tst > 0: C stored transposed, its column c at a[oC + c*tst]), B row k at b[oB + k*ldb] as above:
    a row of C is one output pixel or one tap of a kernel window, the steps run over the window or the
    pixels, and no patch matrix is ever written."""
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
            _, _, _, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, obias, ores, tst, relu = args
            osum = c(0)
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
        def micro(typingctx, a, b, tab, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, obias, ores, tst, relu):
            return types.void(a, b, tab, oA, oB, ldb, oC, ldc, n1, s1, n2, s2, n3, s3, obias, ores, tst, relu), impl
    else:
        @intrinsic
        def micro(typingctx, a, b, oA, sar, sak, oB, ldb, oC, ldc, K, obias, osum, ores, relu):
            return types.void(a, b, oA, sar, sak, oB, ldb, oC, ldc, K, obias, osum, ores, relu), impl
    return micro
