"""Randomness inside the step (btjit/kernels/rng.py): Philox against Random123's known answers, the numbers
against their numpy reference, dropout's keep fraction (binomial bounds) and exact scaling, the backward's
mask, determinism by seed and step, the same masks at any thread count and with data-parallel replicas, eval
mode, gradients against finite differences at a fixed step, and `btjit train --resume` bit-exact with dropout."""
import dataclasses

import numpy as np
import pytest

import btjit
from btjit.host.threads import default_threads
from btjit.graph.trace import TraceError, emit
from btjit.kernels.rng import KEY_SIZE, U_NORMAL, U_UNIFORM, philox_np, random_np
from btjit.models import gpt
from btjit.optim import SGD, AdamW
from btjit.testing import check_grads


def test_philox_matches_random123_known_answers():
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in kat:
        assert tuple(int(w) for w in philox_np(ctr, *key)) == want


def _dropout_fn(p, **kw):
    def f(params, x):
        y = btjit.dropout(params["w"] * x, p, **kw)
        return btjit.sum(y * x), {"y": y, "u": btjit.rand_like(x), "z": btjit.randn_like(x)}
    return f


def _prog(f, shape, seed=0, dtype="float32", **kw):
    x = np.random.default_rng(1).normal(size=shape).astype(dtype)
    w = np.random.default_rng(2).normal(size=shape).astype(dtype)
    return btjit.trace(f, {"w": w}, x, optimizer=SGD(lr=0.0), seed=seed, dtype=dtype, **kw), x, w


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_a_binomial_fraction_scales_exactly_and_the_backward_uses_the_mask(p):
    prog, x, w = _prog(_dropout_fn(p), (200, 1000))
    prog.step(x)
    y, g = prog.outputs["y"], prog.grads["w"]
    kept = y != 0
    n = y.size
    assert abs(kept.sum() - n * (1 - p)) <= 5 * np.sqrt(n * p * (1 - p))     # Bin(n, 1 - p), 5 sigma
    s = np.float32(1 / (1 - p))
    assert np.array_equal(y[kept], (w * x)[kept] * s)                          # torch's scaling, exactly
    assert np.array_equal(g != 0, kept)
    np.testing.assert_allclose(g[kept], (x * x)[kept] * s, rtol=1e-6)


@pytest.mark.parametrize("shape", [(40, 50, 6, 7), (40, 50, 9)])
def test_dropout2d_zeros_whole_channels_and_the_backward_uses_the_mask(shape):
    """torch's dropout2d / dropout1d: every (sample, channel) kept or zeroed whole, Bin(N*C, 1 - p) kept, scaled by
    1 / (1 - p); the gradient through the same mask; the identity in eval mode."""
    p = 0.3
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32) + 2.0       # never exactly 0

    def fn(q):
        y = btjit.dropout2d(q["x"], p)
        return btjit.sum(y * y) * 0.5, {"y": y}
    prog = btjit.trace(fn, {"x": x}, grad=True, seed=3)
    prog.value_and_grad()
    y, g = prog.outputs["y"], prog.grads["x"]
    kept = (y != 0).reshape(shape[0], shape[1], -1)
    assert np.all(kept.all(axis=2) | ~kept.any(axis=2))                         # whole channels
    n = shape[0] * shape[1]
    assert abs(kept[:, :, 0].sum() - n * (1 - p)) <= 5 * np.sqrt(n * p * (1 - p))
    s = np.float32(1 / (1 - p))
    m = (y != 0)
    assert np.array_equal(y[m], x[m] * s)
    np.testing.assert_allclose(g[m], x[m] * s * s, rtol=1e-6)                   # d(y^2/2)/dx = y * s
    assert np.all(g[~m] == 0)
    ev = btjit.trace(fn, {"x": x}, training=False)
    ev.forward()
    np.testing.assert_array_equal(ev.outputs["y"], x)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numbers_are_the_reference_function_of_seed_step_site_and_element(dtype):
    prog, x, _ = _prog(_dropout_fn(0.3), (3, 50, 7), seed=2 ** 40 + 5, dtype=dtype)
    for step in range(3):
        prog.step(x)
        key = np.array([step, 0, 5, 2 ** 8, 0])                       # [step, flag, seed lo, seed hi, replica]
        tol = 1e-13 if dtype == "float64" else 1e-5
        np.testing.assert_allclose(prog.outputs["u"], random_np(x.shape, U_UNIFORM, 1, key), rtol=0, atol=0)
        np.testing.assert_allclose(prog.outputs["z"], random_np(x.shape, U_NORMAL, 2, key), rtol=tol, atol=tol)
        keep = random_np(x.shape, U_UNIFORM, 0, key) >= np.dtype(dtype).type(0.3)
        assert np.array_equal(prog.outputs["y"] != 0, keep)
    assert prog.step_count == 3



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_uniform_fill_takes_four_numbers_a_philox_block_at_any_start(dtype):
    """Element e's uniform number is word e % 4 of the Philox block of e // 4: fill's whole-block loop, its head
    and tail (starts and ends off a multiple of 4) and uniform_at (the attention kernels') all give philox_np's."""
    from btjit.kernels.rng import fill, uniform_at
    k0, k1, site, step = 0x12345678, 0x9ABCDEF0, 3, 11
    n = 64
    e = np.arange(n, dtype=np.uint64)
    w = np.stack(philox_np((e >> np.uint64(2), e * 0, e * 0 + site, e * 0 + step), k0, k1))
    want = ((w[e % 4, e] >> 8).astype(np.float64) * 2.0 ** -24).astype(dtype)
    assert len(set(want[:4].tolist())) == 4
    args = tuple(np.uint64(v) for v in (k0, k1, site, step))
    for e0, m in ((0, 64), (1, 2), (3, 17), (5, 40), (8, 3), (13, 0)):
        d = np.full(m + 2, -1.0, dtype)
        fill(d, m, e0, U_UNIFORM, *args)
        np.testing.assert_array_equal(d[:m], want[e0:e0 + m])
        assert np.all(d[m:] == -1.0)
    got = [uniform_at(np.zeros(1, dtype), np.int64(j), *args) for j in range(n)]
    np.testing.assert_array_equal(np.array(got, dtype), want)

def test_uniform_and_normal_statistics():
    prog, x, _ = _prog(_dropout_fn(0.5), (400, 1000))
    prog.step(x)
    u, z = prog.outputs["u"].ravel().astype(np.float64), prog.outputs["z"].ravel().astype(np.float64)
    n = u.size
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n) and abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
    hist = np.histogram(u, bins=20, range=(0, 1))[0]
    assert np.all(np.abs(hist - n / 20) < 5 * np.sqrt(n / 20))
    assert abs(z.mean()) < 5 / np.sqrt(n) and abs(z.var() - 1) < 5 * np.sqrt(2 / n)
    assert abs(np.mean(z ** 4) - 3) < 5 * np.sqrt(96 / n)                     # a normal's kurtosis
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / np.sqrt(n)             # neighbours independent


def test_fused_chain_and_standalone_rows_draw_the_same_mask():
    outs = []
    for fuse in (True, False):
        prog, x, _ = _prog(_dropout_fn(0.4), (5, 3, 1500), fuse_elementwise=fuse)
        fused = [op for e in prog.graph.eqns if e.op == "ew_fused" for op, *_ in e.attrs["body"]]
        assert ("rand" in fused) == fuse
        outs.append([(prog.step(x), prog.outputs["y"].copy()) for _ in range(2)])
    for (la, ya), (lb, yb) in zip(*outs):
        assert la == lb and np.array_equal(ya, yb)


def _gpt(dropout=0.2, T=8, **kw):
    cfg = gpt.GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=16, block_size=T, dropout=dropout)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (4, T)), rng.integers(0, 11, (4, T))
    return cfg, gpt.init_params(cfg, 3), x, y


def _losses(cfg, params, x, y, steps=3, **kw):
    prog = btjit.trace(gpt.loss_fn(cfg), params, x, y, optimizer=AdamW(lr=1e-2), **kw)
    return [prog.step(x, y) for _ in range(steps)]


def test_same_seed_same_losses_new_masks_every_step_other_seed_other_losses():
    cfg, params, x, y = _gpt()
    a, b = _losses(cfg, params, x, y, seed=4), _losses(cfg, params, x, y, seed=4)
    assert a == b
    assert _losses(cfg, params, x, y, seed=5) != a
    prog = btjit.trace(gpt.loss_fn(cfg), params, x, y, optimizer=SGD(lr=0.0), seed=4)
    losses = [prog.step(x, y) for _ in range(3)]         # lr 0: only the masks change from step to step
    assert len(set(losses)) == 3
    prog.step_count = 1
    assert prog.step(x, y) == losses[1]


@pytest.mark.parametrize("T", [8, 5])      # attention dropout in the kept kernels / as the ops written out
def test_same_masks_at_any_thread_count_and_with_replicas(T):
    cfg, params, x, y = _gpt(T=T)
    one = _losses(cfg, params, x, y, seed=9, dtype="float64")
    assert one != _losses(dataclasses.replace(cfg, dropout=0.0), params, x, y, dtype="float64")
    try:
        btjit.set_num_threads(2)
        two = _losses(cfg, params, x, y, seed=9, dtype="float64")
        reps = _losses(cfg, params, x, y, seed=9, dtype="float64", replicas=2)
    finally:
        btjit.set_num_threads(default_threads())
    np.testing.assert_allclose(two, one, rtol=1e-10)
    np.testing.assert_allclose(reps, one, rtol=1e-10)


def test_attention_dropout_in_the_kernels_equals_the_ops_written_out():
    """The kept kernels draw the mask btjit.dropout draws on the (B, nh, T, T) probabilities."""
    B, T, C, nh = 2, 16, 32, 2

    def f(p, written_out):
        qkv = p["qkv"]
        if not written_out:
            return btjit.sum(btjit.causal_attention(qkv, nh, dropout=0.25) * p["c"])
        q, k, v = (btjit.transpose(btjit.reshape(t, (B, T, nh, C // nh)), (0, 2, 1, 3)) for t in btjit.split(qkv, 3, 2))
        att = btjit.where(np.tril(np.ones((T, T), bool)), q @ btjit.swapaxes(k, -1, -2) / np.sqrt(C // nh), -np.inf)
        y = btjit.dropout(btjit.softmax(att), 0.25) @ v
        return btjit.sum(btjit.reshape(btjit.transpose(y, (0, 2, 1, 3)), (B, T, C)) * p["c"])
    rng = np.random.default_rng(0)
    p = {"qkv": rng.normal(size=(B, T, 3 * C)), "c": rng.normal(size=(B, T, C))}
    res = []
    for written_out in (False, True):
        prog = btjit.trace(lambda q: f(q, written_out), p, dtype="float64", optimizer=SGD(lr=0.0), seed=3)
        kernels = {prog.row_labels[i] for i in range(prog.n_rows)}
        assert ("causal_attention" in kernels) != written_out
        res.append([(prog.step(), prog.grads["qkv"].copy()) for _ in range(2)])
    for (la, ga), (lb, gb) in zip(*res):
        assert la == pytest.approx(lb, rel=1e-12)
        np.testing.assert_allclose(ga, gb, rtol=1e-9, atol=1e-12)


def test_eval_mode_and_p_zero_emit_nothing():
    cfg, params, x, y = _gpt()
    ev = btjit.trace(gpt.loss_fn(cfg), params, x, y, training=False)
    plain = btjit.trace(gpt.loss_fn(dataclasses.replace(cfg, dropout=0.0)), params, x, y)
    for prog in (ev, plain):
        assert prog.graph.rng_key is None and "rand" not in str(prog.graph)
    assert ev.forward(x, y) == plain.forward(x, y)
    prog, x1, w = _prog(_dropout_fn(0.5, training=False), (3, 4))
    prog.step(x1)
    assert np.array_equal(prog.outputs["y"], w * x1)


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, "0.5", True])
def test_bad_probability_names_the_line(p):
    if p != 1.0:                # dropout takes p = 1 (all dropped, as torch); the attention's dropout does not
        with pytest.raises(TraceError, match=r"dropout probability must be a number in \[0, 1\].*test_rng.py:\d+"):
            btjit.trace(lambda q: btjit.sum(btjit.dropout(q["w"], p)), {"w": np.ones(3)}, grad=True)
    with pytest.raises(TraceError, match=r"causal_attention: .*test_rng.py:\d+"):
        btjit.trace(lambda q: btjit.sum(btjit.causal_attention(q["w"], 1, dropout=p)), {"w": np.ones((1, 8, 24))})


@pytest.mark.parametrize("T", [8, 5])
def test_gradients_match_finite_differences_at_a_fixed_step(T):
    cfg, params, x, y = _gpt(dropout=0.3, T=T)
    check_grads(gpt.loss_fn(cfg), params, x, y, rtol=1e-6, atol=1e-9)


def test_key_block_shape_is_checked():
    with pytest.raises(TraceError):
        btjit.trace(lambda q, k: btjit.sum(emit("rand", (k,), shape=(2,), site=0, kind=0) * q["w"]),
                    {"w": np.ones(2)}, np.zeros(KEY_SIZE + 1, np.int32), grad=True)


def test_train_resume_is_bit_exact_with_dropout(tmp_path):
    """`btjit train` with dropout (T 8, head size 8: the kept attention kernels): stopped at step 13 and
    resumed, it ends bit for bit where the uninterrupted run ends -- the masks need only the step count."""
    from click.testing import CliRunner

    from btjit.train import checkpoint as K
    from btjit.cli import cli
    from textdata import corpus, tiny_config, write_run_files
    text = tiny_config(steps=20).replace("n_embd = 8\nblock_size = 4", "n_embd = 16\nblock_size = 8\ndropout = 0.2")
    cfg, data, tmp = write_run_files(tmp_path, text, corpus())
    run = lambda *a: CliRunner().invoke(cli, [str(x) for x in a], catch_exceptions=False)  # noqa: E731
    res = run("train", cfg, "--data", data, "--out", tmp / "a")
    assert res.exit_code == 0 and "dropout 0.2" in res.output, res.output
    assert run("train", cfg, "--data", data, "--out", tmp / "b", "--set", "train.steps=13").exit_code == 0
    res = run("train", cfg, "--data", data, "--out", tmp / "b", "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000013.npz at step 13" in res.output, res.output
    (a, _), (b, _) = K.latest_valid(tmp / "a"), K.latest_valid(tmp / "b")
    assert a.step == b.step == 20 and set(a.state) == set(b.state)
    for k in a.state:
        assert np.array_equal(a.state[k], b.state[k]), k
