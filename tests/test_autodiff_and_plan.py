"""The compiler's middle on small programs: autodiff (a value used by many ops, broadcasting in both operands,
gradients of a shared node accumulating, the tensor API's composites; against finite differences), the arena
planner (no two live buffers overlap, the planned arena is smaller than the naive one; the printed graph) and
the lowering (the native step equals a numpy interpretation of the planned IR; gradients are recomputed each
step, not accumulated)."""
import itertools

import numpy as np

import btjit
from btjit.graph import interp
from btjit.graph.ir import verify
from btjit.graph.ops import TABLE
from btjit.testing import check_grads


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


def test_check_grads_takes_float32_params_and_batch():
    # the README's call: check_grads(loss_fn, params, *batch) on the float32 arrays the notebook example makes
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    x, y = rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    assert check_grads(lambda p, x, y: btjit.cross_entropy(x @ p["w"] + p["b"], y), params, x, y) < 1e-5


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
