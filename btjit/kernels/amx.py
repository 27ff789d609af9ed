# bf16 products on the matrix units (AMX): k_matmul_bf16's numbers -- A and B rounded to bfloat16 (nearest
# even), float32 sums -- from TDPBF16PS, which adds a 16 x 32 bf16 tile of A times a 32 x 16 tile of B (B in
# the VNNI pair layout, as bf16.py packs it) into a 16 x 16 float32 tile of C.
#
# The blocking is bf16.py's: per group of column panels (NC columns, panels of 32 or 16) and block of KB
# k-steps, B's block packed once onto the stack as pairs; per block of MB = 32 rows, A's block packed row-major
# (a tile row is 16 pairs, 64 bytes); the block's pairs padded with zeros to whole tiles of 16. The micro-kernel
# holds C's 2 x 2 (or 1 x 2, 2 x 1, 1 x 1) tiles: tiles 0-3 C, 4-5 A, 6-7 B, all 16 rows of 64 bytes
# (configured once per call of the rows function, released at its end); it stores C's tiles to the stack, and
# the bias or C's earlier sum, the residual, relu and the moved-back panel's columns are added as bf16.py's
# micro-kernels add them.
#
# Where LLVM compiles for a CPU without AMX-BF16 the same loops run on an emulation of the four tile
# instructions (8 x 1 KB of stack; the same pair products in float32), so the kernel's packing and blocking are
# tested on every machine. Linux hands out the tile state per process on request (request_tiles); which
# entry bf16 products run on is chosen and checked once per machine (btjit/kernels/gemm_rule.py).
import ctypes

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from btjit.kernels import bf16
from btjit.kernels.bf16 import KB, NC, OBP, TMP, finish, halves, splat, vload
from btjit.kernels.bf16 import WS as BF16_WS
from btjit.kernels.bf16 import _pack, _pack_bt, _pack_rows, part
from btjit.kernels.common import FM, FM_FLAGS, part_of, row, stack_buf

TR = 16                     # rows of a tile (and pairs per tile row: 64 bytes)
MB = 2 * TR                 # rows of C per micro-kernel call
OA = BF16_WS                # A's pairs, MB rows of KB / 2, after bf16.py's B, TMP areas (which this uses alike)
OUT = OA + MB * KB // 2     # C's tiles as stored: MB rows of 32 floats
WS = OUT + MB * 32
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158
_GRANTED: list = []


def has_amx() -> bool:
    """Whether this CPU (as LLVM compiles for it) has AMX-BF16 and the tile registers."""
    feats = llvm.get_host_cpu_features().flatten().split(",")
    return "+amx-tile" in feats and "+amx-bf16" in feats


def request_tiles() -> bool:
    """Ask Linux for this process's AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), once; whether
    it was granted. Without it the first tile instruction kills the process (SIGILL)."""
    if not _GRANTED:
        ok = False
        if has_amx():
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                ok = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                                  ctypes.c_long(_XFEATURE_XTILEDATA)) == 0
            except (OSError, AttributeError):
                ok = False
        _GRANTED.append(ok)
    return _GRANTED[0]


def describe(kernel) -> str:
    """What a bf16 program's products on library entry `kernel` run on here (prog.precision, the banner)."""
    if not kernel.startswith("k_matmul_amx"):
        return bf16.describe()
    return "bf16 (AMX tdpbf16ps)" if has_amx() else "bf16 (AMX tiles emulated: this CPU has none)"


class _Tiles:
    """TDPBF16PS and its tile loads and stores as LLVM's intrinsics (tile numbers immediate, shapes from the
    configuration ldtilecfg loaded)."""
    def __init__(self, builder):
        m, v, i8, i64 = builder.module, ir.VoidType(), ir.IntType(8), ir.IntType(64)
        p = i8.as_pointer()
        self.b, self.i8 = builder, i8
        self.zero_ = m.declare_intrinsic("llvm.x86.tilezero", fnty=ir.FunctionType(v, [i8]))
        self.load_ = m.declare_intrinsic("llvm.x86.tileloadd64", fnty=ir.FunctionType(v, [i8, p, i64]))
        self.store_ = m.declare_intrinsic("llvm.x86.tilestored64", fnty=ir.FunctionType(v, [i8, p, i64]))
        self.dp_ = m.declare_intrinsic("llvm.x86.tdpbf16ps", fnty=ir.FunctionType(v, [i8, i8, i8]))

    def t(self, n):
        return ir.Constant(self.i8, n)

    def zero(self, t):
        self.b.call(self.zero_, [self.t(t)])

    def load(self, t, ptr, stride):
        self.b.call(self.load_, [self.t(t), self.b.bitcast(ptr, self.i8.as_pointer()), stride])

    def store(self, t, ptr, stride):
        self.b.call(self.store_, [self.t(t), self.b.bitcast(ptr, self.i8.as_pointer()), stride])

    def dp(self, c, a, b):
        self.b.call(self.dp_, [self.t(c), self.t(a), self.t(b)])


class _Emulated:
    """The same four operations on 8 tiles of 16 x 16 int32 on the stack; TDPBF16PS as per the instruction's
    definition: C[m, n] += A[m, 2k] B[k, 2n] + A[m, 2k+1] B[k, 2n+1] over the 16 pairs k, in float32."""
    def __init__(self, builder):
        self.b, self.i8 = builder, ir.IntType(8)
        self.vi, self.vf = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)
        with builder.goto_entry_block():
            self.regs = builder.alloca(ir.ArrayType(ir.IntType(32), 8 * 256))

    def row(self, t, r, vt):
        off = self.b.add(ir.Constant(ir.IntType(64), t * 256), self.b.mul(r, ir.Constant(ir.IntType(64), 16))) \
            if isinstance(r, ir.Value) else ir.Constant(ir.IntType(64), t * 256 + 16 * r)
        return self.b.bitcast(self.b.gep(self.regs, [ir.Constant(ir.IntType(64), 0), off]), vt.as_pointer())

    def zero(self, t):
        for r in range(TR):
            self.b.store(ir.Constant(self.vi, None), self.row(t, r, self.vi), align=4)

    def _rows(self, ptr, stride, r):
        return self.b.bitcast(self.b.gep(self.b.bitcast(ptr, self.i8.as_pointer()),
                                         [self.b.mul(stride, ir.Constant(ir.IntType(64), r))]), self.vi.as_pointer())

    def load(self, t, ptr, stride):
        for r in range(TR):
            self.b.store(self.b.load(self._rows(ptr, stride, r), align=4), self.row(t, r, self.vi), align=4)

    def store(self, t, ptr, stride):
        for r in range(TR):
            self.b.store(self.b.load(self.row(t, r, self.vi), align=4), self._rows(ptr, stride, r), align=4)

    def dp(self, c, a, b):
        b_, i32 = self.b, ir.IntType(32)
        with cgutils.for_range(b_, ir.Constant(ir.IntType(64), TR)) as m:
            s = b_.load(self.row(c, m.index, self.vf), align=4)
            for k in range(TR):
                x = b_.load(b_.gep(b_.bitcast(self.row(a, m.index, self.vi), i32.as_pointer()),
                                   [ir.Constant(ir.IntType(64), k)]))
                xv = splat(b_, x, self.vi)
                (xl, xh), (bl, bh) = halves(b_, xv), halves(b_, b_.load(self.row(b, k, self.vi), align=4))
                s = b_.fadd(s, b_.fmul(xl, bl, flags=FM_FLAGS), flags=FM_FLAGS)
                s = b_.fadd(s, b_.fmul(xh, bh, flags=FM_FLAGS), flags=FM_FLAGS)
            b_.store(s, self.row(c, m.index, self.vf), align=4)


def _ops(builder):
    return _Tiles(builder) if has_amx() else _Emulated(builder)


def product(builder, t, wd, kt, obp, width, nr):
    """C's nr x width/16 tiles (tiles 2i + j) = the sum over kt tiles of k of A's tiles (4 + i: rows 16i.. of
    ws[OA..], row-major pairs KB/2 apart) times B's (6 + j: ws[obp + p*width + 16j]); stored at ws[OUT..] as
    rows of 32 floats. t: the tile operations (_Tiles or _Emulated), wd: ws's int32 pointer."""
    c = lambda x: ir.Constant(ir.IntType(64), x)  # noqa: E731
    nv = width // 16
    for i in range(nr):
        for j in range(nv):
            t.zero(2 * i + j)
    with cgutils.for_range(builder, kt) as loop:
        p = builder.mul(loop.index, c(TR))
        for i in range(nr):
            t.load(4 + i, builder.gep(wd, [builder.add(c(OA + i * TR * KB // 2), p)]), c(KB * 2))
        for j in range(nv):
            t.load(6 + j, builder.gep(wd, [builder.add(obp, builder.add(builder.mul(p, c(width)), c(16 * j)))]),
                   c(4 * width))
        for i in range(nr):
            for j in range(nv):
                t.dp(2 * i + j, 4 + i, 6 + j)
    for i in range(nr):
        for j in range(nv):
            t.store(2 * i + j, builder.gep(wd, [c(OUT + i * TR * 32 + 16 * j)]), c(128))


def configure(builder):
    """ldtilecfg: every tile 16 rows of 64 bytes (palette 1)."""
    cfg = bytearray(64)
    cfg[0] = 1
    for t in range(8):
        cfg[16 + 2 * t] = 64                           # bytes per row (little-endian uint16)
        cfg[48 + t] = TR                               # rows
    ty, p8 = ir.ArrayType(ir.IntType(8), 64), ir.IntType(8).as_pointer()
    with builder.goto_entry_block():
        mem = builder.alloca(ty)
    builder.store(ir.Constant(ty, cfg), mem)
    fn = builder.module.declare_intrinsic("llvm.x86.ldtilecfg", fnty=ir.FunctionType(ir.VoidType(), [p8]))
    builder.call(fn, [builder.bitcast(mem, p8)])


def release(builder):
    """tilerelease: the tile state back to its initial (unused) state."""
    builder.call(builder.module.declare_intrinsic("llvm.x86.tilerelease", fnty=ir.FunctionType(ir.VoidType(), [])),
                 [])


@intrinsic
def _tiles_on(typingctx):
    """Configure the tiles (no-op where they are emulated)."""
    def impl(context, builder, sig, args):
        if has_amx():
            configure(builder)
        return context.get_dummy_value()
    return types.void(), impl


@intrinsic
def _tiles_off(typingctx):
    """Release the tiles (no-op where they are emulated)."""
    def impl(context, builder, sig, args):
        if has_amx():
            release(builder)
        return context.get_dummy_value()
    return types.void(), impl


def _micro(width):
    """Intrinsic micro(a, ws, kt, obp, oC, ldc, mrows, skip, init, obias, ores, relu): for r < mrows and
    skip <= c < width: C[oC + r*ldc + c] = init + the tiles' sum over kt tiles of k of A's rows (ws[OA + r*KB/2
    + p], p < 16 kt) times B's (ws[obp + p*width + c]); init, ores, relu as bf16.py's micro-kernels."""
    nv = width // 16

    @intrinsic
    def micro(typingctx, a, ws, kt, obp, oC, ldc, mrows, skip, init, obias, ores, relu):
        def impl(context, builder, sig, args):
            ad = context.make_array(sig.args[0])(context, builder, args[0]).data
            wd = context.make_array(sig.args[1])(context, builder, args[1]).data
            _, _, kt, obp, oC, ldc, mrows, skip, init, obias, ores, relu = args
            i64, vf = ir.IntType(64), ir.VectorType(ir.FloatType(), 16)
            c = lambda x: ir.Constant(i64, x)  # noqa: E731
            t = _ops(builder)

            with builder.if_else(builder.icmp_signed(">", mrows, c(TR))) as (two, one):
                with two:
                    product(builder, t, wd, kt, obp, width, 2)
                with one:
                    product(builder, t, wd, kt, obp, width, 1)

            with cgutils.for_range(builder, mrows) as loop:
                r = loop.index
                oc, orr = (builder.add(base, builder.mul(r, ldc)) for base in (oC, ores))
                for j in range(nv):
                    acc = cgutils.alloca_once_value(builder, builder.bitcast(vload(
                        builder, wd, builder.add(c(OUT + 16 * j), builder.mul(r, c(32))), ir.VectorType(
                            ir.IntType(32), 16)), vf))
                    with builder.if_then(builder.icmp_signed("==", init, c(1))):
                        builder.store(builder.fadd(builder.load(acc), vload(builder, ad, builder.add(
                            obias, c(16 * j)), vf), flags=FM_FLAGS), acc)
                    with builder.if_then(builder.icmp_signed("==", init, c(2))):
                        builder.store(builder.fadd(builder.load(acc), vload(builder, ad, builder.add(
                            oc, c(16 * j)), vf), flags=FM_FLAGS), acc)
                    finish(builder, ad, builder.load(acc), builder.add(oc, c(16 * j)), ores,
                           builder.add(orr, c(16 * j)), relu, skip, j)
            return context.get_dummy_value()
        i = types.int64
        return types.void(a, ws, i, i, i, i, i, i, i, i, i, i), impl
    return micro


_micro32, _micro16 = _micro(32), _micro(16)


@njit(**FM)
def _panel(N, c0):
    """(width, first column) of the panel of C from column c0: 32 wide while more than 16 columns remain, then
    16; the last moved back to end at N (N >= 16)."""
    w = 32 if N - c0 > 16 else 16
    return w, min(c0, N - w)


@njit(**FM)
def _amx_rows(a, ia, r, lo, m, b0, b1):
    """Rows lo .. lo+m of every product of a k_matmul_amx row (bf16.py's _bf16_rows, on tiles)."""
    oA = r[1]; oB = r[2]; oC = r[3]; M = r[5]; N = r[6]; K = r[7]; sA = r[8]; sB = r[9]
    sC = r[10]; ta = r[11]; tb = r[12]; obias = r[13]; ores = r[14]; relu = r[15]
    sar, sak = (1, M) if ta == 1 else (K, 1)          # A(i, k) = a[oA + i*sar + k*sak]
    sbk, sbc = (1, K) if tb == 1 else (N, 1)          # B(k, j) = a[oB + k*sbk + j*sbc]
    ws = carray(stack_buf(ia, WS), (WS,))
    _tiles_on()
    for i in range(b0, b1):
        oa, ob, oc = oA + i * sA, oB + i * sB, oC + i * sC
        cs = 0
        while cs < N:
            ce = cs
            for k0 in range(0, K, KB):
                kb = min(KB, K - k0)
                kt = (kb + 2 * TR - 1) // (2 * TR)     # tiles of 16 pairs
                last = k0 + KB >= K
                rl = relu if last else 0
                init = 2 if k0 > 0 else (1 if obias > 0 else 0)
                c0, o = cs, OBP
                while c0 < N:
                    w, cc = _panel(N, c0)
                    if c0 > cs and c0 - cs + w > NC:
                        break
                    if tb == 1:
                        _pack_bt(a, ws, o, ob + k0 + cc * K, K, kt * TR, w, kb)
                    else:
                        _pack(a, ws, o, ob + k0 * sbk + cc * sbc, sbc, sbk, kt * TR, w, w, kb)
                    o += kt * TR * w
                    c0 += w
                ce = c0
                for rb in range(lo, lo + m, MB):
                    mr = min(MB, lo + m - rb)
                    if ta == 1:                         # A^T: pairs by columns at TMP, then row-major
                        _pack(a, ws, TMP, oa + rb * sar + k0 * sak, sar, sak, kt * TR, mr, MB, kb)
                        for p in range(kt * TR):
                            for q in range(MB):
                                ws[OA + q * (KB // 2) + p] = ws[TMP + p * MB + q]
                    else:
                        _pack_rows(a, ws, OA, oa + rb * sar + k0 * sak, sar, kt * TR, mr, MB, kb)
                    c0, o = cs, OBP
                    while c0 < ce:
                        w, cc = _panel(N, c0)
                        ocr = oc + rb * N + cc
                        orr = ores + i * sC + rb * N + cc if ores > 0 and last else 0
                        if w == 32:
                            _micro32(a, ws, kt, o, ocr, N, mr, c0 - cc, init, obias + cc, orr, rl)
                        else:
                            _micro16(a, ws, kt, o, ocr, N, mr, c0 - cc, init, obias + cc, orr, rl)
                        o += kt * TR * w
                        c0 += w
            cs = ce
    _tiles_off()


@row("oA oB oC nbatch M N K sA sB sC ta tb obias ores relu by")
@njit(**FM)
def k_matmul_amx(a, ia, r):
    """k_matmul_bf16 on the matrix units (AMX): C_i (M,N) = op(A_i) @ op(B_i) (+ bias) (+ R_i) (relu), A and B
    rounded to bf16, float32 sums; arguments as k_matmul_bf16's. N >= 16. The process must hold the tile state
    (request_tiles). A split row: parts of whole MB-row blocks (by 0) or whole products (by 2)."""
    j, n = part_of(r)
    lo, m, b0, b1 = part(j, n, r[5], r[4], r[16], np.int64(MB))
    _amx_rows(a, ia, r, lo, m, b0, b1)

