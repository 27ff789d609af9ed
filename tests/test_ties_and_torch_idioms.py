"""Gradients at ties and kinks (maximum / minimum, clamp, the hard activations) and torch idioms as ports write
them (grouped-query attention, torch's repeat, a missing method, assignments through index arrays), each against
torch."""
import numpy as np
import pytest

import btjit
from test_functional import _btjit, _torch

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _x(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


KINKS = np.array([-6.0, -3.0, -1.0, -0.5, 0.0, 0.5, 0.7, 1.0, 3.0, 6.0])       # every function's bounds below, exactly
TIES = {
    "np.maximum": (lambda x: np.maximum(x, 0.5), lambda x: torch.maximum(x, torch.tensor(0.5, dtype=x.dtype))),
    "btjit.minimum": (lambda x: btjit.minimum(-1.0, x), lambda x: torch.minimum(torch.tensor(-1.0, dtype=x.dtype), x)),
    "maximum_pair": (lambda x: np.maximum(x, x[::-1] * 1.0), lambda x: torch.maximum(x, x.flip(0))),
    "clip": (lambda x: np.clip(x, -0.5, 0.7), lambda x: torch.clamp(x, -0.5, 0.7)),
    "clamp_min": (lambda x: x.clamp_min(0.0), lambda x: x.clamp_min(0.0)),
    "clamp_max": (lambda x: x.clamp_max(1.0), lambda x: x.clamp_max(1.0)),
    "hardtanh": (btjit.hardtanh, F.hardtanh),
    "relu6": (btjit.relu6, F.relu6),
    "hardsigmoid": (btjit.hardsigmoid, F.hardsigmoid),
    "hardswish": (btjit.hardswish, F.hardswish),
    "relu": (btjit.relu, F.relu),
    "x.relu": (lambda x: x.relu(), lambda x: x.relu()),
    "leaky_relu": (lambda x: btjit.leaky_relu(x, 0.1), lambda x: F.leaky_relu(x, 0.1)),
    "elu": (btjit.elu, F.elu),
    "logsigmoid": (btjit.logsigmoid, F.logsigmoid),
    "bce_logits": (lambda x: btjit.binary_cross_entropy_with_logits(x, np.full(10, 0.3), reduction="none"),
                   lambda x: F.binary_cross_entropy_with_logits(x, torch.full((10,), 0.3, dtype=x.dtype),
                                                                reduction="none")),
    "abs": (np.abs, torch.abs),
    "max_dim": (lambda x: btjit.stack([x, btjit.stop_gradient(x)], 1).max(dim=1).values * 2.0 +
                btjit.stack([x, x * 0.0 + 1.0], 1).min(dim=1)[0],
                lambda x: torch.stack([x, x.detach()], 1).max(dim=1).values * 2.0 +
                torch.stack([x, x * 0.0 + 1.0], 1).min(dim=1)[0]),
    "pow0": (lambda x: x ** 0.0 * 2.0 + x, lambda x: x ** 0.0 * 2.0 + x),
}


@pytest.mark.parametrize("name", list(TIES))
def test_gradients_at_kinks_and_ties_are_torchs(name):
    """At a tie, maximum / minimum give each input half (torch's rule); clamp passes the gradient at its bounds,
    hardtanh, relu6 and the hard activations do not, relu gives 0 at 0: each as torch."""
    bt, th = TIES[name]
    got, got_g = _btjit(bt, KINKS, "float64", np.ones(10))
    want, want_g = _torch(th, KINKS, "float64", np.ones(10))
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-7, atol=1e-15)    # torch's hard* kernels round 1/6 to float32


def test_maximum_names_a_bad_ties_rule():
    with pytest.raises(btjit.TraceError, match="ties must be 'split', 'first' or 'second', got 'left'"):
        btjit.trace(lambda p: btjit.sum(btjit.maximum(p["x"], 0.0, ties="left")), {"x": np.zeros(3)})


def test_torchs_repeat_and_a_missing_method_are_named():
    with pytest.raises(btjit.TraceError, match=r"repeat: axis 3 out of range for a 2-d value .*np.tile"):
        btjit.trace(lambda p: btjit.sum(p["x"].repeat(1, 3)), {"x": np.zeros((2, 2))})
    with pytest.raises(AttributeError, match=r"no attribute 'logcumsumexp': not one of the numpy or torch methods .*"
                                             r"test_ties_and_torch_idioms.py:\d+"):
        btjit.trace(lambda p: btjit.sum(p["x"].logcumsumexp(1)), {"x": np.zeros((2, 2))})


def _softmax_minus_labels(x, y, mod):            # makemore part 4's manual backward: dlogits[range(n), Yb] -= 1
    d = mod.softmax(x, 1) * 1.0
    d[range(5) if mod is btjit else torch.arange(5), y] -= 1
    return d


def _set_constant_arrays(x, y, mod):
    ar, rows, cols = (np.arange(5), np.array([1, 3]), np.array([0, 2])) if mod is btjit else (
        torch.arange(5), torch.tensor([1, 3]), torch.tensor([0, 2]))
    d = x * 2.0
    d[ar, 1] = 0.5                               # ints beside an array
    d[rows, cols] = x[0, :2] ** 2                # a value of the positions' shape
    d[[4, 2]] = x[[0, 1]] * 3.0                  # whole rows
    d[:, [2, 0]] = d[:, [0, 1]] + 1.0            # on axis 1
    d[:, cols] -= 1.0
    return d


@pytest.mark.parametrize("case", [_softmax_minus_labels, _set_constant_arrays])
def test_assignments_through_index_arrays_against_torch(case):
    x, w, y = _x((5, 3)), _x((5, 3), 1), np.array([0, 2, 2, 1, 0], np.int32)
    prog = btjit.trace(lambda p, y: btjit.sum(case(p["x"], y, btjit) * w), {"x": x}, y, grad=True, dtype="float64")
    got = prog.value_and_grad(y)
    tx = torch.tensor(x, requires_grad=True)
    want = (case(tx, torch.tensor(y).long(), torch) * torch.tensor(w)).sum()
    want.backward()
    assert got == pytest.approx(want.item(), rel=1e-13)
    np.testing.assert_allclose(prog.grads["x"], tx.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_an_assignment_to_a_position_twice_keeps_the_last_value():
    """numpy's x[[0, 2, 0]] = v: row 0 gets v's last row (torch's gradient would also reach the lost row: the
    finite differences say it does not)."""
    def f(p):
        d = p["x"] * 2.0
        d[[0, 2, 0]] = p["v"] * 3.0
        return btjit.sum(d * _x((5, 3), 1))
    x, v = _x((5, 3)), _x((3, 3), 2)
    want = x * 2.0
    want[[0, 2, 0]] = v * 3.0
    assert btjit.trace(f, {"x": x, "v": v}, dtype="float64").forward() == pytest.approx(
        float(np.sum(want * _x((5, 3), 1))), rel=1e-13)
    assert btjit.testing.check_grads(f, {"x": x, "v": v}) < 1e-6


def test_one_traced_position_at_a_time_accumulates_as_np_add_at():
    """makemore part 4's embedding backward: `for k, j: ix = Xb[k, j]; dC[ix] += demb[k, j]` (one traced
    position per assignment, repeats across them), against np.add.at; the gradient of each demb row is its dC row's."""
    rng = np.random.default_rng(0)
    X, D, W = rng.integers(0, 7, (4, 2)).astype(np.int32), _x((4, 2, 3)), _x((7, 3), 1)

    def f(p, X):
        demb, dC = p["d"] * 2.0, p["C"] * 0.0
        for k in range(X.shape[0]):
            for j in range(X.shape[1]):
                ix = X[k, j]
                dC[ix] += demb[k, j]
        return btjit.sum(dC * W)
    prog = btjit.trace(f, {"d": D, "C": np.ones((7, 3))}, X, grad=True, dtype="float64")
    want = np.zeros((7, 3))
    np.add.at(want, X.reshape(-1), (D * 2.0).reshape(-1, 3))
    assert prog.value_and_grad(X) == pytest.approx(float(np.sum(want * W)), rel=1e-13)
    np.testing.assert_allclose(prog.grads["d"], 2.0 * W[X], rtol=1e-14)


def test_traced_positions_must_be_distinct():
    def loss(p, y):
        d = p["w"] * 1.0
        d[y] = 0.0                                   # labels may repeat: which value stays is not known
        return btjit.sum(d)
    with pytest.raises(btjit.TraceError, match=r"setitem: traced index arrays may assign only distinct positions.*"
                                               r"x\[range\(n\), y\] = v.*idioms.py:\d+"):
        btjit.trace(loss, {"w": np.ones((4, 3))}, np.array([0, 1, 2, 0], np.int32))


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_grouped_query_attention_against_torch(causal):
    """enable_gqa: 4 query heads over 2 key / value heads (llama's grouped-query attention), values and grads."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s) for s in ((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)))
    w = rng.normal(size=(2, 4, 8, 16))
    prog = btjit.trace(lambda p: btjit.sum(btjit.scaled_dot_product_attention(
        p["q"], p["k"], p["v"], is_causal=causal, enable_gqa=True) * w), {"q": q, "k": k, "v": v}, grad=True,
        dtype="float64")
    ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    want = (F.scaled_dot_product_attention(*ts, is_causal=causal, enable_gqa=True) * torch.tensor(w)).sum()
    want.backward()
    assert prog.value_and_grad() == pytest.approx(want.item(), rel=1e-13)
    for n, t in zip("qkv", ts):
        np.testing.assert_allclose(prog.grads[n], t.grad.numpy(), rtol=1e-11, atol=1e-13, err_msg=n)
    with pytest.raises(btjit.TraceError, match=r"scaled_dot_product_attention: the leading axes .* do not "
                                               r"broadcast \(k and v with fewer heads than q: enable_gqa=True\)"):
        btjit.trace(lambda p: btjit.sum(btjit.scaled_dot_product_attention(p["q"], p["k"], p["v"])),
                    {"q": q, "k": k, "v": v})


@pytest.mark.parametrize("p", [1, 2, float("inf")])
def test_torchs_norm_of_any_order(p):
    """x.norm(p, dim) and x.norm(p) (every element), p 1, 2, inf: values and gradients as torch's."""
    x = np.random.default_rng(0).normal(size=(4, 6))
    w = np.random.default_rng(1).normal(size=4)
    got = _btjit(lambda t: btjit.sum(t.norm(p=p, dim=1) * w) + t.norm(p=p), x, "float64", np.ones(()))
    want = _torch(lambda t: (t.norm(p=p, dim=1) * torch.tensor(w)).sum() + t.norm(p=p), x, "float64", np.ones(()))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-14)
