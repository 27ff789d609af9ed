"""Programs on more than one thread: the parallel kernels (attention over sequences, GEMMs split over threads,
the embedding fold's batched GEMMs, float32 linear grads on the micro-kernels) give one thread's gradients; R
data-parallel replicas give the whole batch's losses, grads, params and optimizer state, take loaded params,
check every shard's input, and need a batch divisible by R (replicas_for picks R)."""
import numpy as np
import pytest

import btjit
from btjit.host.threads import default_threads


# ----------------------------------------------------------------------------- two threads against one
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
