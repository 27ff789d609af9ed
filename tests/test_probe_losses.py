"""The losses of CNN training recipes as torch writes them: cross_entropy / nll_loss with class weights
(imbalanced classes, segmentation; with ignore_index and label smoothing), cross_entropy of class
probabilities (mixup / cutmix, distillation) and binary cross-entropy with per-element weights -- values and
gradients against torch in float64, a mixup CNN's trajectory, and the errors naming the argument."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
from torch_models import sgd_steps_as_torch  # noqa: E402
F = torch.nn.functional
rng = np.random.default_rng(0)
CW = rng.uniform(0.05, 2, 5)                                   # class weights, some well below 1
Z2, Y2 = rng.normal(size=(6, 5)), rng.integers(0, 5, 6)
Z4, Y4 = rng.normal(size=(3, 5, 4, 3)), rng.integers(0, 5, (3, 4, 3))
Y2[1], Y4[0, 0, :2] = -100, -100                               # torch's default ignore_index
P2 = rng.dirichlet(np.ones(5), 6)
P3 = rng.dirichlet(np.ones(5), (3, 4)).transpose(0, 2, 1).copy()   # (N, C, L) probabilities over axis 1
W = torch.tensor(CW)

CASES = [  # name, btjit loss of (z, t), torch loss of (z, t), z, t
    ("weight", lambda z, t: btjit.cross_entropy(z, t, weight=CW), lambda z, t: F.cross_entropy(z, t, weight=W),
     Z2, Y2.clip(0)),
    ("weight ignore", lambda z, t: btjit.cross_entropy(z, t, ignore_index=-100, weight=CW),
     lambda z, t: F.cross_entropy(z, t, weight=W), Z2, Y2),
    ("weight ignore NCHW", lambda z, t: btjit.cross_entropy(z, t, ignore_index=-100, weight=CW),
     lambda z, t: F.cross_entropy(z, t, weight=W), Z4, Y4),
    ("weight smoothing ignore NCHW", lambda z, t: btjit.cross_entropy(z, t, -100, label_smoothing=0.2, weight=CW),
     lambda z, t: F.cross_entropy(z, t, weight=W, label_smoothing=0.2), Z4, Y4),
    ("weight smoothing sum", lambda z, t: btjit.cross_entropy(z, t, -100, "sum", 0.3, weight=CW),
     lambda z, t: F.cross_entropy(z, t, weight=W, label_smoothing=0.3, reduction="sum"), Z2, Y2),
    ("weight none", lambda z, t: btjit.cross_entropy(z, t, -100, "none", weight=CW) * np.arange(6),
     lambda z, t: F.cross_entropy(z, t, weight=W, reduction="none") * torch.arange(6), Z2, Y2),
    ("nll weight NCHW", lambda z, t: btjit.nll_loss(btjit.log_softmax(z, 1), t, -100, weight=CW),
     lambda z, t: F.nll_loss(F.log_softmax(z, 1), t, weight=W), Z4, Y4),
    ("smoothing ignore, no weight", lambda z, t: btjit.cross_entropy(z, t, -100, label_smoothing=0.3),
     lambda z, t: F.cross_entropy(z, t, label_smoothing=0.3), Z2, Y2),
    ("probabilities", lambda z, t: btjit.cross_entropy(z, t), lambda z, t: F.cross_entropy(z, t), Z2, P2),
    ("probabilities smoothing weight (N, C, L)", lambda z, t: btjit.cross_entropy(z, t, label_smoothing=0.1, weight=CW),
     lambda z, t: F.cross_entropy(z, t, weight=W, label_smoothing=0.1), Z4[:, :, :, 0].copy(), P3),
    ("probabilities 1-d sum", lambda z, t: btjit.cross_entropy(z, t, reduction="sum"),
     lambda z, t: F.cross_entropy(z, t, reduction="sum"), Z2[0], P2[0]),
    ("bce weight", lambda z, t: btjit.binary_cross_entropy(btjit.sigmoid(z), t, weight=CW),
     lambda z, t: F.binary_cross_entropy(torch.sigmoid(z), t, weight=W.expand(6, 5)), Z2, (P2 > 0.2) * 1.0),
    ("bce logits weight pos_weight", lambda z, t: btjit.binary_cross_entropy_with_logits(z, t, pos_weight=CW,
                                                                                          weight=CW[::-1].copy()),
     lambda z, t: F.binary_cross_entropy_with_logits(z, t, pos_weight=W, weight=W.flip(0)), Z2, (P2 > 0.2) * 1.0),
]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_weighted_and_probability_losses_match_torch(i):
    _, f, tf, z, t = CASES[i]
    prog = btjit.trace(lambda p, t: btjit.sum(f(p["z"], t)), {"z": z}, t, dtype="float64", grad=True)
    got = prog.value_and_grad(t)
    tz = torch.tensor(z, requires_grad=True)
    want = tf(tz, torch.tensor(t)).sum()
    want.backward()
    assert got == pytest.approx(want.item(), rel=1e-12)
    np.testing.assert_allclose(prog.grads["z"], tz.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_a_mixup_cnn_trains_as_torch():
    """timm's mixup recipe: the batch mixed with its flip, the targets lam one-hot + (1 - lam) the flip's, both as
    batch arguments; cross_entropy of the probabilities with label smoothing; 4 SGD steps against torch."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5)).double()
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}

    def loss(p, x, t):
        h = btjit.max_pool2d(btjit.relu(btjit.conv2d(x, p["0.weight"], p["0.bias"], padding=1)), 2)
        return btjit.cross_entropy(btjit.flatten(h) @ p["4.weight"].T + p["4.bias"], t, label_smoothing=0.1)
    batches = []
    for _ in range(4):
        x, y, lam = rng.normal(size=(6, 3, 8, 8)), rng.integers(0, 5, 6), rng.beta(0.8, 0.8)
        onehot = np.eye(5)[y]
        batches.append((lam * x + (1 - lam) * x[::-1], lam * onehot + (1 - lam) * onehot[::-1]))
    prog = btjit.trace(loss, params, *batches[0], optimizer=btjit.optim.SGD(0.1, momentum=0.9), dtype="float64")
    sgd_steps_as_torch(prog, net, batches,
                       lambda x, t: F.cross_entropy(net(torch.tensor(x)), torch.tensor(t), label_smoothing=0.1))


@pytest.mark.parametrize("call,message", [
    (lambda z, t: btjit.cross_entropy(z, t, weight=np.ones(4)), "cross_entropy: weight must hold one value per class, "
                                                                 "shape (5,), got (4,)"),
    (lambda z, t: btjit.nll_loss(z, t, weight=np.ones((5, 1))), "nll_loss: weight must hold one value per class"),
    (lambda z, t: btjit.cross_entropy(z, z * 0.2, ignore_index=-1), "ignore_index goes with class-id targets"),
    (lambda z, t: btjit.cross_entropy(z, z * 0.2, reduction="avg"), "reduction must be 'mean', 'sum' or 'none'"),
    (lambda z, t: btjit.binary_cross_entropy_with_logits(z, z, weight=np.ones(6)), "weight (6,) does not broadcast"),
])
def test_bad_weights_and_probability_targets_are_named(call, message):
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(lambda p: btjit.sum(call(p["z"], Y2.clip(0))), {"z": Z2}, grad=False)
    assert message in str(e.value) and "test_probe_losses.py:" in str(e.value)


def test_torchs_default_ignore_index_is_hinted():
    """torch's cross_entropy ignores -100 by default, btjit's ignore_index is None: targets of -100 (padding,
    masked pixels) are an error that says how to ignore them, for a batch argument and for constant targets."""
    y = Y2.astype(np.int32)
    prog = btjit.trace(lambda p, y: btjit.cross_entropy(p["z"], y), {"z": Z2}, y.clip(0), grad=True)
    with pytest.raises(ValueError, match=r"got min -100 max \d; torch's cross_entropy / nll_loss ignore -100 by "
                                         r"default, btjit's only with ignore_index=-100"):
        prog.value_and_grad(y)
    with pytest.raises(btjit.TraceError, match="btjit's only with ignore_index=-100"):
        btjit.trace(lambda p: btjit.nll_loss(p["z"], y), {"z": Z2}, grad=True)
    ok = btjit.trace(lambda p, y: btjit.cross_entropy(p["z"], y, ignore_index=-100), {"z": Z2}, y, grad=True)
    assert ok.value_and_grad(y) == pytest.approx(F.cross_entropy(torch.tensor(Z2), torch.tensor(Y2)).item())
