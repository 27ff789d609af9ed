# Shared kernel machinery: the FM njit options, dtype-generic scalar helpers usable inside njit
# (`cvt` cast-to-arena-dtype, `fexp` / `fexp_in_range` vectorizable exp, `ftanh` vectorizable tanh) and
# `gemm`, a row-major GEMM that calls OpenBLAS sgemm/dgemm directly through scipy.linalg.cython_blas
# (KERNEL_NOTES §7).
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

FM_FLAGS = ("nsz", "arcp", "contract", "afn", "reassoc")   # fast-math set: no nnan/ninf, NaNs propagate
FM = dict(fastmath=set(FM_FLAGS), error_model='numpy', boundscheck=False)
MAX_THREADS = 8   # parts a split row's scratch (e.g. 8 int32 BLAS slots each) is sized for

f32 = np.float32


# ---------------------------------------------------------------- the one declaration of each kernel's row
ROW = 32   # int64s per tape row: the opcode, then the kernel's arguments, zero-padded; the last two say the split:
PART, SPLIT = ROW - 2, ROW - 1      # a row whose r[SPLIT] = n > 1 is run in n parts on the thread pool, its entry
#                                     called once per part with r[PART] = j (btjit/core/executor.py: run_parts)


@njit(inline="always")
def part_of(r):
    """(j, n): the part of its row this call computes, of n (1: the whole row). A kernel that can split its work
    computes part j of n exactly as the same elements on one thread (bitwise), whatever n."""
    n = r[SPLIT]
    return (r[PART], n) if n > 1 else (np.int64(0), np.int64(1))


@njit(inline="always")
def part_range(r, n):
    """[lo, hi) of range(n) that this call of a split row computes (all of it for a whole row): its part of n, cut
    at multiples of 16 elements (whole vectors)."""
    j, k = part_of(r)
    lo = j * (n // 16) // k * 16
    return lo, (j + 1) * (n // 16) // k * 16 if j + 1 < k else n


class RowDecl(NamedTuple):
    args: tuple            # the names of r[1], r[2], ... in order
    stop: str | None       # an argument naming an ia slot: the tape stops after the row if it is nonzero


ROWS: dict = {}            # kernel name -> RowDecl (btjit.graph.lower builds rows from it by name)


def inlined(kernel):
    """The @njit kernel as a function numba inlines into its caller, the library entry (numba IR inlining):
    its body is then optimized and compiled to machine code once, in the entry, not first on its own as well
    (measured: a third to a half of an entry's compile)."""
    opts = {k: v for k, v in kernel.targetoptions.items() if k != "nopython"}
    return njit(**dict(opts, inline="always"))(kernel.py_func)


def row(args: str, stop: str | None = None):
    """Decorator declaring a tape kernel's row: `@row("ox og M C")` above `@njit` says r = [op, ox, og, M, C].
    btjit.kernels.rowcheck checks each kernel's source reads r with these names (check_rows)."""
    def deco(k):
        declare(getattr(k, "py_func", k).__name__, args, stop)
        return k
    return deco


def declare(name, args: str, stop=None):
    names = tuple(args.split())
    assert len(names) < PART and (stop is None or stop in names), (name, names)
    ROWS[name] = RowDecl(names, stop)


# ---------------------------------------------------------------- scalar helpers (dtype dispatch via overload)
def cvt(a, x):
    """x converted to the dtype of array or scalar `a` (float32 arena -> float32 scalar). Use for
    precision-sensitive literals and int->float conversions in kernels generic over the arena dtype."""
    return (a.dtype.type if hasattr(a, "dtype") else type(a))(x)


@overload(cvt, jit_options=FM)
def _ov_cvt(a, x):
    if (isinstance(a, types.Array) and a.dtype == types.float32) or a == types.float32:
        return lambda a, x: np.float32(x)
    return lambda a, x: np.float64(x)


@intrinsic
def i32_as_f32(typingctx, x):
    """Bit-cast int32 -> float32 (vectorizes)."""
    if x != types.int32:
        return None

    def impl(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), impl


@intrinsic
def f32_as_i32(typingctx, x):
    """Bit-cast float32 -> int32 (i32_as_f32's inverse)."""
    if x != types.float32:
        return None

    def impl(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), impl


def fexp(x):
    """exp(x). Inside njit: float32 -> branch-free Cephes polynomial (max rel err ~1.2e-7, input clamped to
    [-87, 88] and 0 below -87 -- exp(-inf) of a masked score must be 0, not a denormal that slows every later
    product -- vectorizes); float64 -> math.exp."""
    return np.exp(x)


def fexp_in_range(x):
    """exp(x) for |x| <= 87 (the caller bounds x). Inside njit: float32 -> fexp's polynomial without its clamp
    and range select (1.3x fexp in the GELU kernels); float64 -> math.exp."""
    return np.exp(x)


def _fexp32_in_range(x):
    fn = np.floor(x * f32(1.4426950408889634) + f32(0.5))   # float floor: math.floor's int64 costs 6 instrs
    r = x - fn * f32(0.693359375) + fn * f32(2.12194440e-4)
    p = f32(1.9875691500e-4)
    p = p * r + f32(1.3981999507e-3)
    p = p * r + f32(8.3334519073e-3)
    p = p * r + f32(4.1665795894e-2)
    p = p * r + f32(1.6666665459e-1)
    p = p * r + f32(5.0000001201e-1)
    p = p * r * r + r + f32(1.0)
    return p * i32_as_f32(np.int32((np.int32(fn) + np.int32(127)) << np.int32(23)))


def _fexp32(x):
    e = fexp_in_range(min(max(x, f32(-87.0)), f32(88.0)))
    return e if x > f32(-87.0) else f32(0.0)       # exp(-inf) and below-range inputs: 0, not a denormal


def _exp64(x):
    return math.exp(x)


@overload(fexp, jit_options=FM)
def _ov_fexp(x):
    if x == types.float32:
        return _fexp32
    if isinstance(x, (types.Float, types.Integer)):
        return _exp64


@overload(fexp_in_range, jit_options=FM)
def _ov_fexp_in_range(x):
    if x == types.float32:
        return _fexp32_in_range
    if isinstance(x, (types.Float, types.Integer)):
        return _exp64


def ftanh(x):
    """tanh(x). Inside njit: float32 -> Eigen's rational approximation (abs err ~3e-7, vectorizes), +-1
    exactly from |x| = 9.1 (float32's tanh rounds to 1 beyond 9.01); float64 -> math.tanh."""
    return np.tanh(x)


def _ftanh32(x):
    x0, x = x, min(max(x, f32(-7.90531110763549805)), f32(7.90531110763549805))
    x2 = x * x
    p = f32(-2.76076847742355e-16)
    p = p * x2 + f32(2.00018790482477e-13)
    p = p * x2 + f32(-8.60467152213735e-11)
    p = p * x2 + f32(5.12229709037114e-08)
    p = p * x2 + f32(1.48572235717979e-05)
    p = p * x2 + f32(6.37261928875436e-04)
    p = p * x2 + f32(4.89352455891786e-03)
    q = f32(1.19825839466702e-06)
    q = q * x2 + f32(1.18534705686654e-04)
    q = q * x2 + f32(2.26843463243900e-03)
    q = q * x2 + f32(4.89352518554385e-03)
    t = x * p / q           # 0.99999976 at the clamp; beyond |x| 9.01 float32's tanh is exactly +-1 (its gradient
    return (f32(1.0) if x0 > 0 else f32(-1.0)) if abs(x0) >= f32(9.1) else t   # 1 - t^2 then 0); NaN stays NaN


def _tanh64(x):
    return math.tanh(x)


def ferf(x):
    """erf(x). Inside njit: float32 -> Eigen's rational approximation (abs err ~2e-7, vectorizes: the exact GELU
    runs through it), +-1 from |x| = 4; float64 -> math.erf."""
    return math.erf(x)


def _ferf32(x):
    x = min(max(x, f32(-4.0)), f32(4.0))       # beyond, float32's erf is +-1 (NaN stays NaN: min/max keep it)
    x2 = x * x
    p = f32(-2.72614225801306e-10)
    p = p * x2 + f32(2.77068142495902e-08)
    p = p * x2 + f32(-2.10102402082508e-06)
    p = p * x2 + f32(-5.69250639462346e-05)
    p = p * x2 + f32(-7.34990630326855e-04)
    p = p * x2 + f32(-2.95459980854025e-03)
    p = p * x2 + f32(-1.60960333262415e-02)
    q = f32(-1.45660718464996e-05)
    q = q * x2 + f32(-2.13374055278905e-04)
    q = q * x2 + f32(-1.68282697438203e-03)
    q = q * x2 + f32(-7.37332916720468e-03)
    q = q * x2 + f32(-1.42647390514189e-02)
    return x * p / q


def _erf64(x):
    return math.erf(x)


@overload(ftanh, jit_options=FM)
def _ov_ftanh(x):
    if x == types.float32:
        return _ftanh32
    if isinstance(x, (types.Float, types.Integer)):
        return _tanh64


@overload(ferf, jit_options=FM)
def _ov_ferf(x):
    if x == types.float32:
        return _ferf32
    if isinstance(x, (types.Float, types.Integer)):
        return _erf64


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the CPU to bring arr[off]'s cache line in for reading (llvm.prefetch, kept in every cache level)."""
    def impl(context, builder, sig, args):
        p = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], fnty)
        builder.call(fn, [builder.bitcast(p, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(arr, off), impl


# ---------------------------------------------------------------- stack buffers
@intrinsic
def stack_buf(typingctx, arr, n):
    """Pointer to a fresh n-element stack buffer (n a literal int) of arr's dtype, for numba.carray. LLVM
    knows an alloca aliases no argument, so loops that load from the arena and store only here vectorize
    without runtime alias checks. Keep ONE such buffer per function: with two, LLVM checks them against
    each other and can give up. 64-byte aligned, as the arena's buffers: a zmm load or store never splits a line
    (the interpreter's registers: Lion's update 1.1x, a user's Lion 1.2x faster, znver5)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def impl(context, builder, sig, args):
        ety = context.get_data_type(sig.args[0].dtype)
        with builder.goto_entry_block():
            buf = builder.alloca(ir.ArrayType(ety, size))
            buf.align = 64
        return builder.bitcast(buf, ety.as_pointer())
    return types.CPointer(arr.dtype)(arr, n), impl


def _tile(w, masked=False):
    """Intrinsic tile(src, osrc, ssrc, dst, odst, sdst): dst[odst + j*sdst + i] = src[osrc + i*ssrc + j] for
    i, j < w (arrays of one dtype; offsets and strides in elements): w row loads, log2(w) rounds of w
    two-vector interleaves (vpermt2ps), w stores. masked: tile(src, osrc, ssrc, dst, odst, sdst, omask) moves
    src[...] if src[omask + i*ssrc + j] > 0 else src[...] * 0 instead (relu's gradient, as B_RELU_GRAD)."""
    def typer(typingctx, src, osrc, ssrc, dst, odst, sdst, *omask):
        def impl(context, builder, sig, args):
            sd = context.make_array(sig.args[0])(context, builder, args[0]).data
            dd = context.make_array(sig.args[3])(context, builder, args[3]).data
            osrc, ssrc, _, odst, sdst = args[1:6]
            vt = ir.VectorType(context.get_data_type(sig.args[0].dtype), w)
            i64 = ir.IntType(64)

            def vptr(data, base, stride, k):
                return builder.bitcast(builder.gep(data, [builder.add(base, builder.mul(stride, ir.Constant(i64, k)))]),
                                       vt.as_pointer())
            rows = [builder.load(vptr(sd, osrc, ssrc, k), align=4) for k in range(w)]
            if masked:
                zero = ir.Constant(vt, None)
                keep = [builder.fcmp_ordered(">", builder.load(vptr(sd, args[6], ssrc, k), align=4), zero)
                        for k in range(w)]
                rows = [builder.select(c, v, builder.fmul(v, zero)) for c, v in zip(keep, rows)]
            h = w // 2
            lo = ir.Constant(ir.VectorType(ir.IntType(32), w), [x for k in range(h) for x in (k, k + w)])
            hi = ir.Constant(ir.VectorType(ir.IntType(32), w), [x for k in range(h, w) for x in (k, k + w)])
            for _ in range(w.bit_length() - 1):   # after log2(w) perfect shuffles of rows k and k+w/2: transposed
                rows = [builder.shuffle_vector(rows[k // 2], rows[k // 2 + h], lo if k % 2 == 0 else hi)
                        for k in range(w)]
            for k in range(w):
                builder.store(rows[k], vptr(dd, odst, sdst, k), align=4)
            return context.get_dummy_value()
        if src.dtype != dst.dtype:
            return None
        return types.void(src, osrc, ssrc, dst, odst, sdst, *omask), impl
    def tile(typingctx, src, osrc, ssrc, dst, odst, sdst):
        return typer(typingctx, src, osrc, ssrc, dst, odst, sdst)

    def tile_masked(typingctx, src, osrc, ssrc, dst, odst, sdst, omask):
        return typer(typingctx, src, osrc, ssrc, dst, odst, sdst, omask)
    return intrinsic(tile_masked if masked else tile)


tile8, tile16, tile16_relu = _tile(8), _tile(16), _tile(16, masked=True)


@njit(**FM)
def fill_n(d, v, m):
    """d[:m] = v (d an array or a typed pointer, common.fptr)."""
    for j in range(m):
        d[j] = v


@njit(**FM)
def copy_n(d, x, m):
    """d[:m] = x[:m] (arrays or typed pointers; into or out of a stack buffer, the loop vectorizes unchecked)."""
    for j in range(m):
        d[j] = x[j]


@njit(**FM)
def transpose(src, osrc, dst, odst, R, C, omask=-1):
    """The (R, C) row-major matrix at src[osrc:] into (C, R) at dst[odst:] (arrays of one dtype; the two
    must not overlap): 16 x 16 register tiles (3x the speed of element loops), the last tile of each row
    and column moved back to end at R / C (overlapping tiles rewrite equal values); element loops when a
    side is below 16. omask >= 0: relu's gradient moved instead, masked by the (R, C) matrix at src[omask:]
    (tile16_relu's rule)."""
    if R >= 16 and C >= 16:
        for i0 in range(0, R, 16):
            i = min(i0, R - 16)
            for j0 in range(0, C, 16):
                j = min(j0, C - 16)
                if omask >= 0:
                    tile16_relu(src, osrc + i * C + j, C, dst, odst + j * R + i, R, omask + i * C + j)
                else:
                    tile16(src, osrc + i * C + j, C, dst, odst + j * R + i, R)
        return
    s = src[osrc:osrc + R * C].reshape(R, C)
    m = src[max(omask, 0):max(omask, 0) + R * C].reshape(R, C)
    d = dst[odst:odst + R * C].reshape(C, R)
    z = cvt(src, 0.0)
    for j in range(C):
        dj = d[j]
        for i in range(R):
            dj[i] = s[i, j] if omask < 0 or m[i, j] > z else s[i, j] * z


# ---------------------------------------------------------------- direct BLAS gemm
# The BLAS entry points are bound as named external symbols (llvmlite.add_symbol, by btjit/kernels/blas.py:
# OpenBLAS or MKL, measured), not ctypes pointers: a ctypes pointer is a "dynamic global" that stops numba
# from caching every caller on disk, and a baked-in address would be wrong in the next process.
from btjit.kernels import blas as _blas  # noqa: E402,F401 -- binds btjit_sgemm / btjit_dgemm
_sgemm = types.ExternalFunction("btjit_sgemm", types.void(*([types.voidptr] * 13)))
_dgemm = types.ExternalFunction("btjit_dgemm", types.void(*([types.voidptr] * 13)))


@intrinsic
def fptr(typingctx, arr, off):
    """Typed pointer to arr[off] (indexable: p[j]); no bounds check. A pointer is one word to pass, where a
    slice arr[off:] is a struct built and passed whole: ~55 ns a call (fused.py's interpreter, per instruction)."""
    def impl(context, builder, sig, args):
        return builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
    return types.CPointer(arr.dtype)(arr, off), impl


@intrinsic
def ptr(typingctx, arr, off):
    """void* to arr[off]; no bounds check."""
    def impl(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
    return types.voidptr(arr, off), impl


@njit(**FM)
def gemm(a, ia, osc, oconst, ta, tb, M, N, K, oA, lda, b, oB, ldb, oC, ldc, beta):
    """Row-major C[M,N] = op(A)[M,K] @ op(B)[K,N] (+ C if beta == 1); A and C inside arena `a`, B at b[oB] (b is
    the arena, or a stack copy of the same dtype).
    op(A) = A (stored (M,K), lda >= K) if ta == 0 else A^T (A stored (K,M), lda >= M); likewise B/tb.
    osc: 8 free int32 slots in ia (BLAS char/int args). oconst: a[oconst] == 1.0, a[oconst+1] == 0.0.
    float32 arena -> sgemm, float64 -> dgemm. Implemented as column-major C^T = op(B)^T op(A)^T."""
    if M <= 0 or N <= 0:
        return
    p = ia[osc:osc + 8]
    p[0] = 78                                    # 'N'
    p[1] = 84                                    # 'T'
    p[2] = N
    p[3] = M
    p[4] = K
    p[5] = max(ldb, 1)
    p[6] = max(lda, 1)
    p[7] = max(ldc, 1)
    ob = oconst if beta == 1 else oconst + 1
    if a.itemsize == 4:
        _sgemm(ptr(p, tb), ptr(p, ta), ptr(p, 2), ptr(p, 3), ptr(p, 4), ptr(a, oconst), ptr(b, oB), ptr(p, 5),
               ptr(a, oA), ptr(p, 6), ptr(a, ob), ptr(a, oC), ptr(p, 7))
    else:
        _dgemm(ptr(p, tb), ptr(p, ta), ptr(p, 2), ptr(p, 3), ptr(p, 4), ptr(a, oconst), ptr(b, oB), ptr(p, 5),
               ptr(a, oA), ptr(p, 6), ptr(a, ob), ptr(a, oC), ptr(p, 7))
