"""The CNN model files against torch: pytorch/examples' MNIST net (examples/mnist_cnn.py, without dropout) and
tinygrad's beautiful_mnist net (examples/beautiful_mnist.py, with and without its batch norms) --
the same weights and batches on both sides, 10 AdamW steps, every loss and the final weights compared; and a
conv/pool program exported and run by btjit.runtime bit for bit as in-process."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import btjit
from btjit.train import usermodel
from test_export import _exports_run_bitwise

torch = pytest.importorskip("torch")
nn, TF = torch.nn, torch.nn.functional
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def model_file(name):
    return usermodel.read(EXAMPLES / name).module


class MnistNet(nn.Module):           # pytorch/examples mnist/main.py's Net, dropout left out
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = TF.max_pool2d(TF.relu(self.conv2(TF.relu(self.conv1(x)))), 2)
        x = TF.relu(self.fc1(torch.flatten(x, 1)))
        return TF.log_softmax(self.fc2(x), dim=1)


class BeautifulNet(nn.Module):       # tinygrad's beautiful_mnist Model, BatchNorm left out
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Conv2d(1, 32, 5), nn.Conv2d(32, 32, 5)
        self.l3, self.l4 = nn.Conv2d(32, 64, 3), nn.Conv2d(64, 64, 3)
        self.fc = nn.Linear(576, 10)

    def forward(self, x):
        x = TF.max_pool2d(TF.relu(self.l2(TF.relu(self.l1(x)))), 2)
        x = TF.max_pool2d(TF.relu(self.l4(TF.relu(self.l3(x)))), 2)
        return self.fc(x.flatten(1))


class BeautifulNetBN(BeautifulNet):  # ... with its two BatchNorm2d
    def __init__(self):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(32), nn.BatchNorm2d(64)

    def forward(self, x):
        x = TF.max_pool2d(self.bn1(TF.relu(self.l2(TF.relu(self.l1(x))))), 2)
        x = TF.max_pool2d(self.bn2(TF.relu(self.l4(TF.relu(self.l3(x))))), 2)
        return self.fc(x.flatten(1))


def _trajectory(mod, cfg, net, dtype, normalize, steps=10, B=4, buffers=None):
    rng = np.random.default_rng(0)
    p = mod.init_params(cfg, rng)
    pix = [rng.integers(0, 256, (B, 1, 28, 28)).astype(np.float32) / 255 for _ in range(steps)]
    data = [(x.astype(dtype), rng.integers(0, 10, B).astype(np.int32)) for x in pix]
    tdt = torch.float64 if dtype == "float64" else torch.float32
    net = net.to(tdt)
    with torch.no_grad():
        for k, v in net.state_dict().items():
            if k in p:
                v.copy_(torch.tensor(p[k].T if v.ndim == 2 else p[k]))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    want = []
    for x, y in data:
        opt.zero_grad()
        out = net((torch.tensor(x) - normalize[0]) / normalize[1] if normalize else torch.tensor(x))
        loss = TF.nll_loss(out, torch.tensor(y).long()) if normalize else TF.cross_entropy(out, torch.tensor(y).long())
        loss.backward()
        opt.step()
        want.append(loss.item())
    loss_fn = (lambda q, x, y: mod.loss(q, x, y, cfg)) if mod.loss.__code__.co_argcount == 4 else mod.loss
    prog = btjit.trace(loss_fn, p, *data[0], optimizer=btjit.optim.AdamW(lr=1e-3, weight_decay=0.01), dtype=dtype,
                       buffers=buffers)
    got = [prog.step(x, y) for x, y in data]
    return got, want, {k: v.T if v.ndim == 2 else v for k, v in {**prog.params, **prog.buffers}.items()}, \
        net.state_dict()


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-9), ("float32", 2e-4)])
def test_pytorch_examples_mnist_net_trains_as_torch(dtype, tol):
    mod = model_file("mnist_cnn.py")
    got, want, params, state = _trajectory(mod, SimpleNamespace(dropout=0), MnistNet(), dtype, (mod.MEAN, mod.STD))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    for k, v in state.items():
        np.testing.assert_allclose(params[k], v.numpy(), rtol=100 * tol, atol=100 * tol, err_msg=k)


def test_beautiful_mnist_net_without_batch_norm_trains_as_torch():
    mod = model_file("beautiful_mnist.py")
    got, want, params, state = _trajectory(mod, SimpleNamespace(batch_norm=False), BeautifulNet(), "float64", None)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    for k, v in state.items():
        np.testing.assert_allclose(params[k], v.numpy(), rtol=1e-7, atol=1e-9, err_msg=k)


def test_beautiful_mnist_net_with_batch_norm_trains_as_torch():
    """tinygrad's net as written, its BatchNorm2d's running statistics as buffers: losses, params and running
    statistics over 10 AdamW steps as torch's."""
    mod = model_file("beautiful_mnist.py")
    cfg = SimpleNamespace(batch_norm=True)
    bufs = {k: v.astype(np.float64) for k, v in mod.init_buffers(cfg).items()}
    got, want, params, state = _trajectory(mod, cfg, BeautifulNetBN(), "float64", None, buffers=bufs)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    for k, v in state.items():
        if k.endswith("num_batches_tracked"):
            continue                 # (AdamW's m / sqrt(v) amplifies last-digit gradient differences a little)
        np.testing.assert_allclose(params[k], v.numpy(), rtol=1e-6, atol=1e-8, err_msg=k)


def cnn_loss(p, x, y):
    h = btjit.relu(btjit.conv2d(x, p["w1"], p["b1"], padding=1))
    h = btjit.avg_pool2d(btjit.max_pool2d(h, 2), 2, stride=1)
    h = btjit.conv2d(h, p["w2"], stride=2, groups=2)
    return btjit.cross_entropy(btjit.flatten(btjit.adaptive_avg_pool2d(h, 1)), y)


def dw_loss(p, x, y):                      # a depthwise 3x3 (k_dwconv) between two convolutions, MobileNet's way
    h = btjit.relu(btjit.conv2d(x, p["w1"], p["b1"], padding=1))
    h = btjit.relu(btjit.conv2d(h, p["wd"], padding=1, groups=4))
    return btjit.cross_entropy(btjit.flatten(btjit.adaptive_avg_pool2d(btjit.conv2d(h, p["w2"]), 1)), y)


def test_conv_pool_exports_run_bitwise(tmp_path):
    rng = np.random.default_rng(3)
    cases = []
    for dtype in ("float32", "float64"):
        p = {"w1": rng.normal(size=(4, 1, 3, 3)) * 0.3, "b1": np.zeros(4), "w2": rng.normal(size=(6, 2, 3, 3)) * 0.3}
        data = [(rng.random((5, 1, 12, 12)).astype(dtype), rng.integers(0, 6, 5).astype(np.int32)) for _ in range(4)]
        prog = btjit.trace(cnn_loss, p, *data[0], optimizer=btjit.optim.AdamW(lr=1e-2), dtype=dtype)
        cases.append((dtype, prog, data, "k_im2col"))
    p = {"w1": rng.normal(size=(8, 1, 3, 3)) * 0.3, "b1": np.zeros(8), "w2": rng.normal(size=(6, 4, 3, 3)) * 0.3}
    data = [(rng.random((5, 1, 12, 12)).astype(np.float32), rng.integers(0, 6, 5).astype(np.int32)) for _ in range(4)]
    prog = btjit.trace(cnn_loss, p, *data[0], optimizer=btjit.optim.AdamW(lr=1e-2))     # 8 channels: implicit GEMM
    cases.append(("implicit", prog, data, "k_conv"))
    p = {"w1": rng.normal(size=(4, 1, 3, 3)) * 0.3, "b1": np.zeros(4), "wd": rng.normal(size=(4, 1, 3, 3)) * 0.3,
         "w2": rng.normal(size=(6, 4, 1, 1)) * 0.3}
    prog = btjit.trace(dw_loss, p, *data[0], optimizer=btjit.optim.AdamW(lr=1e-2))
    cases.append(("depthwise", prog, data, "k_dwconv"))
    _exports_run_bitwise(tmp_path, cases)
