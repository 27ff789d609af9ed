"""precision="bf16" (btjit/kernels/bf16.py, graph/ops/matmul.py): every matrix product reads its operands rounded
to bfloat16 (nearest even) and sums in float32, on VDPBF16PS where the CPU has it and on float32 FMAs where it
has not; the rest of the step stays float32. Checked against numpy on the rounded operands, for both code
paths, every operand layout, edge sizes and the thread split; then through btjit.trace, btjit train and an
export."""
import numpy as np
import pytest
from numba import njit

import btjit
from btjit.graph.lower import make_row
from btjit.testing import run_parts
from btjit.kernels import amx
from btjit.kernels import bf16 as B

RNG = np.random.default_rng(0)


def bf(x):
    """numpy's bfloat16 rounding (nearest even; NaN stays NaN) as float32 values."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.int64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    return (r.astype(np.uint32) << 16).view(np.float32)


def test_rounding_is_to_nearest_even_and_keeps_nan_and_inf():
    one = np.float32(1.0).view(np.uint32)
    xs = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001, 0x7F7FFFFF, 0x7F800000,
                   0xFF800000, 0x7F800001, 0x80000001], np.uint32).view(np.float32)
    got = np.array([B._bf16(x) for x in xs], np.int64)
    assert got.tolist() == (bf(xs).view(np.uint32) >> 16).tolist()
    assert got[:4].tolist() == [0x3F80, 0x3F82, 0x3F80, 0x3F81]         # ties to even, else nearest
    assert got[4] == 0x7F80 and got[5] == 0x7F80 and got[6] == 0xFF80  # overflow to inf; infs stay
    assert np.isnan(np.uint32(got[7] << 16).view(np.float32))            # a NaN stays a NaN


def _product(kernel, M, N, K, ta, tb, nb=1, bias=False, res=False, relu=False, nparts=1, by=0):
    A = RNG.standard_normal((nb, K, M) if ta else (nb, M, K)).astype(np.float32)
    Bm = RNG.standard_normal((nb, N, K) if tb else (nb, K, N)).astype(np.float32)
    bv, R = RNG.standard_normal(N).astype(np.float32), RNG.standard_normal((nb, M, N)).astype(np.float32)
    oA = 32
    oB = oA + A.size
    oC = oB + Bm.size
    ob = oC + nb * M * N
    orr = ob + N
    a = np.full(orr + R.size + 32, np.nan, np.float32)    # NaN around: a read or write out of place shows
    a[oA:oB], a[oB:oC], a[ob:orr], a[orr:orr + R.size] = A.ravel(), Bm.ravel(), bv, R.ravel()
    args = dict(oA=oA, oB=oB, oC=oC, nbatch=nb, M=M, N=N, K=K, sA=A[0].size, sB=Bm[0].size, sC=M * N, ta=ta, tb=tb,
                obias=ob if bias else 0, ores=orr if res else 0, relu=int(relu))
    r = np.array(make_row("k_matmul_bf16", **args, by=by), np.int64)
    run_parts(kernel, a, np.zeros(8, np.int32), r, nparts)
    Ab, Bb = bf(A).astype(np.float64), bf(Bm).astype(np.float64)
    Ab, Bb = (Ab.transpose(0, 2, 1) if ta else Ab), (Bb.transpose(0, 2, 1) if tb else Bb)
    want = Ab @ Bb + (bv if bias else 0) + (R if res else 0)
    want = np.maximum(want, 0) if relu else want
    got = a[oC:oC + nb * M * N].reshape(nb, M, N)
    assert np.isnan(a[:oA]).all() and np.isnan(a[orr + R.size:]).all()
    err = np.abs(got - want) / (np.abs(Ab) @ np.abs(Bb) + np.abs(want) + 1)
    return float(err.max()), got


SHAPES = [(8, 16, 1), (9, 17, 3), (37, 50, 301), (64, 130, 256), (21, 200, 530), (100, 400, 40)]


KERNELS = {"vectors": B.k_matmul_bf16, "tiles": amx.k_matmul_amx}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M,N,K", SHAPES + [(33, 48, 64), (16, 16, 32)])
@pytest.mark.parametrize("ta,tb", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_products_equal_float64_products_of_the_rounded_operands(kernel, M, N, K, ta, tb):
    """Both kernels (the AMX tiles emulated where the CPU has none): odd K, K over a packed block (256), N over
    a group of panels (192) and not a multiple of 16 (the last panel moved back), M not a multiple of 8 and over
    and under a block of 32 rows (one row tile or two), K padded to whole tiles, batches, bias, residual, relu."""
    err, one = _product(KERNELS[kernel], M, N, K, ta, tb, nb=2, bias=True, res=True, relu=True)
    assert err < 2e-7, err
    err, _ = _product(KERNELS[kernel], M, N, K, ta, tb)
    assert err < 2e-7, err


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M,nparts", [(16, 2), (37, 3), (70, 3), (100, 2)])
def test_the_thread_split_is_bitwise_one_thread(kernel, M, nparts):
    """By blocks of rows, and by whole products of a batch (by 2), for both kernels."""
    serial = par = KERNELS[kernel]
    RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
    _, one = _product(serial, M, 70, 90, 0, 0, bias=True)
    RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
    _, split = _product(par, M, 70, 90, 0, 0, bias=True, nparts=nparts)
    assert np.array_equal(one, split)
    for ta, tb in ((0, 1), (1, 0)):
        RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
        _, one = _product(serial, M, 70, 90, ta, tb, nb=5)
        RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
        _, split = _product(par, M, 70, 90, ta, tb, nb=5, nparts=nparts, by=2)
        assert np.array_equal(one, split)


def test_the_float32_fallback_computes_the_same_products(monkeypatch):
    """Where the CPU has no VDPBF16PS the micro-kernel multiplies the rounded halves with float32 FMAs: the same
    products (each exact in float32), summed in another order at most."""
    monkeypatch.setattr(B, "has_dpbf16", lambda: False)
    micro = B._micro(16)

    @njit
    def run(a, ws, kp):
        micro(a, ws, B.MR, 1, B.OBP, kp, 0, 16, B.MR, 0, 0, 0, 0, 0)
    K = 50
    A, Bm = RNG.standard_normal((B.MR, K)).astype(np.float32), RNG.standard_normal((K, 16)).astype(np.float32)
    arena = np.concatenate([A.T.ravel(), Bm.ravel()]).astype(np.float32)
    ws = np.zeros(B.WS, np.int32)
    B._pack(arena, ws, 0, 0, 1, B.MR, K // 2, B.MR, B.MR, K)              # A^T's pairs: (k, row) layout
    B._pack(arena, ws, B.OBP, A.size, 1, 16, K // 2, 16, 16, K)
    out = np.zeros(B.MR * 16, np.float32)
    run(out, ws, K // 2)
    want = bf(A).astype(np.float64) @ bf(Bm).astype(np.float64)
    np.testing.assert_allclose(out.reshape(B.MR, 16), want, rtol=0, atol=1e-5)


def _mlp(p, x, y):
    h = btjit.relu(x @ p["w1"] + p["b1"])
    return btjit.mean((h @ p["w2"] - y) ** 2)


def test_a_traced_program_in_bf16_computes_with_rounded_products():
    """The loss and every gradient of a two-layer net, against numpy with the products' operands rounded:
    forward x @ w1, h @ w2, backward dh = g @ w2^T, dW = x^T dY (the biases' sums in float32)."""
    p = {"w1": RNG.standard_normal((40, 48)).astype(np.float32) * 0.2, "b1": RNG.standard_normal(48).astype(np.float32),
         "w2": RNG.standard_normal((48, 16)).astype(np.float32) * 0.2}
    x, y = RNG.standard_normal((24, 40)).astype(np.float32), RNG.standard_normal((24, 16)).astype(np.float32)
    prog = btjit.trace(_mlp, p, x, y, grad=True, precision="bf16", threads=1)
    assert prog.precision.startswith("bf16")
    v = prog.value_and_grad(x, y)
    f = lambda z: bf(z).astype(np.float64)  # noqa: E731
    z1 = f(x) @ f(p["w1"]) + p["b1"]
    h = np.maximum(z1, 0).astype(np.float32)
    out = (f(h) @ f(p["w2"])).astype(np.float32)
    d = (out - y).astype(np.float32)
    assert v == pytest.approx(float(np.mean(d.astype(np.float64) ** 2)), rel=1e-5)
    g = (2 * d / d.size).astype(np.float32)
    np.testing.assert_allclose(prog.grads["w2"], f(h).T @ f(g), rtol=1e-4, atol=1e-7)
    dz = ((f(g) @ f(p["w2"]).T) * (z1 > 0)).astype(np.float32)
    np.testing.assert_allclose(prog.grads["b1"], dz.sum(0), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(prog.grads["w1"], f(x).T @ f(dz), rtol=1e-3, atol=1e-6)
    fp32 = btjit.trace(_mlp, p, x, y, grad=True, threads=1)
    assert fp32.precision == "fp32" and fp32.value_and_grad(x, y) != v      # the rounding is there


def test_threads_and_eval_keep_the_precision():
    from btjit.models import gpt
    cfg = gpt.GPTConfig(vocab_size=20, n_layer=1, n_head=2, n_embd=32, block_size=16)
    p = gpt.init_params(cfg, np.random.default_rng(0))
    x = RNG.integers(0, 20, (8, 16)).astype(np.int32)
    y = RNG.integers(0, 20, (8, 16)).astype(np.int32)
    losses = []
    for threads in (1, 2):
        prog = btjit.trace(gpt.loss_fn(cfg), p, x, y, optimizer=btjit.optim.AdamW(lr=1e-2), precision="bf16",
                           threads=threads)
        losses.append([prog.step(x, y) for _ in range(3)] + [prog.eval(x, y)])
    assert losses[0] == losses[1]                       # the thread split computes what one thread does
    ref = btjit.trace(gpt.loss_fn(cfg), p, x, y, optimizer=btjit.optim.AdamW(lr=1e-2), threads=1)
    want = [ref.step(x, y) for _ in range(3)]
    assert losses[0][:3] != want and np.allclose(losses[0][:3], want, rtol=2e-2)


def test_bad_precision_is_named():
    p, x = {"w": np.ones((3, 3), np.float32)}, np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match='precision must be "fp32" or "bf16", got .fp16.'):
        btjit.trace(lambda p, x: btjit.sum(x @ p["w"]), p, x, precision="fp16")
    with pytest.raises(ValueError, match="needs dtype float32"):
        btjit.trace(lambda p, x: btjit.sum(x @ p["w"]), p, x, precision="bf16", dtype="float64")


def test_a_bf16_export_runs_bitwise_and_records_the_instruction_set(tmp_path):
    from test_export import CFG, batches, gpt, run_fresh
    import json
    p = gpt.init_params(CFG, np.random.default_rng(0))
    data = batches(3, B=4)
    prog = btjit.trace(gpt.loss_fn(CFG), p, *data[0], optimizer=btjit.optim.AdamW(lr=1e-2), precision="bf16")
    cfg16 = gpt.GPTConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=16, block_size=4)
    prog16 = btjit.trace(gpt.loss_fn(cfg16), gpt.init_params(cfg16, np.random.default_rng(1)), *data[0],
                         optimizer=btjit.optim.AdamW(lr=1e-2), precision="bf16")
    assert any(e.startswith(B.KERNELS) for e in prog16.kernels.entries)
    np.savez(tmp_path / "b.npz", **{f"x{i}": x for i, (x, _) in enumerate(data)},
             **{f"y{i}": y for i, (_, y) in enumerate(data)})
    jobs, want = {}, {}
    for name, pr in (("small", prog), ("wide", prog16)):
        pr.export(tmp_path / name)
        want[name] = [pr.step(x, y) for x, y in data]
        jobs[name] = {"kind": "tensor", "dir": str(tmp_path / name), "batches": str(tmp_path / "b.npz"), "steps": 3}
    got = run_fresh(jobs)
    for name in want:
        assert got[name]["losses"] == want[name], name
    flags = json.loads((tmp_path / "wide" / "manifest.json").read_text())["cpu_flags"]
    assert ("avx512_bf16" in flags) == B.has_dpbf16()


def test_the_scale_suite_runs_bf16_beside_float32():
    """`btjit bench --suite scale --precision bf16`: btjit's bf16 step beside its float32 step (and torch under
    autocast when asked), each in its own process; the rows say their precision."""
    from btjit.bench import report, scale_suite
    rows = scale_suite.run(only="E6", impls=["btjit"], reps=1, precision="bf16")
    assert [(r["impl"], r["precision"], r["status"]) for r in rows] == [("btjit", "bf16", "ok"),
                                                                       ("btjit-fp32", "fp32", "ok")]
    assert all(r["time_s"] is not None and r["gflops"] is not None for r in rows)    # each was measured
    head, cells = report.parse_markdown(scale_suite.format_table(rows, markdown=True, command="btjit bench"))
    assert [c[1] for c in cells] == ["btjit bf16", "btjit-fp32"]
    with pytest.raises(ValueError, match="precision must be fp32 or bf16"):
        scale_suite.run(only="E6", precision="fp16")
    from btjit.bench import suites
    with pytest.raises(ValueError, match="--precision applies to --suite scale"):
        suites.run("nanogpt", precision="bf16")
