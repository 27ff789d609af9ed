# bf16 products (precision="bf16"): C = op(A) @ op(B) on the float32 arena with A and B rounded to bfloat16
# (nearest even) and the products summed in float32. Not the matrix units' tiles (AMX): the AVX512-BF16
# instruction VDPBF16PS, one 16-lane float32 accumulator += a pair of bf16 products per lane, where the CPU has
# it; elsewhere the same numbers from float32 FMAs on the rounded operands (a bf16 times a bf16 is exact in
# float32, so each FMA rounds once, as VDPBF16PS's halves do).
#
# Per group of column panels of C (NC columns; panels 48, 32 or 16 wide) and block of KB k-steps: B's block is
# rounded and packed onto the stack once as pairs (B[k, c], B[k+1, c]) in one int32 (the VNNI layout), then per
# block of MR rows A's block likewise (A[r, k], A[r, k+1]), once for all the group's panels, and the register
# micro-kernel runs MR x panel accumulators over the pairs (a later K block adds to C).
# Every entry of C is the same sequence of operations whichever thread computes its rows, so the split over
# the threads (a split row) is bitwise equal to one thread.
import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from btjit.kernels.common import FM, FM_FLAGS, f32_as_i32, part_of, row, stack_buf
from btjit.kernels.linalg import MR      # rows of C per micro-kernel call, as the float32 micro-kernels'

KB = 256            # k-steps per packed block
NC = 192            # columns of B packed at a time (KB / 2 x NC int32 pairs, 96 KB: in L2), as panels of 48, 32, 16
OBP = MR * KB // 2  # where B's pairs start in the stack workspace (A's pairs, MR x KB / 2, first)
TMP = OBP + KB // 2 * NC    # a B^T panel's pairs row-major, before they are transposed into B's place
WS = TMP + KB // 2 * 48
N_MIN = 16          # a panel is 16 columns at least: narrower products stay float32 (graph/ops/matmul.py)
KERNELS = ("k_matmul_bf16", "k_matmul_amx")    # the entries bf16 products run on


def has_dpbf16() -> bool:
    """Whether this CPU (as LLVM compiles for it) has VDPBF16PS (AVX512-BF16)."""
    return "+avx512bf16" in llvm.get_host_cpu_features().flatten().split(",")


def describe() -> str:
    """What a bf16 program's products on k_matmul_bf16 run on here, for prog.precision and the banner."""
    return "bf16 (AVX512-BF16 vdpbf16ps)" if has_dpbf16() else "bf16 (float32 FMAs on bf16-rounded operands)"


def vload(builder, data, off, vt):
    """The vector of type vt at data[off] (a pointer to its lanes' type, offset in lanes)."""
    return builder.load(builder.bitcast(builder.gep(data, [off]), vt.as_pointer()), align=4)


def splat(builder, x, vt):
    """x in every lane of a vector of type vt."""
    i64 = ir.IntType(64)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(i64, 0)),
                                  ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), vt.count),
                                                                             [0] * vt.count))


def halves(builder, v):
    """The two bf16 of each int32 pair lane of v as float32 vectors (low, high): the low shifted up, the high
    masked."""
    vi = v.type
    lo = builder.shl(v, ir.Constant(vi, [16] * vi.count))
    hi = builder.and_(v, ir.Constant(vi, [-65536] * vi.count))
    vf = ir.VectorType(ir.FloatType(), vi.count)
    return builder.bitcast(lo, vf), builder.bitcast(hi, vf)


def finish(builder, ad, v, oc, ores, orr, relu, skip, j):
    """Store 16 sums v as C's columns 16j .. 16j+15 at ad[oc]: plus the residual at ad[orr] where ores > 0,
    relu of that where relu > 0, and the columns before `skip` left as they are (another panel wrote them)."""
    i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
    vf, vi = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
    zero = ir.Constant(vf, None)
    acc = cgutils.alloca_once_value(builder, v)
    with builder.if_then(builder.icmp_signed(">", ores, ir.Constant(i64, 0))):
        builder.store(builder.fadd(builder.load(acc), vload(builder, ad, orr, vf), flags=FM_FLAGS), acc)
    with builder.if_then(builder.icmp_signed(">", relu, ir.Constant(i64, 0))):
        v = builder.load(acc)
        builder.store(builder.select(builder.fcmp_ordered(">", v, zero), v, zero), acc)
    out = builder.bitcast(builder.gep(ad, [oc]), vf.as_pointer())
    with builder.if_else(builder.icmp_signed(">", skip, ir.Constant(i64, 16 * j))) as (part, whole):
        with part:      # the last panel moved back to end at N: keep the columns before skip
            cols = ir.Constant(vi, list(range(16 * j, 16 * j + 16)))
            keep = builder.icmp_signed("<", cols, splat(builder, builder.trunc(skip, i32), vi))
            builder.store(builder.select(keep, builder.load(out, align=4), builder.load(acc)), out, align=4)
        with whole:
            builder.store(builder.load(acc), out, align=4)


def _micro(width):
    """Intrinsic micro(a, ws, sp, sr, obp, kp, oC, ldc, mrows, skip, init, obias, ores, relu): for r < mrows
    and skip <= c < width (columns before skip are stored unchanged: another panel computed them):
    C[oC + r*ldc + c] = init + sum_p A pair (ws[p*sp + r*sr]) . B pair (ws[obp + p*width + c]) for p < kp, where
    init is 0 (init 0), the bias row a[obias + c] (init 1) or C's entry (init 2: a later K block); with ores > 0
    the rows R[ores + r*ldc] are added as C is stored, with relu > 0 relu of that is stored."""
    nv = width // 16

    @intrinsic
    def micro(typingctx, a, ws, sp, sr, obp, kp, oC, ldc, mrows, skip, init, obias, ores, relu):
        def impl(context, builder, sig, args):
            ad = context.make_array(sig.args[0])(context, builder, args[0]).data
            wd = context.make_array(sig.args[1])(context, builder, args[1]).data
            _, _, sp, sr, obp, kp, oC, ldc, mrows, skip, init, obias, ores, relu = args
            i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
            vf, vi = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
            c = lambda x: ir.Constant(i64, x)  # noqa: E731
            zero = ir.Constant(vf, None)
            dp = has_dpbf16() and builder.module.declare_intrinsic(
                "llvm.x86.avx512bf16.dpbf16ps.512", fnty=ir.FunctionType(vf, [vf, vi, vi]))

            def crow(base, r, j):
                return builder.add(builder.add(base, builder.mul(c(r), ldc)), c(16 * j))

            def row_valid(r):
                return builder.icmp_signed(">", mrows, c(r))

            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(MR)]
            with builder.if_then(builder.icmp_signed("==", init, c(1))):
                bias = [vload(builder, ad, builder.add(obias, c(16 * j)), vf) for j in range(nv)]
                for r in range(MR):
                    for j in range(nv):
                        builder.store(bias[j], acc[r][j])
            with builder.if_then(builder.icmp_signed("==", init, c(2))):
                for r in range(MR):
                    with builder.if_then(row_valid(r)):
                        for j in range(nv):
                            builder.store(vload(builder, ad, crow(oC, r, j), vf), acc[r][j])

            with cgutils.for_range(builder, kp) as loop:
                p = loop.index
                bv = [vload(builder, wd, builder.add(builder.add(obp, builder.mul(p, c(width))), c(16 * j)), vi)
                      for j in range(nv)]
                if not dp:          # the pairs' halves as float32: the low bf16 shifted up, the high one masked
                    bh = [halves(builder, b) for b in bv]
                for r in range(MR):
                    x = builder.load(builder.gep(wd, [builder.add(builder.mul(p, sp), builder.mul(c(r), sr))]))
                    xv = splat(builder, x, vi)
                    if not dp:
                        xh = halves(builder, xv)
                    for j in range(nv):
                        s = builder.load(acc[r][j])
                        if dp:
                            s = builder.call(dp, [s, xv, bv[j]])
                        else:
                            for h in (1, 0):
                                s = builder.fadd(s, builder.fmul(xh[h], bh[j][h], flags=FM_FLAGS), flags=FM_FLAGS)
                        builder.store(s, acc[r][j])

            for r in range(MR):
                with builder.if_then(row_valid(r)):
                    for j in range(nv):
                        finish(builder, ad, builder.load(acc[r][j]), crow(oC, r, j), ores, crow(ores, r, j), relu,
                               skip, j)
            return context.get_dummy_value()
        i = types.int64
        return types.void(a, ws, i, i, i, i, i, i, i, i, i, i, i, i), impl
    return micro


_micro48, _micro32, _micro16 = _micro(48), _micro(32), _micro(16)


@njit(**FM)
def _bf16(x):
    """The bfloat16 nearest to the float32 x (ties to even), as the high 16 bits of its float32's bits, in an
    int64; a NaN stays a (quiet) NaN."""
    u = np.int64(f32_as_i32(x)) & 0xFFFFFFFF
    return (u >> 16) | 64 if (u & 0x7FFFFFFF) > 0x7F800000 else (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def _rounded(builder, u, k):
    """Float32 bits (an int32 vector) rounded to bf16 in the high half (ties to even; NaN stays NaN), the low
    half junk."""
    r = builder.add(builder.add(u, k(0x7FFF)), builder.and_(builder.lshr(u, k(16)), k(1)))
    nan = builder.icmp_unsigned(">", builder.and_(u, k(0x7FFFFFFF)), k(0x7F800000))
    return builder.select(nan, builder.or_(u, k(0x400000)), r)


def _pairs(width, adjacent, masked=False):
    """Intrinsic pairs(a, ws, o, src, s_k, both): ws[o + l] for l < width = the pair (bf16 of a[src + l],
    bf16 of a[src + s_k + l]) (the second zero unless both), or with adjacent the pair (bf16 of a[src + 2l],
    bf16 of a[src + 2l + 1]) (both unused; s_k unused, or with masked the number of floats to read: those
    past it are not read and pack as 0); vectors, the rounding as _bf16's."""
    @intrinsic
    def pairs(typingctx, a, ws, o, src, s_k, both):
        def impl(context, builder, sig, args):
            ad = context.make_array(sig.args[0])(context, builder, args[0]).data
            wd = context.make_array(sig.args[1])(context, builder, args[1]).data
            _, _, o, src, s_k, both = args
            i32 = ir.IntType(32)
            vi = ir.VectorType(i32, width)

            def load(off, n):
                vt = ir.VectorType(i32, n)
                ptr = builder.bitcast(builder.gep(ad, [off]), vt.as_pointer())
                if not masked:
                    return builder.load(ptr, align=4)
                name = f"llvm.masked.load.v{n}i32.p0"
                fn = builder.module.globals.get(name) or ir.Function(
                    builder.module, ir.FunctionType(vt, [vt.as_pointer(), i32, ir.VectorType(ir.IntType(1), n), vt]),
                    name)
                keep = builder.icmp_signed("<", ir.Constant(vt, list(range(n))),
                                           splat(builder, builder.trunc(s_k, i32), vt))
                return builder.call(fn, [ptr, ir.Constant(i32, 4), keep, ir.Constant(vt, None)])
            if adjacent:
                k2 = lambda x: ir.Constant(ir.VectorType(i32, 2 * width), [x] * 2 * width)  # noqa: E731
                r = _rounded(builder, load(src, 2 * width), k2)
                even = builder.shuffle_vector(r, r, ir.Constant(vi, list(range(0, 2 * width, 2))))
                odd = builder.shuffle_vector(r, r, ir.Constant(vi, list(range(1, 2 * width, 2))))
                lo, hi = even, odd
            else:
                k = lambda x: ir.Constant(vi, [x] * width)  # noqa: E731
                lo = _rounded(builder, load(src, width), k)
                hi = builder.select(builder.icmp_signed(">", both, ir.Constant(ir.IntType(64), 0)),
                                    _rounded(builder, load(builder.add(src, s_k), width), k), ir.Constant(vi, None))
            k = lambda x: ir.Constant(vi, [x] * width)  # noqa: E731
            pair = builder.or_(builder.lshr(lo, k(16)), builder.and_(hi, k(-65536)))
            builder.store(pair, builder.bitcast(builder.gep(wd, [o]), vi.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(a, ws, types.int64, types.int64, types.int64, types.int64), impl
    return pairs


_pairs16, _pairs8, _adjacent16 = _pairs(16, False), _pairs(8, False), _pairs(16, True)
_adjacent16_upto = _pairs(16, True, masked=True)


@njit(**FM)
def _pack(a, ws, o, src, s_lane, s_k, n_pairs, lanes, stride, k_left):
    """ws[o + p*stride + l] = the pair (bf16 of a[src + 2p*s_k + l*s_lane], bf16 of the next k's) for
    p < n_pairs, l < lanes; a k-step at k_left or past it (an odd block's last pair, AMX's whole tiles) is zero,
    and lanes from `lanes` to stride too."""
    if s_lane == 1 and lanes == stride and lanes % 8 == 0:     # contiguous lanes: 16 or 8 pairs at a time
        for p in range(n_pairs):
            both = 1 if 2 * p + 1 < k_left else 0
            if 2 * p >= k_left:                 # pairs past the block (AMX's whole tiles): zero
                for l in range(lanes):
                    ws[o + p * stride + l] = 0
                continue
            for l in range(0, lanes - 15, 16):
                _pairs16(a, ws, o + p * stride + l, src + 2 * p * s_k + l, s_k * both, both)
            if lanes % 16:
                _pairs8(a, ws, o + p * stride + lanes - 8, src + 2 * p * s_k + lanes - 8, s_k * both, both)
        return
    for p in range(n_pairs):
        lo = src + 2 * p * s_k
        if 2 * p + 1 < k_left:
            for l in range(lanes):
                ws[o + p * stride + l] = np.int32(_bf16(a[lo + l * s_lane]) | (_bf16(a[lo + s_k + l * s_lane]) << 16))
        elif 2 * p < k_left:
            for l in range(lanes):
                ws[o + p * stride + l] = np.int32(_bf16(a[lo + l * s_lane]))
        else:
            for l in range(lanes):
                ws[o + p * stride + l] = 0
        for l in range(lanes, stride):
            ws[o + p * stride + l] = 0


@njit(**FM)
def _pack_rows(a, ws, o, src, sar, n_pairs, rows, nrows, k_left):
    """Pairs of rows whose k-steps are adjacent (row-major A, or B^T's rows): ws[o + r*KB/2 + p] = the pair
    (bf16 of a[src + r*sar + 2p], of the next) for r < rows, p < n_pairs (16 pairs a time, the last 16 from a
    masked load: a K of 24 packed by scalars cost more than its bf16 products saved); rows from `rows` to nrows
    zero. Writes whole 16-pair groups (up to KB/2 a row: the pairs past n_pairs are zero)."""
    for r in range(nrows):
        if r >= rows:
            for p in range(n_pairs):
                ws[o + r * (KB // 2) + p] = 0
            continue
        full = k_left // 32 * 16
        for p in range(0, full, 16):
            _adjacent16(a, ws, o + r * (KB // 2) + p, src + r * sar + 2 * p, 0, 0)
        if 2 * full < k_left:
            _adjacent16_upto(a, ws, o + r * (KB // 2) + full, src + r * sar + 2 * full, k_left - 2 * full, 0)


@njit(**FM)
def _pack_bt(a, ws, o, src, K, n_pairs, w, k_left):
    """B's block of a B^T product (B (N, K) stored row-major, its rows' k-steps adjacent): packed row-major at
    TMP, then transposed into ws[o + p*w + c]."""
    _pack_rows(a, ws, TMP, src, K, n_pairs, w, w, k_left)
    for p in range(n_pairs):
        for c in range(w):
            ws[o + p * w + c] = ws[TMP + c * (KB // 2) + p]


@njit(**FM)
def _panel(N, c0):
    """(width, first column) of the panel of C from column c0: 48 wide, or 32 where 64 or 32-47 columns remain
    (N 128: 48 + 48 + 32), then 16; the last moved back to end at N (N >= 16)."""
    rem = N - c0
    w = 32 if rem == 64 or 32 <= rem < 48 else 48 if rem >= 48 else 16
    return w, min(c0, N - w)


@njit(**FM)
def _bf16_rows(a, ia, r, lo, m, b0, b1):
    """Rows lo .. lo+m of every product of a k_matmul_bf16 row: per group of panels (NC columns) and block
    of KB k-steps, B's block packed once, then per block of MR rows A's block packed once for all the panels."""
    oA = r[1]; oB = r[2]; oC = r[3]; M = r[5]; N = r[6]; K = r[7]; sA = r[8]; sB = r[9]
    sC = r[10]; ta = r[11]; tb = r[12]; obias = r[13]; ores = r[14]; relu = r[15]
    sar, sak = (1, M) if ta == 1 else (K, 1)          # A(i, k) = a[oA + i*sar + k*sak]
    sbk, sbc = (1, K) if tb == 1 else (N, 1)          # B(k, j) = a[oB + k*sbk + j*sbc]
    sp, sr = (MR, 1) if ta == 1 else (1, KB // 2)     # A's packed pair (row r, pair p) at ws[p*sp + r*sr]
    ws = carray(stack_buf(ia, WS), (WS,))
    for i in range(b0, b1):
        oa, ob, oc = oA + i * sA, oB + i * sB, oC + i * sC
        cs = 0
        while cs < N:
            ce = cs
            for k0 in range(0, K, KB):
                kb = min(KB, K - k0)
                kp = (kb + 1) // 2
                last = k0 + KB >= K                    # the residual and relu as the last block stores C
                rl = relu if last else 0
                init = 2 if k0 > 0 else (1 if obias > 0 else 0)
                c0, o = cs, OBP
                while c0 < N:                          # the group's panels, B's pairs one after another
                    w, cc = _panel(N, c0)
                    if c0 > cs and c0 - cs + w > NC:       # the same group for every K block
                        break
                    if tb == 1:
                        _pack_bt(a, ws, o, ob + k0 + cc * K, K, kp, w, kb)
                    else:
                        _pack(a, ws, o, ob + k0 * sbk + cc * sbc, sbc, sbk, kp, w, w, kb)
                    o += kp * w
                    c0 += w
                ce = c0
                for rb in range(lo, lo + m, MR):
                    mr = min(MR, lo + m - rb)
                    if ta == 1:
                        _pack(a, ws, 0, oa + rb * sar + k0 * sak, sar, sak, kp, mr, MR, kb)
                    else:
                        _pack_rows(a, ws, 0, oa + rb * sar + k0 * sak, sar, kp, mr, MR, kb)
                    c0, o = cs, OBP
                    while c0 < ce:
                        w, cc = _panel(N, c0)
                        ocr = oc + rb * N + cc
                        orr = ores + i * sC + rb * N + cc if ores > 0 and last else 0
                        ob_ = obias + cc
                        if w == 48:
                            _micro48(a, ws, sp, sr, o, kp, ocr, N, mr, c0 - cc, init, ob_, orr, rl)
                        elif w == 32:
                            _micro32(a, ws, sp, sr, o, kp, ocr, N, mr, c0 - cc, init, ob_, orr, rl)
                        else:
                            _micro16(a, ws, sp, sr, o, kp, ocr, N, mr, c0 - cc, init, ob_, orr, rl)
                        o += kp * w
                        c0 += w
            cs = ce


@row("oA oB oC nbatch M N K sA sB sC ta tb obias ores relu by")
@njit(**FM)
def k_matmul_bf16(a, ia, r):
    """Batched float32 matmul with bf16-rounded operands, float32 sums: C_i (M,N) = op(A_i) @ op(B_i)
    (+ bias) (+ R_i) (relu) for i < nbatch, overwriting C_i; arguments as k_matmul_micro's (ta, tb any; no
    column sums; a split row by 0 rows or 2 whole products). N >= N_MIN."""
    j, n = part_of(r)
    lo, m, b0, b1 = part(j, n, r[5], r[4], r[16], np.int64(MR))
    _bf16_rows(a, ia, r, lo, m, b0, b1)


@njit(**FM)
def part(j, nparts, M, nbatch, by, blk):
    """(first row, rows, first product, end product) of part j of nparts of a split bf16 product row: with
    by 2 whole products, else blocks of whole blk-row blocks of every product."""
    if by == 2:
        return np.int64(0), M, j * nbatch // nparts, (j + 1) * nbatch // nparts
    nblk = (M + blk - 1) // blk
    lo = j * nblk // nparts * blk
    hi = M if j == nparts - 1 else (j + 1) * nblk // nparts * blk
    return lo, hi - lo, np.int64(0), nbatch

