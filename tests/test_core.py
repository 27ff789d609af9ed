"""The compiler core: autodiff cases, the arena planner, lowering vs a numpy interpretation of the planned IR,
trace-time errors, step() input checks, and training an MLP end to end."""
import itertools

import numpy as np
import pytest

import btjit
from btjit.host.threads import default_threads
from btjit.graph import interp
from btjit.graph.ir import verify
from btjit.graph.ops import TABLE
from btjit.testing import check_grads


def _mlp(seed=0, n_in=4, n_h=16, n_out=3):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(0, 0.5, (n_in, n_h)), "b1": np.zeros(n_h),
            "w2": rng.normal(0, 0.5, (n_h, n_out)), "b2": np.zeros(n_out)}


def mlp_loss(p, x, y):
    h = btjit.tanh(x @ p["w1"] + p["b1"])
    return btjit.cross_entropy(h @ p["w2"] + p["b2"], y)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] * x[:, 2] > 0)).astype(np.int32)
    return x, y


# ----------------------------------------------------------------------------- autodiff
def test_value_used_by_many_ops():
    def f(p):
        x = p["x"]
        y = x * x                       # fan-out of x into mul twice, then y into three consumers
        return btjit.sum(y * 2.0 + btjit.exp(y) * x - y / (1.0 + x * x))
    check_grads(f, {"x": np.random.default_rng(0).normal(size=(3, 4))})


def test_broadcasting_in_both_operands():
    def f(p):
        return btjit.sum(btjit.tanh(p["a"] * p["b"] + p["a"] / (2.0 + p["b"] * p["b"])))
    rng = np.random.default_rng(1)
    check_grads(f, {"a": rng.normal(size=(3, 1, 5)), "b": rng.normal(size=(4, 1))})


def test_unused_param_gets_zero_grad_and_a_warning():
    x, y = _data()
    params = {**_mlp(), "unused": np.ones(3)}
    with pytest.warns(UserWarning, match="'unused' does not reach the loss"):
        prog = btjit.trace(mlp_loss, params, x, y, optimizer=btjit.optim.SGD(lr=0.1, weight_decay=0.0), dtype="float64")
    prog.step(x, y)
    assert np.all(prog.grads["unused"] == 0) and np.all(prog.params["unused"] == 1)


def test_shared_node_gradients_accumulate():
    # PAPER.md: x=3, y=x*x, l1=2y, l2=3y; d(l1 + l2)/dx = 30 (BurTorch's repeated backward gives 12)
    prog = btjit.trace(lambda p: 2 * (p["x"] * p["x"]) + 3 * (p["x"] * p["x"]), {"x": np.array(3.0)},
                       dtype="float64", grad=True)
    assert prog.value_and_grad() == 45.0 and prog.grads["x"] == 30.0


def test_tensor_api_composites_gradcheck():
    def f(p, idx):
        x = p["x"]
        s = btjit.softmax(x, axis=-1) * btjit.log_softmax(x[:, ::-1] if False else x.T.T)
        parts = btjit.split(x, [1, 3], axis=1)
        c = btjit.concatenate([parts[2], parts[0]], axis=1)
        m = btjit.mean(c, axis=0, keepdims=True) + btjit.max(x, axis=1, keepdims=True)
        w = btjit.where(np.eye(3, 5, dtype=bool), x, -1.0) + x[1:, 2:4].sum() + btjit.sqrt(x * x + 1.0)
        e = btjit.take(p["emb"], idx).reshape(2, -1).swapaxes(0, 1)
        return btjit.sum(s) + btjit.sum(m * m) + btjit.sum(w ** 3) + btjit.sum(btjit.sigmoid(e) @ p["v"]) + \
            btjit.sum(np.exp(x) * np.tanh(x)) + btjit.sum(btjit.maximum(x, 0.1) + btjit.relu(x - 0.05))
    rng = np.random.default_rng(3)
    params = {"x": rng.normal(size=(3, 5)), "emb": rng.normal(size=(7, 3)), "v": rng.normal(size=(2, 4))}
    check_grads(f, params, np.array([[1, 2], [6, 1], [0, 0]], np.int32))


# ----------------------------------------------------------------------------- planner
def _prog(B=8):
    from btjit.models import gpt
    cfg = gpt.GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=8, block_size=4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (B, 4)).astype(np.int32)
    y = rng.integers(0, 11, (B, 4)).astype(np.int32)
    return btjit.trace(gpt.loss_fn(cfg), gpt.init_params(cfg, 0), x, y, optimizer=btjit.optim.SGD(lr=0.1)), x, y


def test_no_two_live_buffers_overlap_and_planned_is_smaller():
    prog, _, _ = _prog()
    iv = list(prog.plan.intervals.values())
    assert len(iv) > 50
    for (d1, u1, o1, n1), (d2, u2, o2, n2) in itertools.combinations(iv, 2):
        if not (u1 < d2 or u2 < d1):                     # alive at the same time
            assert o1 + n1 <= o2 or o2 + n2 <= o1, "overlapping live buffers"
    fixed_end = min(o for _, _, o, _ in iv)
    for _, _, o, n in iv:
        assert o >= fixed_end and o + n <= prog.plan.float_size
    m = prog.memory
    assert m["minimum_bytes"] < m["planned_bytes"] < m["naive_bytes"]
    verify(prog.graph, TABLE)


def test_graph_prints_one_line_per_equation_with_shapes():
    prog, _, _ = _prog()
    text = str(prog.graph)
    assert "matmul(" in text and "f32[8,4,8]" in text and "# ---- backward ----" in text
    assert sum(1 for line in text.splitlines() if " = " in line) == len(prog.graph.eqns)


# ----------------------------------------------------------------------------- lowering
def test_native_step_equals_numpy_interpretation_of_the_planned_ir():
    prog, x, y = _prog()
    a_ref, _ = interp.run(prog, x, y, upto="backward")
    loss = prog.value_and_grad(x, y)
    grads_start, n = prog.plan.grads_start, prog.plan.params_span[1]
    np.testing.assert_allclose(prog.a[grads_start:grads_start + n], a_ref[grads_start:grads_start + n],
                               rtol=1e-4, atol=2e-6)
    assert abs(loss - a_ref[prog.plan.off[prog.graph.loss.id]]) < 1e-5
    before = {k: v.copy() for k, v in prog.params.items()}
    prog.step(x, y)
    for k in before:   # SGD update = p - lr * g, g from this step
        np.testing.assert_allclose(prog.params[k], before[k] - 0.1 * prog.grads[k], rtol=1e-6, atol=1e-7)


def test_grads_are_recomputed_not_accumulated_across_steps():
    prog, x, y = _prog()
    prog.lr = 0.0
    prog.step(x, y)
    g1 = {k: v.copy() for k, v in prog.grads.items()}
    prog.step(x, y)
    for k in g1:
        np.testing.assert_array_equal(prog.grads[k], g1[k])


# ----------------------------------------------------------------------------- errors
def _emb_mlp(V, B, P=3, E=4, N=5, seed=0):
    rng = np.random.default_rng(seed)
    params = {"emb": rng.normal(size=(V, E)), "w": rng.normal(size=(P * E, N)), "b": rng.normal(size=N)}
    x = rng.integers(0, V, (B, P)).astype(np.int32)
    y = rng.integers(0, N, B).astype(np.int32)

    def loss(p, x, y):
        e = btjit.take(p["emb"], x)
        return btjit.cross_entropy(btjit.tanh(e.reshape(B, P * E) @ p["w"] + p["b"]), y)

    def ref(p):                       # numpy, the textbook schedule
        h = np.tanh(p["emb"][x].reshape(B, P * E) @ p["w"] + p["b"])
        z = h - h.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(B), y]))
    return params, loss, x, y, ref


@pytest.mark.parametrize("V,B,folded", [(5, 16, True), (16, 5, False)])
def test_embedding_fold_only_when_the_table_is_smaller_than_the_batch(V, B, folded):
    params, loss, x, y, ref = _emb_mlp(V, B)
    prog = btjit.trace(loss, params, x, y, dtype="float64", grad=True)
    ops = [e.op for e in prog.graph.eqns[:prog.graph.n_forward]]
    assert ("take_sum" in ops) == folded and ("take" in ops) == (not folded)
    assert prog.value_and_grad(x, y) == pytest.approx(ref(params), rel=1e-12)
    check_grads(loss, params, x, y)


@pytest.mark.parametrize("V,B,folded", [(5, 8, True), (40, 2, False)])
def test_embedding_fold_of_concatenated_takes(V, B, folded):
    """makemore's MLP: one take per context position (of rolled indices, the blank token set) concatenated
    along the last axis, then a linear: folded into take_sum when the table has fewer rows than the batch's
    positions, with the same loss and gradients (numpy, finite differences)."""
    T, E, N, P = 3, 2, 4, 3
    rng = np.random.default_rng(V)
    params = {"emb": rng.normal(size=(V, E)), "w": rng.normal(size=(P * E, N)), "b": rng.normal(size=N)}
    x = rng.integers(0, V - 1, (B, T)).astype(np.int32)
    y = rng.integers(0, N, (B, T)).astype(np.int32)

    def loss(p, x, y):
        embs = []
        for _ in range(P):
            embs.append(btjit.take(p["emb"], x))
            x = btjit.roll(x, 1, 1)
            x[:, 0] = V - 1
        h = btjit.tanh(btjit.concatenate(embs, -1) @ p["w"] + p["b"])
        return btjit.cross_entropy(h, y)

    def ref(p):
        xs, xk = [], x.copy()
        for _ in range(P):
            xs.append(p["emb"][xk])
            xk = np.roll(xk, 1, 1)
            xk[:, 0] = V - 1
        h = np.tanh(np.concatenate(xs, -1) @ p["w"] + p["b"]).reshape(B * T, N)
        z = h - h.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(B * T), y.ravel()]))
    prog = btjit.trace(loss, params, x, y, dtype="float64", grad=True)
    ops = [e.op for e in prog.graph.eqns[:prog.graph.n_forward]]
    assert ("take_sum" in ops) == folded and ("take" in ops) == (not folded)
    assert prog.value_and_grad(x, y) == pytest.approx(ref(params), rel=1e-12)
    check_grads(loss, params, x, y)


def test_embedding_fold_keeps_a_gather_that_is_used_twice():
    params, loss, x, y, ref = _emb_mlp(5, 16)

    def loss2(p, x, y):
        e = btjit.take(p["emb"], x)
        h = btjit.tanh(e.reshape(16, 12) @ p["w"] + p["b"])
        return btjit.cross_entropy(h, y) + btjit.sum(e * e)
    prog = btjit.trace(loss2, params, x, y, dtype="float64", grad=True)
    assert "take_sum" not in [e.op for e in prog.graph.eqns]
    assert prog.value_and_grad(x, y) == pytest.approx(ref(params) + float(np.sum(params["emb"][x] ** 2)), rel=1e-12)


def test_shape_error_names_op_shapes_and_line():
    def bad(p, x):
        return btjit.sum(x @ p["w"])
    with pytest.raises(btjit.TraceError, match=r"matmul: .*\(64, 16\) and \(32, 8\).*test_core.py:\d+"):
        btjit.trace(bad, {"w": np.zeros((32, 8))}, np.zeros((64, 16)), grad=False)


def test_data_dependent_control_flow_is_a_clear_error():
    def bad(p, x):
        y = btjit.sum(x * p["w"])
        if y > 0:
            return y
        return -y
    with pytest.raises(btjit.TraceError, match=r"data-dependent control flow.*test_core.py"):
        btjit.trace(bad, {"w": np.zeros(3)}, np.zeros(3))


def test_unsupported_numpy_function_and_int_as_float():
    with pytest.raises(btjit.TraceError, match="np.median is not supported"):
        btjit.trace(lambda p: btjit.sum(np.median(p["w"])), {"w": np.zeros(3)}, grad=True)
    with pytest.raises(btjit.TraceError, match="integer array where floats are needed"):
        btjit.trace(lambda p, i: btjit.sum(p["w"] * i), {"w": np.zeros(3)}, np.zeros(3, np.int32), grad=True)
    with pytest.raises(TypeError, match="parameter 'w' has dtype int64"):
        btjit.trace(lambda p: btjit.sum(p["w"]), {"w": np.zeros(3, np.int64)})


def test_value_and_grad_of_a_program_without_gradients_says_how():
    x, y = _data()
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y)
    with pytest.raises(RuntimeError, match=r"computes no gradients: trace it with btjit.trace\(..., grad=True\)"):
        prog.value_and_grad(x.astype(np.float32), y)
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y, grad=True)
    assert prog.value_and_grad(x.astype(np.float32), y) == prog.forward(x.astype(np.float32), y)


def test_step_rejects_wrong_batches():
    x, y = _data()
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y, optimizer=btjit.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"argument 0 \(x\): expected float32 array of shape \(64, 4\), got float32 \(32, 4\)"):
        prog.step(x[:32].astype(np.float32), y)
    with pytest.raises(ValueError, match=r"argument 0 \(x\): expected float32"):
        prog.step(x, y)     # float64
    with pytest.raises(ValueError, match=r"argument 1 \(y\): index values must be in \[0, 3\)"):
        prog.step(x.astype(np.float32), np.full(64, 7, np.int32))
    with pytest.raises(TypeError, match="expected 2 batch arguments"):
        prog.step(x.astype(np.float32))


# ----------------------------------------------------------------------------- training
def test_mlp_training_drives_the_loss_far_down():
    x, y = _data(256)
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y, optimizer=btjit.optim.SGD(lr=0.5, momentum=0.9))
    first = prog.forward(x.astype(np.float32), y)
    for _ in range(300):
        last = prog.step(x.astype(np.float32), y)
    assert first > 0.8 and last < 0.1 * first


def test_forward_only_program_returns_outputs():
    p = _mlp()
    x, _ = _data(5)
    prog = btjit.trace(lambda p, x: btjit.tanh(x @ p["w1"] + p["b1"]), p, x, dtype="float64")
    np.testing.assert_allclose(prog(x), np.tanh(x @ p["w1"] + p["b1"]), rtol=1e-12)
    with pytest.raises(RuntimeError, match="without an optimizer"):
        prog.step(x)


def test_state_dict_round_trip_is_exact():
    x, y = _data()
    x = x.astype(np.float32)
    prog = btjit.trace(mlp_loss, _mlp(), x, y, optimizer=btjit.optim.AdamW(lr=0.01))
    for _ in range(3):
        prog.step(x, y)
    sd = prog.state_dict()
    other = btjit.trace(mlp_loss, _mlp(seed=9), x, y, optimizer=btjit.optim.AdamW(lr=0.01))
    other.load_state_dict(sd)
    assert other.step(x, y) == prog.step(x, y)
    for k in prog.params:
        np.testing.assert_array_equal(other.params[k], prog.params[k])


def test_skip_nonfinite_leaves_params_and_state_untouched():
    x, y = _data()
    x = x.astype(np.float32)
    prog = btjit.trace(lambda p, x, y: mlp_loss(p, x, y) * btjit.sqrt(p["s"]), {**_mlp(), "s": np.ones(())}, x, y,
                       optimizer=btjit.optim.AdamW(lr=0.01), skip_nonfinite=True)
    prog.step(x, y)
    assert not prog.last_step_skipped and prog.step_count == 1
    prog.params["s"][...] = -1.0                       # sqrt(-1) = NaN: loss and every gradient non-finite
    before = prog.state_dict()
    loss = prog.step(x, y)
    assert np.isnan(loss) and prog.last_step_skipped
    after = prog.state_dict()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    prog.params["s"][...] = 1.0
    prog.step(x, y)
    assert not prog.last_step_skipped and prog.step_count == 2


def _serial_and_two_thread(loss, params, *batch):
    """The same float64 gradient program traced with 1 thread and with 2 (the parallel kernels)."""
    serial = btjit.trace(loss, params, *batch, dtype="float64", grad=True, threads=1)
    par = btjit.trace(loss, params, *batch, dtype="float64", grad=True, threads=2)
    return serial, par


@pytest.mark.parametrize("B", [17, 67])
def test_two_thread_attention_kernels_match_the_serial_ones(B):
    from btjit.graph.ops import TABLE as OPS
    rng = np.random.default_rng(B)
    qkv = rng.normal(size=(B, 5, 12))
    w = rng.normal(size=(B, 5, 4))

    def f(p):
        return btjit.sum(btjit.causal_attention(p["qkv"], 2) * w)
    serial, par = _serial_and_two_thread(f, {"qkv": qkv})
    assert any(lbl.startswith("causal_attention") for lbl in par.row_labels)
    from btjit.testing import split_kernels
    assert {"k_attn_fwd_bl", "k_attn_bwd_bl"} <= set(split_kernels(par))
    assert par.value_and_grad() == pytest.approx(serial.value_and_grad(), rel=1e-12)
    np.testing.assert_allclose(par.grads["qkv"], serial.grads["qkv"], rtol=1e-12, atol=1e-14)
    ref = OPS["causal_attention"].ref([qkv], {"n_head": 2})[0]
    assert par.forward() == pytest.approx(float(np.sum(ref * w)), rel=1e-12)


def test_two_thread_gpt_step_matches_one_thread():
    """The parallel kernels (GEMMs split over threads, attention over sequences) give the same gradients."""
    from btjit.testing import split_kernels
    from btjit.models import gpt
    cfg = gpt.GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=16, block_size=8)
    params = {k: v.astype(np.float64) for k, v in gpt.init_params(cfg, 0).items()}
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (32, 8)).astype(np.int32)
    y = rng.integers(0, 11, (32, 8)).astype(np.int32)
    serial, par = _serial_and_two_thread(gpt.loss_fn(cfg), params, x, y)
    assert "k_matmul" in split_kernels(par)
    assert par.value_and_grad(x, y) == pytest.approx(serial.value_and_grad(x, y), rel=1e-12)
    for k in params:
        np.testing.assert_allclose(par.grads[k], serial.grads[k], rtol=1e-10, atol=1e-13, err_msg=k)


def test_two_thread_folded_mlp_matches_one_thread():
    """The embedding fold's batched, broadcast GEMMs split over threads (and in halves on one thread,
    split_gemm) give the gradients of the serial program."""
    from btjit.kernels.library import OPCODE
    from btjit.testing import split_kernels
    from btjit.models import mlp
    cfg = mlp.MLPConfig(vocab_size=11, context=8, n_emb=16, n_hidden=1024)
    params = {k: v.astype(np.float64) for k, v in mlp.init_params(cfg, 0).items()}
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (48, 8)).astype(np.int32)
    y = rng.integers(0, 11, 48).astype(np.int32)
    serial, par = _serial_and_two_thread(mlp.loss_fn(cfg), params, x, y)
    assert "take_sum" in [e.op for e in par.graph.eqns]
    assert "k_matmul" in split_kernels(par)
    assert any(int(r[0]) == OPCODE["k_matmul"] and r[17] == 2 for r in serial.tape)   # a split GEMM
    assert par.value_and_grad(x, y) == pytest.approx(serial.value_and_grad(x, y), rel=1e-12)
    for k in params:
        np.testing.assert_allclose(par.grads[k], serial.grads[k], rtol=1e-10, atol=1e-13, err_msg=k)


def test_two_thread_float32_linear_grads():
    """float32 `x @ W + b` on 2 threads, dW = X^T dY big enough to be split over them (k_matmul_micro's row, with
    db riding along): both gradients bitwise equal to the one-thread program's and close to numpy's."""
    from btjit.testing import split_kernels
    rng = np.random.default_rng(3)
    x = rng.normal(size=(600, 24)).astype(np.float32)
    p = {"W": rng.normal(0, 0.3, (24, 30)).astype(np.float32), "b": rng.normal(size=30).astype(np.float32)}
    w = rng.normal(size=(600, 30))

    def f(p, x):
        return btjit.sum(btjit.tanh(x @ p["W"] + p["b"]) * w)
    serial = btjit.trace(f, p, x, grad=True, threads=1)
    par = btjit.trace(f, p, x, grad=True, threads=2)
    assert "k_matmul_micro" in split_kernels(par) and not split_kernels(serial)
    g = (1 - np.tanh(x.astype(np.float64) @ p["W"] + p["b"]) ** 2) * w
    for prog in (serial, par):
        prog.value_and_grad(x)
        np.testing.assert_allclose(prog.grads["W"], x.T.astype(np.float64) @ g, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(prog.grads["b"], g.sum(0), rtol=1e-4, atol=1e-4)
    for k in p:
        np.testing.assert_array_equal(serial.grads[k], par.grads[k])


# ----------------------------------------------------------------------------- data-parallel replicas
def _gpt_case(B=6, seed=0):
    from btjit.models import gpt
    cfg = gpt.GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=8, block_size=5)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 11, (B, 5)).astype(np.int32)
    return gpt.loss_fn(cfg), gpt.init_params(cfg, seed), x, rng.integers(0, 11, (B, 5)).astype(np.int32)


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_step_equals_the_whole_batch_step(replicas):
    """R replicas on R threads: the same losses, grads, params and optimizer state as one program on the
    whole batch (AdamW with a global-norm clip, which must see the averaged grads), step after step."""
    loss, params, x, y = _gpt_case()
    params = {k: v.astype(np.float64) for k, v in params.items()}
    make = lambda r: btjit.trace(loss, params, x, y, optimizer=btjit.optim.AdamW(lr=1e-2), clip_norm=0.5,  # noqa: E731
                                 dtype="float64", replicas=r)
    btjit.set_num_threads(2)
    try:
        one, rep = make(1), make(replicas)
        assert rep.replicas == replicas and rep.inputs["idx"].shape == (6 // replicas, 5)
        for _ in range(3):
            assert rep.step(x, y) == pytest.approx(one.step(x, y), rel=1e-13)
        assert rep.value_and_grad(x, y) == pytest.approx(one.value_and_grad(x, y), rel=1e-13)
        assert rep.forward(x, y) == pytest.approx(one.forward(x, y), rel=1e-13)
    finally:
        btjit.set_num_threads(default_threads())
    for k in params:
        np.testing.assert_allclose(rep.params[k], one.params[k], rtol=1e-11, atol=1e-14, err_msg=k)
        np.testing.assert_allclose(rep.grads[k], one.grads[k], rtol=1e-11, atol=1e-14, err_msg=k)
    ro, rr = one.state_dict(), rep.state_dict()
    assert int(rr["opt/step"]) == 3 and ro.keys() == rr.keys()
    for k in ro:
        np.testing.assert_allclose(rr[k], ro[k], rtol=1e-11, atol=1e-14, err_msg=k)
    assert rep.memory["planned_bytes"] >= replicas * rep.plan.float_size * 8


def test_replicas_take_loaded_params_and_check_every_shard():
    """Params set through the views (load_state_dict) reach every replica; a bad index in the last shard is
    an error naming the argument, and that step changes nothing."""
    loss, params, x, y = _gpt_case()
    one = btjit.trace(loss, params, x, y, optimizer=btjit.optim.SGD(lr=0.1))
    rep = btjit.trace(loss, params, x, y, optimizer=btjit.optim.SGD(lr=0.1), replicas=2)
    one.step(x, y)
    rep.load_state_dict(one.state_dict())
    assert rep.forward(x, y) == pytest.approx(one.forward(x, y), rel=1e-6)
    before = {k: v.copy() for k, v in rep.params.items()}
    bad = y.copy()
    bad[-1, -1] = 11
    with pytest.raises(ValueError, match=r"batch argument 1 \(targets\): index values must be in \[0, 11\)"):
        rep.step(x, bad)
    for k, v in rep.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    assert rep.step(x, y) == pytest.approx(one.step(x, y), rel=1e-5)


def test_replicas_bad_input_errors():
    loss, params, x, y = _gpt_case(B=5)
    with pytest.raises(ValueError, match=r"batch argument 'idx' has shape \(5, 5\): replicas=2 needs a first axis "
                                         r"divisible by 2"):
        btjit.trace(loss, params, x, y, optimizer=btjit.optim.SGD(lr=0.1), replicas=2)
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        btjit.trace(loss, params, x, y, optimizer=btjit.optim.SGD(lr=0.1), replicas=0)
    with pytest.raises(btjit.TraceError, match=r"replicas=2 averages one scalar .* returns outputs 'h'"):
        btjit.trace(lambda p, x: (btjit.sum(x @ p["w"]), {"h": x @ p["w"]}), {"w": np.ones((3, 2))},
                    np.ones((4, 3)), replicas=2)
    rep = btjit.trace(loss, params, x[:4], y[:4], optimizer=btjit.optim.SGD(lr=0.1), replicas=2)
    with pytest.raises(ValueError, match=r"batch argument 0 \(idx\): expected int array of shape \(4, 5\)"):
        rep.step(x, y)


@pytest.mark.parametrize("batch, rows, threads, want", [(64, 512, 2, 2), (64, 64, 2, 1), (5, 640, 2, 1),
                                                         (64, 512, 1, 1), (12, 384, 3, 3)])
def test_replicas_for_needs_a_divisible_batch_and_enough_rows(batch, rows, threads, want):
    assert btjit.replicas_for(batch, rows, threads) == want


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_first_param_as_bias_or_residual(dtype):
    """The first param sits at the start of the arena; kernel rows take offset 0 for "no bias / residual",
    so the arena keeps offset 0 unused: a bias or residual that is the first param is still added."""
    rng = np.random.default_rng(0)
    p = {"b": rng.normal(size=16), "r": rng.normal(size=(12, 16)), "W": rng.normal(size=(8, 16))}
    x = rng.normal(size=(12, 8))
    w = rng.normal(size=(12, 16))
    for first in ("b", "r"):
        order = {first: p[first], **{k: v for k, v in p.items() if k != first}}
        prog = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(p["r"] + (x @ p["W"] + p["b"])) * w),
                           {k: v.astype(dtype) for k, v in order.items()}, x.astype(dtype), grad=True, dtype=dtype)
        h = np.tanh(p["r"] + x @ p["W"] + p["b"])
        tol = 1e-4 if dtype == "float32" else 1e-10
        assert prog.value_and_grad(x.astype(dtype)) == pytest.approx(float(np.sum(h * w)), rel=tol)
        np.testing.assert_allclose(prog.grads["b"], ((1 - h ** 2) * w).sum(0), rtol=tol, atol=tol)
        assert prog.plan.param_off[first] > 0


def _pre_ln_block(p):
    """A pre-LayerNorm residual MLP block, twice, then a LayerNorm: the GPT's residual pattern."""
    x = p["x"]
    for k in ("1", "2"):
        h = btjit.layer_norm(x, p["g" + k], p["b" + k])
        x = x + (btjit.relu(h @ p["W" + k] + p["c" + k]) @ p["V" + k] + p["d" + k])
    return btjit.sum(btjit.tanh(btjit.layer_norm(x, p["g3"], p["b3"])) * p["w"])


def _pre_ln_params(rng, T, C, dtype):
    p = {"x": rng.normal(size=(T, C)), "w": rng.normal(size=(T, C)),
         "g3": 1 + 0.1 * rng.normal(size=C), "b3": 0.1 * rng.normal(size=C)}
    for k in ("1", "2"):
        p.update({"g" + k: 1 + 0.1 * rng.normal(size=C), "b" + k: 0.1 * rng.normal(size=C),
                  "W" + k: rng.normal(0, 0.3, (C, 2 * C)), "c" + k: 0.1 * rng.normal(size=2 * C),
                  "V" + k: rng.normal(0, 0.3, (2 * C, C)), "d" + k: 0.1 * rng.normal(size=C)})
    return {k: v.astype(dtype) for k, v in p.items()}


@pytest.mark.parametrize("T", [3, 16])
def test_residual_adds_and_relu_fused_into_linear_and_layernorm_grad(T):
    """x + (h @ V + d) becomes one linear with the residual added as the GEMM stores, relu(h @ W + c) one
    linear with the relu applied as it stores (micro-kernel rows in float32 from 8 rows, add / relu rows
    below), and the LayerNorm backward adds x's residual gradient as it stores: no add or relu is left in
    the blocks or their backward. Gradients: finite differences in float64, and float32 (the micro-kernel
    path) against float64."""
    rng = np.random.default_rng(T)
    p64 = _pre_ln_params(rng, T, 8, np.float64)
    prog = btjit.trace(_pre_ln_block, p64, grad=True, dtype="float64")
    ops = [(e.op, len(e.ins), e.attrs.get("relu", False)) for e in prog.graph.eqns]
    assert ops.count(("linear", 4, False)) == 2 and ops.count(("linear", 3, True)) == 2
    assert ops.count(("layernorm_grad", 6, False)) == 2 and not {"add", "relu"} & {op for op, _, _ in ops}
    check_grads(_pre_ln_block, p64)
    p32 = {k: v.astype(np.float32) for k, v in p64.items()}
    prog32 = btjit.trace(_pre_ln_block, p32, grad=True)
    loss32, loss64 = prog32.value_and_grad(), prog.value_and_grad()
    assert loss32 == pytest.approx(loss64, rel=1e-5, abs=1e-5)
    for k in p64:
        np.testing.assert_allclose(prog32.grads[k], prog.grads[k], rtol=1e-3, atol=1e-4, err_msg=k)


def test_relu_input_is_not_kept_for_the_backward():
    """relu's gradient reads relu's output, so its input (a (rows, 4C) activation in a GPT) dies at the relu:
    the planned arena holds one such buffer less per layer. Gradients: finite differences."""
    rng = np.random.default_rng(0)
    p = {"W": rng.normal(size=(6, 32)), "V": rng.normal(size=(32, 6))}
    x = rng.normal(size=(16, 6))

    def f(p, x):
        return btjit.sum(btjit.tanh(btjit.relu(x @ p["W"]) @ p["V"]))
    prog = btjit.trace(f, p, x, grad=True, dtype="float64", fuse_elementwise=False)   # the rule, before fusion
    relu = next(e for e in prog.graph.eqns if e.op == "relu")
    grad = next(e for e in prog.graph.eqns if e.op == "relu_grad")
    assert grad.ins[0] is relu.outs[0]
    assert not any(v is relu.ins[0] for e in prog.graph.eqns[prog.graph.n_forward:] for v in e.ins)
    check_grads(f, p, x)


@pytest.mark.parametrize("rows", [8, 130])
def test_linear_grads_on_micro_kernels_with_fused_bias_grad(rows):
    """float32 `x @ W + b` with >= 8 rows: the lowering runs dW = X^T dY and db = dY.sum(0) as one
    micro-kernel row (no separate sum), and every gradient matches numpy in float64."""
    from btjit.kernels.library import OPCODE
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 24)).astype(np.float32)
    w = rng.normal(size=(rows, 30))
    p = {"W": rng.normal(0, 0.3, (24, 30)).astype(np.float32), "b": rng.normal(size=30).astype(np.float32)}
    prog = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(x @ p["W"] + p["b"]) * w), p, x, grad=True)
    colsum = [r for r in prog.tape if r[0] == OPCODE["k_matmul_micro"] and r[14] > 0]
    assert len(colsum) == 1 and "sum (bwd)" not in prog.row_labels
    prog.value_and_grad(x)
    x64, W64, b64 = x.astype(np.float64), p["W"].astype(np.float64), p["b"].astype(np.float64)
    g = (1 - np.tanh(x64 @ W64 + b64) ** 2) * w
    np.testing.assert_allclose(prog.grads["W"], x64.T @ g, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(prog.grads["b"], g.sum(0), rtol=1e-4, atol=1e-4)


def test_float32_exp_of_masked_scores_is_exactly_zero():
    """exp(-inf) and exp(x < -87) are 0 in float32 kernels (the polynomial's clamp once gave 1.6e-38: masked
    softmax weights became denormals that slowed every later product ~10x). Below -87 numpy's float32 exp is
    itself a denormal; 0 is what float64 rounding to float32 gives from -104 on."""
    x = np.array([[0.0, -np.inf, -100.0, -86.0, 3.0]], np.float32)
    sm = btjit.trace(lambda p: btjit.softmax(p["x"], -1), {"x": x}, optimizer=None)()
    e = btjit.trace(lambda p: btjit.exp(p["x"]), {"x": x}, optimizer=None)()
    assert sm[0, 1] == 0.0 and sm[0, 2] == 0.0 and sm[0, 3] == 0.0
    np.testing.assert_allclose(sm, np.exp(x - 3.0) / np.exp(x - 3.0).sum(), rtol=1e-6, atol=1e-30)
    assert e[0, 1] == 0.0 and e[0, 2] == 0.0
    np.testing.assert_allclose(e[0, [0, 3, 4]], np.exp(x[0, [0, 3, 4]].astype(np.float64)), rtol=1e-6)


def test_a_transpose_met_again_is_traced_once():
    """x @ w.T in every step of a loop (torch's Linear weight layout, an RNN cell): the transpose of w is made
    once, not per step; the loss and gradients are numpy's."""
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(6, 4)) * 0.5, "u": rng.normal(size=(6, 6)) * 0.3}
    x = rng.normal(size=(5, 3, 4))

    def fn(p, x):
        h = btjit.tanh(x[0] @ p["w"].T)
        for t in range(1, x.shape[0]):
            h = btjit.tanh(x[t] @ p["w"].T + h @ p["u"].T)
        return btjit.sum(h * h)
    prog = btjit.trace(fn, p, x, dtype="float64", grad=True)
    assert sum(e.op == "transpose" for e in prog.graph.eqns[:prog.graph.n_forward]) == 2
    v = prog.value_and_grad(x)
    h = np.tanh(x[0] @ p["w"].T)
    for t in range(1, 5):
        h = np.tanh(x[t] @ p["w"].T + h @ p["u"].T)
    assert v == pytest.approx(float((h * h).sum()), rel=1e-12)
    from btjit.testing import check_grads
    check_grads(fn, p, x)


def test_assigning_a_param_copies_it_into_the_arena():
    """prog.params[name] = array loads the values (the program then computes with them, and state_dict saves
    what it computes with); an unknown name or another shape is an error naming it."""
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(5, 3)), "b": np.zeros(3)}
    x, y = rng.normal(size=(4, 5)), np.array([0, 1, 2, 1])
    prog = btjit.trace(lambda p, x, y: btjit.cross_entropy(x @ p["w"] + p["b"], y), p, x, y, dtype="float64",
                       optimizer=btjit.optim.SGD(lr=0.1))
    prog.params["w"] = np.zeros((5, 3))
    assert prog.forward(x, y) == pytest.approx(np.log(3.0), rel=1e-14)
    assert np.all(prog.state_dict()["param/w"] == 0.0)
    with pytest.raises(ValueError, match=r"prog.params\['w'\].*\(2, 2\).*\(5, 3\)"):
        prog.params["w"] = np.zeros((2, 2))
    with pytest.raises(KeyError, match="no such param"):
        prog.params["q"] = 1.0
