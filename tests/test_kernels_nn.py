# Tests for btjit/kernels/{common,linalg,nn,attn_loops,attn_lanes}.py: every kernel on float32 and float64
# arenas against float64 numpy references (written here), backward kernels also against central finite
# differences of the numpy forward.
# Each test also checks that a kernel writes nothing outside its declared outputs.
import functools

import numpy as np
import pytest
from numba import njit

from btjit.kernels.common import FM, cvt, fexp, ftanh, transpose
from btjit.kernels.linalg import k_matmul
from btjit.testing import run_parts
from btjit.kernels import attn_lanes, attn_loops as KA
from btjit.kernels import nn as K

DTS = [np.float32, np.float64]
GARBAGE = 777.25


def tol(dt):
    return 1e-5 if dt == np.float32 else 1e-10


def check(got, ref, dt, t=None):
    """max |got - ref| <= tol * max(1, max|ref|)"""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    lim = (tol(dt) if t is None else t) * max(1.0, float(np.abs(ref).max(initial=0.0)))
    err = float(np.abs(got - ref).max(initial=0.0))
    assert err <= lim, f"max abs err {err:.3e} > {lim:.3e}"


def rnd(rng, shape, dt, scale=1.0):
    """random normal values already rounded to dt (so the float64 reference sees the stored values)"""
    return (rng.standard_normal(shape) * scale).astype(dt).astype(np.float64)


class Arena:
    """Float arena with named regions (16-aligned, 16-float guard gaps pre-filled with garbage)."""

    def __init__(self, dt):
        self.dt, self.regions, self.n = dt, {}, 16

    def put(self, name, x=None, size=None):
        size = int(np.size(x)) if x is not None else int(size)
        self.regions[name] = (self.n, size, x)
        self.n += (size + 15) // 16 * 16 + 16
        return self.regions[name][0]

    def build(self):
        self.a = np.full(self.n + 16, GARBAGE, self.dt)
        for o, size, x in self.regions.values():
            if x is not None:
                self.a[o:o + size] = np.ravel(x)
        self.before = self.a.copy()
        return self.a

    def get(self, name, shape=None):
        o, size, _ = self.regions[name]
        v = self.a[o:o + size].astype(np.float64)
        return v.reshape(shape) if shape is not None else v

    def only_wrote(self, *names):
        mask = np.ones(self.a.size, bool)
        for nm in names:
            o, size, _ = self.regions[nm]
            mask[o:o + size] = False
        assert np.array_equal(self.a[mask], self.before[mask]), "kernel wrote outside its outputs"


def row(*args):
    """A tape row as the lowering makes them: opcode slot, args, zero-padded to ROW."""
    from btjit.kernels.common import ROW
    return np.array([0, *args] + [0] * (ROW - 1 - len(args)), np.int64)


def fd_grad(f, x, eps=1e-6):
    """central finite-difference gradient of scalar f at x (float64)"""
    g = np.zeros_like(x)
    for i in range(x.size):
        xp = x.copy(); xp.flat[i] += eps
        xm = x.copy(); xm.flat[i] -= eps
        g.flat[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


# ---------------------------------------------------------------- common helpers
@njit(**FM)
def _map(x, y, which):
    for i in range(x.shape[0]):
        y[i] = fexp(x[i]) if which == 0 else ftanh(x[i])


@njit(**FM)
def _cvt(a):
    return cvt(a, 0.1)


@pytest.mark.parametrize("dt", DTS)
def test_fexp_ftanh_cvt(dt):
    x = np.linspace(-80, 80, 20001).astype(dt)
    y = np.empty_like(x)
    _map(x, y, 0)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - ref) / ref) < (3e-7 if dt == np.float32 else 1e-15)
    x = np.linspace(-12, 12, 20001).astype(dt)
    _map(x, y, 1)
    assert np.max(np.abs(y - np.tanh(x.astype(np.float64)))) < (5e-7 if dt == np.float32 else 1e-15)
    # saturated where tanh rounds to +-1 in the dtype (a tanh gradient 1 - t^2 is then exactly 0), NaN kept
    x = np.array([9.5, 12.0, 36.0, np.inf, -9.5, -40.0, -np.inf, np.nan], dt)
    y = np.empty_like(x)
    _map(x, y, 1)
    ref = np.tanh(x.astype(np.float64)).astype(dt)
    np.testing.assert_allclose(y, ref, rtol=0, atol=0 if dt == np.float32 else 1e-15)
    c = _cvt(np.zeros(1, dt))
    assert type(c) in (float, np.float32, np.float64) and c == dt(0.1)


# ---------------------------------------------------------------- matmul
MM_SHAPES = [(8, 72, 24), (5, 7, 13), (1, 65, 24), (33, 17, 96),
             (130, 24, 40), (64, 96, 24),   # >= linalg.COPY_MIN_ROWS rows: B^T products on a transposed copy
             (6, 129, 128)]                 # N*K > linalg.WT_MAX: through BLAS's transpose, not a stack copy


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("beta", [0, 1])
@pytest.mark.parametrize("M,N,Kd", MM_SHAPES)
@pytest.mark.parametrize("nparts", [1, 2, 3])
def test_matmul(dt, ta, tb, beta, M, N, Kd, nparts):
    rng = np.random.default_rng(M * 100 + N + 7 * Kd)
    A, B, C0 = rnd(rng, (M, Kd), dt), rnd(rng, (Kd, N), dt), rnd(rng, (M, N), dt)
    ar = Arena(dt)
    oc, oA = ar.put("const", np.array([1.0, 0.0])), ar.put("A", A.T if ta else A)
    oB, oC = ar.put("B", B.T if tb else B), ar.put("C", C0)
    a = ar.build()
    ia = np.full(32, -5, np.int32)
    k_matmul(a, ia, row(oA, oB, oC, 1, M, N, Kd, 0, 0, 0, ta, tb, beta, 4, oc, 0, nparts))
    check(ar.get("C", (M, N)), A @ B + (C0 if beta else 0), dt)
    ar.only_wrote("C")
    assert np.all(ia[:4] == -5) and np.all(ia[4 + 8 * nparts:] == -5)     # 8 BLAS slots per block


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("bcast", ["A", "B", "none"])
@pytest.mark.parametrize("ta,tb,beta", [(0, 0, 0), (1, 0, 1), (0, 1, 1), (1, 1, 0)])
@pytest.mark.parametrize("nparts", [1, 2])
@pytest.mark.parametrize("M", [8, 64])
def test_matmul_batched(dt, bcast, ta, tb, beta, nparts, M):
    rng = np.random.default_rng(3)
    nb, N, Kd = 3, 4, 6
    A = rnd(rng, (nb, M, Kd), dt)
    B = rnd(rng, (nb, Kd, N), dt)
    A[:] = A[0] if bcast == "A" else A
    B[:] = B[0] if bcast == "B" else B
    C0 = rnd(rng, (nb, M, N), dt)
    As = A.transpose(0, 2, 1) if ta else A
    Bs = B.transpose(0, 2, 1) if tb else B
    ar = Arena(dt)
    oc = ar.put("const", np.array([1.0, 0.0]))
    oA = ar.put("A", As[0] if bcast == "A" else As)
    oB = ar.put("B", Bs[0] if bcast == "B" else Bs)
    oC = ar.put("C", C0)
    a = ar.build()
    ia = np.zeros(16, np.int32)
    sA = 0 if bcast == "A" else M * Kd
    sB = 0 if bcast == "B" else Kd * N
    k_matmul(a, ia, row(oA, oB, oC, nb, M, N, Kd, sA, sB, M * N, ta, tb, beta, 0, oc, 0, nparts))
    check(ar.get("C", (nb, M, N)), A @ B + (C0 if beta else 0), dt)
    ar.only_wrote("C")


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("nb", [1, 2])
@pytest.mark.parametrize("nparts", [1, 2])
def test_matmul_with_fused_bias(dt, nb, nparts):
    rng = np.random.default_rng(4)
    M, N, Kd = 5, 7, 3
    A, B, bias = rnd(rng, (nb, M, Kd), dt), rnd(rng, (Kd, N), dt), rnd(rng, (N,), dt)
    ar = Arena(dt)
    oc = ar.put("const", np.array([1.0, 0.0]))
    oA, oB, obias = ar.put("A", A), ar.put("B", B), ar.put("bias", bias)
    oC = ar.put("C", rnd(rng, (nb, M, N), dt))          # garbage: the bias pre-fill overwrites it
    a = ar.build()
    k_matmul(a, np.zeros(16, np.int32), row(oA, oB, oC, nb, M, N, Kd, M * Kd, 0, M * N, 0, 0, 0, 0, oc, obias,
                                             nparts))
    check(ar.get("C", (nb, M, N)), A @ B + bias, dt)
    ar.only_wrote("C")


@pytest.mark.parametrize("M,N,Kd,ta,tb,bias", [
    (8, 72, 24, 0, 0, 1), (8, 24, 96, 0, 0, 1), (8, 65, 24, 0, 0, 0), (13, 30, 5, 0, 0, 1), (8, 8, 1, 0, 0, 0),
    (96, 24, 8, 1, 0, 0), (24, 65, 8, 1, 0, 0), (9, 100, 7, 1, 0, 0), (17, 50, 3, 1, 0, 0),
    (8, 96, 24, 0, 1, 0), (8, 24, 24, 0, 1, 0), (13, 30, 5, 0, 1, 0), (16, 9, 3, 0, 1, 0),
    (8, 24, 96, 0, 1, 0), (8, 24, 65, 0, 1, 0), (10, 40, 30, 0, 1, 0), (8, 9, 50, 0, 1, 0),
    (130, 96, 24, 0, 0, 1), (24, 96, 130, 1, 0, 0), (130, 24, 96, 0, 1, 0), (64, 65, 24, 0, 1, 0),
    (40, 300, 520, 1, 0, 0), (33, 260, 530, 0, 0, 1),        # B above MICRO_B_MAX (the measured limit's range)
    (16, 64, 24, 0, 0, 1), (24, 40, 16, 1, 0, 0), (9, 128, 20, 0, 0, 0),               # 32-wide blocks
    (130, 200, 100, 0, 1, 0), (70, 520, 130, 0, 1, 0), (64, 300, 1024, 0, 1, 0)])  # B^T above WT_MAX: row blocks
@pytest.mark.parametrize("nb,bcast", [(1, "none"), (3, "B"), (2, "none")])
def test_matmul_micro_kernels(M, N, Kd, ta, tb, bias, nb, bcast, monkeypatch):
    """k_matmul_micro, float32: every column-block width (48, 32, 24, 16, 8) and the blocks moved back to end
    at M / N (13 x 30, 17 x 50, 9 x 100, 130 rows), plain, A^T (with B's column sums alongside) and B^T
    products (8-row ones in registers, from 64 rows on a transposed copy of B, once for a broadcast B, or
    above WT_MAX of blocks of its rows, the last moved back to end at N), bias
    rows, batched; only C (and the sums) are written, and the lowering picks it for these shapes in float32
    only, never to accumulate."""
    from btjit.graph.ops import micro_gemm
    from btjit.kernels import gemm_rule
    from btjit.kernels.linalg import k_matmul_micro
    monkeypatch.setattr(gemm_rule, "_VALUE", [1 << 20])      # the measured limit, as on a machine where they win
    assert micro_gemm(M, N, Kd, ta, tb, 0, bias, "f32") and not micro_gemm(M, N, Kd, ta, tb, 0, bias, "f64")
    assert not micro_gemm(M, N, Kd, ta, tb, 1, bias, "f32")                  # accumulation: sgemm
    dt = np.float32
    rng = np.random.default_rng(M * N + Kd)
    A, B, b = rnd(rng, (nb, M, Kd), dt), rnd(rng, (nb, Kd, N), dt), rnd(rng, (N,), dt)
    B[:] = B[0] if bcast == "B" else B
    As = A.transpose(0, 2, 1) if ta else A
    Bs = B.transpose(0, 2, 1) if tb else B
    ar = Arena(dt)
    oA, oB = ar.put("A", As), ar.put("B", Bs[0] if bcast == "B" else Bs)
    ob = ar.put("bias", b) if bias else 0
    oC = ar.put("C", rnd(rng, (nb, M, N), dt))          # garbage: overwritten
    colsum = ta == 1 and nb == 1                         # dW = X^T dY with db = dY.sum(0) (matmul_colsum)
    osum = ar.put("sum", size=N) if colsum else 0
    a = ar.build()
    k_matmul_micro(a, np.zeros(4, np.int32), row(oA, oB, oC, nb, M, N, Kd, M * Kd, 0 if bcast == "B" else Kd * N,
                                                 M * N, ta, tb, ob, osum, 0, 0, Kd))
    check(ar.get("C", (nb, M, N)), A @ B + (b if bias else 0), dt)
    if colsum:
        check(ar.get("sum", (N,)), B[0].sum(0), dt)
    ar.only_wrote("C", *(("sum",) if colsum else ()))


def test_micro_gemm_choice(monkeypatch):
    """Micro-kernels: float32, overwrite, C >= 8 x 8, B <= MICRO_B_MAX floats (or the limit measured on the
    machine), not A^T B^T; B^T products from 64 rows (K <= WT_MAX / 16), or on fewer rows up to NT_MACS
    multiply-adds (or the limit measured on the machine); no bias on B^T."""
    from btjit.graph.ops import micro_gemm
    from btjit.graph.ops.matmul import kc_rows
    from btjit.kernels import gemm_rule, linalg
    monkeypatch.setattr(gemm_rule, "_VALUE", [262144])
    assert micro_gemm(64, 256, 512, 1, 0, 0, 0, "f32") and micro_gemm(512, 1024, 256, 0, 0, 0, 1, "f32")
    assert not micro_gemm(64, 1024, 512, 1, 0, 0, 0, "f32")
    monkeypatch.setattr(gemm_rule, "_VALUE", [gemm_rule.MIN_LIMIT])
    assert micro_gemm(64, 128, 512, 1, 0, 0, 0, "f32") and kc_rows(64, 128, 512, 0) == 512
    # beyond the limit: B in blocks of rows where it is <= KC_N_MAX wide and M, N are multiples of 8, else sgemm
    assert micro_gemm(64, 256, 512, 1, 0, 0, 0, "f32") and kc_rows(64, 256, 512, 0) == 256
    assert micro_gemm(288, 64, 36864, 1, 0, 0, 0, "f32") and kc_rows(288, 64, 36864, 0) == 1024
    assert not micro_gemm(60, 256, 512, 1, 0, 0, 0, "f32") and not micro_gemm(64, 260, 512, 1, 0, 0, 0, "f32")
    assert not micro_gemm(64, 1024, 512, 0, 0, 0, 0, "f32") and not micro_gemm(64, 256, 512, 0, 1, 0, 0, "f32")
    assert micro_gemm(8, 24, 24, 0, 1, 0, 0, "f32") and micro_gemm(8, 24, 96, 0, 1, 0, 0, "f32")
    monkeypatch.setattr(gemm_rule, "_NT", [linalg.NT_MACS])                 # the measured B^T limit: none
    assert not micro_gemm(8, 100, 100, 0, 1, 0, 0, "f32")                    # > NT_MACS on 8 rows: sgemm
    monkeypatch.setattr(gemm_rule, "_NT", [1 << 20])                         # ... or 1M multiply-adds
    assert micro_gemm(8, 100, 100, 0, 1, 0, 0, "f32") and micro_gemm(32, 128, 256, 0, 1, 0, 0, "f32")
    assert not micro_gemm(32, 256, 256, 0, 1, 0, 0, "f32") and not micro_gemm(8, 8, 4000, 0, 1, 0, 0, "f32")
    assert micro_gemm(512, 24, 96, 0, 1, 0, 0, "f32") and micro_gemm(512, 96, 24, 0, 0, 0, 1, "f32")
    assert micro_gemm(96, 24, 512, 1, 0, 0, 0, "f32") and not micro_gemm(64, 1024, 1024, 0, 0, 0, 0, "f32")
    assert not micro_gemm(7, 24, 24, 0, 0, 0, 0, "f32") and not micro_gemm(8, 7, 24, 0, 0, 0, 0, "f32")
    assert not micro_gemm(8, 24, 8, 1, 1, 0, 0, "f32") and not micro_gemm(8, 24, 8, 0, 1, 0, 1, "f32")
    assert micro_gemm(64, 200, 100, 0, 1, 0, 0, "f32")                        # B^T > WT_MAX: blocks of rows
    assert not micro_gemm(64, 20, 1100, 0, 1, 0, 0, "f32")                    # ... of < 16 rows: sgemm



@pytest.mark.parametrize("M,N,Kd,ta,kc", [(64, 64, 1000, 1, 128), (16, 128, 700, 0, 256), (8, 8, 65, 1, 64),
                                          (24, 40, 300, 0, 299)])
@pytest.mark.parametrize("extras", [False, True])
def test_matmul_micro_kernels_read_b_in_blocks_of_rows(M, N, Kd, ta, kc, extras):
    """kc < K: B read in blocks of kc rows, C accumulated over the blocks, equal to the product at once (to float32
    rounding) with its bias, residual and relu applied once, and B's column sums over all of K; on one thread
    and on the threads by rows and by columns (bitwise one thread's)."""
    from btjit.kernels.linalg import k_matmul_micro
    dt = np.float32
    rng = np.random.default_rng(Kd)
    A, B, b, R = rnd(rng, (M, Kd), dt), rnd(rng, (Kd, N), dt), rnd(rng, (N,), dt), rnd(rng, (M, N), dt)
    want = np.maximum(A @ B + b + R, 0) if extras else A @ B
    got = []
    for by, nparts in ((0, 1), (0, min(2, M // 8)), (1, 2)):       # one thread; by rows; by columns
        ar = Arena(dt)
        oA, oB = ar.put("A", A.T.copy() if ta else A), ar.put("B", B)
        ob, ores = (ar.put("bias", b), ar.put("R", R)) if extras else (0, 0)
        oC = ar.put("C", rnd(rng, (M, N), dt))
        osum = ar.put("sum", size=N) if ta else 0
        a = ar.build()
        args = [oA, oB, oC, 1, M, N, Kd, 0, 0, 0, ta, 0, ob, osum, ores, int(extras), kc, by]
        run_parts(k_matmul_micro, a, np.zeros(4, np.int32), row(*args), nparts)
        got.append(ar.get("C", (M, N)).copy())
        check(got[-1], want, dt)
        if ta:
            check(ar.get("sum", (N,)), B.sum(0), dt)
        ar.only_wrote("C", *(("sum",) if ta else ()))
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])


@pytest.mark.parametrize("nb,nparts", [(4, 2), (5, 2), (9, 3)])
@pytest.mark.parametrize("ta,tb,shared,M", [(0, 0, False, 27), (1, 0, False, 27), (0, 1, False, 27), (0, 1, True, 27),
                                            (0, 1, True, 70)])
def test_batched_products_split_as_whole_products_equal_one_thread(nb, nparts, ta, tb, shared, M):
    """by 2: nparts blocks of whole products of a batch, bitwise one thread's, for every layout and a B shared by
    the batch (from COPY_MIN_ROWS rows a B^T copy, made once per block by its first product)."""
    from btjit.kernels.linalg import COPY_MIN_ROWS, k_matmul_micro
    assert 27 < COPY_MIN_ROWS <= 70
    dt, N, Kd = np.float32, 40, 64
    rng = np.random.default_rng(nb)
    A = rnd(rng, (nb, Kd, M) if ta else (nb, M, Kd), dt)
    B = rnd(rng, (1 if shared else nb, N, Kd) if tb else (nb, Kd, N), dt)
    got = []
    for by, parts in ((0, 1), (2, nparts)):
        ar = Arena(dt)
        oA, oB, oC = ar.put("A", A), ar.put("B", B), ar.put("C", rnd(rng, (nb, M, N), dt))
        a = ar.build()
        args = [oA, oB, oC, nb, M, N, Kd, M * Kd, 0 if shared else N * Kd, M * N, ta, tb, 0, 0, 0, 0, Kd, by]
        run_parts(k_matmul_micro, a, np.zeros(4, np.int32), row(*args), parts)
        got.append(ar.get("C", (nb, M, N)).copy())
        ar.only_wrote("C")
    At = A.transpose(0, 2, 1) if ta else A
    Bt = B.transpose(0, 2, 1) if tb else B
    check(got[0], At @ Bt, dt)
    np.testing.assert_array_equal(got[0], got[1])


def test_micro_gemm_limit_is_measured_once_and_remembered(tmp_path, monkeypatch):
    """The limits come from timing both kernels (a size they tried, or the minimum), are written to gemm.json
    and read back by a later process instead of measuring again; $BTJIT_MICRO_B_MAX / $BTJIT_NT_MACS override."""
    import json
    from btjit.kernels import gemm_rule, linalg
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BTJIT_MICRO_B_MAX", raising=False)
    monkeypatch.delenv("BTJIT_NT_MACS", raising=False)
    calls = []
    real = gemm_rule.measure

    def counted():
        calls.append(1)
        return real()
    monkeypatch.setattr(gemm_rule, "measure", counted)
    monkeypatch.setattr(gemm_rule, "_VALUE", [])
    first = gemm_rule.micro_b_max()
    saved = json.loads((tmp_path / "gemm.json").read_text())
    assert first in (gemm_rule.MIN_LIMIT,) + gemm_rule.SIZES and saved["micro_b_max"] == first
    assert all(len(v) == 2 and min(v) > 0 for v in saved["us"].values()) and "131072:1" in saved["us"]
    monkeypatch.setattr(gemm_rule, "_NT", [])
    nt = gemm_rule.nt_macs()
    saved_nt = json.loads((tmp_path / "gemm_nt.json").read_text())
    assert nt == saved_nt["nt_macs"] in [linalg.NT_MACS] + [M * N * K for M, N, K in gemm_rule.NT_PROBES]
    assert set(saved_nt["us"]) == {f"{M}x{N}x{K}" for M, N, K in gemm_rule.NT_PROBES}
    monkeypatch.setattr(gemm_rule, "_VALUE", [])
    monkeypatch.setattr(gemm_rule, "_NT", [])
    assert gemm_rule.micro_b_max() == first and gemm_rule.nt_macs() == nt and calls == [1]
    monkeypatch.setattr(gemm_rule, "_VALUE", [])
    monkeypatch.setattr(gemm_rule, "_NT", [])
    monkeypatch.setenv("BTJIT_MICRO_B_MAX", "12345")
    monkeypatch.setenv("BTJIT_NT_MACS", "777")
    assert gemm_rule.micro_b_max() == 12345 and gemm_rule.nt_macs() == 777 and calls == [1]

# ---------------------------------------------------------------- LayerNorm
def ln_ref(x, g, b, eps):
    mu = x.mean(-1)
    rs = 1.0 / np.sqrt(x.var(-1) + eps)
    return (x - mu[:, None]) * rs[:, None] * g + b, mu, rs


def ln_bwd_ref(x, g, dy, eps):
    _, mu, rs = ln_ref(x, g, 0.0, eps)
    xh = (x - mu[:, None]) * rs[:, None]
    gy = dy * g
    dx = rs[:, None] * (gy - gy.mean(-1, keepdims=True) - xh * (gy * xh).mean(-1, keepdims=True))
    return dx, (dy * xh).sum(0), dy.sum(0)


def run_ln(dt, x, g, b, dy, eps):
    M, C = x.shape
    ar = Arena(dt)
    oe = ar.put("eps", np.array([eps]))
    ox, og, ob, ody = ar.put("x", x), ar.put("g", g), ar.put("b", b), ar.put("dy", dy)
    oy, om, orr = ar.put("y", size=M * C), ar.put("mean", size=M), ar.put("rstd", size=M)
    odx, odg, odb = ar.put("dx", size=M * C), ar.put("dg", size=C), ar.put("db", size=C)
    a = ar.build()
    ia = np.zeros(1, np.int32)
    K.k_layernorm_fwd(a, ia, row(ox, og, ob, oy, om, orr, M, C, oe))
    K.k_layernorm_bwd(a, ia, row(ox, og, om, orr, ody, odx, odg, odb, M, C))
    ar.only_wrote("y", "mean", "rstd", "dx", "dg", "db")
    return ar


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("M,C", [(8, 24), (32, 24), (5, 7), (1, 3)])
def test_layernorm(dt, M, C):
    rng = np.random.default_rng(M + C)
    x = rnd(rng, (M, C), dt, 2.0) + 0.5
    g, b, dy = rnd(rng, C, dt) + 1.0, rnd(rng, C, dt), rnd(rng, (M, C), dt)
    eps = float(dt(1e-5))
    ar = run_ln(dt, x, g, b, dy, eps)
    y, mu, rs = ln_ref(x, g, b, eps)
    check(ar.get("y", (M, C)), y, dt)
    check(ar.get("mean"), mu, dt)
    check(ar.get("rstd") / rs, np.ones(M), dt)
    dx, dg, db = ln_bwd_ref(x, g, dy, eps)
    check(ar.get("dx", (M, C)), dx, dt)
    check(ar.get("dg"), dg, dt)
    check(ar.get("db"), db, dt)


def test_layernorm_bwd_finite_diff():
    rng = np.random.default_rng(11)
    M, C, eps = 3, 5, 1e-5
    x, g, b, dy = rnd(rng, (M, C), np.float64), rnd(rng, C, np.float64), rnd(rng, C, np.float64), rnd(rng, (M, C), np.float64)
    ar = run_ln(np.float64, x, g, b, dy, eps)
    dx_fd = fd_grad(lambda v: (ln_ref(v, g, b, eps)[0] * dy).sum(), x)
    dg_fd = fd_grad(lambda v: (ln_ref(x, v, b, eps)[0] * dy).sum(), g)
    db_fd = fd_grad(lambda v: (ln_ref(x, g, v, eps)[0] * dy).sum(), b)
    for name, fd, refv in zip(("dx", "dg", "db"), (dx_fd, dg_fd, db_fd), ln_bwd_ref(x, g, dy, eps)):
        check(ar.get(name).reshape(fd.shape), fd, np.float64, 1e-7)
        check(refv, fd, np.float64, 1e-7)


# ---------------------------------------------------------------- transpose (16 x 16 register tiles)
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("R,C", [(16, 16), (64, 576), (37, 53), (5, 3), (16, 40), (33, 16), (1, 17)])
def test_transpose(dt, R, C):
    """Exact (a copy), for full tiles, tiles moved back at either edge and no tile at all; writes only the
    output."""
    x = rnd(np.random.default_rng(R * 100 + C), (R, C), dt)
    ar = Arena(dt)
    ox, oy = ar.put("x", x), ar.put("y", size=R * C)
    a = ar.build()
    transpose(a, ox, a, oy, R, C)
    assert np.array_equal(ar.get("y", (C, R)), x.T.astype(np.float64))
    ar.only_wrote("y")


# ---------------------------------------------------------------- attention
def attn_ref(qkv, B, T, C, NH, scale):
    hs = C // NH
    x = qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)         # (3, B, NH, T, hs)
    q, k, v = x[0], x[1], x[2]
    S = q @ k.transpose(0, 1, 3, 2) * scale
    S = np.where(np.tril(np.ones((T, T), bool)), S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    y = (P @ v).transpose(0, 2, 1, 3).reshape(B * T, C)
    return y, P.reshape(B * NH * T, T)


def attn_bwd_ref(qkv, dy, B, T, C, NH, scale):
    hs = C // NH
    x = qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    q, k, v = x[0], x[1], x[2]
    P = attn_ref(qkv, B, T, C, NH, scale)[1].reshape(B, NH, T, T)
    dY = dy.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    dv = P.transpose(0, 1, 3, 2) @ dY
    dP = dY @ v.transpose(0, 1, 3, 2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True)) * scale
    dq, dk = dS @ k, dS.transpose(0, 1, 3, 2) @ q
    return np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B * T, 3 * C)


def run_attn(dt, qkv, dy, B, T, C, NH, scale):
    ar = Arena(dt)
    osc = ar.put("scale", np.array([scale]))
    oq, ody = ar.put("qkv", qkv), ar.put("dy", dy)
    oy, oP, odq = ar.put("y", size=B * T * C), ar.put("P", size=B * NH * T * T), ar.put("dqkv", size=B * T * 3 * C)
    a = ar.build()
    ia = np.zeros(1, np.int32)
    KA.k_attn_fwd(a, ia, row(oq, oy, oP, B, T, C, NH, osc))
    KA.k_attn_bwd(a, ia, row(oq, oP, ody, odq, B, T, C, NH, osc))
    ar.only_wrote("y", "P", "dqkv")
    return ar


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("B,T,C,NH", [(1, 8, 24, 6), (4, 8, 24, 6), (2, 5, 6, 3), (3, 1, 4, 1), (2, 7, 10, 1)])
def test_attention(dt, B, T, C, NH):
    rng = np.random.default_rng(B * 1000 + T * 10 + C)
    qkv, dy = rnd(rng, (B * T, 3 * C), dt, 1.5), rnd(rng, (B * T, C), dt)
    scale = float(dt(1.0 / np.sqrt(C // NH)))
    ar = run_attn(dt, qkv, dy, B, T, C, NH, scale)
    y, P = attn_ref(qkv, B, T, C, NH, scale)
    check(ar.get("y", y.shape), y, dt)
    Pk = ar.get("P", P.shape)
    check(Pk, P, dt)
    assert np.all(Pk[np.triu(np.ones((T, T), bool), 1)[None].repeat(B * NH, 0).reshape(-1, T)] == 0)
    check(ar.get("dqkv", qkv.shape), attn_bwd_ref(qkv, dy, B, T, C, NH, scale), dt)


def check_bl_pair(dt, B, T, C, NH, nb, fwd, bwd, seed, wrote_P=True):
    """Run a forward/backward pair with the bl rows and layouts (nb lane blocks; the pairs kernels take the
    same rows without nb) against the references; they may write only y, P (unless not wrote_P), W (forward)
    and dqkv, S (backward)."""
    rng = np.random.default_rng(seed)
    qkv, dy = rnd(rng, (B * T, 3 * C), dt, 1.5), rnd(rng, (B * T, C), dt)
    scale = float(dt(1.0 / np.sqrt(C // NH)))
    ar = Arena(dt)
    osc = ar.put("scale", np.array([scale]))
    oq, ody = ar.put("qkv", qkv), ar.put("dy", dy)
    oy, oP = ar.put("y", size=B * T * C), ar.put("P", size=B * NH * T * T)
    fd = "f32" if dt == np.float32 else "f64"
    oW, odq = ar.put("W", size=KA.attn_scratch_size(B, T, C, NH, fd)), ar.put("dqkv", size=B * T * 3 * C)
    oS = ar.put("S", size=KA.attn_bwd_scratch_size(B, T, C, NH, fd))
    a = ar.build()
    ia = np.zeros(1, np.int32)
    fwd(a, ia, row(oq, oy, oP, oW, B, T, C, NH, osc, nb))
    P = ("P",) if wrote_P else ()
    ar.only_wrote("y", *P, "W")
    bwd(a, ia, row(oP, oW, ody, odq, oS, B, T, C, NH, osc, nb))
    ar.only_wrote("y", *P, "W", "dqkv", "S")
    check(ar.get("y", (B * T, C)), attn_ref(qkv, B, T, C, NH, scale)[0], dt)
    check(ar.get("dqkv", qkv.shape), attn_bwd_ref(qkv, dy, B, T, C, NH, scale), dt)


@functools.lru_cache(maxsize=None)
def _generated(name, T, hs):
    """The generated entry `name` for (T, hs) as the library loads it (its object code, called through its
    address), as f(a, ia, r)."""
    import ctypes
    from btjit.kernels.library import LIBRARY
    LIBRARY.load(name, "f32", (T, hs))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = ctypes.CFUNCTYPE(ctypes.c_int32, p, i64, p, i64, p)(LIBRARY.loaded[(name, "f32", (T, hs))].address)
    return lambda a, ia, r: fn(a.ctypes.data, a.size, ia.ctypes.data, ia.size, r.ctypes.data)


def _lanes_pair(T, hs):
    """The rows the lowering gives a lanes attention (k_attn_bl_move in, the generated entry, k_attn_bl_move out) as one
    forward / backward pair taking the bl pair's rows."""
    gf, gb = _generated("k_attn_fwd_lanes", T, hs), _generated("k_attn_bwd_lanes", T, hs)

    def fwd(a, ia, r):
        oq, oy, oP, oW, B, T_, C, NH, osc, nb = r[1:11]
        KA.k_attn_bl_move(a, ia, row(oq, oW, B, 3 * T_ * C, nb, 0))
        gf(a, ia, row(oW, oP, oy, B, T_, C, NH, osc, nb))

    def bwd(a, ia, r):
        oP, oW, ody, odq, oS, B, T_, C, NH, osc, nb = r[1:12]
        oD = oS + B * T_ * C
        KA.k_attn_bl_move(a, ia, row(ody, oS, B, T_ * C, nb, 0))
        gb(a, ia, row(oW, oP, oS, oD, B, T_, C, NH, osc, nb))
        KA.k_attn_bl_move(a, ia, row(oD, odq, B, 3 * T_ * C, nb, 1))
    return fwd, bwd


def _pairs_pair(T, hs):
    """The generated pairs entries as a forward / backward pair taking the bl pair's rows."""
    gf, gb = _generated("k_attn_fwd_pairs", T, hs), _generated("k_attn_bwd_pairs", T, hs)

    def fwd(a, ia, r):
        oq, oy, oP, oW, B, T_, C, NH, osc = r[1:10]
        gf(a, ia, row(oq, oy, oW, B, T_, C, NH, osc))

    def bwd(a, ia, r):
        oP, oW, ody, odq, oS, B, T_, C, NH, osc = r[1:11]
        gb(a, ia, row(ody, odq, oW, oS, B, T_, C, NH, osc))
    return fwd, bwd


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("B,T,C,NH,nb", [(16, 8, 24, 6, 1), (17, 8, 24, 6, 3), (20, 5, 6, 3, 2), (16, 1, 4, 1, 4)])
def test_attention_sequence_vectorized_pair(dt, B, T, C, NH, nb):
    """k_attn_fwd_bl / k_attn_bwd_bl, nb lane blocks (the last one shorter when nb does not divide B)."""
    check_bl_pair(dt, B, T, C, NH, nb, KA.k_attn_fwd_bl, KA.k_attn_bwd_bl, B * 100 + nb)


@pytest.mark.parametrize("B,T,C,NH,nb", [(16, 8, 24, 6, 1), (67, 8, 24, 6, 2), (64, 8, 24, 6, 2), (20, 5, 6, 3, 1),
                                         (40, 3, 4, 2, 2), (33, 1, 4, 1, 1), (16, 2, 40, 4, 1), (48, 8, 64, 8, 1)])
def test_attention_generated_lanes(B, T, C, NH, nb):
    """The vector kernels generated for (T, hs) (kernels/attn_lanes.py), as the library loads them, with the
    layout rows around them, in the bl pair's layouts: blocks of 16 lanes exactly, of 34/33 (the last chunk
    overlapping the one before), and of 20 and 33 (one overlap each)."""
    from btjit.kernels import attn_lanes
    assert attn_lanes.eligible(T, C // NH, B, nb, "f32")
    fwd, bwd = _lanes_pair(T, C // NH)
    check_bl_pair(np.float32, B, T, C, NH, nb, fwd, bwd, B * 100 + T)


@pytest.mark.parametrize("B,T,C,NH", [(1, 8, 24, 6), (2, 8, 24, 6), (15, 8, 24, 6), (1, 8, 32, 8), (3, 5, 6, 3),
                                     (1, 1, 4, 1), (5, 3, 8, 2), (4, 8, 24, 6), (1, 4, 9, 3), (1, 3, 20, 2),
                                     (1, 2, 5, 5), (1, 3, 16, 2), (1, 2, 10, 5), (1, 2, 15, 3), (1, 4, 56, 7)])
def test_attention_generated_pairs(B, T, C, NH):
    """The small-batch generated kernels (lanes over (sequence, head) pairs, 8 wide): padded lanes (B*NH < 8),
    exactly 8, several chunks with the last overlapping (12, 90), T = 1, head sizes 1-10; one sequence of
    <= 8 heads of <= 8 moved between the layouts by vector shuffles, the rest by scalar moves. They leave P
    alone."""
    assert attn_lanes.pairs_eligible(T, C // NH, "f32") and B < KA.BL_MIN_B
    fwd, bwd = _pairs_pair(T, C // NH)
    check_bl_pair(np.float32, B, T, C, NH, 1, fwd, bwd, B * 100 + T, wrote_P=False)


def test_attention_generated_lanes_eligibility():
    """Used for float32 when every lane block holds >= 16 sequences and the body is bounded; otherwise the
    loop kernels run."""
    assert attn_lanes.eligible(8, 4, 64, 1, "f32") and attn_lanes.eligible(8, 4, 32, 2, "f32")
    assert not attn_lanes.eligible(8, 4, 64, 1, "f64")
    assert not attn_lanes.eligible(8, 4, 31, 2, "f32")        # blocks of 16 and 15
    assert not attn_lanes.eligible(8, 4, 17, 3, "f32")
    assert not attn_lanes.eligible(64, 4, 64, 1, "f32")       # 2080 score terms
    assert attn_lanes.eligible(8, 8, 16, 1, "f32") and attn_lanes.pairs_eligible(8, 8, "f32")   # 1296 <= 1400
    assert not attn_lanes.pairs_eligible(16, 2, "f32")        # 136 scores x 24 operations
    assert not attn_lanes.pairs_eligible(4, 48, "f32")        # T * hs > 64


def test_attention_bwd_finite_diff():
    rng = np.random.default_rng(5)
    B, T, C, NH = 2, 4, 6, 2
    qkv, dy = rnd(rng, (B * T, 3 * C), np.float64), rnd(rng, (B * T, C), np.float64)
    scale = 1.0 / np.sqrt(C // NH)
    ar = run_attn(np.float64, qkv, dy, B, T, C, NH, scale)
    fd = fd_grad(lambda v: (attn_ref(v, B, T, C, NH, scale)[0] * dy).sum(), qkv)
    check(ar.get("dqkv", qkv.shape), fd, np.float64, 1e-7)
    check(attn_bwd_ref(qkv, dy, B, T, C, NH, scale), fd, np.float64, 1e-7)


# ---------------------------------------------------------------- cross-entropy
def ce_ref(l, t):
    mx = l.max(-1, keepdims=True)
    e = np.exp(l - mx)
    s = e.sum(-1, keepdims=True)
    loss = (np.log(s[:, 0]) + mx[:, 0] - l[np.arange(len(t)), t]).mean()
    return loss, e / s


def run_ce(dt, l, t, g):
    M, V = l.shape
    ar = Arena(dt)
    ol, og = ar.put("logits", l), ar.put("g", np.array([g]))
    oloss, op, od = ar.put("loss", size=1), ar.put("probs", size=M * V), ar.put("dlogits", size=M * V)
    a = ar.build()
    ia = np.full(M + 8, -1, np.int32)
    ia[3:3 + M] = t
    from btjit.graph.ops import IGNORE_NONE
    K.k_ce_fwd(a, ia, row(ol, 3, oloss, op, M, V, IGNORE_NONE, 0))      # ign: none; red 0: mean
    K.k_ce_bwd(a, ia, row(op, 3, og, od, M, V, IGNORE_NONE, 0))
    ar.only_wrote("loss", "probs", "dlogits")
    return ar


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("M,V", [(8, 65), (32, 65), (5, 13), (3, 1), (4, 2)])
def test_cross_entropy(dt, M, V):
    rng = np.random.default_rng(M * V)
    l = rnd(rng, (M, V), dt, 3.0) + 20.0                      # offset: max subtraction matters
    t = rng.integers(0, V, M).astype(np.int32)
    g = 0.75
    ar = run_ce(dt, l, t, g)
    loss, probs = ce_ref(l, t)
    check(ar.get("loss"), [loss], dt)
    check(ar.get("probs", (M, V)), probs, dt)
    oh = np.zeros((M, V))
    oh[np.arange(M), t] = 1
    check(ar.get("dlogits", (M, V)), (probs - oh) * g / M, dt)


def test_cross_entropy_finite_diff_and_extreme():
    rng = np.random.default_rng(9)
    M, V = 4, 7
    l, t = rnd(rng, (M, V), np.float64, 2.0), np.array([0, 6, 3, 3], np.int32)
    ar = run_ce(np.float64, l, t, 1.0)
    check(ar.get("dlogits", (M, V)), fd_grad(lambda v: ce_ref(v, t)[0], l), np.float64, 1e-7)
    for dt in DTS:                                            # huge spread: no overflow / NaN
        l = np.array([[1000.0, -1000.0, 0.0], [-50.0, -50.0, -50.0]])
        ar = run_ce(dt, l, np.array([1, 2], np.int32), 1.0)
        check(ar.get("loss"), [(2000.0 + np.log(3.0)) / 2], dt)
        assert np.all(np.isfinite(ar.get("probs")))


# ---------------------------------------------------------------- GELU
def gelu_ref(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_grad_ref(x):
    k = np.sqrt(2 / np.pi)
    th = np.tanh(k * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * k * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("n", [1, 13, 8 * 96, 1001])
@pytest.mark.parametrize("scale", [1.0, 3.0, 30.0])
def test_gelu(dt, n, scale):
    rng = np.random.default_rng(n)
    x, dy = rnd(rng, n, dt, scale), rnd(rng, n, dt)
    ar = Arena(dt)
    ox, ody, oy, odx = ar.put("x", x), ar.put("dy", dy), ar.put("y", size=n), ar.put("dx", size=n)
    a = ar.build()
    ia = np.zeros(1, np.int32)
    K.k_gelu_fwd(a, ia, row(ox, oy, n))
    K.k_gelu_bwd(a, ia, row(ox, ody, odx, n))
    ar.only_wrote("y", "dx")
    check(ar.get("y"), gelu_ref(x), dt)
    check(ar.get("dx"), gelu_grad_ref(x) * dy, dt)
    eps = 1e-6                                                # analytic reference vs elementwise central FD
    check(gelu_grad_ref(x), (gelu_ref(x + eps) - gelu_ref(x - eps)) / (2 * eps), np.float64, 1e-7)


# ---------------------------------------------------------------- embedding gather / scatter-add
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("V,C,n", [(65, 24, 8), (65, 24, 32), (13, 7, 5), (3, 5, 11)])
def test_gather_scatter(dt, V, C, n):
    rng = np.random.default_rng(V + C + n)
    table, g = rnd(rng, (V, C), dt), rnd(rng, (n, C), dt)
    idx = rng.integers(0, V, n).astype(np.int32)
    idx[-1] = idx[0]                                          # guaranteed repeat
    ar = Arena(dt)
    ot, og, oo, odt = ar.put("table", table), ar.put("g", g), ar.put("out", size=n * C), ar.put("dtable", size=V * C)
    a = ar.build()
    ia = np.full(n + 6, 99999, np.int32)
    ia[2:2 + n] = idx
    K.k_gather_rows(a, ia, row(ot, 2, oo, n, C))
    K.k_scatter_add_rows(a, ia, row(og, 2, odt, n, V, C))
    ar.only_wrote("out", "dtable")
    check(ar.get("out", (n, C)), table[idx], dt)
    ref = np.zeros((V, C))
    np.add.at(ref, idx, g)
    check(ar.get("dtable", (V, C)), ref, dt)


# ---------------------------------------------------------------- optional extra reference
def test_against_torch_optional():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    B, T, C, NH = 2, 8, 24, 6
    qkv = rnd(rng, (B * T, 3 * C), np.float64)
    ar = run_attn(np.float64, qkv, np.zeros((B * T, C)), B, T, C, NH, 1.0 / np.sqrt(C // NH))
    x = torch.tensor(qkv).view(B, T, 3, NH, C // NH).permute(2, 0, 3, 1, 4)
    yt = torch.nn.functional.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=True)
    check(ar.get("y", (B * T, C)), yt.transpose(1, 2).reshape(B * T, C).numpy(), np.float64)
    xs = rnd(rng, 50, np.float64, 3.0)
    check(gelu_ref(xs), torch.nn.functional.gelu(torch.tensor(xs), approximate="tanh").numpy(), np.float64)
