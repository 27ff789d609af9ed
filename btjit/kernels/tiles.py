# Register-tile intrinsics for btjit/kernels/attention.py and attn_kept.py, generic over float32 / float64 arrays
# and over every size (runtime trip counts: llvmlite loops, no per-shape code): `mk_set` / `mk_add`, an R x V
# tile of a matrix product, and the passes over one row of scores in V-wide vectors: the flash kernels' online
# softmax (`softmax_row`, `prob_row`), the kept kernels' normalised softmax and dS (`softmax_norm_row`,
# `dscore_row`).
import math

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from btjit.kernels.common import FM_FLAGS

R = 4               # rows of the register tile (query rows)
V = 16              # columns of the register tile and width of the softmax vectors (keys or head dims)
_I64, _I32 = ir.IntType(64), ir.IntType(32)


def _mk(add):
    """Intrinsic mk(A, oA, lda, sak, B, oB, ldb, K, C, oC, ldc): for r < R, c < V:
    C[oC + r*ldc + c] (+)= sum_{k<K} A[oA + r*lda + k*sak] * B[oB + k*ldb + c]  (arrays of one dtype)."""
    @intrinsic
    def mk(typingctx, A, oA, lda, sak, Bm, oB, ldb, K, Cm, oC, ldc):
        if not (isinstance(A, types.Array) and A.dtype == Bm.dtype == Cm.dtype):
            return None
        i = types.int64
        sig = types.void(A, i, i, i, Bm, i, i, i, Cm, i, i)

        def impl(context, builder, sig, args):
            _, oA, lda, sak, _, oB, ldb, K, _, oC, ldc = args
            pa, pb, pc = (context.make_array(sig.args[j])(context, builder, args[j]).data for j in (0, 4, 8))
            vt = ir.VectorType(context.get_data_type(sig.args[0].dtype), V)
            al = sig.args[0].dtype.bitwidth // 8
            i64, i32 = ir.IntType(64), ir.IntType(32)
            bcast = ir.Constant(ir.VectorType(i32, V), [0] * V)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vt, None)) for _ in range(R)]
            with cgutils.for_range(builder, K) as loop:
                k = loop.index
                bv = builder.load(builder.bitcast(builder.gep(pb, [builder.add(oB, builder.mul(k, ldb))]),
                                                  vt.as_pointer()), align=al)
                ka = builder.add(oA, builder.mul(k, sak))
                for r in range(R):
                    x = builder.load(builder.gep(pa, [builder.add(ka, builder.mul(ir.Constant(i64, r), lda))]))
                    xv = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, ir.Undefined), x,
                                                                       ir.Constant(i32, 0)),
                                                ir.Constant(vt, ir.Undefined), bcast)
                    builder.store(builder.fadd(builder.load(accs[r]), builder.fmul(xv, bv, flags=FM_FLAGS),
                                               flags=FM_FLAGS), accs[r])
            for r in range(R):
                cp = builder.bitcast(builder.gep(pc, [builder.add(oC, builder.mul(ir.Constant(i64, r), ldc))]),
                                     vt.as_pointer())
                v = builder.load(accs[r])
                if add:
                    v = builder.fadd(builder.load(cp, align=al), v, flags=FM_FLAGS)
                builder.store(v, cp, align=al)
            return context.get_dummy_value()
        return sig, impl
    return mk


mk_set, mk_add = _mk(False), _mk(True)


class _Vec:
    """V-wide vector arithmetic of one dtype on a builder (fast-math flags as the njit kernels)."""

    def __init__(self, context, builder, dtype):
        self.b = builder
        self.f32 = dtype == types.float32
        self.et = context.get_data_type(dtype)
        self.vt = ir.VectorType(self.et, V)
        self.al = dtype.bitwidth // 8

    def const(self, x):
        return ir.Constant(self.vt, [float(x)] * V)

    def splat(self, x):
        v = self.b.insert_element(ir.Constant(self.vt, ir.Undefined), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(self.vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, V), [0] * V))

    def ptr(self, data, off):
        return self.b.bitcast(self.b.gep(data, [off]), self.vt.as_pointer())

    def load(self, data, off):
        return self.b.load(self.ptr(data, off), align=self.al)

    def store(self, v, data, off):
        self.b.store(v, self.ptr(data, off), align=self.al)

    def add(self, x, y):
        return self.b.fadd(x, y, flags=FM_FLAGS)

    def sub(self, x, y):
        return self.b.fsub(x, y, flags=FM_FLAGS)

    def mul(self, x, y):
        return self.b.fmul(x, y, flags=FM_FLAGS)

    def max(self, x, y):
        return self.b.select(self.b.fcmp_ordered(">", x, y), x, y)

    def valid(self, j0, nv):
        """Lanes j0 + l < nv."""
        vi = ir.VectorType(_I64, V)
        idx = self.b.add(self.b.shuffle_vector(self.b.insert_element(ir.Constant(vi, ir.Undefined), j0,
                                                                     ir.Constant(_I32, 0)),
                                               ir.Constant(vi, ir.Undefined), ir.Constant(ir.VectorType(_I32, V), [0] * V)),
                         ir.Constant(vi, list(range(V))))
        lim = self.b.shuffle_vector(self.b.insert_element(ir.Constant(vi, ir.Undefined), nv, ir.Constant(_I32, 0)),
                                    ir.Constant(vi, ir.Undefined), ir.Constant(ir.VectorType(_I32, V), [0] * V))
        return self.b.icmp_signed("<", idx, lim)

    def reduce(self, v, op):
        """op over the lanes (a shuffle tree), as a scalar."""
        n = V
        while n > 1:
            n //= 2
            hi = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, V), [(k + n) % V for k in range(V)]))
            v = op(v, hi)
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    def exp(self, x):
        """common.fexp lane-wise: float32 the same Cephes polynomial (0 below -87), float64 llvm.exp."""
        b = self.b
        if not self.f32:
            f = cgutils.get_or_insert_function(b.module, ir.FunctionType(self.vt, [self.vt]), f"llvm.exp.v{V}f64")
            return b.call(f, [x])
        x0 = x
        x = self.b.select(self.b.fcmp_ordered("<", x, self.const(88.0)), x, self.const(88.0))
        x = self.max(x, self.const(-87.0))
        floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(self.vt, [self.vt]), f"llvm.floor.v{V}f32")
        fn = b.call(floor, [self.add(self.mul(x, self.const(1.4426950408889634)), self.const(0.5))])
        r = self.add(self.sub(x, self.mul(fn, self.const(0.693359375))), self.mul(fn, self.const(2.12194440e-4)))
        p = self.const(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = self.add(self.mul(p, r), self.const(c))
        p = self.add(self.add(self.mul(self.mul(p, r), r), r), self.const(1.0))
        vi = ir.VectorType(_I32, V)
        e = b.shl(b.add(b.fptosi(fn, vi), ir.Constant(vi, [127] * V)), ir.Constant(vi, [23] * V))
        e = self.mul(p, b.bitcast(e, self.vt))
        return b.select(b.fcmp_ordered(">", x0, self.const(-87.0)), e, self.const(0.0))


@intrinsic
def softmax_row(typingctx, P, off, n, nv, mo, oout):
    """One row of a forward score tile, P[off:off+n] (n a multiple of V), keys j < nv valid: mx = max(mo, the
    valid scores); P[j] = exp(P[j] - mx) for j < nv, else 0; P[oout] = mx, P[oout+1] = the sum of the row."""
    if not isinstance(P, types.Array):
        return None
    i = types.int64
    sig = types.void(P, i, i, i, P.dtype, i)

    def impl(context, builder, sig, args):
        _, off, n, nv, mo, oout = args
        v = _Vec(context, builder, sig.args[0].dtype)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        nc = builder.sdiv(n, ir.Constant(_I64, V))
        mxv = cgutils.alloca_once_value(builder, v.splat(mo))
        with cgutils.for_range(builder, nc) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            x = builder.select(v.valid(j0, nv), v.load(data, builder.add(off, j0)), v.const(-math.inf))
            builder.store(v.max(builder.load(mxv), x), mxv)
        mx = v.reduce(builder.load(mxv), v.max)
        mxs = v.splat(mx)
        tot = cgutils.alloca_once_value(builder, v.const(0.0))
        with cgutils.for_range(builder, nc) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            e = v.exp(v.sub(v.load(data, builder.add(off, j0)), mxs))
            e = builder.select(v.valid(j0, nv), e, v.const(0.0))
            v.store(e, data, builder.add(off, j0))
            builder.store(v.add(builder.load(tot), e), tot)
        builder.store(mx, builder.gep(data, [oout]))
        builder.store(v.reduce(builder.load(tot), v.add), builder.gep(data, [builder.add(oout, ir.Constant(_I64, 1))]))
        return context.get_dummy_value()
    return sig, impl


@intrinsic
def prob_row(typingctx, P, off, goff, n, nv, lse, D):
    """One row of a backward tile: P[off+j] = exp(P[off+j] - lse) (the probabilities from the scores and the
    row's logsumexp) and P[goff+j] = P[off+j] * (P[goff+j] - D) (dS from dP) for j < nv; both 0 for
    nv <= j < n (n a multiple of V)."""
    if not isinstance(P, types.Array):
        return None
    i = types.int64
    sig = types.void(P, i, i, i, i, P.dtype, P.dtype)

    def impl(context, builder, sig, args):
        _, off, goff, n, nv, lse, D = args
        v = _Vec(context, builder, sig.args[0].dtype)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ls, Ds = v.splat(lse), v.splat(D)
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(_I64, V))) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            ok = v.valid(j0, nv)
            e = builder.select(ok, v.exp(v.sub(v.load(data, builder.add(off, j0)), ls)), v.const(0.0))
            v.store(e, data, builder.add(off, j0))
            g = v.mul(e, v.sub(v.load(data, builder.add(goff, j0)), Ds))
            v.store(builder.select(ok, g, v.const(0.0)), data, builder.add(goff, j0))
        return context.get_dummy_value()
    return sig, impl


@intrinsic
def softmax_norm_row(typingctx, P, off, n, nv, npad):
    """One row of scores P[off:off+n] (n a multiple of V), keys j < nv valid, into its probabilities:
    P[j] = exp(P[j] - max) / sum for j < nv, 0 for nv <= j < npad (npad a multiple of V)."""
    if not isinstance(P, types.Array):
        return None
    i = types.int64
    sig = types.void(P, i, i, i, i)

    def impl(context, builder, sig, args):
        _, off, n, nv, npad = args
        v = _Vec(context, builder, sig.args[0].dtype)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        nc = builder.sdiv(n, ir.Constant(_I64, V))
        mxv = cgutils.alloca_once_value(builder, v.const(-math.inf))
        with cgutils.for_range(builder, nc) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            x = builder.select(v.valid(j0, nv), v.load(data, builder.add(off, j0)), v.const(-math.inf))
            builder.store(v.max(builder.load(mxv), x), mxv)
        mxs = v.splat(v.reduce(builder.load(mxv), v.max))
        tot = cgutils.alloca_once_value(builder, v.const(0.0))
        with cgutils.for_range(builder, nc) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            e = builder.select(v.valid(j0, nv), v.exp(v.sub(v.load(data, builder.add(off, j0)), mxs)), v.const(0.0))
            v.store(e, data, builder.add(off, j0))
            builder.store(v.add(builder.load(tot), e), tot)
        inv = v.splat(builder.fdiv(ir.Constant(v.et, 1.0), v.reduce(builder.load(tot), v.add)))
        with cgutils.for_range(builder, nc) as loop:
            o = builder.add(off, builder.mul(loop.index, ir.Constant(_I64, V)))
            v.store(v.mul(v.load(data, o), inv), data, o)
        with cgutils.for_range(builder, builder.sdiv(builder.sub(npad, n), ir.Constant(_I64, V))) as loop:
            v.store(v.const(0.0), data, builder.add(builder.add(off, n), builder.mul(loop.index, ir.Constant(_I64, V))))
        return context.get_dummy_value()
    return sig, impl


@intrinsic
def dscore_row(typingctx, P, off, goff, n, npad, scale):
    """One row of the kept backward: with the probabilities P[off:off+n] (n a multiple of V, zero past the
    row's keys) and dP in P[goff:goff+n]: D = sum_j P[j] dP[j], then P[goff+j] = scale P[j] (dP[j] - D) (dS)
    and, if n < npad, 0 for the V entries from goff+n."""
    if not isinstance(P, types.Array):
        return None
    i = types.int64
    sig = types.void(P, i, i, i, i, P.dtype)

    def impl(context, builder, sig, args):
        _, off, goff, n, npad, scale = args
        v = _Vec(context, builder, sig.args[0].dtype)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        nc = builder.sdiv(n, ir.Constant(_I64, V))
        acc = cgutils.alloca_once_value(builder, v.const(0.0))
        with cgutils.for_range(builder, nc) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            builder.store(v.add(builder.load(acc), v.mul(v.load(data, builder.add(off, j0)),
                                                          v.load(data, builder.add(goff, j0)))), acc)
        D, sc = v.splat(v.reduce(builder.load(acc), v.add)), v.splat(scale)
        with cgutils.for_range(builder, nc) as loop:
            j0 = builder.mul(loop.index, ir.Constant(_I64, V))
            g = builder.add(goff, j0)
            v.store(v.mul(v.mul(sc, v.load(data, builder.add(off, j0))), v.sub(v.load(data, g), D)), data, g)
        with builder.if_then(builder.icmp_signed("<", n, npad)):
            v.store(v.const(0.0), data, builder.add(goff, n))
        return context.get_dummy_value()
    return sig, impl
