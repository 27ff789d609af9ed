# Tests for btjit/kernels/linalg.py and the 16 x 16 tile transpose of btjit/kernels/common.py: k_matmul (BLAS;
# transposed operands, accumulation, batched and broadcast products, a fused bias, split over parts) and
# k_matmul_micro (every column-block width, A^T with B's column sums, B^T, bias / residual / relu rows, B in
# blocks of rows, batched products split as whole products), the rule that picks the micro-kernels
# (micro_gemm) and its measured limits, on float32 and float64 arenas against float64 numpy.
# Each test also checks that a kernel writes nothing outside its declared outputs.
import numpy as np
import pytest

from btjit.kernels.common import transpose
from btjit.kernels.linalg import k_matmul
from btjit.testing import run_parts
from kernel_harness import DTS, Arena, check, rnd, row


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
