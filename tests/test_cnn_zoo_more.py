"""More small public CNNs written against btjit's API as their authors write them, each beside the same net in
torch (tests/cnn_zoo_harness.py's run_against_torch): a 1-D conv net, a squeeze-and-excitation block, GroupNorm /
InstanceNorm nets, a tiny U-Net (transposed, nearest and bilinear upsampling, reflect padding),
torch's keywords as written, and the errors of bad shapes."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
from cnn_zoo_harness import bn, close, conv, linear, run_against_torch  # noqa: E402
nn, F = torch.nn, torch.nn.functional


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
    close(prog.value_and_grad(x), want.item(), 1e-10, "loss")
    for k in p:
        close(prog.grads[k], t[k].grad.numpy(), 1e-10, k)


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
    assert message in str(e.value) and "test_cnn_zoo_more.py:" in str(e.value), str(e.value)
