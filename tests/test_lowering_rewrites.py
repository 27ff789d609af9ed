"""What the tracer and the lowering rewrite, with the values and gradients unchanged (numpy, finite
differences): an embedding gather feeding a linear folded into take_sum when the table has fewer rows than the
batch (also of concatenated takes; not a gather used twice); a first param used as a bias or residual at arena
offset 0; residual adds and relu fused into linear, and LayerNorm's backward adding the residual's gradient;
relu's input not kept for the backward; linear grads on the micro-kernels with the bias gradient fused; float32
exp of masked scores exactly 0; a transpose met again traced once."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads


# ----------------------------------------------------------------------------- the embedding fold
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


# ----------------------------------------------------------------------------- fusion and other rewrites
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
