"""Threads: every core by default, the thread count from trace(threads=), $BTJIT_NUM_THREADS and set_num_threads;
GEMMs split over the threads by blocks of rows are bitwise equal to one thread, and a program whose kernels are
too small to split runs on one (prog.threads says so)."""
import numpy as np
import pytest

import btjit
from btjit.host import threads as TH
from btjit.kernels.common import ROWS, SPLIT
from btjit.testing import split_kernels


def _mlp(p, x, y):
    h = btjit.relu(x @ p["w1"] + p["b1"])
    return btjit.cross_entropy(h @ p["w2"] + p["b2"], y)


def _params(rng, d_in, d_h, d_out):
    return {"w1": rng.normal(0, 0.1, (d_in, d_h)).astype(np.float32), "b1": np.zeros(d_h, np.float32),
            "w2": rng.normal(0, 0.1, (d_h, d_out)).astype(np.float32), "b2": np.zeros(d_out, np.float32)}


def _train(threads, batch, d_in, d_h, d_out, steps=3):
    rng = np.random.default_rng(0)
    params = _params(rng, d_in, d_h, d_out)
    x = rng.normal(size=(batch, d_in)).astype(np.float32)
    y = rng.integers(0, d_out, batch).astype(np.int32)
    prog = btjit.trace(_mlp, params, x, y, optimizer=btjit.optim.AdamW(lr=1e-2), threads=threads)
    losses = [prog.step(x, y) for _ in range(steps)]
    return prog, losses


def test_default_is_every_core(monkeypatch):
    monkeypatch.delenv("BTJIT_NUM_THREADS", raising=False)
    assert TH.default_threads() == TH.cores() >= 1
    monkeypatch.setenv("BTJIT_NUM_THREADS", "1")
    assert TH.default_threads() == 1
    monkeypatch.setenv("BTJIT_NUM_THREADS", "0")
    assert TH.default_threads() == TH.cores()


@pytest.mark.parametrize("bad", ["two", "-1", "1.5"])
def test_bad_thread_counts_are_named(monkeypatch, bad):
    monkeypatch.setenv("BTJIT_NUM_THREADS", bad)
    with pytest.raises(ValueError, match="BTJIT_NUM_THREADS"):
        TH.default_threads()
    with pytest.raises(ValueError, match="threads must be"):
        TH.resolve(-1)


def test_large_gemms_split_bitwise_equal_to_one_thread():
    p1, l1 = _train(1, 256, 96, 200, 40)
    p2, l2 = _train(2, 256, 96, 200, 40)
    assert p1.threads == 1 and p2.threads == 2
    assert l1 == l2
    for k in p1.params:
        np.testing.assert_array_equal(p1.params[k], p2.params[k])
    assert "k_matmul_micro" in split_kernels(p2)


@pytest.mark.parametrize("batch,d_in,d_h,d_out", [(64, 520, 1000, 27), (200, 64, 2100, 130)])
def test_gemms_with_a_large_b_split_by_columns_bitwise_equal_to_one_thread(batch, d_in, d_h, d_out, monkeypatch):
    """A B of >= 256K floats (E5's 1024 x 1024 layer): the threads take the forward product's columns (by 1, the
    bias and relu fused), N not a multiple of 16 x threads; the same three steps as one thread, bit for bit. The
    micro-kernels' limit on B is set (the machine's measured one may give these products to BLAS)."""
    from btjit.kernels import gemm_rule
    monkeypatch.setattr(gemm_rule, "_VALUE", [4 << 20])
    p1, l1 = _train(1, batch, d_in, d_h, d_out)
    p2, l2 = _train(2, batch, d_in, d_h, d_out)
    assert l1 == l2
    for k in p1.params:
        np.testing.assert_array_equal(p1.params[k], p2.params[k])
    rows = [r for r in p2.tape if btjit.core.program.LIBRARY.entry_of(r[0])[0] == "k_matmul_micro"]
    by = 1 + ROWS["k_matmul_micro"].args.index("by")
    assert any(r[by] == 1 and r[SPLIT] == 2 for r in rows)


def test_small_program_stays_on_one_thread():
    prog, _ = _train(2, 8, 12, 16, 5)
    assert prog.threads == 1


@pytest.mark.parametrize("M,N,K,ta,tb", [(37, 29, 13, 0, 0), (130, 50, 9, 1, 0), (19, 24, 40, 0, 1),
                                         (77, 48, 33, 0, 1), (16, 8, 100, 0, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_variants_against_numpy(M, N, K, ta, tb, threads):
    """Products at odd shapes through every path (micro-kernels, split micro-kernels, BLAS), forward and both
    gradients, float32 and float64, against numpy."""
    rng = np.random.default_rng(M * N + K)
    A = rng.normal(size=(K, M) if ta else (M, K))
    B = rng.normal(size=(N, K) if tb else (K, N))
    G = rng.normal(size=(M, N))

    def f(p):
        a = p["A"].T if ta else p["A"]
        b = p["B"].T if tb else p["B"]
        return btjit.sum((a @ b) * G)

    for dtype, tol in (("float32", 2e-4), ("float64", 1e-12)):
        params = {"A": A.astype(dtype), "B": B.astype(dtype)}
        prog = btjit.trace(f, params, grad=True, dtype=dtype, threads=threads)
        val = prog.value_and_grad()
        a = A.T if ta else A
        b = B.T if tb else B
        ref = float(np.sum((a @ b) * G))
        assert abs(val - ref) <= tol * max(1.0, abs(ref)) * K
        dA, dB = G @ b.T, a.T @ G
        np.testing.assert_allclose(prog.grads["A"], dA.T if ta else dA, rtol=tol * 10, atol=tol * K)
        np.testing.assert_allclose(prog.grads["B"], dB.T if tb else dB, rtol=tol * 10, atol=tol * K)


@pytest.mark.parametrize("shape", [(70, 1000), (3, 5, 9001)])
def test_large_elementwise_chains_split_bitwise_equal_to_one_thread(shape):
    """A fused chain over >= 64K elements runs as runs of blocks on the threads (its row split): a broadcast
    row, a scalar (a register filled once per run, also where a run starts at a row's short last block),
    dropout's random numbers (functions of the element's index) and a strided operand; every thread count
    gives the one-thread result bit for bit, and that is numpy's (up to float32 rounding)."""
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=shape).astype(np.float32), "b": rng.normal(size=shape[-1]).astype(np.float32),
         "s": np.array(0.7, np.float32)}
    x = rng.normal(size=shape[::-1]).astype(np.float32)

    def fn(p, x):
        h = btjit.tanh(p["w"] * p["s"] + p["b"]) * btjit.transpose(x) + 1.5
        return btjit.dropout(h, 0.25) * 2.0, {"h": h}
    outs = []
    for threads in (1, 2):
        prog = btjit.trace(fn, p, x, threads=threads, seed=3)
        assert ("k_ew_program" in split_kernels(prog)) == (threads > 1)
        prog.forward(x)
        outs.append({k: v.copy() for k, v in prog.outputs.items()})
    for k in outs[0]:
        assert np.array_equal(outs[0][k], outs[1][k]), k
    h = np.tanh(p["w"] * p["s"] + p["b"]) * x.T + 1.5
    np.testing.assert_allclose(outs[0]["h"], h, rtol=2e-6, atol=2e-6)
    kept = outs[0]["out"] != 0
    assert 0.7 < kept.mean() < 0.8
    np.testing.assert_allclose(outs[0]["out"][kept], (h * 2.0 / 0.75)[kept], rtol=2e-6, atol=2e-6)


def test_large_binary_rows_split_over_threads_bitwise():
    """A lone elementwise product of >= 64K elements (one row, or rows with a broadcast row) runs on the
    threads (its row split), bitwise equal to one thread."""
    rng = np.random.default_rng(2)
    p = {"x": rng.normal(size=(300, 260)).astype(np.float32), "v": rng.normal(size=(260,)).astype(np.float32)}

    def loss(q):
        return btjit.sum(btjit.relu(q["x"] * q["v"]) * btjit.reshape(q["x"], (-1,)).reshape(300, 260))
    out = []
    for threads in (1, 2):
        prog = btjit.trace(loss, p, grad=True, threads=threads, fuse_elementwise=False)
        out.append((prog.value_and_grad(), {k: prog.grads[k].copy() for k in p}, split_kernels(prog)))
    assert out[0][0] == out[1][0] and all(np.array_equal(out[0][1][k], out[1][1][k]) for k in p)
    assert "k_binary_rows" in out[1][2] and not out[0][2]


@pytest.mark.parametrize("dtype,M,K,N", [("float64", 64, 333, 13), ("float32", 4, 512, 200), ("float64", 4, 512, 200)])
def test_blas_products_between_the_split_sizes_give_one_threads_bits(dtype, M, K, N):
    """200K-1M multiply-adds: a BLAS product (float64, or float32 on fewer than 8 rows) is cut into the same blocks on
    one thread as on two (the shape decides them, not the threads), so its gradient has one thread's bits."""
    rng = np.random.default_rng(0)
    p = {"W": rng.normal(0, 0.05, (K, N)).astype(dtype)}
    x = rng.normal(size=(M, K)).astype(dtype)
    out = []
    for threads in (1, 2):
        prog = btjit.trace(lambda q, x: btjit.sum(btjit.tanh(x @ q["W"])), p, x, grad=True, dtype=dtype,
                           threads=threads, replicas=1)
        out.append((prog.value_and_grad(x), prog.grads["W"].copy(), split_kernels(prog)))
    assert out[1][2].get("k_matmul") == 2 and not out[0][2]
    assert out[0][0] == out[1][0] and np.array_equal(out[0][1], out[1][1])


def test_folded_embeddings_split_their_columns_bitwise():
    """makemore's embedding -> concat -> matmul, folded into take_sum (forward and gradient): with >= 64K
    multiply-adds its columns are split over the threads, one thread's bits."""
    from btjit.models import mlp
    cfg = mlp.MLPConfig(vocab_size=27, context=16, n_emb=64, n_hidden=1000)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 27, (48, 16)).astype(np.int32)
    y = rng.integers(0, 27, 48).astype(np.int32)
    out = []
    for threads in (1, 2):
        prog = btjit.trace(mlp.loss_fn(cfg), mlp.init_params(cfg, 0), x, y, optimizer=btjit.optim.SGD(lr=0.1),
                           threads=threads, replicas=1)
        losses = [prog.step(x, y) for _ in range(3)]
        out.append((losses, {k: v.copy() for k, v in prog.params.items()}, split_kernels(prog)))
    assert {"k_take_sum", "k_take_sum_grad"} <= set(out[1][2]) and not out[0][2]
    assert out[0][0] == out[1][0] and all(np.array_equal(out[0][1][k], out[1][1][k]) for k in out[0][1])
