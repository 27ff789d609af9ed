"""torch's per-class `weight=` in cross_entropy and nll_loss (class-imbalanced classifiers as written): values
and the logits' gradient against torch in float64 (a traced weight's against central differences of torch's
loss), with ignore_index, label smoothing, each reduction and torch's (N, C, d1) layout; weights below one (the
"mean" divides by their sum, not by a count of at least one); a float32 SGD trajectory; a weight of the wrong
shape is an error naming the op; normalize, cosine_similarity and glu take axis= as softmax does."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
F = torch.nn.functional

N, C = 7, 5
CASES = [
    ("ce", dict(reduction="mean")),
    ("ce", dict(reduction="sum")),
    ("ce", dict(reduction="none")),
    ("ce", dict(ignore_index=2)),
    ("ce", dict(label_smoothing=0.1)),
    ("ce", dict(label_smoothing=0.2, ignore_index=2)),
    ("ce", dict(label_smoothing=0.2, ignore_index=2, reduction="none")),
    ("ce", dict(label_smoothing=0.3, reduction="sum")),
    ("nll", dict(reduction="mean")),
    ("nll", dict(ignore_index=2)),
    ("nll", dict(ignore_index=2, reduction="sum")),
    ("nll", dict(reduction="none")),
]


def _data(layout, seed=0):
    rng = np.random.default_rng(seed)
    shape = (N, C) if layout == "nc" else (2, C, 4)
    x = rng.normal(size=shape) * 2
    y = rng.integers(0, C, (N,) if layout == "nc" else (2, 4)).astype(np.int32)
    y.flat[:2] = 2                                        # some positions ignored where ignore_index = 2
    w = rng.uniform(0.05, 0.4, C)                         # weights below one: their sum is the "mean" divisor
    return x, y, w


def _btjit(kind, kw, x, y, w):
    def fn(p, y):
        if kind == "ce":
            out = btjit.cross_entropy(p["x"], y, weight=p["w"], **kw)
        else:
            axis = 1
            out = btjit.nll_loss(btjit.log_softmax(p["x"], axis=axis), y, weight=p["w"], **kw)
        return btjit.sum(out * out) + out.sum()           # reaches every element of a "none" result nonlinearly
    prog = btjit.trace(fn, {"x": x, "w": w}, y, grad=True, dtype="float64")
    return prog.value_and_grad(y), prog.grads["x"], prog.grads["w"]


def _torch_loss(kind, kw, tx, y, w):
    tw, ty = torch.tensor(w), torch.tensor(y).long()
    if kind == "ce":
        out = F.cross_entropy(tx, ty, weight=tw, **kw)
    else:
        out = F.nll_loss(F.log_softmax(tx, 1), ty, weight=tw, **kw)
    return (out * out).sum() + out.sum()


def _torch(kind, kw, x, y, w):
    """torch's loss and logits' gradient; the weight's (torch does not differentiate it) by central differences
    of torch's loss."""
    tx = torch.tensor(x, requires_grad=True)
    loss = _torch_loss(kind, kw, tx, y, w)
    loss.backward()
    gw, h = np.zeros_like(w), 1e-6
    for c in range(len(w)):
        e = np.eye(len(w))[c] * h
        gw[c] = (_torch_loss(kind, kw, torch.tensor(x), y, w + e).item()
                 - _torch_loss(kind, kw, torch.tensor(x), y, w - e).item()) / (2 * h)
    return loss.item(), tx.grad.numpy(), gw


@pytest.mark.parametrize("layout", ["nc", "ncd"])
@pytest.mark.parametrize("kind,kw", CASES)
def test_class_weights_match_torch(kind, kw, layout):
    x, y, w = _data(layout)
    got, want = _btjit(kind, kw, x, y, w), _torch(kind, kw, x, y, w)
    assert abs(got[0] - want[0]) <= 1e-10 * max(1.0, abs(want[0]))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-6)


def test_class_weights_train_as_torch_in_float32():
    x, y, w = _data("nc", seed=1)
    rng = np.random.default_rng(2)
    lin = rng.normal(size=(C, C)).astype(np.float32)
    xs, w32 = x.astype(np.float32), w.astype(np.float32)
    fn = lambda p, x, y: btjit.cross_entropy(x @ p["lin"], y, weight=w32, label_smoothing=0.1)  # noqa: E731
    prog = btjit.trace(fn, {"lin": lin}, xs, y, optimizer=btjit.optim.SGD(lr=0.5))
    tl = torch.tensor(lin, requires_grad=True)
    opt = torch.optim.SGD([tl], lr=0.5)
    for _ in range(6):
        got = prog.step(xs, y)
        opt.zero_grad()
        want = F.cross_entropy(torch.tensor(xs) @ tl, torch.tensor(y).long(), weight=torch.tensor(w32),
                               label_smoothing=0.1)
        want.backward()
        opt.step()
        assert abs(got - want.item()) <= 1e-5 * abs(want.item())
    np.testing.assert_allclose(prog.params["lin"], tl.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", ["cross_entropy", "nll_loss"])
def test_a_weight_of_the_wrong_shape_is_an_error_naming_the_op(fn):
    x, y, _ = _data("nc")
    with pytest.raises(btjit.TraceError, match=rf"{fn}: weight must hold one value per class, shape \({C},\)"):
        btjit.trace(lambda p, y: getattr(btjit, fn)(p["x"], y, weight=np.ones(C + 1)), {"x": x}, y, grad=True)


@pytest.mark.parametrize("name,axis", [("normalize", 0), ("cosine_similarity", 0), ("glu", 0)])
def test_torch_fns_take_numpys_axis_as_softmax_does(name, axis):
    """btjit's own spelling (axis=, as softmax and stack take) gives torch's dim= result."""
    x = np.random.default_rng(3).normal(size=(4, 6))
    args = (x, x[::-1].copy()) if name == "cosine_similarity" else (x,)
    prog = btjit.trace(lambda p: getattr(btjit, name)(*args, axis=axis), {}, dtype="float64")
    want = getattr(F, name)(*[torch.tensor(a) for a in args], dim=axis).numpy()
    np.testing.assert_allclose(prog(), want, rtol=1e-12, atol=1e-14)
