# Causal attention at batch >= 16 for one (T, hs), as explicit 16-lane vector code (float32 arenas). Same
# layouts as the "bl" pair in btjit/kernels/attn_loops.py (qkv transposed into W, probabilities lane-major in P),
# but a chunk of LANES sequences x one head is ONE LLVM IR block built here with llvmlite: every q/k/v row
# is loaded once as a <16 x float>, the whole T x T problem (scores, max, exp, sums, products, and in the
# backward all of dq/dk/dv) runs in registers, and only P rows, y and dqkv are stored. Numba's front end
# never sees the unrolled body (as numba source it took 6 s per kernel to compile), and LLVM needs no
# vectorizer or alias checks. Per GPT layer at batch 64 (T=8, hs=4, one thread, with the transposes in and
# out): forward 44 -> 18.5 us, backward 57 -> 19.6 us against the loop kernels; ~1.5 s compile each.
#
# The kernel library (btjit/kernels/library.py) gets, for each (T, hs) a program uses, the block functions
# below (source text) and a kernel k_attn_{fwd,bwd}_lanes(_par) / _pairs as one entry each. graph/ops/nn.py
# picks them for a row only when every lane block holds >= LANES sequences; the last chunk of a block then
# starts at L - LANES and may redo lanes of the chunk before it, which is harmless: every store is an overwrite.
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from btjit.kernels.common import FM_FLAGS as _FLAGS, ROWS, declare

LANES = 16
PAIR_LANES = 8        # the small-batch "pairs" kernels: lanes are (sequence, head) pairs (Zen 4 runs 16 as 2 x 8)
KERNEL_NAMES = ("k_attn_bwd_lanes", "k_attn_bwd_lanes_par", "k_attn_bwd_pairs", "k_attn_fwd_lanes",
                "k_attn_fwd_lanes_par", "k_attn_fwd_pairs")
_F = ir.FloatType()
for _p in ("", "_par"):                 # the rows of the bl pair in btjit/kernels/attn_loops.py
    declare(f"k_attn_fwd_lanes{_p}", "oqkv oy oP oW B T C NH oscale nb")
    declare(f"k_attn_bwd_lanes{_p}", "oP oW ody odqkv oS B T C NH oscale nb")
declare("k_attn_fwd_pairs", "oqkv oy oP oW B T C NH oscale")
declare("k_attn_bwd_pairs", "oP oW ody odqkv oS B T C NH oscale")


def _small(T, hs, float_dtype) -> bool:
    """float32 and a body of bounded size (the GPT's T=8, hs=4 is 144 score terms of 4)."""
    return float_dtype == "f32" and T * (T + 1) // 2 * hs <= 300


def eligible(T, hs, B, nb, float_dtype) -> bool:
    """Whether rows of this attention use the generated lanes kernels: every one of the nb lane blocks at
    least LANES sequences wide, and _small."""
    Lb = -(-B // nb)
    return min(Lb, B - (nb - 1) * Lb) >= LANES and _small(T, hs, float_dtype)


def pairs_eligible(T, hs, float_dtype) -> bool:
    """Whether rows of a small-batch attention use the generated pairs kernels (see pairs_scratch)."""
    return _small(T, hs, float_dtype)


def pairs_scratch(B, T, C, NH) -> tuple:
    """Floats of the pairs kernels' forward scratch (qkv in the pairs layout, the probabilities, y) and
    backward scratch (dy, then dqkv, in the pairs layout): Lp = max(B*NH, PAIR_LANES) lanes each."""
    Lp, hs = max(B * NH, PAIR_LANES), C // NH
    return T * (3 * hs + T + hs) * Lp, T * 4 * hs * Lp


class _Vec:
    """Emits <n x float> arithmetic on one llvmlite builder."""

    def __init__(self, context, builder, arr_type, arr, n=LANES):
        self.b = builder
        self.data = context.make_array(arr_type)(context, builder, arr).data
        self.i64 = ir.IntType(64)
        self.n = n
        self.vf = ir.VectorType(_F, n)
        self.vi = ir.VectorType(ir.IntType(32), n)

    def const(self, x):
        return ir.Constant(self.vf, [float(x)] * self.n)

    def off(self, base, *terms):
        """base + sum(c * v) with Python-int c and i64 values v."""
        o = base
        for c, v in terms:
            if c:
                o = self.b.add(o, self.b.mul(ir.Constant(self.i64, c), v) if c != 1 else v)
        return o

    def load(self, off):
        return self.b.load(self.b.bitcast(self.b.gep(self.data, [off]), self.vf.as_pointer()), align=4)

    def store(self, v, off):
        self.b.store(v, self.b.bitcast(self.b.gep(self.data, [off]), self.vf.as_pointer()), align=4)

    def scatter(self, v, off, stride):
        """Lane l of v to data[off + l * stride] (one llvm.masked.scatter)."""
        b, n = self.b, self.n
        vi = ir.VectorType(self.i64, n)
        lanes = b.mul(ir.Constant(vi, list(range(n))), self._splat(stride, vi))
        base = b.ptrtoint(b.gep(self.data, [off]), self.i64)
        addrs = b.add(self._splat(base, vi), b.shl(lanes, ir.Constant(vi, [2] * n)))
        pty = ir.VectorType(self.data.type, n)
        ptrs = b.inttoptr(addrs, pty)
        mask = ir.VectorType(ir.IntType(1), n)
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(ir.VoidType(), [self.vf, pty, ir.IntType(32), mask]),
            f"llvm.masked.scatter.v{n}f32.v{n}p0")
        b.call(fn, [v, ptrs, ir.Constant(ir.IntType(32), 4), ir.Constant(mask, [1] * n)])

    def _splat(self, x, vty):
        v = self.b.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
        return self.b.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(self.vi, [0] * self.n))

    def splat(self, off):
        """data[off] in every lane."""
        return self._splat(self.b.load(self.b.gep(self.data, [off])), self.vf)

    def add(self, x, y):
        return self.b.fadd(x, y, flags=_FLAGS)

    def sub(self, x, y):
        return self.b.fsub(x, y, flags=_FLAGS)

    def mul(self, x, y):
        return self.b.fmul(x, y, flags=_FLAGS)

    def dot(self, xs, ys):
        acc = self.mul(xs[0], ys[0])
        for x, y in zip(xs[1:], ys[1:]):
            acc = self.add(acc, self.mul(x, y))
        return acc

    def sum(self, xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = self.add(acc, x)
        return acc

    def max(self, x, y):
        return self.b.select(self.b.fcmp_ordered(">", x, y), x, y)

    def min(self, x, y):
        return self.b.select(self.b.fcmp_ordered("<", x, y), x, y)

    def exp(self, x):
        """common._fexp32 (Cephes, max rel err ~1.2e-7), lane-wise."""
        b, n = self.b, self.n
        x = self.min(self.max(x, self.const(-87.0)), self.const(88.0))
        floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(self.vf, [self.vf]), f"llvm.floor.v{n}f32")
        fn = b.call(floor, [self.add(self.mul(x, self.const(1.4426950408889634)), self.const(0.5))])
        r = self.add(self.sub(x, self.mul(fn, self.const(0.693359375))), self.mul(fn, self.const(2.12194440e-4)))
        p = self.const(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = self.add(self.mul(p, r), self.const(c))
        p = self.add(self.add(self.mul(self.mul(p, r), r), r), self.const(1.0))
        e = b.shl(b.add(b.fptosi(fn, self.vi), ir.Constant(self.vi, [127] * n)), ir.Constant(self.vi, [23] * n))
        return self.mul(p, b.bitcast(e, self.vf))


def fwd_chunk(T, hs, lanes=LANES, y_rows=False):
    """Intrinsic: `lanes` independent (T x T, hs) problems of the forward -- one head x LANES sequences of the
    lanes kernels. Arguments (int64 arena offsets and strides): x0 = X[head's row 0, l0] with rows L apart
    and a token's q|k|v blocks of C rows CL = C*L apart; p0 = PL[(h*T + 0)*T + 0, l0] (rows L apart);
    y0 = y[l0, h*hs] (sequences TC = T*C apart); oscale. With y_rows (the pairs kernels), y is stored like
    X instead: row t*hs + d at y0 + (t*hs + d)*L (TC and C unused)."""
    @intrinsic
    def chunk(typingctx, a, x0, L, CL, p0, y0, TC, C, oscale):
        def impl(context, builder, sig, args):
            v = _Vec(context, builder, sig.args[0], args[0], lanes)
            _, x0, L, CL, p0, y0, TC, C, oscale = args
            X = [[[v.load(v.off(x0, (3 * t + p, CL), (d, L))) for d in range(hs)] for p in range(3)]
                 for t in range(T)]
            scale = v.splat(oscale)
            for t in range(T):
                s = [v.dot(X[t][0], X[j][1]) for j in range(t + 1)]
                m = s[0]
                for x in s[1:]:
                    m = v.max(x, m)
                e = [v.exp(v.mul(v.sub(x, m), scale)) for x in s]
                iz = builder.fdiv(v.const(1.0), v.sum(e), flags=_FLAGS)
                p = [v.mul(x, iz) for x in e]
                for j in range(t + 1):
                    v.store(p[j], v.off(p0, (t * T + j, L)))
                for d in range(hs):
                    y = v.dot(p, [X[j][2][d] for j in range(t + 1)])
                    if y_rows:
                        v.store(y, v.off(y0, (t * hs + d, L)))
                    else:
                        v.scatter(y, builder.add(v.off(y0, (t, C)), ir.Constant(v.i64, d)), TC)
            return context.get_dummy_value()
        sig = types.void(a, x0, L, CL, p0, y0, TC, C, oscale)
        return sig, impl
    return chunk


def bwd_chunk(T, hs, lanes=LANES):
    """Intrinsic: one head x LANES sequences of the backward, from X and PL as in fwd_chunk and g0 = G[head's
    row 0, l0] (dy transposed, rows as X's); writes dqkv transposed (D, rows as X's, from d0 = D[head's row
    0, l0]), which the block function then transposes out: 16-lane scatters measured slower (29 against 26
    us per layer). Overwrites, so D needs no zeroing."""
    @intrinsic
    def chunk(typingctx, a, x0, L, CL, g0, p0, d0, oscale):
        def impl(context, builder, sig, args):
            v = _Vec(context, builder, sig.args[0], args[0], lanes)
            _, x0, L, CL, g0, p0, d0, oscale = args
            X = [[[v.load(v.off(x0, (3 * t + p, CL), (d, L))) for d in range(hs)] for p in range(3)]
                 for t in range(T)]
            G = [[v.load(v.off(g0, (t, CL), (d, L))) for d in range(hs)] for t in range(T)]
            scale = v.splat(oscale)
            dq = [[None] * hs for _ in range(T)]
            dk = [[None] * hs for _ in range(T)]
            dv = [[None] * hs for _ in range(T)]

            def acc(grid, t, d, x):
                grid[t][d] = x if grid[t][d] is None else v.add(grid[t][d], x)

            for t in range(T):
                p = [v.load(v.off(p0, (t * T + j, L))) for j in range(t + 1)]
                dp = [v.dot(G[t], X[j][2]) for j in range(t + 1)]           # <dy_t, v_j>
                for j in range(t + 1):
                    for d in range(hs):
                        acc(dv, j, d, v.mul(p[j], G[t][d]))
                dot = v.dot(p, dp)
                ds = [v.mul(v.mul(p[j], v.sub(dp[j], dot)), scale) for j in range(t + 1)]
                for d in range(hs):
                    acc(dq, t, d, v.dot(ds, [X[j][1][d] for j in range(t + 1)]))
                for j in range(t + 1):
                    for d in range(hs):
                        acc(dk, j, d, v.mul(ds[j], X[t][0][d]))
            for t in range(T):
                for part, grid in enumerate((dq, dk, dv)):
                    for d in range(hs):
                        v.store(grid[t][d], v.off(d0, (3 * t + part, CL), (d, L)))
            return context.get_dummy_value()
        sig = types.void(a, x0, L, CL, g0, p0, d0, oscale)
        return sig, impl
    return chunk


_BLOCKS = """
_fwd_chunk_{T}_{hs} = fwd_chunk({T}, {hs})
_bwd_chunk_{T}_{hs} = bwd_chunk({T}, {hs})


@njit(**{OPTS})
def _lanes_fwd_{T}_{hs}(a, r, i):
    oqkv = r[1]; oy = r[2]; oP = r[3]; oW = r[4]; B = r[5]; C = r[7]; NH = r[8]
    b0, L = bl_span(B, r[10], i)
    n = {T} * 3 * C
    bl_in(a, oqkv, oW, b0, L, n)
    for h in range(NH):
        for c in range((L + {V1}) // {V}):
            l0 = min(c * {V}, L - {V})
            _fwd_chunk_{T}_{hs}(a, oW + b0 * n + h * {hs} * L + l0, L, C * L,
                               oP + (b0 * NH + h * L) * {TT} + l0, oy + (b0 + l0) * {T} * C + h * {hs}, {T} * C, C, r[9])


@njit(**{OPTS})
def _lanes_bwd_{T}_{hs}(a, r, i):
    oP = r[1]; oW = r[2]; ody = r[3]; odqkv = r[4]; oS = r[5]; B = r[6]; C = r[8]; NH = r[9]
    b0, L = bl_span(B, r[11], i)
    n = {T} * 3 * C
    bl_in(a, ody, oS, b0, L, {T} * C)
    oD = oS + B * {T} * C
    for h in range(NH):
        for c in range((L + {V1}) // {V}):
            l0 = min(c * {V}, L - {V})
            _bwd_chunk_{T}_{hs}(a, oW + b0 * n + h * {hs} * L + l0, L, C * L, oS + b0 * {T} * C + h * {hs} * L + l0,
                               oP + (b0 * NH + h * L) * {TT} + l0, oD + b0 * n + h * {hs} * L + l0, r[10])
    bl_out(a, oD, odqkv, b0, L, n)


_fwd_pairs_{T}_{hs} = fwd_chunk({T}, {hs}, {P}, True)
_bwd_pairs_{T}_{hs} = bwd_chunk({T}, {hs}, {P})
_to_pairs_{T}_{hs}, _from_pairs_{T}_{hs} = ({FAST} and pairs_block({hs}, True), {FAST} and pairs_block({hs}, False))


@njit(**FM)
def _pairs_copy_{T}_{hs}(a, orows, opairs, B, NH, parts, Lp, to_pairs):    # attn_loops.pairs_copy; B = 1 by pairs_block
    if {FAST} and B == 1 and Lp == {P}:
        for tp in range({T} * parts):
            if to_pairs:
                _to_pairs_{T}_{hs}(a, orows + tp * NH * {hs}, opairs + tp * {hs} * {P}, NH)
            else:
                _from_pairs_{T}_{hs}(a, orows + tp * NH * {hs}, opairs + tp * {hs} * {P}, NH)
    else:
        pairs_copy(a, orows, opairs, B, {T}, NH, {hs}, parts, Lp, to_pairs)


@njit(**{OPTS})
def _pairs_fwd_{T}_{hs}(a, r, i):
    oqkv = r[1]; oy = r[2]; oW = r[4]; B = r[5]; NH = r[8]
    Lp = max(B * NH, {P})
    oPL = oW + {T} * 3 * {hs} * Lp
    oY = oPL + {TT} * Lp
    _pairs_copy_{T}_{hs}(a, oqkv, oW, B, NH, 3, Lp, True)
    for c in range((Lp + {P1}) // {P}):
        l0 = min(c * {P}, Lp - {P})
        _fwd_pairs_{T}_{hs}(a, oW + l0, Lp, {hs} * Lp, oPL + l0, oY + l0, Lp, Lp, r[9])
    _pairs_copy_{T}_{hs}(a, oy, oY, B, NH, 1, Lp, False)


@njit(**{OPTS})
def _pairs_bwd_{T}_{hs}(a, r, i):
    oW = r[2]; ody = r[3]; odqkv = r[4]; oS = r[5]; B = r[6]; NH = r[9]
    Lp = max(B * NH, {P})
    oPL = oW + {T} * 3 * {hs} * Lp
    oD = oS + {T} * {hs} * Lp
    _pairs_copy_{T}_{hs}(a, ody, oS, B, NH, 1, Lp, True)
    for c in range((Lp + {P1}) // {P}):
        l0 = min(c * {P}, Lp - {P})
        _bwd_pairs_{T}_{hs}(a, oW + l0, Lp, {hs} * Lp, oS + l0, oPL + l0, oD + l0, r[10])
    _pairs_copy_{T}_{hs}(a, odqkv, oD, B, NH, 3, Lp, False)
"""


def pairs_block(hs, to_pairs):
    """Intrinsic f(a, orow, opair, NH) for one sequence (B = 1, NH <= PAIR_LANES) and one (t, part): between
    the NH*hs floats of a row, head h element d at a[orow + h*hs + d], and the pairs layout's hs rows of 8
    lanes, lane h at a[opair + d*8 + h] (lanes NH.. zero). One masked vector load, hs shuffles and hs stores
    (or hs loads, one shuffle and a masked store) in place of 8*hs scalar moves (attn_loops.pairs_copy)."""
    n = PAIR_LANES * hs

    @intrinsic
    def f(typingctx, a, orow, opair, NH):
        def impl(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            _, orow, opair, NH = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            vn, v8 = ir.VectorType(_F, n), ir.VectorType(_F, PAIR_LANES)
            vmask = ir.VectorType(ir.IntType(1), n)
            lim = builder.insert_element(ir.Constant(ir.VectorType(i64, n), ir.Undefined),
                                         builder.mul(NH, ir.Constant(i64, hs)), ir.Constant(i32, 0))
            lim = builder.shuffle_vector(lim, lim, ir.Constant(ir.VectorType(i32, n), [0] * n))
            mask = builder.icmp_unsigned("<", ir.Constant(ir.VectorType(i64, n), list(range(n))), lim)
            rowp = builder.bitcast(builder.gep(data, [orow]), vn.as_pointer())
            pair = [builder.bitcast(builder.gep(data, [builder.add(opair, ir.Constant(i64, d * PAIR_LANES))]),
                                    v8.as_pointer()) for d in range(hs)]
            if to_pairs:
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    vn, [vn.as_pointer(), i32, vmask, vn]), f"llvm.masked.load.v{n}f32.p0")
                v = builder.call(fn, [rowp, ir.Constant(i32, 4), mask, ir.Constant(vn, None)])
                for d in range(hs):
                    builder.store(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, PAIR_LANES), [
                        h * hs + d for h in range(PAIR_LANES)])), pair[d], align=4)
            else:
                vs = [builder.load(pair[d], align=4) for d in range(hs)]
                vs += [ir.Constant(v8, ir.Undefined)] * ((1 << (hs - 1).bit_length()) - hs)
                while len(vs) > 1:          # concatenate: d-th 8 lanes at d*8
                    w = vs[0].type.count
                    vs = [builder.shuffle_vector(vs[k], vs[k + 1], ir.Constant(ir.VectorType(i32, 2 * w),
                                                                                 list(range(2 * w))))
                          for k in range(0, len(vs), 2)]
                v = builder.shuffle_vector(vs[0], vs[0], ir.Constant(ir.VectorType(i32, n), [
                    (j % hs) * PAIR_LANES + j // hs for j in range(n)]))
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    ir.VoidType(), [vn, vn.as_pointer(), i32, vmask]), f"llvm.masked.store.v{n}f32.p0")
                builder.call(fn, [v, rowp, ir.Constant(i32, 4), mask])
            return context.get_dummy_value()
        if a.dtype != types.float32:
            return None
        return types.void(a, orow, opair, NH), impl
    return f


def kernel_source(name, T, hs) -> str:
    """Source of the generated kernel `name` (one of KERNEL_NAMES) for one (T, hs): the block functions above,
    then `name(a, ia, r)` (btjit/kernels/library.py wraps it as a library entry). Block functions no kernel
    of the file calls are never compiled."""
    kind, family = name.split("_")[2:4]
    par = "_par" if name.endswith("_par") else ""
    inl = 'dict(FM, inline="always")'      # the kernel and its block inlined into the entry (common.inlined)
    out = ["from numba import njit, prange",
           "from btjit.kernels.attn_lanes import bwd_chunk, fwd_chunk, pairs_block",
           "from btjit.kernels.common import FM, FM_PAR",
           "from btjit.kernels.attn_loops import bl_in, bl_out, bl_span, pairs_copy",
           _BLOCKS.format(T=T, hs=hs, TT=T * T, V=LANES, V1=LANES - 1, P=PAIR_LANES, P1=PAIR_LANES - 1,
                          FAST=hs <= PAIR_LANES, OPTS="FM" if par else inl)]
    if family == "lanes":
        body = (f"for i in {'prange' if par else 'range'}(r[{ROWS[name].args.index('nb') + 1}]):\n"
                f"        _lanes_{kind}_{T}_{hs}(a, r, i)")
    else:
        body = f"_pairs_{kind}_{T}_{hs}(a, r, 0)"
    out.append(f"\n@njit(**{'FM_PAR' if par else inl})\ndef {name}(a, ia, r):\n    {body}\n")
    return "\n".join(out)
