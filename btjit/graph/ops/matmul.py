"""Matmul and the fused linear (graph/fuse.py): shape rule, VJP, numpy reference, lowering (which GEMM
kernel a product runs on), gradient cases."""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.kernels import bf16, gemm_rule, linalg
from btjit.kernels.common import MAX_THREADS
from btjit.kernels.gemm_rule import bf16_kernel

from btjit.graph.optable import Case, F, ShapeError, TABLE, _bcast_shape, _float, bstrides, cstrides, loop_nest, op


# ----------------------------------------------------------------------------- matmul
def _matmul_rule(types, attrs, fd):
    _float(types, "")
    (sa, _), (sb, _) = types
    if len(sa) < 2 or len(sb) < 2:
        raise ShapeError("operands must be at least 2-d")
    M, K = (sa[-1], sa[-2]) if attrs["ta"] else sa[-2:]
    K2, N = (sb[-1], sb[-2]) if attrs["tb"] else sb[-2:]
    if K != K2:
        raise ShapeError(f"shapes {sa} and {sb} do not align ({K} != {K2})")
    return [(_bcast_shape(sa[:-2], sb[:-2]) + (M, N), fd)]


def _mm_ref(xs, a):
    x, y = xs
    x = np.swapaxes(x, -1, -2) if a["ta"] else x
    y = np.swapaxes(y, -1, -2) if a["tb"] else y
    return (np.matmul(x, y),)


PAR_GEMM_MACS = 200_000   # from this many multiply-adds a GEMM is split over the threads (launch ~2-4 us)
COL_SPLIT_B = 262_144     # floats of B (1 MB) from which the threads split a forward product's columns, not its
#                           rows: the micro-kernels re-read B per 8 rows, and row blocks would each stream all of
#                           it (E5's 1024 x 1024 layer on 64 rows: 1.57x -> 1.64x on two threads). dW = X^T dY
#                           products ran 15-20% slower split so (S2, S3's): they keep the rows


def split_gemm(nb, M, N, K) -> int:
    """Blocks one thread computes a GEMM row in. OpenBLAS 0.3.30 (SkylakeX kernels on this Zen 4) ran products
    of >= 1M multiply-adds 1.2-2x faster in two halves (E5: 16 x (27,1024,64) 1066 -> 662 us; E6b64 dW
    (96,24,512) 43 -> 23 us, fc (512,96,24) 28 -> 22 us) and smaller ones no faster. (B^T products split
    this way were 2-6% slower; k_matmul runs them on a transposed copy of B, where halves win too.)"""
    return 2 if nb * M * N * K >= 1_000_000 else 1


def micro_gemm(M, N, K, ta, tb, beta, bias, float_dtype) -> bool:
    """Whether a product runs on k_matmul_micro's register micro-kernels instead of sgemm: float32, C
    overwritten and at least 8 x 8, B (K x N) at most linalg.MICRO_B_MAX floats or, above, the limit
    measured on this machine (btjit/kernels/gemm_rule.py); B^T products on fewer than COPY_MIN_ROWS rows up to
    NT_MACS multiply-adds or, above, the measured limit (gemm_rule.nt_macs). They win every E6 product
    (512 rows: 50-58 against sgemm's 32-52 G multiply-adds/s; 8 rows: no per-call work; B^T on 8 rows:
    8 x 96 x 24 0.41 against 1.15 us, 8 x 24 x 72 0.33 against 0.40, 8 x 24 x 96 even at 0.45 against 0.43);
    a B^T product never has a bias (fuse_linear)."""
    if float_dtype != "f32" or beta or M < linalg.MR or N < 8 or (ta and tb):
        return False
    if K * N > linalg.MICRO_B_MAX and K * N > gemm_rule.micro_b_max():     # measured once per machine
        return bool(kc_rows(M, N, K, tb) < K)         # beyond it, B in blocks of rows (a dW on many rows)
    if not tb:
        return True
    if M >= linalg.COPY_MIN_ROWS:      # B^T on a transposed copy of B or of blocks of >= 16 of its rows
        return (N * K <= linalg.WT_MAX or K <= linalg.WT_MAX // 16) and not bias
    macs = M * N * K                  # gemm_micro_nt: K x 8 floats of A^T on the stack
    return not bias and (macs <= linalg.NT_MACS or (K <= linalg.WT_MAX // linalg.MR and macs <= gemm_rule.nt_macs()))


def kc_rows(M, N, K, tb) -> int:
    """Rows of B per block for k_matmul_micro (gemm_micro_kc): K (at once) up to the measured limit on B, beyond
    it blocks that fit linalg.MICRO_B_MAX floats where B is at most KC_N_MAX wide and M, N are multiples of 8
    (a conv's dW = X^T dY over N*OH*OW rows, an FC layer's forward on a wide input: sgemm before)."""
    if K * N <= linalg.MICRO_B_MAX or tb or M % linalg.MR or N % 8 or N > linalg.KC_N_MAX or \
            K * N <= gemm_rule.micro_b_max():
        return K
    return linalg.MICRO_B_MAX // N // 8 * 8


def bf16_gemm(L, N, float_dtype) -> bool:
    """Whether a product runs on k_matmul_bf16 or k_matmul_amx (bf16 operands, float32 sums; gemm_rule.bf16_kernel
    chooses): a float32 program traced with precision="bf16", C at least bf16.N_MIN columns wide (narrower
    products stay float32)."""
    return L.precision == "bf16" and float_dtype == "f32" and N >= bf16.N_MIN


def batch_split(nbatch, threads) -> bool:
    """Whether a batch of products splits over the threads as whole products (no B read by two threads, no
    transposed copy made twice) rather than by rows: as many products as threads at least, evenly or >= 4 per
    thread (16 products of 27 rows, E5's tables: its rows would split 16 / 11)."""
    return nbatch >= threads and (nbatch % threads == 0 or nbatch >= 4 * threads)


def par_gemm(macs, threads) -> bool:
    """Whether a product of `macs` multiply-adds in all runs split over the thread pool (a split row)."""
    return min(threads, MAX_THREADS) > 1 and macs >= PAR_GEMM_MACS


def _lower_matmul(e, L, beta=0, bias=0, osum=0, res=None, relu=False):
    """Rows of a matmul (C = op(A) @ op(B), + bias row, and the column sums osum of B for matmul_colsum);
    res: a var of C's shape added to it (a linear's residual connection); relu: C = relu(all that) (a linear's
    activation). Both by the micro-kernels as they store C, else by add / relu rows after the product."""
    A, B = e.ins
    C = e.outs[0]
    M, N = C.shape[-2:]
    ta, tb = int(e.attrs["ta"]), int(e.attrs["tb"])
    K = A.shape[-2] if ta else A.shape[-1]
    batch = C.shape[:-2]
    nb_total = int(np.prod(batch, dtype=np.int64))
    threads = min(L.threads, MAX_THREADS)
    par = par_gemm(M * N * K * nb_total, threads)

    bf = bf16_gemm(L, N, C.dtype) and not beta

    def micro(m):           # bias, residual and relu inside the product's kernel
        return bf or micro_gemm(m, N, K, ta, tb, beta, bias, C.dtype)

    def row(oa, ob, oc, nb, m, sa_, sb_, sc_):
        args = dict(oA=oa, oB=ob, oC=oc, nbatch=nb, M=m, N=N, K=K, sA=sa_, sB=sb_, sC=sc_, ta=ta, tb=tb)
        if micro(m):        # split over the threads by blocks of C's rows (or columns): bitwise equal to one thread
            kernel = bf16_kernel() if bf else "k_matmul_micro"
            margs = dict(args, obias=bias, relu=int(relu), ores=L.off(res) + oc - L.off(C) if res is not None else 0,
                         **({} if bf else {"osum": osum, "kc": kc_rows(m, N, K, tb)}))
            if par and batch_split(nb, threads):                              # each thread whole products
                return L.row(kernel, **margs, by=2, split=threads)
            if par and not bf and not ta and not tb and K * N >= COL_SPLIT_B and N >= 16 * threads:
                return L.row(kernel, **margs, by=1, split=threads)            # each thread its columns
            if par and m >= 2 * linalg.MR:
                return L.row(kernel, **margs, by=0, split=min(threads, m // linalg.MR))
            return L.row(kernel, **margs, by=0)
        # its blocks: decided by the shape, never by the threads (BLAS sums blocks of other shapes in another order:
        # a thread count must not change the bits); with threads, one block per part on the pool
        parts = max(split_gemm(nb, m, N, K), 2 if M * N * K * nb_total >= PAR_GEMM_MACS else 1)
        return L.row("k_matmul", **args, beta=beta, osc=L.scratch, oconst=L.one_zero, obias=bias, nparts=parts,
                     split=min(threads, parts) if par else 1)
    if len(B.shape) == 2 and not ta:      # fold A's batch dims into M: one GEMM
        rows = [row(L.off(A), L.off(B), L.off(C), 1, nb_total * M, 0, 0, 0)]
        if not micro(nb_total * M):
            rows += TABLE["add"].lower(type(e)("add", (C, res), (C,), {}), L) if res is not None else []
            rows += TABLE["relu"].lower(type(e)("relu", (C,), (C,), {}), L) if relu else []
        return rows
    assert res is None and not relu, "a residual or relu needs B 2-D and A untransposed (graph/fuse.py)"
    sa = bstrides(A.shape[:-2] or (1,), batch or (1,))
    sb = bstrides(B.shape[:-2] or (1,), batch or (1,))
    ma, mb = A.shape[-2] * A.shape[-1], B.shape[-2] * B.shape[-1]
    ops_ = [(L.off(C), tuple(s * M * N for s in cstrides(batch or (1,)))),
            (L.off(A), tuple(s * ma for s in sa)), (L.off(B), tuple(s * mb for s in sb))]
    # the innermost collapsed batch run is the kernel's nbatch loop; outer batch dims become rows
    return [row(oa, ob, oc, nb, M, sa_, sb_, sc_)
            for (oc, oa, ob), [(nb, (sc_, sa_, sb_))] in loop_nest(batch or (1,), ops_, 1)]


def _matmul_vjp(g, x, o, a):
    A, B = x
    g = g[0]
    ta, tb = a["ta"], a["tb"]
    mm = lambda p, q, t1, t2: T.emit("matmul", (p, q), ta=bool(t1), tb=bool(t2))  # noqa: E731
    if ta:
        dA = mm(B, g, 0, 1) if not tb else mm(B, g, 1, 1)
    elif A.ndim == 2 and B.ndim > 2 and not tb:
        # A broadcast over B's batch (the embedding fold's table @ W-blocks): dA = (sum_i B_i @ g_i^T)^T. The
        # GEMMs written this way round ran 1.28x faster than g_i @ B_i^T (E5: 1.11 vs 1.42 ms, OpenBLAS 0.3.30).
        dA = T.transpose(T.sum(mm(B, g, 0, 1), axis=tuple(range(B.ndim - 2))))
    else:
        dA = mm(g, B, 0, not tb)
    if A.ndim > 2 and B.ndim == 2 and not ta:   # dW of x @ W: fold the batch into one GEMM
        A2, g2 = T.reshape(A, (-1, A.shape[-1])), T.reshape(g, (-1, g.shape[-1]))
        dB = mm(A2, g2, 1, 0) if not tb else mm(g2, A2, 1, 0)
    elif not tb:
        dB = mm(A, g, not ta, 0) if not ta else mm(A, g, 0, 0)
    else:
        dB = mm(g, A, 1, 0) if not ta else mm(g, A, 1, 1)
    return [dA, dB]


op("matmul", infer=_matmul_rule, ref=_mm_ref, lower=_lower_matmul, vjp=_matmul_vjp,
   cases=[Case((F(3, 4), F(4, 5)), {"ta": False, "tb": False}), Case((F(2, 3, 4), F(4, 5)), {"ta": False, "tb": False}),
          Case((F(2, 3, 4), F(2, 4, 5)), {"ta": False, "tb": False}), Case((F(3, 4), F(2, 4, 5)), {"ta": False, "tb": False}),
          Case((F(4, 3), F(4, 5)), {"ta": True, "tb": False}), Case((F(3, 4), F(5, 4)), {"ta": False, "tb": True}),
          Case((F(2, 4, 3), F(2, 5, 4)), {"ta": True, "tb": True}), Case((F(2, 1, 3, 4), F(3, 4, 2)), {"ta": False, "tb": False})])


# ----------------------------------------------------------------------------- fused linear (graph/fuse.py)
def _linear_rule(types, attrs, fd):
    _float(types, "")
    (sx, _), (sw, _), (sb, _) = types[:3]
    out = tuple(sx[:-1]) + (sw[1],) if len(sw) == 2 and sx else None
    if out is None or sx[-1] != sw[0] or tuple(sb) != (sw[1],) or (len(types) == 4 and tuple(types[3][0]) != out):
        raise ShapeError(f"linear needs x (..., K), w (K, N), b (N,) [, r (..., N)]; got "
                         f"{', '.join(str(t[0]) for t in types)}")
    return [(out, fd)]


def _linear_vjp(g, x, o, a):
    X, W = x[:2]
    g = T.emit("relu_grad", (o[0], g[0])) if a.get("relu") else g[0]
    X2, g2 = T.reshape(X, (-1, X.shape[-1])), T.reshape(g, (-1, g.shape[-1]))
    dX = T.emit("matmul", (g, W), ta=False, tb=True)
    dW, db = T.emit("matmul_colsum", (X2, g2))
    return [dX, dW, db, g][:len(x)]


def _lower_matmul_colsum(e, L):
    """dW = X^T dY and db = dY.sum(0): one micro-kernel row where the product takes them (the column sums
    ride along the loop over dY's rows), else the matmul and sum rows."""
    (X, G), (dW, db) = e.ins, e.outs
    mm = type(e)("matmul", (X, G), (dW,), {"ta": True, "tb": False})
    M, N, K = X.shape[1], G.shape[1], X.shape[0]
    if micro_gemm(M, N, K, 1, 0, 0, 0, X.dtype) and not bf16_gemm(L, N, X.dtype):
        return _lower_matmul(mm, L, osum=L.off(db))
    return _lower_matmul(mm, L) + TABLE["sum"].lower(type(e)("sum", (G,), (db,), {"lo": 0, "hi": 1}), L)


op("matmul_colsum", internal=True, lower=_lower_matmul_colsum,
   infer=lambda t, a, fd: [((t[0][0][1], t[1][0][1]), fd), ((t[1][0][1],), fd)],
   ref=lambda xs, a: (xs[0].T @ xs[1], xs[1].sum(0)),
   cases=[Case((F(8, 24), F(8, 72))), Case((F(5, 3), F(5, 4))), Case((F(130, 9), F(130, 50)))])


def _linear_ref(xs, a):
    y = xs[0] @ xs[1] + xs[2] + (xs[3] if len(xs) > 3 else 0)
    return (np.where(y > 0, y, 0.0) if a.get("relu") else y,)


op("linear", infer=_linear_rule, ref=_linear_ref, vjp=_linear_vjp,
   lower=lambda e, L: _lower_matmul(type(e)("matmul", e.ins[:2], e.outs, {"ta": False, "tb": False}), L,
                                    bias=L.off(e.ins[2]), res=e.ins[3] if len(e.ins) > 3 else None,
                                    relu=e.attrs.get("relu", False)),
   cases=[Case((F(5, 3), F(3, 4), F(4))), Case((F(2, 3, 4), F(4, 6), F(6))),
          Case((F(5, 3), F(3, 4), F(4), F(5, 4))), Case((F(2, 8, 24), F(24, 30), F(30), F(2, 8, 30))),
          Case((F(5, 3), F(3, 4), F(4)), {"relu": True}), Case((F(2, 8, 24), F(24, 30), F(30)), {"relu": True}),
          Case((F(2, 8, 24), F(24, 30), F(30), F(2, 8, 30)), {"relu": True}),
          Case((F(9, 5), F(5, 8), F(8), F(9, 8)), {"relu": True})])


