"""Small public CNNs written against btjit's API as their authors write them, each beside the same net in torch:
LeNet-5, pytorch/examples' MNIST net (dropout compared in eval), tinygrad's beautiful_mnist (BatchNorm2d),
a CIFAR ResNet-8, a MobileNetV2 inverted residual, a VGG block, a 1-D conv net, a tiny U-Net, a
squeeze-and-excitation block, GroupNorm / InstanceNorm nets, ResNet's and flax's max-pool stems, odd image
sizes, batch 1 and NHWC inputs. For each: the loss and every gradient at each step of a short SGD-momentum or
Adam trajectory, the params and batch norms' running statistics after it, and prog.eval against model.eval()."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
TOL = {"float64": 1e-10, "float32": 1e-4}


def bn(p, x, name):                  # nn.BatchNorm*d as the user calls it, its state_dict's names
    return btjit.batch_norm(x, p[name + ".weight"], p[name + ".bias"], p[name + ".running_mean"],
                            p[name + ".running_var"])


def linear(p, x, name):              # nn.Linear: weight (out, in)
    return x @ p[name + ".weight"].T + p[name + ".bias"]


def conv(p, x, name, **kw):
    return btjit.conv2d(x, p[name + ".weight"], p.get(name + ".bias"), **kw)


def _close(got, want, tol, what):
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def run_against_torch(net, loss, shape, classes=10, dtype="float64", opt="sgd", steps=5, B=4, seed=0, nhwc=False,
                      pixels=False):
    """net: a torch nn.Module; loss(p, x, y): the same net in btjit over net's state_dict names. Trains both for
    `steps` steps on the same batches, comparing the loss and every gradient at each step, then the params,
    the running statistics and the eval-mode loss."""
    torch.manual_seed(seed)
    tdt = getattr(torch, dtype)
    net = net.to(tdt).train()
    rng = np.random.default_rng(seed)
    data = [(rng.normal(size=(B,) + shape).astype(dtype),
             rng.integers(0, classes, (B,) + (shape[1:] if pixels else ())).astype(np.int32)) for _ in range(steps + 1)]
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    bufs = {k: v.numpy().copy() for k, v in net.named_buffers() if not k.endswith("num_batches_tracked")}
    if opt == "sgd":
        topt, bopt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), btjit.optim.SGD(0.05, momentum=0.9)
    else:
        topt, bopt = torch.optim.Adam(net.parameters(), lr=1e-3), btjit.optim.Adam(1e-3)
    prog = btjit.trace(loss, params, *data[0], optimizer=bopt, dtype=dtype, buffers=bufs)
    tol = TOL[dtype]

    def tloss(x, y):
        xt = torch.tensor(x)
        if nhwc:                     # (torch's conv of a permuted 1-channel image is channels-last: .view fails)
            xt = xt.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
        return F.cross_entropy(net(xt), torch.tensor(y).long())
    for x, y in data[:steps]:
        topt.zero_grad()
        want = tloss(x, y)
        want.backward()
        got = prog.step(x, y)
        _close(got, want.item(), tol, "loss")
        for k, v in net.named_parameters():
            _close(prog.grads[k], v.grad.numpy(), tol * 10, "grad " + k)
        topt.step()
    for k, v in net.named_parameters():
        _close(prog.params[k], v.detach().numpy(), tol * 10, k)
    for k in bufs:
        _close(prog.buffers[k], dict(net.named_buffers())[k].numpy(), tol * 10, k)
    net.eval()
    with torch.no_grad():
        want = tloss(*data[steps]).item()
    _close(prog.eval(*data[steps]), want, tol * 10, "eval loss")
    return prog


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


# --- a 1-D conv net over sequences (conv1d, BatchNorm1d, max_pool1d, global average) -----------------------
class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        # bias=False before the batch norm (as authors write it): a bias there has a gradient of exactly zero in
        # theory, and Adam turns float32's leftover rounding of it into whole steps
        self.c1, self.bn1 = nn.Conv1d(4, 8, 5, padding=2, bias=False), nn.BatchNorm1d(8)
        self.c2, self.c3 = nn.Conv1d(8, 8, 3, dilation=2, padding="same"), nn.Conv1d(8, 12, 3, stride=2)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        x = F.max_pool1d(F.relu(self.bn1(self.c1(x))), 2)
        x = F.avg_pool1d(F.gelu(self.c2(x)), 3, stride=1, padding=1)
        return self.fc(F.relu(self.c3(x)).mean(-1))


def conv1d_loss(p, x, y):
    x = btjit.conv1d(x, p["c1.weight"], None, padding=2)
    x = btjit.max_pool1d(btjit.relu(bn(p, x, "bn1")), 2)
    x = btjit.gelu(btjit.conv1d(x, p["c2.weight"], p["c2.bias"], dilation=2, padding="same"))
    x = btjit.avg_pool1d(x, 3, stride=1, padding=1)
    x = btjit.relu(btjit.conv1d(x, p["c3.weight"], p["c3.bias"], stride=2))
    return btjit.cross_entropy(linear(p, x.mean(-1), "fc"), y)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_conv1d_sequence_net(dtype):
    run_against_torch(Conv1dNet(), conv1d_loss, (4, 23), classes=5, dtype=dtype, opt="adam")


# --- squeeze-and-excitation (adaptive_avg_pool2d, then a sigmoid gate broadcast over H, W) ------------------
class SENet(nn.Module):
    def __init__(self, c=8, r=4):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(c, c // r), nn.Linear(c // r, c)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = F.relu(self.conv(x))
        b, c, _, _ = x.size()
        s = F.adaptive_avg_pool2d(x, (1, 1)).view(b, c)
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s)))).view(b, c, 1, 1)
        x = x * s.expand_as(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def se_loss(p, x, y):
    x = btjit.relu(conv(p, x, "conv", padding=1))
    b, c, _, _ = x.size()
    s = btjit.adaptive_avg_pool2d(x, (1, 1)).view(b, c)
    s = btjit.sigmoid(linear(p, btjit.relu(linear(p, s, "fc1")), "fc2")).view(b, c, 1, 1)
    x = x * s.expand_as(x)
    return btjit.cross_entropy(linear(p, btjit.flatten(btjit.adaptive_avg_pool2d(x, 1), 1), "head"), y)


def test_squeeze_and_excitation():
    run_against_torch(SENet(), se_loss, (3, 11, 9))


# --- GroupNorm and InstanceNorm nets ------------------------------------------------------------------------
class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.gn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8)
        self.c2, self.inorm = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.InstanceNorm2d(8, affine=True)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = F.silu(self.gn(self.c1(x)))
        x = F.leaky_relu(self.inorm(self.c2(x)), 0.2)
        return self.fc(x.mean(dim=(2, 3)))


def norm_loss(p, x, y):
    x = btjit.silu(btjit.group_norm(conv(p, x, "c1", padding=1), 2, p["gn.weight"], p["gn.bias"]))
    x = btjit.instance_norm(conv(p, x, "c2", padding=1), p["inorm.weight"], p["inorm.bias"])
    return btjit.cross_entropy(linear(p, btjit.leaky_relu(x, 0.2).mean(dim=(2, 3)), "fc"), y)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_group_norm_and_instance_norm(dtype):
    run_against_torch(NormNet(), norm_loss, (3, 7, 6), dtype=dtype, opt="adam")


# --- NHWC images (TensorFlow's layout) transposed by the user -----------------------------------------------
def nhwc_loss(p, x, y):
    return lenet_loss(p, x.permute(0, 3, 1, 2), y)


def nhwc_numpy_loss(p, x, y):
    return lenet_loss(p, np.transpose(x, (0, 3, 1, 2)), y)


@pytest.mark.parametrize("fn", [nhwc_loss, nhwc_numpy_loss])
def test_nhwc_input_transposed(fn):
    run_against_torch(LeNet5(), fn, (28, 28, 1), nhwc=True, B=2, steps=3)


# --- a tiny U-Net (conv_transpose2d and interpolate upsampling, skip features concatenated) -------------------
class TinyUNet(nn.Module):
    def __init__(self, up="transpose", padding_mode="zeros"):
        super().__init__()
        self.mode = up
        self.enc1 = nn.Conv2d(3, 4, 3, padding=1, padding_mode=padding_mode)
        self.enc2 = nn.Conv2d(4, 8, 3, padding=1)
        if up == "transpose":
            self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.dec = nn.Conv2d(8, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        if self.mode == "transpose":
            u = self.up(e2)
        elif self.mode == "nearest":
            u = F.interpolate(e2[:, :4], scale_factor=2)
        else:
            u = F.interpolate(e2[:, 4:], size=e1.shape[2:], mode="bilinear", align_corners=self.mode == "corners")
        d = F.relu(self.bn(self.dec(torch.cat([u, e1], dim=1))))
        return self.head(d)                                    # per-pixel logits (N, 3, H, W)


def unet_loss(up, padding_mode="zeros"):
    def loss(p, x, y):
        e1 = btjit.relu(conv(p, x, "enc1", padding=1, padding_mode=padding_mode))
        e2 = btjit.relu(conv(p, btjit.max_pool2d(e1, 2), "enc2", padding=1))
        if up == "transpose":
            u = btjit.conv_transpose2d(e2, p["up.weight"], p["up.bias"], stride=2)
        elif up == "nearest":
            u = btjit.interpolate(e2[:, :4], scale_factor=2)
        else:
            u = btjit.interpolate(e2[:, 4:], size=e1.shape[2:], mode="bilinear", align_corners=up == "corners")
        d = btjit.relu(bn(p, btjit.conv2d(btjit.cat([u, e1], dim=1), p["dec.weight"], padding=1), "bn"))
        return btjit.cross_entropy(conv(p, d, "head"), y)       # torch's (N, C, H, W) logits, (N, H, W) targets
    return loss


@pytest.mark.parametrize("up,shape", [("transpose", (3, 8, 10)), ("nearest", (3, 8, 6)), ("bilinear", (3, 11, 9)),
                                      ("corners", (3, 7, 8))])
def test_tiny_unet(up, shape):
    run_against_torch(TinyUNet(up), unet_loss(up), shape, classes=3, B=2, opt="adam", pixels=True)


def test_tiny_unet_float32_reflect_padding():
    run_against_torch(TinyUNet("bilinear", "reflect"), unet_loss("bilinear", "reflect"), (3, 9, 8), classes=3, B=2,
                      dtype="float32", pixels=True)


# --- torch's spellings, and bad shapes: errors naming the problem and the user's line -----------------------
def test_torch_keywords_as_written():
    """F.relu(x, inplace=True) (the value returned), F.conv2d(x, w, bias=b), x.mean([2, 3]), avg_pool2d over
    x.size()[2:] (a global average), batch_norm's running statistics by keyword."""
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(4, 3, 3, 3)), "b": rng.normal(size=4), "g": np.ones(4), "h": np.zeros(4)}
    x = rng.normal(size=(2, 3, 6, 5))

    def fn(p, x):
        x = btjit.relu(btjit.conv2d(x, p["w"], bias=p["b"], padding=1), inplace=True)
        x = btjit.batch_norm(x, running_mean=p["rm"], running_var=p["rv"], weight=p["g"], bias=p["h"])
        return btjit.sum(btjit.avg_pool2d(x, x.size()[2:]).flatten(1) * x.mean([2, 3]))
    prog = btjit.trace(fn, p, x, grad=True, dtype="float64", buffers={"rm": np.zeros(4), "rv": np.ones(4)})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    y = F.batch_norm(F.relu(F.conv2d(torch.tensor(x), t["w"], bias=t["b"], padding=1), inplace=True), None, None,
                     t["g"], t["h"], training=True)
    want = (F.avg_pool2d(y, y.size()[2:]).flatten(1) * y.mean([2, 3])).sum()
    want.backward()
    _close(prog.value_and_grad(x), want.item(), 1e-10, "loss")
    for k in p:
        _close(prog.grads[k], t[k].grad.numpy(), 1e-10, k)


@pytest.mark.parametrize("call,message", [
    (lambda p, x: btjit.conv2d(x, np.zeros((8, 4, 3, 3))),           # RGB images into a 4-channel conv
     "conv2d: x has 3 channels but w has 4 input channels: w must be (8, 3, kh, kw)"),
    (lambda p, x: btjit.conv2d(x, np.zeros((8, 3, 7, 7)), padding=1),   # the kernel larger than the padded input
     "window 7 (stride 1, dilation 1, padding 1+1) gives no output on a size-4 axis"),
    (lambda p, x: btjit.conv2d(x, np.zeros((8, 1, 3, 3)), groups=2),   # groups not dividing the channels
     "groups=2 must be a positive int dividing both the input's 3 channels and w's 8 output channels"),
    (lambda p, x: btjit.conv2d(x, np.zeros((6, 1, 3, 3)), groups=3, padding="same")[:, :5] @ np.zeros((5, 4)),
     "matmul: shapes (2, 5, 5, 4) and (5, 4) do not align"),
    (lambda p, x: btjit.conv1d(x[:, :, 0], np.zeros((4, 2, 3))),
     "conv1d: x has 3 channels but w has 2 input channels: w must be (4, 3, k) for 3 channels and groups=1 "
     "(input shapes (2, 3, 4) and (4, 2, 3))"),
    (lambda p, x: btjit.max_pool2d(x, 3, stride=2, padding=2), "at most half the kernel size"),
    (lambda p, x: btjit.batch_norm(x, p["rm"], p["rv"], p["g"], p["h"]),     # torch's positional order
     "batch_norm: running_mean must be a buffer"),
    (lambda p, x: btjit.conv2d(x, np.zeros((4, 3, 1, 1)), p["h"][:4], bias=p["h"][:4]), "given twice"),
])
def test_bad_shapes_name_the_problem_and_the_line(call, message):
    def fn(p, x):
        return btjit.sum(call(p, x))
    p = {"g": np.ones(3), "h": np.zeros(3)}
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(fn, p, np.zeros((2, 3, 5, 4)), grad=False, buffers={"rm": np.zeros(3), "rv": np.ones(3)})
    assert message in str(e.value) and "test_cnn_zoo.py:" in str(e.value), str(e.value)
