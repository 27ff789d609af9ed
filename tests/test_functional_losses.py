"""The losses and normalizations torch code uses, against torch in float64 (values and gradients): nll_loss and
cross_entropy in both layouts with every reduction, ignore_index and label smoothing, the regression and binary
losses, kl_div, batch / layer / group / instance norms, one_hot and embedding; their errors name the problem."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

torch = pytest.importorskip("torch")
F = torch.nn.functional


NLL = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(ignore_index=2), dict(ignore_index=-1),
       dict(ignore_index=-100, reduction="none"), dict(ignore_index=1, reduction="sum")]


@pytest.mark.parametrize("kw", NLL, ids=[str(k) for k in NLL])
@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 5)])
def test_nll_loss_against_torch(kw, shape):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=shape)
    y = rng.integers(0, shape[-1], size=shape[:-1]).astype(np.int32)
    if "ignore_index" in kw:
        y.reshape(-1)[::3] = kw["ignore_index"]
    w = rng.normal(size=y.shape) if kw.get("reduction") == "none" else 1.0
    prog = btjit.trace(lambda p, y: btjit.sum(btjit.nll_loss(btjit.log_softmax(p["z"]), y, **kw) * w),
                       {"z": logits}, y, dtype="float64", grad=True)
    loss = prog.value_and_grad(y)
    t = torch.tensor(logits, requires_grad=True)
    lp = F.log_softmax(t, -1).reshape(-1, shape[-1])
    tw = torch.tensor(np.broadcast_to(w, y.shape).reshape(-1)) if kw.get("reduction") == "none" else 1.0
    want = (F.nll_loss(lp, torch.tensor(y.reshape(-1), dtype=torch.long),
                       **{"ignore_index": -100, **kw}) * tw).sum()
    want.backward()
    assert abs(loss - want.item()) < 1e-12 * max(1.0, abs(want.item()))
    np.testing.assert_allclose(prog.grads["z"], t.grad.numpy(), rtol=1e-10, atol=1e-13)
    check_grads(lambda p, y: btjit.sum(btjit.nll_loss(btjit.log_softmax(p["z"]), y, **kw) * w), {"z": logits}, y)


CE = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(ignore_index=1),
      dict(label_smoothing=0.1), dict(label_smoothing=0.2, reduction="sum"),
      dict(label_smoothing=0.3, reduction="none"),
      dict(label_smoothing=0.1, ignore_index=2), dict(label_smoothing=1.0, ignore_index=0, reduction="sum")]


@pytest.mark.parametrize("kw", CE, ids=[str(k) for k in CE])
@pytest.mark.parametrize("shape", [(7, 5), (2, 5, 3), (2, 4, 3, 2)])
def test_cross_entropy_against_torch_in_its_layout(kw, shape):
    """torch's F.cross_entropy as written: logits (N, C, d1, ...) with targets (N, d1, ...), label smoothing,
    every reduction, ignore_index; float64 values and gradients, and finite differences."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=shape) * 2.0
    y = rng.integers(0, shape[1], size=shape[:1] + shape[2:]).astype(np.int32)
    if "ignore_index" in kw:
        y.reshape(-1)[::3] = kw["ignore_index"]
    w = rng.normal(size=y.shape) if kw.get("reduction") == "none" else 1.0

    def loss(p, y):
        return btjit.sum(btjit.cross_entropy(p["z"], y, **kw) * w)
    prog = btjit.trace(loss, {"z": logits}, y, dtype="float64", grad=True)
    got = prog.value_and_grad(y)
    t = torch.tensor(logits, requires_grad=True)
    want = (F.cross_entropy(t, torch.tensor(y, dtype=torch.long), **kw) * torch.tensor(w)).sum()
    want.backward()
    assert abs(got - want.item()) < 1e-12 * max(1.0, abs(want.item()))
    np.testing.assert_allclose(prog.grads["z"], t.grad.numpy(), rtol=1e-10, atol=1e-13)
    check_grads(loss, {"z": logits}, y)


LOSSES = ["mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
          "huber_loss", "kl_div"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", LOSSES)
def test_regression_and_binary_losses_against_torch(name, reduction):
    """Each loss of (input, target) against torch.nn.functional's in float64: the value and both gradients."""
    rng = np.random.default_rng(7)
    x, t = rng.normal(size=(5, 3)), rng.uniform(size=(5, 3))
    kw = {"reduction": reduction, **({"beta": 0.5} if name == "smooth_l1_loss" else {}),
          **({"delta": 0.7} if name == "huber_loss" else {})}
    tx = (lambda a: torch.sigmoid(a)) if name == "binary_cross_entropy" else (lambda a: a)
    bx = (lambda a: btjit.sigmoid(a)) if name == "binary_cross_entropy" else (lambda a: a)
    w = rng.normal(size=x.shape) if reduction == "none" else 1.0
    prog = btjit.trace(lambda p: btjit.sum(getattr(btjit, name)(bx(p["x"]), p["t"], **kw) * w), {"x": x, "t": t},
                       dtype="float64", grad=True)
    got = prog.value_and_grad()
    tt = {k: torch.tensor(v, requires_grad=True) for k, v in (("x", x), ("t", t))}
    want = (getattr(F, name)(tx(tt["x"]), tt["t"], **kw) * torch.tensor(w)).sum()
    want.backward()
    assert abs(got - want.item()) < 1e-12 * max(1.0, abs(want.item()))
    for k in tt:
        np.testing.assert_allclose(prog.grads[k], tt[k].grad.numpy(), rtol=1e-10, atol=1e-13, err_msg=k)


def test_bce_with_logits_pos_weight_and_extreme_logits():
    x, t = np.array([-200.0, -3.0, 0.0, 2.5, 300.0]), np.array([1.0, 0.0, 0.5, 1.0, 0.0])
    pw = np.array([2.0, 0.5, 1.0, 3.0, 1.5])
    prog = btjit.trace(lambda p: btjit.binary_cross_entropy_with_logits(p["x"], t, pos_weight=pw), {"x": x},
                       dtype="float64", grad=True)
    tx = torch.tensor(x, requires_grad=True)
    want = F.binary_cross_entropy_with_logits(tx, torch.tensor(t), pos_weight=torch.tensor(pw))
    want.backward()
    assert abs(prog.value_and_grad() - want.item()) < 1e-12 * abs(want.item())
    np.testing.assert_allclose(prog.grads["x"], tx.grad.numpy(), rtol=1e-12)


NORMS = {  # id -> (btjit fn of x, w, b; torch fn; x shape, w / b shape)
    "layer_norm torch signature": (lambda x, w, b: btjit.layer_norm(x, (4,), w, b, 1e-3),
                                   lambda x, w, b: F.layer_norm(x, (4,), w, b, 1e-3), (2, 3, 4), (4,)),
    "layer_norm over two axes": (lambda x, w, b: btjit.layer_norm(x, [3, 4], weight=w, bias=b),
                                 lambda x, w, b: F.layer_norm(x, [3, 4], weight=w, bias=b), (2, 3, 4), (3, 4)),
    "group_norm": (lambda x, w, b: btjit.group_norm(x, 3, w, b), lambda x, w, b: F.group_norm(x, 3, w, b),
                   (2, 6, 3, 4), (6,)),
    "group_norm one group, 3-d": (lambda x, w, b: btjit.group_norm(x, 1, w, b, eps=1e-3),
                                  lambda x, w, b: F.group_norm(x, 1, w, b, eps=1e-3), (2, 4, 5), (4,)),
    "instance_norm": (lambda x, w, b: btjit.instance_norm(x, w, b),
                      lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (2, 3, 4, 5), (3,)),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_normalizations_against_torch(name):
    bt, th, xs, ws = NORMS[name]
    rng = np.random.default_rng(4)
    x, w, b = rng.normal(size=xs) * 2.0 + 0.5, 1.0 + rng.normal(size=ws) * 0.2, rng.normal(size=ws) * 0.2
    r = rng.normal(size=xs)
    prog = btjit.trace(lambda p: btjit.sum(bt(p["x"], p["w"], p["b"]) * r), {"x": x, "w": w, "b": b},
                       dtype="float64", grad=True)
    got = prog.value_and_grad()
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in (("x", x), ("w", w), ("b", b))}
    want = (th(ts["x"], ts["w"], ts["b"]) * torch.tensor(r)).sum()
    want.backward()
    assert abs(got - want.item()) < 1e-10 * max(1.0, abs(want.item()))
    for k in ts:
        np.testing.assert_allclose(prog.grads[k], ts[k].grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=k)


def test_one_hot_and_embedding_as_torch():
    y = np.array([[2, 0], [1, 3]])
    table = np.random.default_rng(0).normal(size=(4, 3))

    def fn(p, y):
        return btjit.sum(btjit.embedding(y, p["e"])), {"oh": btjit.one_hot(y, 5), "emb": btjit.embedding(y, p["e"])}
    prog = btjit.trace(fn, {"e": table}, y.astype(np.int32), dtype="float64")
    prog.forward(y.astype(np.int32))
    np.testing.assert_array_equal(prog.outputs["oh"], F.one_hot(torch.tensor(y), 5).numpy())
    np.testing.assert_array_equal(prog.outputs["emb"], F.embedding(torch.tensor(y), torch.tensor(table)).numpy())
    with pytest.raises(btjit.TraceError, match="group_norm: 6 channels do not split into 4 groups"):
        btjit.trace(lambda p: btjit.sum(btjit.group_norm(p["x"], 4)), {"x": np.zeros((2, 6, 3))})
    with pytest.raises(btjit.TraceError, match=r"layer_norm: normalized_shape \(5,\) is not the end"):
        btjit.trace(lambda p: btjit.sum(btjit.layer_norm(p["x"], (5,))), {"x": np.zeros((2, 6, 3))})


def test_losses_name_a_bad_reduction_or_shape():
    with pytest.raises(btjit.TraceError, match="mse_loss: reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        btjit.trace(lambda p: btjit.mse_loss(p["x"], np.zeros(3), reduction="avg"), {"x": np.zeros(3)})
    with pytest.raises(btjit.TraceError, match=r"l1_loss: input \(3,\) and target \(4,\) must have one shape"):
        btjit.trace(lambda p: btjit.l1_loss(p["x"], np.zeros(4)), {"x": np.zeros(3)})
    with pytest.raises(btjit.TraceError, match="kl_div: reduction must be 'mean', 'batchmean', 'sum' or 'none'"):
        btjit.trace(lambda p: btjit.kl_div(p["x"], np.zeros(3), reduction="avg"), {"x": np.zeros(3)})
    with pytest.raises(btjit.TraceError, match=r"prelu: weight \(4,\) must have one element or one per channel"):
        btjit.trace(lambda p: btjit.sum(btjit.prelu(p["x"], np.ones(4))), {"x": np.zeros((2, 3))})
    with pytest.raises(btjit.TraceError, match=r"glu: dim 1 of x \(2, 3\) must exist and have an even size"):
        btjit.trace(lambda p: btjit.sum(btjit.glu(p["x"], 1)), {"x": np.zeros((2, 3))})


@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_batchmean_and_log_target_against_torch(log_target):
    """The KL divergence as a VAE or distillation loss writes it: log-probabilities against (log-)probabilities,
    'batchmean', a zero target probability included; both gradients."""
    rng = np.random.default_rng(3)
    x, t = rng.normal(size=(4, 5)), rng.uniform(size=(4, 5))
    t[0, 0] = 0.0
    t = np.log(t + 0.1) if log_target else t
    prog = btjit.trace(lambda p: btjit.kl_div(btjit.log_softmax(p["x"], 1), p["t"], "batchmean", log_target),
                       {"x": x, "t": t}, dtype="float64", grad=True)
    got = prog.value_and_grad()
    tt = {k: torch.tensor(v, requires_grad=True) for k, v in (("x", x), ("t", t))}
    want = F.kl_div(F.log_softmax(tt["x"], 1), tt["t"], reduction="batchmean", log_target=log_target)
    want.backward()
    assert abs(got - want.item()) < 1e-12
    np.testing.assert_allclose(prog.grads["x"], tt["x"].grad.numpy(), rtol=1e-10, atol=1e-13)
    kept = np.ones(t.shape, bool) if log_target else t > 0     # torch's d(t log t)/dt at t = 0 is NaN
    np.testing.assert_allclose(prog.grads["t"][kept], tt["t"].grad.numpy()[kept], rtol=1e-10, atol=1e-13)
    assert np.isfinite(prog.grads["t"]).all()


def test_nll_loss_in_torch_layout_and_the_ambiguous_shape():
    """nll_loss on torch's (N, C, d) layout; where C equals the last dim both layouts fit and btjit's (classes
    last) is taken, as documented."""
    rng = np.random.default_rng(6)
    lp = rng.normal(size=(2, 4, 3))
    y = rng.integers(0, 4, size=(2, 3)).astype(np.int32)
    prog = btjit.trace(lambda p, y: btjit.nll_loss(p["lp"], y), {"lp": lp}, y, dtype="float64")
    assert abs(prog.forward(y) - F.nll_loss(torch.tensor(lp), torch.tensor(y, dtype=torch.long)).item()) < 1e-14
    sq = rng.normal(size=(2, 3, 3))
    yq = rng.integers(0, 3, size=(2, 3)).astype(np.int32)
    prog = btjit.trace(lambda p, y: btjit.nll_loss(p["lp"], y), {"lp": sq}, yq, dtype="float64")
    want = -np.mean(np.take_along_axis(sq, yq[..., None], -1))
    assert abs(prog.forward(yq) - want) < 1e-14


def test_cross_entropy_bad_label_smoothing():
    with pytest.raises(btjit.TraceError, match=r"cross_entropy: label_smoothing must be in \[0, 1\], got 1.5"):
        btjit.trace(lambda p: btjit.cross_entropy(p["z"], np.zeros(4, np.int32), label_smoothing=1.5),
                    {"z": np.zeros((4, 3))})


def test_nll_loss_every_position_ignored_is_nan_with_zero_grads():
    y = np.full(4, -1, np.int32)
    prog = btjit.trace(lambda p, y: btjit.nll_loss(p["lp"], y, ignore_index=-1), {"lp": np.zeros((4, 3))}, y,
                       dtype="float64", grad=True)
    assert np.isnan(prog.value_and_grad(y))
    assert np.all(prog.grads["lp"] == 0)


def test_nll_loss_bad_targets():
    lp = {"lp": np.zeros((4, 3))}
    prog = btjit.trace(lambda p, y: btjit.nll_loss(p["lp"], y), lp, np.zeros(4, np.int32))
    with pytest.raises(Exception, match=r"\[0, 3\)"):
        prog.forward(np.array([0, 1, 3, 2], np.int32))
    with pytest.raises(btjit.TraceError, match=r"nll_loss: target values must be in \[0, 3\)"):
        btjit.trace(lambda p: btjit.nll_loss(p["lp"], np.array([0, 5, 1, 1])), lp)
    with pytest.raises(btjit.TraceError, match=r"nll_loss: target must be integer class ids of shape \(4,\)"):
        btjit.trace(lambda p, y: btjit.nll_loss(p["lp"], y), lp, np.zeros((4, 3), np.int32))
    with pytest.raises(btjit.TraceError, match="reduction must be 'mean' or 'sum' or 'none'"):
        btjit.trace(lambda p, y: btjit.nll_loss(p["lp"], y, reduction="avg"), lp, np.zeros(4, np.int32))
