# Causal attention for one (T, hs) as explicit 16-lane vector code (float32 arenas), emitted here as LLVM IR
# and compiled by llvmlite straight to machine code: ~0.2-0.5 s per entry, where numba's pipeline around the
# same IR took 2.4-3.5 s. A chunk of LANES sequences x one head is ONE straight-line block: every q/k/v row is
# loaded once as a <16 x float>, the whole T x T problem (scores, max, exp, sums, products, and in the
# backward all of dq/dk/dv) runs in registers, and only P rows, y and dqkv are stored. Per GPT layer at batch
# 64 (T=8, hs=4, one thread): forward 44 -> 18.5 us, backward 57 -> 19.6 us against the loop kernels.
#
# Each generated kernel is a library entry per (T, hs) with the entry ABI
#   int32 entry(float *a, int64 na, int32 *ia, int64 nia, int64 *row)
# (btjit/kernels/library.py caches its object code and loads it). The layout changes around it are the
# shape-generic library kernels of attn_loops.py, rows of their own:
#   lanes (batch >= BL_MIN_B, one thread): the bl pair's layouts (attn_loops.py) -- k_attn_bl_move (qkv -> W),
#     k_attn_fwd_lanes; k_attn_bl_move (dy -> S), k_attn_bwd_lanes, k_attn_bl_move (D -> dqkv). Every block
#     holds >= LANES sequences; its last chunk starts at L - LANES and may redo lanes of the chunk before it,
#     which is harmless: every store is an overwrite.
#   pairs (batch < BL_MIN_B): lanes are 8 (sequence, head) pairs, qkv / dy moved into that layout in W / S
#     and y / dqkv out of it by the entry itself (one sequence of <= 8 heads by masked vector loads / stores
#     and shuffles, else by scalar loops).
import llvmlite.binding as llvm
from llvmlite import ir

from btjit.kernels.common import FM_FLAGS as _FLAGS, ROWS, declare

LANES = 16
PAIR_LANES = 8        # the small-batch "pairs" kernels: lanes are (sequence, head) pairs (Zen 4 runs 16 as 2 x 8)
KERNEL_NAMES = ("k_attn_bwd_lanes", "k_attn_bwd_pairs", "k_attn_fwd_lanes", "k_attn_fwd_pairs")
declare("k_attn_fwd_lanes", "oW oP oy B T C NH oscale nb")
declare("k_attn_bwd_lanes", "oW oP oS oD B T C NH oscale nb")
declare("k_attn_fwd_pairs", "oqkv oy oW B T C NH oscale")
declare("k_attn_bwd_pairs", "ody odqkv oW oS B T C NH oscale")
_F = ir.FloatType()
_I64, _I32 = ir.IntType(64), ir.IntType(32)


FAST_CODEGEN_OPS = 1100     # bodies above this compile with LLVM's code generator at level 1, not 3: at T 8 and
# hs 8 (1296) 0.25 s less per entry and the same speed (fwd 26.8 / 27.5 us, bwd 33.5 / 33.7 us, batch 32); at
# T 8, hs 4 (1008) level 1 ran 7-11% slower (E6 batch 64), so it keeps level 3


def body_ops(T, hs) -> int:
    """Vector operations of a chunk body: per score 2*hs multiply-adds and ~20 of exp and softmax."""
    return T * (T + 1) // 2 * (2 * hs + 20)


def _small(T, hs, float_dtype) -> bool:
    """float32 and a body of bounded size, so that an entry compiles in well under a second: per score 2*hs
    multiply-adds and ~20 operations of exp and softmax, at most 1400 (T 8, hs 8: 1296, 0.6-0.7 s; T 16,
    hs 2: 3264 took 1.3 s), and T*hs <= 64 (q, k, v and their gradients, 4*T*hs vectors, held at once:
    T 4, hs 48 took 2.3 s)."""
    return float_dtype == "f32" and body_ops(T, hs) <= 1400 and T * hs <= 64


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


def _declare(module, fnty, name):
    return module.globals.get(name) or ir.Function(module, fnty, name)


class _Vec:
    """Emits <n x float> arithmetic on one llvmlite builder over the float* `data`."""

    def __init__(self, builder, data, n=LANES):
        self.b = builder
        self.data = data
        self.i64 = _I64
        self.n = n
        self.vf = ir.VectorType(_F, n)
        self.vi = ir.VectorType(_I32, n)

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
        fn = _declare(
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
        floor = _declare(b.module, ir.FunctionType(self.vf, [self.vf]), f"llvm.floor.v{n}f32")
        fn = b.call(floor, [self.add(self.mul(x, self.const(1.4426950408889634)), self.const(0.5))])
        r = self.add(self.sub(x, self.mul(fn, self.const(0.693359375))), self.mul(fn, self.const(2.12194440e-4)))
        p = self.const(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = self.add(self.mul(p, r), self.const(c))
        p = self.add(self.add(self.mul(self.mul(p, r), r), r), self.const(1.0))
        e = b.shl(b.add(b.fptosi(fn, self.vi), ir.Constant(self.vi, [127] * n)), ir.Constant(self.vi, [23] * n))
        return self.mul(p, b.bitcast(e, self.vf))



def _emit_fwd(v, T, hs, x0, L, CL, p0, y0, TC, C, oscale, y_rows=False):
    """`v.n` independent (T x T, hs) problems of the forward -- one head x LANES sequences of the lanes
    kernels (int64 arena offsets and strides): x0 = X[head's row 0, l0] with rows L apart and a token's q|k|v
    blocks of C rows CL = C*L apart; p0 = PL[(h*T + 0)*T + 0, l0] (rows L apart); y0 = y[l0, h*hs]
    (sequences TC = T*C apart); oscale. With y_rows (the pairs kernels), y is stored like X instead: row
    t*hs + d at y0 + (t*hs + d)*L (TC and C unused)."""
    b = v.b
    X = [[[v.load(v.off(x0, (3 * t + p, CL), (d, L))) for d in range(hs)] for p in range(3)] for t in range(T)]
    scale = v.splat(oscale)
    for t in range(T):
        s = [v.dot(X[t][0], X[j][1]) for j in range(t + 1)]
        m = s[0]
        for x in s[1:]:
            m = v.max(x, m)
        e = [v.exp(v.mul(v.sub(x, m), scale)) for x in s]
        iz = b.fdiv(v.const(1.0), v.sum(e), flags=_FLAGS)
        p = [v.mul(x, iz) for x in e]
        for j in range(t + 1):
            v.store(p[j], v.off(p0, (t * T + j, L)))
        for d in range(hs):
            y = v.dot(p, [X[j][2][d] for j in range(t + 1)])
            if y_rows:
                v.store(y, v.off(y0, (t * hs + d, L)))
            else:
                v.scatter(y, b.add(v.off(y0, (t, C)), ir.Constant(_I64, d)), TC)


def _emit_bwd(v, T, hs, x0, L, CL, g0, p0, d0, oscale):
    """One head x LANES sequences of the backward, from X and PL as in _emit_fwd and g0 = G[head's row 0, l0]
    (dy transposed, rows as X's); writes dqkv transposed (D, rows as X's, from d0 = D[head's row 0, l0]),
    which k_attn_bl_move then transposes out: 16-lane scatters measured slower (29 against 26 us per layer).
    Overwrites, so D needs no zeroing."""
    X = [[[v.load(v.off(x0, (3 * t + p, CL), (d, L))) for d in range(hs)] for p in range(3)] for t in range(T)]
    G = [[v.load(v.off(g0, (t, CL), (d, L))) for d in range(hs)] for t in range(T)]
    scale = v.splat(oscale)
    grids = [[[None] * hs for _ in range(T)] for _ in range(3)]      # dq, dk, dv
    dq, dk, dv = grids

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
        for part, grid in enumerate(grids):
            for d in range(hs):
                v.store(grid[t][d], v.off(d0, (3 * t + part, CL), (d, L)))


def _emit_pairs_block(b, data, hs, to_pairs, orow, opair, NH):
    """One sequence (B = 1, NH <= PAIR_LANES) and one (t, part): between the NH*hs floats of a row, head h
    element d at data[orow + h*hs + d], and the pairs layout's hs rows of 8 lanes, lane h at
    data[opair + d*8 + h] (lanes NH.. zero). One masked vector load, hs shuffles and hs stores (or hs loads,
    one shuffle and a masked store) in place of 8*hs scalar moves (_emit_pairs_copy)."""
    n = PAIR_LANES * hs
    vn, v8 = ir.VectorType(_F, n), ir.VectorType(_F, PAIR_LANES)
    vmask = ir.VectorType(ir.IntType(1), n)
    lim = b.insert_element(ir.Constant(ir.VectorType(_I64, n), ir.Undefined), b.mul(NH, ir.Constant(_I64, hs)),
                           ir.Constant(_I32, 0))
    lim = b.shuffle_vector(lim, lim, ir.Constant(ir.VectorType(_I32, n), [0] * n))
    mask = b.icmp_unsigned("<", ir.Constant(ir.VectorType(_I64, n), list(range(n))), lim)
    rowp = b.bitcast(b.gep(data, [orow]), vn.as_pointer())
    pair = [b.bitcast(b.gep(data, [b.add(opair, ir.Constant(_I64, d * PAIR_LANES))]), v8.as_pointer())
            for d in range(hs)]
    if to_pairs:
        fn = _declare(b.module, ir.FunctionType(vn, [vn.as_pointer(), _I32, vmask, vn]), f"llvm.masked.load.v{n}f32.p0")
        v = b.call(fn, [rowp, ir.Constant(_I32, 4), mask, ir.Constant(vn, None)])
        for d in range(hs):
            b.store(b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, PAIR_LANES), [
                h * hs + d for h in range(PAIR_LANES)])), pair[d], align=4)
    else:
        vs = [b.load(pair[d], align=4) for d in range(hs)]
        vs += [ir.Constant(v8, ir.Undefined)] * ((1 << (hs - 1).bit_length()) - hs)
        while len(vs) > 1:          # concatenate: d-th 8 lanes at d*8
            w = vs[0].type.count
            vs = [b.shuffle_vector(vs[k], vs[k + 1], ir.Constant(ir.VectorType(_I32, 2 * w), list(range(2 * w))))
                  for k in range(0, len(vs), 2)]
        v = b.shuffle_vector(vs[0], vs[0], ir.Constant(ir.VectorType(_I32, n), [
            (j % hs) * PAIR_LANES + j // hs for j in range(n)]))
        fn = _declare(b.module, ir.FunctionType(ir.VoidType(), [vn, vn.as_pointer(), _I32, vmask]),
                      f"llvm.masked.store.v{n}f32.p0")
        b.call(fn, [v, rowp, ir.Constant(_I32, 4), mask])



def _emit_pairs_copy(b, data, T, hs, parts, to_pairs, orows, opairs, B, NH, Lp):
    """Between the (B, T, parts*C) rows at orows (C = NH*hs; part p, head h, element d at column p*C + h*hs + d)
    and the pairs layout at opairs: row (t*parts + p)*hs + d, lane q = b*NH + h of a (T*parts*hs, Lp) matrix.
    to_pairs: rows -> pairs, with lanes B*NH .. Lp-1 zeroed; else pairs -> rows. Scalar moves."""
    c = lambda x: ir.Constant(_I64, x)   # noqa: E731
    C = b.mul(NH, c(hs))
    if to_pairs:
        BN = b.mul(B, NH)
        _loop(b, c(T * parts * hs), lambda rw: _loop(b, b.sub(Lp, BN), lambda q: b.store(
            ir.Constant(_F, 0.0), b.gep(data, [b.add(opairs, b.add(b.mul(rw, Lp), b.add(BN, q)))]))))

    def seq(bi):
        def tok(t):
            rows = b.add(orows, b.mul(b.add(b.mul(bi, c(T)), t), b.mul(C, c(parts))))

            def head(h):
                for p in range(parts):
                    lanes = b.add(opairs, b.add(b.mul(b.add(b.mul(t, c(parts)), c(p)), b.mul(c(hs), Lp)),
                                                b.add(b.mul(bi, NH), h)))
                    for d in range(hs):
                        x = b.gep(data, [b.add(rows, b.add(b.mul(c(p), C), b.add(b.mul(h, c(hs)), c(d))))])
                        y = b.gep(data, [b.add(lanes, b.mul(c(d), Lp))])
                        src, dst = (x, y) if to_pairs else (y, x)
                        b.store(b.load(src), dst)
            _loop(b, NH, head)
        _loop(b, c(T), tok)
    _loop(b, B, seq)

# ---------------------------------------------------------------- the entries
def _loop(b, n, body):
    """for i in range(n): body(i) -- n an i64 value."""
    zero = ir.Constant(_I64, 0)
    pre, loop, done = b.block, b.append_basic_block("loop"), b.append_basic_block("done")
    b.cbranch(b.icmp_signed(">", n, zero), loop, done)
    b.position_at_end(loop)
    i = b.phi(_I64)
    i.add_incoming(zero, pre)
    body(i)
    nxt = b.add(i, ir.Constant(_I64, 1))
    i.add_incoming(nxt, b.block)
    b.cbranch(b.icmp_signed("<", nxt, n), loop, done)
    b.position_at_end(done)


def symbol(name, T, hs) -> str:
    return f"btjit_{name}_T{T}_hs{hs}"


def entry_ir(name, T, hs) -> str:
    """The LLVM IR of the generated entry `name` (one of KERNEL_NAMES) for (T, hs)."""
    mod = ir.Module(name=symbol(name, T, hs))
    fp = _F.as_pointer()
    fn = ir.Function(mod, ir.FunctionType(_I32, [fp, _I64, _I32.as_pointer(), _I64, _I64.as_pointer()]),
                     symbol(name, T, hs))
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    data, rp = fn.args[0], fn.args[4]
    args = ROWS[name].args
    f = {n: b.load(b.gep(rp, [ir.Constant(_I64, k + 1)])) for k, n in enumerate(args)}
    c = lambda x: ir.Constant(_I64, x)   # noqa: E731
    B, C, NH = f["B"], f["C"], f["NH"]
    if name.endswith("_lanes"):
        v = _Vec(b, data)
        n = b.mul(c(3 * T), C)                                      # a sequence's floats in X (W)

        def block(i):                                               # attn_loops.bl_span
            Lb = b.sdiv(b.add(B, b.sub(f["nb"], c(1))), f["nb"])
            b0 = b.mul(i, Lb)
            L = b.select(b.icmp_signed("<", Lb, b.sub(B, b0)), Lb, b.sub(B, b0))
            xb = b.add(f["oW"], b.mul(b0, n))
            pb = b.add(f["oP"], b.mul(b.mul(b0, NH), c(T * T)))

            def head(h):
                def chunk(ci):
                    l0 = b.mul(ci, c(LANES))
                    l0 = b.select(b.icmp_signed("<", l0, b.sub(L, c(LANES))), l0, b.sub(L, c(LANES)))
                    x0 = b.add(b.add(xb, b.mul(h, b.mul(c(hs), L))), l0)
                    p0 = b.add(b.add(pb, b.mul(b.mul(h, L), c(T * T))), l0)
                    if name == "k_attn_fwd_lanes":
                        y0 = b.add(f["oy"], b.add(b.mul(b.mul(b.add(b0, l0), c(T)), C), b.mul(h, c(hs))))
                        _emit_fwd(v, T, hs, x0, L, b.mul(C, L), p0, y0, b.mul(c(T), C), C, f["oscale"])
                    else:
                        g0 = b.add(b.add(b.add(f["oS"], b.mul(b0, b.mul(c(T), C))), b.mul(h, b.mul(c(hs), L))), l0)
                        d0 = b.add(b.add(b.add(f["oD"], b.mul(b0, n)), b.mul(h, b.mul(c(hs), L))), l0)
                        _emit_bwd(v, T, hs, x0, L, b.mul(C, L), g0, p0, d0, f["oscale"])
                _loop(b, b.sdiv(b.add(L, c(LANES - 1)), c(LANES)), chunk)
            _loop(b, NH, head)
        _loop(b, f["nb"], block)
    else:
        v = _Vec(b, data, PAIR_LANES)
        BN = b.mul(B, NH)
        Lp = b.select(b.icmp_signed(">", BN, c(PAIR_LANES)), BN, c(PAIR_LANES))
        oW = f["oW"]
        oPL = b.add(oW, b.mul(c(T * 3 * hs), Lp))
        one = b.and_(b.icmp_signed("==", B, c(1)), b.icmp_signed("<=", NH, c(PAIR_LANES)))

        def moves(orows, opairs, parts, to_pairs):                   # between the rows and the pairs layout
            if hs > PAIR_LANES:
                return _emit_pairs_copy(b, data, T, hs, parts, to_pairs, orows, opairs, B, NH, Lp)
            with b.if_else(one) as (then, otherwise):
                with then:
                    for tp in range(T * parts):
                        _emit_pairs_block(b, data, hs, to_pairs, b.add(orows, b.mul(c(tp * hs), NH)),
                                          b.add(opairs, c(tp * hs * PAIR_LANES)), NH)
                with otherwise:
                    _emit_pairs_copy(b, data, T, hs, parts, to_pairs, orows, opairs, B, NH, Lp)

        def chunk(ci):
            l0 = b.mul(ci, c(PAIR_LANES))
            l0 = b.select(b.icmp_signed("<", l0, b.sub(Lp, c(PAIR_LANES))), l0, b.sub(Lp, c(PAIR_LANES)))
            if name == "k_attn_fwd_pairs":
                oY = b.add(oPL, b.mul(c(T * T), Lp))
                _emit_fwd(v, T, hs, b.add(oW, l0), Lp, b.mul(c(hs), Lp), b.add(oPL, l0), b.add(oY, l0), Lp, Lp,
                          f["oscale"], y_rows=True)
            else:
                oD = b.add(f["oS"], b.mul(c(T * hs), Lp))
                _emit_bwd(v, T, hs, b.add(oW, l0), Lp, b.mul(c(hs), Lp), b.add(f["oS"], l0), b.add(oPL, l0),
                          b.add(oD, l0), f["oscale"])
        nchunks = b.sdiv(b.add(Lp, c(PAIR_LANES - 1)), c(PAIR_LANES))
        if name == "k_attn_fwd_pairs":
            moves(f["oqkv"], oW, 3, True)
            _loop(b, nchunks, chunk)
            moves(f["oy"], b.add(oPL, b.mul(c(T * T), Lp)), 1, False)
        else:
            moves(f["ody"], f["oS"], 1, True)
            _loop(b, nchunks, chunk)
            moves(f["odqkv"], b.add(f["oS"], b.mul(c(T * hs), Lp)), 3, False)
    b.ret(ir.Constant(_I32, 0))
    return str(mod)


def compile_entry(name, T, hs, tm) -> bytes:
    """Object code of the generated entry for the target machine `tm` (numba's, so it runs and links as
    the library's other entries do): the IR optimized at O3 without the loop vectorizer and unroller -- the
    chunks are vector code already, and on the pairs entries' scalar layout loops those two took 5 of 5.6 s
    (backward, T 8, hs 8) -- then emitted."""
    m = llvm.parse_assembly(entry_ir(name, T, hs))
    m.triple, m.data_layout = tm.triple, str(tm.target_data)
    m.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = pto.loop_unrolling = False
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(m, pb)
    return tm.emit_object(m)

