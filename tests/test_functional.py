"""The functions and methods torch / numpy code uses (issue 28 item 5): gelu (exact and tanh), erf, log1p, silu,
softplus, clip / np.clip, var / std (numpy's ddof and torch's keywords), logsumexp, nll_loss, layer_norm without
weight or bias, and the tensor methods .relu() .tanh() .exp() .log() .sigmoid() .sqrt() .abs() .var() .std().
Each against torch in float64 (values and gradients, 1e-10), against numpy where numpy has it, and its
gradient against finite differences; float32 values against torch."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

torch = pytest.importorskip("torch")
F = torch.nn.functional

X = (4, 6)


def _np_x(shape=X, seed=0, scale=1.5):
    return np.random.default_rng(seed).normal(size=shape) * scale


def _set_col(h):
    """h[:, 0] = a column (an int index drops the axis: the value broadcasts to h[:, 0]'s shape), h[..., -1] too."""
    h[:, 0] = h[:, 1] * 3.0
    h[..., -1] = h[..., 2] - h[:, 0]
    return h


# id -> (btjit fn of x, torch fn of x, x shape, x scale)
CASES = {
    "gelu": (lambda x: btjit.gelu(x), lambda x: F.gelu(x), X, 2.0),
    "gelu_tanh": (lambda x: btjit.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh"), X, 2.0),
    "erf": (btjit.erf, torch.erf, X, 1.5),
    "log1p": (lambda x: btjit.log1p(x * x), lambda x: torch.log1p(x * x), X, 1.5),
    "silu": (btjit.silu, F.silu, X, 2.0),
    "softplus": (btjit.softplus, F.softplus, X, 2.0),
    "softplus_beta": (lambda x: btjit.softplus(x, beta=2.0, threshold=5.0),
                      lambda x: F.softplus(x, beta=2.0, threshold=5.0), X, 3.0),
    "clip": (lambda x: btjit.clip(x, -0.5, 0.7), lambda x: torch.clamp(x, -0.5, 0.7), X, 1.0),
    "np.clip": (lambda x: np.clip(x, -0.5, None), lambda x: torch.clamp(x, min=-0.5), X, 1.0),
    "x.clip": (lambda x: x.clip(max=0.3), lambda x: x.clip(max=0.3), X, 1.0),
    "var": (lambda x: btjit.var(x, axis=1), lambda x: torch.var(x, dim=1, correction=0), X, 1.0),
    "np.var_ddof": (lambda x: np.var(x, axis=(0, 2), ddof=1, keepdims=True),
                    lambda x: torch.var(x, dim=(0, 2), correction=1, keepdim=True), (3, 4, 5), 1.0),
    "x.var_torch": (lambda x: x.var(0, keepdim=True), lambda x: x.var(0, keepdim=True), X, 1.0),
    "x.std": (lambda x: x.std(), lambda x: x.std(correction=0), X, 1.0),
    "np.std": (lambda x: np.std(x, axis=-1, ddof=1), lambda x: x.std(-1), X, 1.0),
    "logsumexp": (lambda x: btjit.logsumexp(x, axis=-1), lambda x: torch.logsumexp(x, -1), X, 3.0),
    "logsumexp_axes": (lambda x: btjit.logsumexp(x, axis=(0, 2), keepdims=True),
                       lambda x: torch.logsumexp(x, (0, 2), keepdim=True), (3, 4, 5), 3.0),
    "logsumexp_all": (lambda x: btjit.logsumexp(x), lambda x: torch.logsumexp(x, (0, 1)), X, 3.0),
    "leaky_relu": (lambda x: btjit.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2), X, 1.5),
    "elu": (lambda x: btjit.elu(x, 0.7), lambda x: F.elu(x, 0.7), X, 2.0),
    "relu6": (lambda x: btjit.relu6(x * 3.0), lambda x: F.relu6(x * 3.0), X, 2.0),
    "softmax_axis0": (lambda x: btjit.softmax(x, axis=0), lambda x: F.softmax(x, 0), (3, 4, 5), 2.0),
    "log_softmax_axis1": (lambda x: btjit.log_softmax(x, axis=1), lambda x: F.log_softmax(x, 1), (3, 4, 5), 2.0),
    "hardtanh": (lambda x: btjit.hardtanh(x, -0.5, 0.8), lambda x: F.hardtanh(x, -0.5, 0.8), X, 1.5),
    # torch's hardsigmoid kernel rounds its gradient's 1/6 to float32: compared with torch's own relu6 / 6
    "hardsigmoid": (btjit.hardsigmoid, lambda x: F.relu6(x + 3.0) / 6.0, X, 4.0),
    "hardswish": (btjit.hardswish, F.hardswish, X, 4.0),
    "logsigmoid": (btjit.logsigmoid, F.logsigmoid, X, 30.0),
    "mish": (btjit.mish, F.mish, X, 3.0),
    "selu": (btjit.selu, F.selu, X, 2.0),
    "celu": (lambda x: btjit.celu(x, 0.5), lambda x: F.celu(x, 0.5), X, 2.0),
    "softsign": (btjit.softsign, F.softsign, X, 2.0),
    "rsqrt": (lambda x: btjit.rsqrt(x * x + 0.5) + (x * x + 0.2).rsqrt(), lambda x: torch.rsqrt(x * x + 0.5) +
              (x * x + 0.2).rsqrt(), X, 1.0),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=1) * btjit.repeat_interleave(x, 2, 1),
                          lambda x: x.repeat_interleave(2, dim=1) * torch.repeat_interleave(x, 2, 1), X, 1.0),
    "unbind": (lambda x: x.unbind(1)[2] * btjit.unbind(x, -1)[0] + x.unbind(0)[1].sum(),
               lambda x: x.unbind(1)[2] * torch.unbind(x, -1)[0] + x.unbind(0)[1].sum(), X, 1.0),
    "torch_arith_methods": (lambda x: x.neg().add(x.exp(), alpha=2.0).sub(x.exp().reciprocal()).mul(x).div(3.0)
                      + x.log1p().where(x > 0, x * 0.5) + x.maximum(x * 0.3) * x.dim(),
                      lambda x: x.neg().add(x.exp(), alpha=2.0).sub(x.exp().reciprocal()).mul(x).div(3.0)
                      + x.clamp_min(0.0).log1p().where(x > 0, x * 0.5) + x.maximum(x * 0.3) * x.dim(), X, 1.0),
    "x.logsumexp": (lambda x: x.logsumexp(-1) + x.logsumexp(0, keepdim=True).sum(),
                    lambda x: x.logsumexp(-1) + x.logsumexp(0, keepdim=True).sum(), X, 2.0),
    "dim_keywords": (lambda x: btjit.softmax(x, dim=0) + btjit.log_softmax(x, dim=1) +
                     btjit.cat([x, x * 2], dim=1)[:, 3:9] + btjit.stack([x, x * x], dim=1).sum(1),
                     lambda x: F.softmax(x, dim=0) + F.log_softmax(x, dim=1) + torch.cat([x, x * 2], dim=1)[:, 3:9]
                     + torch.stack([x, x * x], dim=1).sum(1), X, 1.5),
    "transpose_2d": (lambda x: x.transpose(0, 1) @ x + x.transpose(-2, -1).sum(),
                     lambda x: x.transpose(0, 1) @ x + x.transpose(-2, -1).sum(), X, 1.0),
    "setitem_int": (lambda x: _set_col(x * 2), lambda x: _set_col(x * 2), X, 1.0),
    "prelu": (lambda x: btjit.prelu(x, np.linspace(-0.3, 0.5, 6)),
              lambda x: F.prelu(x, torch.linspace(-0.3, 0.5, 6, dtype=x.dtype)), X, 1.5),
    "prelu_one": (lambda x: btjit.prelu(x, np.array([0.25])), lambda x: F.prelu(x, torch.tensor([0.25], dtype=x.dtype)),
                  (2, 3, 4), 1.5),
    "glu": (lambda x: btjit.glu(x, 1), lambda x: F.glu(x, 1), X, 2.0),
    "normalize": (lambda x: btjit.normalize(x, dim=1), lambda x: F.normalize(x, dim=1), (3, 4, 5), 1.0),
    "normalize_p1": (lambda x: btjit.normalize(x, p=1, dim=-1), lambda x: F.normalize(x, p=1, dim=-1), X, 1.0),
    "normalize_p3": (lambda x: btjit.normalize(x, p=3, dim=0), lambda x: F.normalize(x, p=3, dim=0), X, 1.0),
    "cosine_similarity": (lambda x: btjit.cosine_similarity(x, x[::-1] + 0.3, dim=1),
                          lambda x: F.cosine_similarity(x, x.flip(0) + 0.3, dim=1), (3, 4, 5), 1.0),
    "sin_cos": (lambda x: np.sin(x) * x.cos(), lambda x: torch.sin(x) * x.cos(), X, 3.0),
    "logaddexp": (lambda x: np.logaddexp(x, 0.5 * x[:, ::-1]), lambda x: torch.logaddexp(x, 0.5 * x.flip(1)), X, 3.0),
    "moveaxis": (lambda x: np.moveaxis(x, (0, 1), (-1, 0)) * np.arange(60.0).reshape(4, 5, 3),
                 lambda x: torch.movedim(x, (0, 1), (-1, 0)) * torch.arange(60.0, dtype=x.dtype).reshape(4, 5, 3),
                 (3, 4, 5), 1.0),
    "tril_triu": (lambda x: np.triu(x, 1) + x.tril(-2) * 2.0, lambda x: torch.triu(x, 1) + x.tril(-2) * 2.0,
                  (2, 4, 5), 1.0),
    "torch_methods": (lambda x: (x.clamp_min(-0.3) + x.mT.mT.clamp_max(0.5) + x[:, :1].expand_as(x)) / x.numel(),
                      lambda x: (x.clamp_min(-0.3) + x.mT.mT.clamp_max(0.5) + x[:, :1].expand_as(x)) / x.numel(),
                      X, 1.0),
    "methods": (lambda x: (x.abs() + 0.5).sqrt().log() + x.relu() * x.sigmoid() - x.tanh().exp(),
                lambda x: (x.abs() + 0.5).sqrt().log() + x.relu() * x.sigmoid() - x.tanh().exp(), X, 1.5),
}


def _btjit(fn, x, dtype, w=None):
    """(value, gradient of sum(value * w)) of fn at x, compiled by btjit."""
    def loss(p):
        y = fn(p["x"])
        return btjit.sum(y * (1.0 if w is None else w)), {"y": y}
    prog = btjit.trace(loss, {"x": x.astype(dtype)}, dtype=dtype, grad=True)
    prog.value_and_grad()
    return prog.outputs["y"].copy(), prog.grads["x"].copy()


def _torch(fn, x, dtype, w=None):
    t = torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True)
    y = fn(t)
    (y * (1.0 if w is None else torch.tensor(w, dtype=t.dtype))).sum().backward()
    return y.detach().numpy(), t.grad.numpy()


def assert_like_torch(bt, th, x):
    """bt's values and gradients (of a random weighting of its output) at x are th's, float64, to 1e-10."""
    want, _ = _torch(th, x, "float64")
    w = np.random.default_rng(1).normal(size=want.shape)
    want, want_g = _torch(th, x, "float64", w)
    got, got_g = _btjit(bt, x, "float64", w)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_against_torch_float64(name):
    bt, th, shape, scale = CASES[name]
    assert_like_torch(bt, th, _np_x(shape, scale=scale))


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_finite_differences(name):
    bt, _, shape, scale = CASES[name]
    w = np.random.default_rng(1).normal(size=_btjit(bt, _np_x(shape, scale=scale), "float64")[0].shape)
    check_grads(lambda p: btjit.sum(bt(p["x"]) * w), {"x": _np_x(shape, seed=2, scale=scale)})


@pytest.mark.parametrize("name", ["gelu", "erf", "silu", "softplus", "logsumexp", "x.std", "methods", "sin_cos", "mish",
                                  "logsigmoid", "cosine_similarity"])
def test_against_torch_float32(name):
    bt, th, shape, scale = CASES[name]
    x = _np_x(shape, scale=scale)
    np.testing.assert_allclose(_btjit(bt, x, "float32")[0], _torch(th, x, "float32")[0], rtol=2e-5, atol=2e-6)


def test_numpy_references():
    x = _np_x((3, 4, 5))
    for fn, want in [(lambda v: np.var(v, axis=1, ddof=1), np.var(x, axis=1, ddof=1)),
                     (lambda v: v.std(axis=(0, 2), keepdims=True), x.std(axis=(0, 2), keepdims=True)),
                     (lambda v: np.clip(v, -0.3, 0.4), np.clip(x, -0.3, 0.4)),
                     (lambda v: v.clip(-1.0, 0.1), x.clip(-1.0, 0.1)),
                     (lambda v: np.log1p(v * v), np.log1p(x * x))] + _scipy_erf(x):
        np.testing.assert_allclose(_btjit(fn, x, "float64")[0], want, rtol=1e-12)


def _scipy_erf(x):
    try:
        from scipy.special import erf
    except ImportError:
        return []
    return [(lambda v: erf(v), erf(x))]          # a ufunc: __array_ufunc__ -> btjit.erf


def test_logsumexp_infinities():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, np.inf, 1.0], [1.0, -np.inf, 2.0]])
    prog = btjit.trace(lambda p, x: btjit.logsumexp(x, -1) * p["s"], {"s": np.ones(())}, x, dtype="float64")
    prog.forward(x)
    np.testing.assert_array_equal(prog.outputs["out"], torch.logsumexp(torch.tensor(x), -1).numpy())


SDPA = [  # q, k, v shapes, kwargs (attn_mask given as a seed: a boolean or a float mask of shape (L, S))
    (((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4)), {}),
    (((2, 2, 9, 8),) * 3, dict(is_causal=True)),                             # the fused kernels
    (((2, 4, 6), (2, 7, 6), (2, 7, 3)), dict(attn_mask="bool")),             # cross attention, 3-d
    (((1, 2, 4, 5), (1, 2, 6, 5), (1, 2, 6, 5)), dict(attn_mask="float", scale=0.3)),
    (((2, 3, 4), (2, 6, 4), (2, 6, 4)), dict(is_causal=True)),               # L != S: top-left causal, as torch
]


@pytest.mark.parametrize("i", range(len(SDPA)))
def test_scaled_dot_product_attention_against_torch(i):
    shapes, kw = SDPA[i]
    rng = np.random.default_rng(i)
    q, k, v = (rng.normal(size=s) for s in shapes)
    kw = dict(kw)
    if "attn_mask" in kw:
        L, S = shapes[0][-2], shapes[1][-2]
        kw["attn_mask"] = (rng.uniform(size=(L, S)) < 0.7) | np.eye(L, S, dtype=bool) if kw["attn_mask"] == "bool" \
            else rng.normal(size=(L, S))
    r = rng.normal(size=shapes[0][:-1] + shapes[2][-1:])
    prog = btjit.trace(lambda p: btjit.sum(btjit.scaled_dot_product_attention(p["q"], p["k"], p["v"], **kw) * r),
                       {"q": q, "k": k, "v": v}, dtype="float64", grad=True)
    got = prog.value_and_grad()
    ts = {n: torch.tensor(a, requires_grad=True) for n, a in (("q", q), ("k", k), ("v", v))}
    tkw = {n: torch.tensor(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    want = (F.scaled_dot_product_attention(ts["q"], ts["k"], ts["v"], **tkw) * torch.tensor(r)).sum()
    want.backward()
    assert abs(got - want.item()) < 1e-10 * max(1.0, abs(want.item()))
    for n in ts:
        np.testing.assert_allclose(prog.grads[n], ts[n].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=n)
    assert ("causal_attention" in str(prog.graph)) == (i == 1)


def test_causal_sdpa_is_causal_attention_with_its_dropout():
    """nanoGPT's call (B, H, T, hs, is_causal, dropout_p) computes what btjit.causal_attention does on q | k | v,
    the dropout mask included (float32, the kept kernels)."""
    rng = np.random.default_rng(0)
    B, H, T, hs = 2, 2, 16, 8
    x = rng.normal(size=(B, T, 3 * H * hs)).astype(np.float32)

    def heads(t):
        return btjit.transpose(btjit.reshape(t, (B, T, H, hs)), (0, 2, 1, 3))

    def via_sdpa(p):
        q, k, v = btjit.split(p["x"], 3, axis=2)
        y = btjit.scaled_dot_product_attention(heads(q), heads(k), heads(v), dropout_p=0.2, is_causal=True)
        return btjit.sum(btjit.reshape(btjit.transpose(y, (0, 2, 1, 3)), (B, T, H * hs)) * 1.0)

    def direct(p):
        return btjit.sum(btjit.causal_attention(p["x"], H, dropout=0.2) * 1.0)
    a = btjit.trace(via_sdpa, {"x": x}, grad=True, seed=5)
    b = btjit.trace(direct, {"x": x}, grad=True, seed=5)
    assert a.value_and_grad() == b.value_and_grad()
    np.testing.assert_array_equal(a.grads["x"], b.grads["x"])


@pytest.mark.parametrize("which", ["bias None", "both None"])
def test_layer_norm_without_weight_or_bias(which):
    rng = np.random.default_rng(4)
    x, wt = rng.normal(size=(3, 4, 6)), rng.normal(size=6)
    params = {"x": x, "w": wt} if which == "bias None" else {"x": x}
    g = rng.normal(size=x.shape)
    prog = btjit.trace(lambda p: btjit.sum(btjit.layer_norm(p["x"], p.get("w"), None) * g), params, dtype="float64",
                       grad=True)
    loss = prog.value_and_grad()
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    want = (F.layer_norm(tp["x"], (6,), tp.get("w"), None) * torch.tensor(g)).sum()
    want.backward()
    assert abs(loss - want.item()) < 1e-11
    for k in params:
        np.testing.assert_allclose(prog.grads[k], tp[k].grad.numpy(), rtol=1e-10, atol=1e-12)


def test_gelu_bad_approximate():
    with pytest.raises(btjit.TraceError, match="gelu: approximate must be 'none' or 'tanh', got 'erf'"):
        btjit.trace(lambda p: btjit.sum(btjit.gelu(p["x"], approximate="erf")), {"x": np.zeros(3)})


def test_logaddexp_splits_its_gradient_at_ties():
    """logaddexp is smooth: where x == y each side gets 1/2 (a logistic loss from zero weights must move)."""
    a, b = np.array([0.3, 1.0, -2.0, 5.0]), np.array([0.3, 0.0, -2.0, -30.0])
    prog = btjit.trace(lambda p: btjit.sum(np.logaddexp(p["a"], p["b"])), {"a": a, "b": b}, grad=True, dtype="float64")
    assert prog.value_and_grad() == pytest.approx(np.sum(np.logaddexp(a, b)), rel=1e-14)
    w = 1.0 / (1.0 + np.exp(b - a))
    np.testing.assert_allclose(prog.grads["a"], w, rtol=1e-13)
    np.testing.assert_allclose(prog.grads["b"], 1.0 - w, rtol=1e-12, atol=1e-15)
    assert prog.grads["a"][0] == prog.grads["b"][0] == 0.5


def test_flip_and_squeeze_take_torchs_keywords():
    x = np.arange(12.0).reshape(1, 3, 4)
    c = np.arange(12.0).reshape(3, 4)
    prog = btjit.trace(lambda p: btjit.sum(p["x"].flip(dims=(2,)).squeeze(dim=0) * c), {"x": x}, grad=True,
                       dtype="float64")
    assert prog.value_and_grad() == np.sum(x[0, :, ::-1] * c)
    np.testing.assert_array_equal(prog.grads["x"][0], c[:, ::-1])
