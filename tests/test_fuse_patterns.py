"""Hand-written forms of ops btjit has kernels for become those ops (btjit/graph/fuse.py, fuse_act.py): makemore's
attention (split heads, q @ k^T * scale, causal masked_fill, softmax, @ v) -> causal_attention, NewGELU written out
-> gelu, the exact GELU written out -> gelu_erf, x * sigmoid(x) -> silu. Same values and gradients as the
written-out program; near misses are left alone."""
import math

import numpy as np
import pytest

import btjit
import btjit.graph.fuse as F
import btjit.graph.fuse_act as FA
from btjit.models import makemore as M


def traced(fn, params, *batch, fuse=True, dtype="float64"):
    saved = F.fuse_attention, FA.fuse_activations
    if not fuse:
        F.fuse_attention, FA.fuse_activations = (lambda g, t: None), (lambda g: None)
    try:
        return btjit.trace(fn, params, *batch, grad=True, dtype=dtype)
    finally:
        F.fuse_attention, FA.fuse_activations = saved


def ops(prog):
    return [e.op for e in prog.graph.eqns[:prog.graph.n_forward]]


def same(a, b, x, tol):
    va, vb = a.value_and_grad(*x), b.value_and_grad(*x)
    assert abs(va - vb) <= tol * max(1.0, abs(vb))
    for k in b.grads:
        np.testing.assert_allclose(a.grads[k], b.grads[k], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, T", [("float64", 16), ("float32", 16), ("float64", 9), ("float32", 33)])
def test_makemore_attention_becomes_causal_attention(dtype, T):
    c = M.MakemoreConfig(vocab_size=27, block_size=T, n_layer=2, n_head=4, n_embd=32, n_embd2=32)
    m = M.model("transformer", c)
    p = {k: v.astype(dtype) for k, v in m.init_params(np.random.default_rng(0)).items()}
    x = np.random.default_rng(1).integers(0, 27, (5, T)).astype(np.int32)
    fused, plain = traced(m.loss, p, x, x, dtype=dtype), traced(m.loss, p, x, x, fuse=False, dtype=dtype)
    assert ops(fused).count("causal_attention") == 2 and "softmax" not in ops(fused)
    assert ops(fused).count("gelu") == 2 and "gelu" not in ops(plain)
    same(fused, plain, (x, x), 1e-9 if dtype == "float64" else 2e-4)


def attention(q_scale=None, mask_future=True, T=6, nh=2, hs=4):
    B, C = 3, nh * hs

    def fn(p, x):
        q, k, v = btjit.split(x @ p["w"], 3, axis=2)
        q, k, v = (t.reshape(B, T, nh, hs).swapaxes(1, 2) for t in (q, k, v))
        att = (q @ k.swapaxes(-2, -1)) * (q_scale if q_scale is not None else 1.0 / math.sqrt(hs))
        tri = np.tril(np.ones((T, T)), 0 if mask_future else 1)
        att = btjit.softmax(M.masked_fill(att, tri == 0, float("-inf")), -1)
        return btjit.sum((att @ v).swapaxes(1, 2).reshape(B, T, C) * p["c"])
    rng = np.random.default_rng(2)
    p = {"w": rng.normal(size=(C, 3 * C)) * 0.3, "c": rng.normal(size=(B, T, C))}
    return fn, p, (rng.normal(size=(B, T, C)),)


def test_hand_written_attention_and_its_near_misses():
    fn, p, x = attention()
    fused, plain = traced(fn, p, *x), traced(fn, p, *x, fuse=False)
    assert "causal_attention" in ops(fused)
    same(fused, plain, x, 1e-10)
    for variant in (attention(q_scale=0.3), attention(mask_future=False)):   # another scale; a leaky mask
        assert "causal_attention" not in ops(traced(variant[0], variant[1], *variant[2]))


@pytest.mark.parametrize("form", [
    lambda x: 0.5 * x * (1.0 + btjit.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3.0))),
    lambda x: x * (1.0 + btjit.tanh((x + x * x * x * 0.044715) * 0.7978845608028654)) * 0.5,
    lambda x: (0.5 * (1.0 + btjit.tanh(0.7978845608028654 * (0.044715 * x * x * x + x)))) * x])
def test_new_gelu_written_out_becomes_gelu(form):
    rng = np.random.default_rng(3)
    p, x = {"w": rng.normal(size=(4, 6))}, (rng.normal(size=(5, 4)) * 2,)
    fn = lambda p, x: btjit.sum(form(x @ p["w"]))  # noqa: E731
    fused, plain = traced(fn, p, *x), traced(fn, p, *x, fuse=False)
    assert "gelu" in ops(fused) and "tanh" not in ops(fused)
    same(fused, plain, x, 1e-12)


def test_gelu_near_misses_are_left_alone():
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(5, 4)),)
    for form in (lambda x: 0.5 * x * (1.0 + btjit.tanh(0.79788 * (x + 0.044715 * x ** 3))),     # a rounded constant
                 lambda x: 0.5 * x * (1.0 + btjit.tanh(0.7978845608028654 * (x + 0.044715 * x ** 2)))):
        prog = traced(lambda p, x: btjit.sum(form(x * p["s"])), {"s": np.ones(4)}, *x)
        assert "gelu" not in ops(prog)
    t = {}                                       # an intermediate used elsewhere keeps the chain as written

    def keeps(p, x):
        y = x * p["s"]
        t["u"] = btjit.tanh(0.7978845608028654 * (y + 0.044715 * y ** 3))
        return btjit.sum(0.5 * y * (1.0 + t["u"])) + btjit.sum(t["u"])
    assert "gelu" not in ops(traced(keeps, {"s": np.ones(4)}, *x))


@pytest.mark.parametrize("form", [
    lambda x: 0.5 * x * (1.0 + btjit.erf(x / math.sqrt(2.0))),                  # BERT's, HF's gelu
    lambda x: x * 0.5 * (1.0 + btjit.erf(x * 0.7071067811865476)),
    lambda x: x * (0.5 + 0.5 * btjit.erf(x / 1.4142135623730951)),
    lambda x: x * (1.0 + btjit.erf(x / math.sqrt(2.0))) / 2.0])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exact_gelu_written_out_becomes_gelu_erf(form, dtype):
    rng = np.random.default_rng(5)
    p, x = {"w": rng.normal(size=(4, 6)).astype(dtype)}, (rng.normal(size=(5, 4)).astype(dtype) * 2,)
    fn = lambda p, x: btjit.sum(form(x @ p["w"]) * np.arange(6.0))  # noqa: E731
    fused, plain = traced(fn, p, *x, dtype=dtype), traced(fn, p, *x, fuse=False, dtype=dtype)
    unfused = btjit.trace(fn, p, *x, dtype=dtype, fuse_elementwise=False)         # the ops before the chains fuse
    assert ops(unfused).count("gelu_erf") == 1 and "erf" not in ops(unfused)
    same(fused, plain, x, 1e-12 if dtype == "float64" else 2e-5)
    h = x[0].astype(np.float64) @ p["w"].astype(np.float64)             # numpy's exact GELU in float64
    cdf = 0.5 + 0.5 * np.vectorize(math.erf)(h / math.sqrt(2.0))
    want = (h * cdf * np.arange(6.0)).sum()
    dh = (cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)) * np.arange(6.0)
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert abs(fused.value_and_grad(*x) - want) <= tol * abs(want)
    np.testing.assert_allclose(fused.grads["w"], x[0].astype(np.float64).T @ dh, rtol=tol * 10, atol=tol * 10)


def test_exact_gelu_near_misses_are_left_alone():
    x = (np.random.default_rng(6).normal(size=(5, 4)),)
    for form in (lambda x: 0.5 * x * (1.0 + btjit.erf(x / 1.414)),                  # a rounded constant
                 lambda x: 0.5 * x * (1.0 + btjit.erf(x / 2.0)),
                 lambda x: 0.5 * x * (2.0 + btjit.erf(x / math.sqrt(2.0)))):
        prog = btjit.trace(lambda p, x: btjit.sum(form(x * p["s"])), {"s": np.ones(4)}, *x, fuse_elementwise=False)
        assert "erf" in ops(prog) and "gelu_erf" not in ops(prog)


@pytest.mark.parametrize("form", [lambda x: x * btjit.sigmoid(x), lambda x: btjit.sigmoid(x) * x])
def test_swish_written_out_becomes_silu(form):
    rng = np.random.default_rng(7)
    p, x = {"w": rng.normal(size=(4, 6))}, (rng.normal(size=(5, 4)) * 3,)
    fn = lambda p, x: btjit.sum(form(x @ p["w"]) * np.arange(6.0))  # noqa: E731
    fused, plain = traced(fn, p, *x), traced(fn, p, *x, fuse=False)
    unfused = btjit.trace(fn, p, *x, dtype="float64", fuse_elementwise=False)
    assert "silu" in ops(unfused) and "sigmoid" not in ops(unfused)
    same(fused, plain, x, 1e-12)
    h = x[0] @ p["w"]
    s = 1 / (1 + np.exp(-h))
    assert abs(fused.value_and_grad(*x) - (h * s * np.arange(6.0)).sum()) <= 1e-12 * abs((h * s).sum()) + 1e-12
    np.testing.assert_allclose(fused.grads["w"], x[0].T @ (s * (1 + h * (1 - s)) * np.arange(6.0)), rtol=1e-10)


def test_swish_near_misses_are_left_alone():
    x = (np.random.default_rng(8).normal(size=(5, 4)),)
    t = {}

    def keeps(p, x):                            # the sigmoid is used elsewhere too
        y = x * p["s"]
        t["s"] = btjit.sigmoid(y)
        return btjit.sum(y * t["s"]) + btjit.sum(t["s"])
    for fn in (keeps, lambda p, x: btjit.sum(x * btjit.sigmoid(x * p["s"]))):     # x * sigmoid(another value)
        prog = btjit.trace(fn, {"s": np.ones(4)}, *x, fuse_elementwise=False)
        assert "sigmoid" in ops(prog) and "silu" not in ops(prog)
