"""Small public CNNs written against btjit's API as their authors write them, each beside the same net in torch:
LeNet-5, pytorch/examples' MNIST net (dropout compared in eval), tinygrad's beautiful_mnist (BatchNorm2d),
a CIFAR ResNet-8, a MobileNetV2 inverted residual, a VGG block, ResNet's and flax's max-pool stems, odd image
sizes, batch 1 and NHWC inputs (more nets: test_cnn_zoo_more.py). For each: the loss and every gradient at each
step of a short SGD-momentum or Adam trajectory, the params and batch norms' running statistics after it, and
prog.eval against model.eval()."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
from cnn_zoo_harness import bn, conv, linear, run_against_torch  # noqa: E402
nn, F = torch.nn, torch.nn.functional


# --- LeNet-5 (LeCun et al. 1998, as the tutorials write it: tanh, average pools) -----------------------------
class LeNet5(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c3 = nn.Conv2d(1, 6, 5, padding=2), nn.Conv2d(6, 16, 5)
        self.f5, self.f6, self.f7 = nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x):
        x = F.avg_pool2d(torch.tanh(self.c1(x)), 2)
        x = F.avg_pool2d(torch.tanh(self.c3(x)), 2)
        x = x.view(x.size(0), -1)
        return self.f7(torch.tanh(self.f6(torch.tanh(self.f5(x)))))


def lenet_loss(p, x, y):
    x = btjit.avg_pool2d(btjit.tanh(conv(p, x, "c1", padding=2)), 2)
    x = btjit.avg_pool2d(btjit.tanh(conv(p, x, "c3")), 2)
    x = x.view(x.size(0), -1)
    x = btjit.tanh(linear(p, btjit.tanh(linear(p, x, "f5")), "f6"))
    return btjit.cross_entropy(linear(p, x, "f7"), y)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lenet5(dtype):
    run_against_torch(LeNet5(), lenet_loss, (1, 28, 28), dtype=dtype)


# --- pytorch/examples mnist/main.py's Net, its dropouts on: eval compared, training with them off ----------
class MnistNet(nn.Module):
    def __init__(self, drop=(0.25, 0.5)):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(drop[0]), nn.Dropout(drop[1])
        self.fc1, self.fc2 = nn.Linear(16 * 6 * 6, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def mnist_loss(drop):
    def loss(p, x, y):
        x = btjit.relu(conv(p, btjit.relu(conv(p, x, "conv1", stride=1)), "conv2", stride=1))
        x = btjit.dropout(btjit.max_pool2d(x, 2), drop[0])
        x = btjit.dropout(btjit.relu(linear(p, btjit.flatten(x, 1), "fc1")), drop[1])
        return btjit.nll_loss(btjit.log_softmax(linear(p, x, "fc2"), dim=1), y)
    return loss


def test_pytorch_examples_mnist_net():
    run_against_torch(MnistNet((0, 0)), mnist_loss((0, 0)), (1, 16, 16))
    torch.manual_seed(0)
    net = MnistNet()
    prog = run_against_torch(net, mnist_loss((0.25, 0.5)), (1, 16, 16), steps=0)
    x, y = np.random.default_rng(1).normal(size=(4, 1, 16, 16)), np.arange(4, dtype=np.int32)
    assert prog.step(x, y) != pytest.approx(prog.eval(x, y))            # the dropouts draw while training


# --- tinygrad's beautiful_mnist (BatchNorm2d in train mode, its running statistics as buffers) ---------------
class Beautiful(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.bn1 = nn.Conv2d(1, 8, 5), nn.Conv2d(8, 8, 5), nn.BatchNorm2d(8)
        self.l3, self.l4, self.bn2 = nn.Conv2d(8, 16, 3), nn.Conv2d(16, 16, 3), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 3 * 3, 10)

    def forward(self, x):
        x = F.max_pool2d(self.bn1(F.relu(self.l2(F.relu(self.l1(x))))), (2, 2))
        x = F.max_pool2d(self.bn2(F.relu(self.l4(F.relu(self.l3(x))))), (2, 2))
        return self.fc(x.flatten(1))


def beautiful_loss(p, x, y):
    x = btjit.max_pool2d(bn(p, btjit.relu(conv(p, btjit.relu(conv(p, x, "l1")), "l2")), "bn1"), (2, 2))
    x = btjit.max_pool2d(bn(p, btjit.relu(conv(p, btjit.relu(conv(p, x, "l3")), "l4")), "bn2"), (2, 2))
    return btjit.cross_entropy(linear(p, x.flatten(1), "fc"), y)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_beautiful_mnist_batch_norm(dtype):
    run_against_torch(Beautiful(), beautiful_loss, (1, 28, 28), dtype=dtype, opt="adam")


# --- a CIFAR ResNet-8 (He et al.'s BasicBlock: bias-free convs, BN, a strided 1x1 shortcut) ------------------
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet8(nn.Module):
    def __init__(self, w=(4, 8, 16)):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, w[0], 3, 1, 1, bias=False), nn.BatchNorm2d(w[0])
        self.layer1, self.layer2 = BasicBlock(w[0], w[0], 1), BasicBlock(w[0], w[1], 2)
        self.layer3, self.linear = BasicBlock(w[1], w[2], 2), nn.Linear(w[2], 10)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, (1, 1))
        return self.linear(out.view(out.size(0), -1))


def basic_block(p, x, name, stride):
    out = btjit.relu(bn(p, btjit.conv2d(x, p[name + ".conv1.weight"], stride=stride, padding=1), name + ".bn1"))
    out = bn(p, btjit.conv2d(out, p[name + ".conv2.weight"], None, 1, 1), name + ".bn2")
    if name + ".shortcut.0.weight" in p:
        x = bn(p, btjit.conv2d(x, p[name + ".shortcut.0.weight"], stride=stride), name + ".shortcut.1")
    return btjit.relu(out + x)


def resnet_loss(p, x, y):
    out = btjit.relu(bn(p, btjit.conv2d(x, p["conv1.weight"], padding=1), "bn1"))
    out = basic_block(p, out, "layer1", 1)
    out = basic_block(p, out, "layer2", 2)
    out = basic_block(p, out, "layer3", 2)
    out = btjit.adaptive_avg_pool2d(out, (1, 1))
    return btjit.cross_entropy(linear(p, out.view(out.size(0), -1), "linear"), y)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_resnet8(dtype):
    run_against_torch(ResNet8(), resnet_loss, (3, 16, 16), dtype=dtype)


def test_resnet8_odd_image_batch_1():
    run_against_torch(ResNet8(), resnet_loss, (3, 13, 17), B=1, opt="adam")


# --- MobileNetV2's inverted residual (1x1 expand, depthwise 3x3 groups=C, relu6, linear 1x1 projection) -------
class InvertedResidual(nn.Module):
    def __init__(self, c=6, t=4):
        super().__init__()
        h = c * t
        self.conv = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
                                  nn.Conv2d(h, h, 3, 1, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
                                  nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        x = x + self.conv(x)
        return self.fc(x.mean([2, 3]))


def inverted_residual_loss(p, x, y):
    h = btjit.relu6(bn(p, btjit.conv2d(x, p["conv.0.weight"]), "conv.1"))
    h = btjit.relu6(bn(p, btjit.conv2d(h, p["conv.3.weight"], padding=1, groups=h.shape[1]), "conv.4"))
    x = x + bn(p, btjit.conv2d(h, p["conv.6.weight"]), "conv.7")
    return btjit.cross_entropy(linear(p, x.mean((2, 3)), "fc"), y)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_mobilenet_v2_inverted_residual(dtype):
    run_against_torch(InvertedResidual(), inverted_residual_loss, (6, 9, 10), dtype=dtype, opt="adam")


# --- a VGG block (padding "same"), ResNet's stem (7x7 stride 2, max-pool 3/2/1) and flax's stride-1 pool --------
class VGGStem(nn.Module):
    def __init__(self, stem):
        super().__init__()
        self.stem = stem
        self.conv0 = nn.Conv2d(3, 8, 7, 2, 3, bias=False) if stem == "resnet" else nn.Conv2d(3, 8, 3, padding="same")
        self.bn0 = nn.BatchNorm2d(8)
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding="same"), nn.Conv2d(8, 12, 3, padding="same")
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        x = F.relu(self.bn0(self.conv0(x)))
        x = F.max_pool2d(x, 3, 2, 1) if self.stem == "resnet" else F.max_pool2d(x, 3, stride=1)
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), kernel_size=2, stride=2)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def vgg_loss(stem):
    def loss(p, x, y):
        if stem == "resnet":
            x = btjit.max_pool2d(btjit.relu(bn(p, btjit.conv2d(x, p["conv0.weight"], None, 2, 3), "bn0")), 3, 2, 1)
        else:
            x = btjit.max_pool2d(btjit.relu(bn(p, conv(p, x, "conv0", padding="same"), "bn0")), 3, stride=1)
        x = btjit.relu(conv(p, btjit.relu(conv(p, x, "conv1", padding="same")), "conv2", padding="same"))
        x = btjit.max_pool2d(x, kernel_size=2, stride=2)
        return btjit.cross_entropy(linear(p, btjit.adaptive_avg_pool2d(x, 1).flatten(1), "fc"), y)
    return loss


@pytest.mark.parametrize("stem", ["resnet", "flax"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_vgg_block_and_max_pool_stems(stem, dtype):
    run_against_torch(VGGStem(stem), vgg_loss(stem), (3, 15, 13), dtype=dtype)


# --- NHWC images (TensorFlow's layout) transposed by the user -----------------------------------------------
def nhwc_loss(p, x, y):
    return lenet_loss(p, x.permute(0, 3, 1, 2), y)


def nhwc_numpy_loss(p, x, y):
    return lenet_loss(p, np.transpose(x, (0, 3, 1, 2)), y)


@pytest.mark.parametrize("fn", [nhwc_loss, nhwc_numpy_loss])
def test_nhwc_input_transposed(fn):
    run_against_torch(LeNet5(), fn, (28, 28, 1), nhwc=True, B=2, steps=3)
