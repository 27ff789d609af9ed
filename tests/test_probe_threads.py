"""Threads, replicas and bf16 at sizes the other tests do not use: a program's threads= leaves the default of
the next program alone; replicas beyond the threads asked for take turns on them (prog.threads says so); the GPT
and nanoGPT at odd widths, heads, contexts and batches give one thread's bits on two threads and the float64
gradients to float32 rounding; replicas at odd sizes give the whole batch's step and evaluate other batch sizes;
dropout draws the same masks for any replica count; bf16 products of odd, transposed and broadcast batched
shapes are numpy's products of the rounded operands on one thread and on two."""
from pathlib import Path

import numba
import numpy as np
import pytest

import btjit
from btjit.host import threads as TH
from btjit.models import gpt, nanogpt

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _bf(x):
    """bfloat16 rounding (nearest, ties to even) of finite float32 values, as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.int64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _case(kind, E, H, T, B, V, L=2, dropout=0.0):
    if kind == "gpt":
        cfg = gpt.GPTConfig(vocab_size=V, n_layer=L, n_head=H, n_embd=E, block_size=T)
        params, loss = gpt.init_params(cfg, 0), gpt.loss_fn(cfg)
    else:
        cfg = nanogpt.NanoGPTConfig(vocab_size=V, n_layer=L, n_head=H, n_embd=E, block_size=T, bias=True,
                                    dropout=dropout)
        params, loss = nanogpt.init_params(cfg, np.random.default_rng(0)), nanogpt.loss_fn(cfg)
    rng = np.random.default_rng(E + T + B)
    x, y = (rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(2))
    return loss, params, x, y


# ----------------------------------------------------------------------------- the thread counts
def test_a_programs_threads_leave_the_default_of_the_next_program():
    """threads=2 on one program grows numba's pool; the next program traced without threads= still takes
    btjit.set_num_threads's count (BTJIT_NUM_THREADS=1 stays one thread), and so does replicas_for."""
    loss, params, x, y = _case("gpt", 96, 3, 64, 8, 37, L=1)
    btjit.set_num_threads(1)
    try:
        assert btjit.trace(loss, params, x, y, grad=True, threads=2).threads == 2
        assert btjit.trace(loss, params, x, y, grad=True).threads == 1
        assert btjit.replicas_for(8, 512) == 1
    finally:
        btjit.set_num_threads(TH.default_threads())


def test_replicas_beyond_the_threads_take_turns_on_them():
    """replicas=2 with threads=1 runs both replicas on one thread (prog.threads == 1, numba's pool count
    restored after the step) and computes what two threads compute, bit for bit."""
    loss, params, x, y = _case("gpt", 48, 3, 24, 6, 37)
    make = lambda th: btjit.trace(loss, params, x, y, optimizer=btjit.optim.AdamW(lr=1e-3),  # noqa: E731
                                  threads=th, replicas=2)
    one, two = make(1), make(2)
    assert (one.threads, two.threads) == (1, 2)
    pool = numba.get_num_threads()
    assert [one.step(x, y) for _ in range(3)] == [two.step(x, y) for _ in range(3)]
    assert numba.get_num_threads() == pool
    for k in params:
        np.testing.assert_array_equal(one.params[k], two.params[k], err_msg=k)


# ----------------------------------------------------------------------------- models at odd sizes
@pytest.mark.parametrize("kind, E, H, T, B, V", [("gpt", 80, 5, 24, 3, 65), ("gpt", 136, 2, 100, 1, 53),
                                                  ("nano", 75, 3, 33, 5, 29), ("nano", 200, 5, 7, 13, 11)])
def test_odd_sizes_on_two_threads_give_one_threads_bits_and_the_float64_grads(kind, E, H, T, B, V):
    loss, params, x, y = _case(kind, E, H, T, B, V)
    ref = btjit.trace(loss, {k: v.astype(np.float64) for k, v in params.items()}, x, y, dtype="float64",
                      grad=True, threads=1)
    want = ref.value_and_grad(x, y)
    got = {}
    for th in (1, 2):
        prog = btjit.trace(loss, params, x, y, grad=True, threads=th)
        got[th] = (prog.value_and_grad(x, y), {k: prog.grads[k].copy() for k in params})
        assert got[th][0] == pytest.approx(want, rel=1e-6)
        for k in params:
            g, r = got[th][1][k], ref.grads[k]
            assert np.abs(g - r).max() <= 2e-5 * np.abs(r).max() + 1e-9, k
    assert got[1][0] == got[2][0]
    for k in params:
        np.testing.assert_array_equal(got[1][1][k], got[2][1][k], err_msg=k)


@pytest.mark.parametrize("kind, E, H, T, B, V", [("gpt", 48, 3, 7, 6, 37), ("nano", 80, 5, 24, 4, 65)])
def test_replicas_at_odd_sizes_step_as_the_whole_batch_and_evaluate_other_batches(kind, E, H, T, B, V):
    loss, params, x, y = _case(kind, E, H, T, B, V)
    params = {k: v.astype(np.float64) for k, v in params.items()}
    make = lambda r: btjit.trace(loss, params, x, y, optimizer=btjit.optim.AdamW(lr=1e-3),  # noqa: E731
                                 clip_norm=1.0, dtype="float64", replicas=r, threads=2)
    one, rep, again = make(1), make(2), make(2)
    for _ in range(3):
        a, b = one.step(x, y), rep.step(x, y)
        assert b == pytest.approx(a, rel=1e-12) and again.step(x, y) == b
    for k in params:
        np.testing.assert_allclose(rep.params[k], one.params[k], rtol=1e-10, atol=1e-13, err_msg=k)
    for b2 in (1, 3, B + 1):
        assert rep.eval(x[:1].repeat(b2, 0), y[:1].repeat(b2, 0)) == pytest.approx(one.eval(x[:1], y[:1]), rel=1e-12)


def test_dropout_draws_the_same_masks_for_any_replica_count():
    loss, params, x, y = _case("nano", 48, 3, 12, 4, 29, L=1, dropout=0.2)
    params = {k: v.astype(np.float64) for k, v in params.items()}
    runs = []
    for r in (1, 2, 4):
        prog = btjit.trace(loss, params, x, y, dtype="float64", optimizer=btjit.optim.SGD(lr=0.1), replicas=r,
                           seed=3, threads=2)
        runs.append([prog.step(x, y) for _ in range(3)])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-13)
    np.testing.assert_allclose(runs[2], runs[0], rtol=1e-13)


# ----------------------------------------------------------------------------- bf16 products at odd shapes
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch_a, batch_w, ta, tb", [((), (), 0, 0), ((), (), 1, 1), ((3,), (), 0, 1),
                                                      ((2, 1), (3,), 1, 0), ((2, 3), (2, 3), 0, 1)])
def test_bf16_products_of_odd_shapes_are_products_of_the_rounded_operands(threads, batch_a, batch_w, ta, tb):
    rng = np.random.default_rng(len(batch_a) + 2 * ta + tb)
    sw = lambda v: btjit.swapaxes(v, -1, -2)  # noqa: E731
    for M, N, K in [(17, 33, 19), (65, 67, 69), (3, 130, 33)]:
        a = rng.normal(size=batch_a + ((K, M) if ta else (M, K))).astype(np.float32)
        w = rng.normal(size=batch_w + ((N, K) if tb else (K, N))).astype(np.float32)
        prog = btjit.trace(lambda p, x: (sw(x) if ta else x) @ (sw(p["w"]) if tb else p["w"]), {"w": w}, a,
                           precision="bf16", threads=threads)
        A, W = _bf(a), _bf(w)
        A, W = (np.swapaxes(A, -1, -2) if ta else A), (np.swapaxes(W, -1, -2) if tb else W)
        err = np.abs(prog(a) - A @ W) / (np.abs(A) @ np.abs(W))
        assert err.max() < 1e-6, (M, N, K)


def test_thread_and_replica_counts_take_numpys_integers_and_refuse_others():
    """threads= and replicas= from a config or an array (np.int64) are counts; 2.0, True and -1 are errors."""
    p, x = {"w": np.ones((3, 2), np.float32)}, np.ones((4, 3), np.float32)
    f = lambda p, x: btjit.mean(x @ p["w"])  # noqa: E731
    prog = btjit.trace(f, p, x, grad=True, threads=np.int64(2), replicas=np.int32(2))
    assert prog.replicas == 2 and type(prog.replicas) is int and prog.value_and_grad(x) == pytest.approx(3.0)
    for bad in (2.0, True, -1):
        with pytest.raises(ValueError, match="threads must be a whole number"):
            btjit.trace(f, p, x, grad=True, threads=bad)
        with pytest.raises(ValueError, match="threads must be a whole number"):
            btjit.set_num_threads(bad)
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        btjit.trace(f, p, x, grad=True, replicas=2.0)
    assert btjit.set_num_threads(np.int64(1)) == 1
    btjit.set_num_threads(TH.default_threads())


def test_btjit_train_takes_btjit_num_threads_where_the_config_leaves_threads_at_0(monkeypatch, tmp_path):
    """[train] threads = 0 (the configs' default) is btjit's default: $BTJIT_NUM_THREADS where set; a nonzero
    count (config or --threads) overrides it."""
    from click.testing import CliRunner
    from btjit.cli import cli
    from btjit.train.runparts import set_threads
    small = ["--set", "train.steps=2", "--set", "train.eval_interval=0", "--set", "train.eval_batches=1",
             "--set", "train.sample_interval=0", "--set", "model.n_layer=1", "--set", "train.batch_size=64"]
    monkeypatch.setenv("BTJIT_NUM_THREADS", "1")
    try:
        assert set_threads(0) == 1 and set_threads(2) == 2
        res = CliRunner().invoke(cli, ["train", str(CONFIGS / "gpt3_tiny.toml"), *small, "--out", str(tmp_path / "a")])
        assert res.exit_code == 0 and "threads 1 of 1 (one thread)" in res.output, res.output
        res = CliRunner().invoke(cli, ["train", str(CONFIGS / "gpt3_tiny.toml"), *small, "--threads", "2",
                                        "--out", str(tmp_path / "b")])
        assert res.exit_code == 0 and "threads 2 of 2 (2 data-parallel replicas)" in res.output, res.output
    finally:
        monkeypatch.delenv("BTJIT_NUM_THREADS")
        btjit.set_num_threads(TH.default_threads())
