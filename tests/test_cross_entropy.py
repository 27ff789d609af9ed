"""cross_entropy(logits, targets, ignore_index=None, reduction="mean") with torch's semantics: the loss and
its gradient against numpy and finite differences with some, none and every position ignored; the range
check accepts exactly the ignore value; the same against torch when it is installed."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

V = 7


def _ref(logits, t, ignore, reduction):
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    keep = t != ignore if ignore is not None else np.ones(t.shape, bool)
    losses = -np.take_along_axis(lp, np.where(keep, t, 0)[..., None], -1)[..., 0][keep]
    return losses.sum() if reduction == "sum" else (losses.mean() if losses.size else np.nan)


def _loss(ignore, reduction):
    return lambda p, x, t: btjit.cross_entropy(x @ p["w"] + p["b"], t, ignore_index=ignore, reduction=reduction)


@pytest.mark.parametrize("ignored", ["none", "some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_loss_and_gradient_with_ignored_positions(ignored, reduction, dtype):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5, 6))
    t = rng.integers(0, V, size=(4, 5))
    if ignored != "none":
        t[rng.random(t.shape) < 0.4 if ignored == "some" else np.ones(t.shape, bool)] = -1
    p = {"w": rng.normal(0, 0.5, (6, V)), "b": rng.normal(size=V)}
    prog = btjit.trace(_loss(-1, reduction), {k: v.astype(dtype) for k, v in p.items()}, x.astype(dtype), t,
                       dtype=dtype, grad=True)
    loss = prog.value_and_grad(x.astype(dtype), t)
    want = _ref(x @ p["w"] + p["b"], t, -1, reduction)
    tol = 1e-12 if dtype == "float64" else 1e-5
    if ignored == "all" and reduction == "mean":
        assert np.isnan(loss) and np.isnan(want)
        assert not prog.grads["w"].any() and not prog.grads["b"].any()     # torch: NaN loss, zero gradients
        return
    assert loss == pytest.approx(want, rel=tol, abs=tol)
    if dtype == "float64":
        check_grads(_loss(-1, reduction), p, x, t)
    if ignored == "all":
        assert loss == 0.0 and not prog.grads["w"].any()


def test_ignored_rows_get_zero_gradient_and_do_not_count_in_the_mean():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, V))
    t = np.array([1, -1, 3, -1, 0, 4])
    prog = btjit.trace(lambda p, t: btjit.cross_entropy(p["z"], t, ignore_index=-1), {"z": x}, t, dtype="float64",
                       grad=True)
    assert prog.value_and_grad(t) == pytest.approx(_ref(x, t, -1, "mean"), rel=1e-12)
    g = prog.grads["z"]
    assert not g[[1, 3]].any() and g[[0, 2, 4, 5]].any()
    prog2 = btjit.trace(lambda p, t: btjit.cross_entropy(p["z"], t), {"z": x[[0, 2, 4, 5]]}, t[[0, 2, 4, 5]],
                        dtype="float64", grad=True)
    prog2.value_and_grad(t[[0, 2, 4, 5]])
    np.testing.assert_allclose(g[[0, 2, 4, 5]], prog2.grads["z"], rtol=1e-12)   # the mean over the kept rows


def test_range_check_accepts_exactly_the_ignore_value():
    x = np.zeros((3, V))
    prog = btjit.trace(lambda p, t: btjit.cross_entropy(p["z"], t, ignore_index=-1), {"z": x}, np.zeros(3, np.int32),
                       dtype="float64", grad=True)
    prog.value_and_grad(np.array([-1, 0, V - 1]))
    for bad in ([-2, 0, 1], [0, V, -1]):
        with pytest.raises(ValueError, match=r"must be in \[0, 7\) or -1 \(the ignore_index\)"):
            prog.value_and_grad(np.array(bad))
    plain = btjit.trace(lambda p, t: btjit.cross_entropy(p["z"], t), {"z": x}, np.zeros(3, np.int32),
                        dtype="float64", grad=True)
    with pytest.raises(ValueError, match=r"must be in \[0, 7\), got min -1"):
        plain.value_and_grad(np.array([-1, 0, 1]))
    with pytest.raises(btjit.TraceError, match="reduction must be 'mean' or 'sum' or 'none', got 'avg'"):
        btjit.trace(lambda p: btjit.cross_entropy(p["z"], [0, 1, 2], reduction="avg"), {"z": x}, grad=True)
    with pytest.raises(btjit.TraceError, match=r"target values must be in \[0, 7\) or -1"):
        btjit.trace(lambda p: btjit.cross_entropy(p["z"], [0, -2, 1], ignore_index=-1), {"z": x}, grad=True)


def test_an_input_used_as_take_index_too_is_checked_without_the_ignore_value():
    f = lambda p, t: btjit.cross_entropy(btjit.take(p["e"], t), t, ignore_index=-1)  # noqa: E731
    prog = btjit.trace(f, {"e": np.zeros((V, V))}, np.zeros(3, np.int32), dtype="float64", grad=True)
    with pytest.raises(ValueError, match=r"must be in \[0, 7\), got min -1"):
        prog.value_and_grad(np.array([-1, 0, 1]))
    assert prog.value_and_grad(np.array([2, 0, 1])) == pytest.approx(np.log(V), rel=1e-12)


def test_matches_torch_with_ignore_index():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    z = rng.normal(size=(2, 8, V))
    t = rng.integers(0, V, size=(2, 8))
    t[:, 5:] = -1                                            # makemore's padding
    for reduction in ("mean", "sum"):
        prog = btjit.trace(lambda p, t: btjit.cross_entropy(p["z"], t, ignore_index=-1, reduction=reduction),
                           {"z": z}, t, dtype="float64", grad=True)
        Z = torch.tensor(z, requires_grad=True)
        ref = torch.nn.functional.cross_entropy(Z.reshape(-1, V), torch.tensor(t).reshape(-1), ignore_index=-1,
                                                reduction=reduction)
        ref.backward()
        assert prog.value_and_grad(t) == pytest.approx(ref.item(), rel=1e-12)
        np.testing.assert_allclose(prog.grads["z"], Z.grad.numpy(), rtol=1e-10, atol=1e-14)
