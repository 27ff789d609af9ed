"""Modern CNN blocks as their authors write them, beside the same net in torch (tests/test_vit_and_blocks.py's
against_torch: float64 loss, every gradient, AdamW steps, params and running statistics, prog.eval against
model.eval(); float32 with SGD momentum; bf16 products training):

1. ConvNeXt (facebookresearch/ConvNeXt): the stem's channels_first LayerNorm written out (weight[:, None, None]),
   the block's depthwise 7x7 conv, permute to NHWC, LayerNorm, Linear 4x, GELU, Linear, layer scale gamma,
   permute back, residual and timm's drop_path (x.new_empty(shape).bernoulli_(keep_prob), random_tensor.div_()),
   or the same written as x * (torch.rand(B, 1, 1, 1) >= p) / (1 - p): its statistics and the eval identity.
2. torchvision's ResNeXt Bottleneck (grouped 3x3 conv, BatchNorm2d with running statistics, strided 1x1
   projection shortcut, out += identity).
3. torchvision's DenseNet block (torch.cat of every earlier feature map, BN-ReLU-Conv, transition) and a
   MobileNetV3 block (hardswish, torchvision's SqueezeExcitation with hardsigmoid, depthwise stride 2).
4. Kim's text CNN, as Shawn1993/cnn-text-classification-pytorch writes it (Conv2d over (K, D) windows,
   F.max_pool1d(x, x.size(2)).squeeze(2)) and with Conv1d and x.max(dim=2)[0]."""
import numpy as np
import pytest

import btjit
from test_vit_and_blocks import against_torch, images, learns, linear

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


def bn(p, x, name):
    return btjit.batch_norm(x, p[name + ".weight"], p[name + ".bias"], p[name + ".running_mean"],
                            p[name + ".running_var"])


def conv(p, x, name, **kw):
    return btjit.conv2d(x, p[name + ".weight"], p.get(name + ".bias"), **kw)


# --- 1. ConvNeXt --------------------------------------------------------------------------------------------------
def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """timm's drop_path, as written there (torch and btjit values alike)."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class ChannelsFirstLayerNorm(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.bias = nn.Parameter(1 + 0.1 * torch.randn(c)), nn.Parameter(0.1 * torch.randn(c))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, drop_path=0.0, layer_scale_init_value=0.5):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale_init_value * torch.ones((dim)))
        self.drop_path = drop_path

    def forward(self, x):
        input = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        x = (self.gamma * x).permute(0, 3, 1, 2)
        return input + drop_path(x, self.drop_path, self.training)


class ConvNeXt(nn.Module):
    def __init__(self, dim=16, depth=2, drop_path=0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, kernel_size=4, stride=4), ChannelsFirstLayerNorm(dim))
        self.stages = nn.Sequential(*[ConvNeXtBlock(dim, drop_path) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(self.norm(self.stages(self.stem(x)).mean([-2, -1])))


def convnext_loss(depth=2, p_drop=0.0):
    def block(p, x, name):
        input = x
        x = conv(p, x, name + ".dwconv", padding=3, groups=x.shape[1]).permute(0, 2, 3, 1)
        x = btjit.layer_norm(x, (x.shape[-1],), p[name + ".norm.weight"], p[name + ".norm.bias"], 1e-6)
        x = linear(p, btjit.gelu(linear(p, x, name + ".pwconv1")), name + ".pwconv2")
        x = (p[name + ".gamma"] * x).permute(0, 3, 1, 2)
        return input + drop_path(x, p_drop, btjit.is_training())

    def loss(p, x, y):
        x = conv(p, x, "stem.0", stride=4)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / btjit.sqrt(s + 1e-6)
        x = p["stem.1.weight"][:, None, None] * x + p["stem.1.bias"][:, None, None]
        for i in range(depth):
            x = block(p, x, f"stages.{i}")
        x = btjit.layer_norm(x.mean([-2, -1]), p["norm.weight"], p["norm.bias"], 1e-6)
        return btjit.cross_entropy(linear(p, x, "head"), y)
    return loss


@pytest.mark.parametrize("dtype,opt", [("float64", "adamw"), ("float32", "sgd")])
def test_convnext(dtype, opt):
    torch.manual_seed(0)
    against_torch(ConvNeXt(), convnext_loss(), images((3, 16, 16)), dtype=dtype, opt=opt)


def test_convnext_drop_path_eval_and_bf16():
    torch.manual_seed(0)
    prog = against_torch(ConvNeXt(drop_path=0.5), convnext_loss(p_drop=0.5), images((3, 16, 16), n=1))
    x, y = images((3, 16, 16), n=1, seed=2)[0]
    assert abs(prog.step(x, y) - prog.eval(x, y)) > 1e-6         # the paths are dropped while training
    torch.manual_seed(0)
    learns(ConvNeXt(drop_path=0.1), convnext_loss(p_drop=0.1), x)


@pytest.mark.parametrize("spelling", ["timm", "rand"])
def test_drop_path_statistics(spelling):
    """Per sample, the branch is kept with probability 1 - p and then scaled by 1 / (1 - p); the same sample's
    every element shares the draw; eval is the identity; new draws every step."""
    p_drop, B = 0.3, 4000

    def fn(p, x):
        if spelling == "timm":
            out = drop_path(x, p_drop, btjit.is_training())
        else:
            out = x * (btjit.rand(x.shape[0], 1, 1, 1) >= p_drop) / (1 - p_drop) if btjit.is_training() else x
        return btjit.sum(out * p["w"]), {"dropped": out}
    x = np.ones((B, 2, 3, 3))
    prog = btjit.trace(fn, {"w": np.ones(())}, x, grad=True, dtype="float64")
    prog.value_and_grad(x)
    out = prog.outputs["dropped"].reshape(B, -1)
    assert (out == out[:, :1]).all() and set(np.unique(out)) == {0.0, 1 / (1 - p_drop)}
    kept = (out[:, 0] > 0).mean()
    assert abs(kept - (1 - p_drop)) < 3 * np.sqrt(p_drop * (1 - p_drop) / B), kept
    np.testing.assert_allclose(prog.grads["w"], out.sum())
    first = out.copy()
    prog.value_and_grad(x)
    assert not np.array_equal(prog.outputs["dropped"].reshape(B, -1), first)
    assert prog.eval(x) == x.sum()                                 # the identity in eval mode


def test_an_output_named_out_is_refused():
    """(loss, {"out": h}) used to put h in the loss's place silently: prog.outputs["out"] is the returned value."""
    with pytest.raises(btjit.TraceError, match="an output named 'out' would replace the returned value"):
        btjit.trace(lambda p, x: (btjit.sum(x * p["w"]), {"out": x * 2}), {"w": np.ones(())}, np.ones(3), grad=True)


# --- 2. ResNeXt bottleneck (torchvision's Bottleneck with groups and base_width) -------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=4, base_width=16):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1, self.bn1 = nn.Conv2d(inplanes, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu, self.downsample = nn.ReLU(inplace=True), downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNeXt(nn.Module):
    def __init__(self, groups=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        down = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
        self.layer1 = nn.Sequential(Bottleneck(16, 8, 2, down, groups), Bottleneck(32, 8, 1, None, groups))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.layer1(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1))


def resnext_loss(groups=4):
    def bottleneck(p, x, name, stride):
        identity = x
        out = btjit.relu(bn(p, conv(p, x, name + ".conv1"), name + ".bn1"), inplace=True)
        out = btjit.relu(bn(p, conv(p, out, name + ".conv2", stride=stride, padding=1, groups=groups), name + ".bn2"))
        out = bn(p, conv(p, out, name + ".conv3"), name + ".bn3")
        if name + ".downsample.0.weight" in p:
            identity = bn(p, conv(p, x, name + ".downsample.0", stride=stride), name + ".downsample.1")
        out += identity
        return btjit.relu(out)

    def loss(p, x, y):
        x = btjit.relu(bn(p, conv(p, x, "conv1", padding=1), "bn1"))
        x = bottleneck(p, bottleneck(p, x, "layer1.0", 2), "layer1.1", 1)
        return btjit.cross_entropy(linear(p, btjit.flatten(btjit.adaptive_avg_pool2d(x, (1, 1)), 1), "fc"), y)
    return loss


@pytest.mark.parametrize("dtype,opt", [("float64", "adamw"), ("float32", "sgd")])
def test_resnext_bottleneck(dtype, opt):
    torch.manual_seed(0)
    against_torch(ResNeXt(), resnext_loss(), images((3, 12, 12)), dtype=dtype, opt=opt)


# --- 3. DenseNet block and MobileNetV3 block ------------------------------------------------------------------------
class DenseLayer(nn.Module):                  # torchvision's _DenseLayer (memory_efficient=False)
    def __init__(self, cin, growth, bn_size, drop_rate):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)
        self.drop_rate = drop_rate

    def forward(self, prev_features):
        bottleneck_output = self.conv1(self.relu1(self.norm1(torch.cat(prev_features, 1))))
        new_features = self.conv2(self.relu2(self.norm2(bottleneck_output)))
        return F.dropout(new_features, p=self.drop_rate, training=self.training)


class DenseNet(nn.Module):
    def __init__(self, growth=4, layers=3, bn_size=2, drop=0.0):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.block = nn.ModuleList([DenseLayer(8 + i * growth, growth, bn_size, drop) for i in range(layers)])
        c = 8 + layers * growth
        self.trans_norm, self.trans_conv = nn.BatchNorm2d(c), nn.Conv2d(c, c // 2, 1, bias=False)
        self.norm5, self.classifier = nn.BatchNorm2d(c // 2), nn.Linear(c // 2, 10)

    def forward(self, x):
        features = [self.conv0(x)]
        for layer in self.block:                                  # _DenseBlock.forward
            features.append(layer(features))
        x = F.avg_pool2d(self.trans_conv(F.relu(self.trans_norm(torch.cat(features, 1)))), kernel_size=2, stride=2)
        out = F.adaptive_avg_pool2d(F.relu(self.norm5(x), inplace=True), (1, 1))
        return self.classifier(torch.flatten(out, 1))


def densenet_loss(layers=3, drop=0.0):
    def loss(p, x, y):
        features = [conv(p, x, "conv0", padding=1)]
        for i in range(layers):
            n = f"block.{i}"
            h = conv(p, btjit.relu(bn(p, btjit.cat(features, 1), n + ".norm1")), n + ".conv1")
            new = conv(p, btjit.relu(bn(p, h, n + ".norm2")), n + ".conv2", padding=1)
            features.append(btjit.dropout(new, p=drop))
        x = btjit.relu(bn(p, btjit.cat(features, 1), "trans_norm"))
        x = btjit.avg_pool2d(conv(p, x, "trans_conv"), kernel_size=2, stride=2)
        out = btjit.adaptive_avg_pool2d(btjit.relu(bn(p, x, "norm5"), inplace=True), (1, 1))
        return btjit.cross_entropy(linear(p, btjit.flatten(out, 1), "classifier"), y)
    return loss


class SqueezeExcitation(nn.Module):           # torchvision.ops.SqueezeExcitation, MobileNetV3's hardsigmoid scale
    def __init__(self, cin, csq):
        super().__init__()
        self.avgpool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, csq, 1), nn.Conv2d(csq, cin, 1)

    def forward(self, input):
        return F.hardsigmoid(self.fc2(F.relu(self.fc1(self.avgpool(input))))) * input


class InvertedResidualV3(nn.Module):
    def __init__(self, cin, exp, cout, k, stride):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        self.expand = nn.Sequential(nn.Conv2d(cin, exp, 1, bias=False), nn.BatchNorm2d(exp), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(exp, exp, k, stride, (k - 1) // 2, groups=exp, bias=False),
                                nn.BatchNorm2d(exp), nn.Hardswish())
        self.se = SqueezeExcitation(exp, exp // 4)
        self.project = nn.Sequential(nn.Conv2d(exp, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        r = self.project(self.se(self.dw(self.expand(x))))
        return r + x if self.use_res_connect else r


class MobileNetV3(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1, self.b2 = InvertedResidualV3(8, 24, 12, 3, 2), InvertedResidualV3(12, 36, 12, 5, 1)
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.b2(self.b1(x)), 1).flatten(1))


def mbv3_loss(p, x, y):
    def block(x, n, k, stride):
        r = btjit.hardswish(bn(p, conv(p, x, n + ".expand.0"), n + ".expand.1"))
        r = conv(p, r, n + ".dw.0", stride=stride, padding=(k - 1) // 2, groups=r.shape[1])
        r = btjit.hardswish(bn(p, r, n + ".dw.1"))
        s = conv(p, btjit.relu(conv(p, btjit.adaptive_avg_pool2d(r, 1), n + ".se.fc1")), n + ".se.fc2")
        r = bn(p, conv(p, btjit.hardsigmoid(s) * r, n + ".project.0"), n + ".project.1")
        return r + x if stride == 1 and x.shape[1] == r.shape[1] else r
    x = block(block(x, "b1", 3, 2), "b2", 5, 1)
    return btjit.cross_entropy(linear(p, btjit.adaptive_avg_pool2d(x, 1).flatten(1), "fc"), y)


@pytest.mark.parametrize("dtype,opt", [("float64", "adamw"), ("float32", "sgd")])
def test_densenet_block(dtype, opt):
    torch.manual_seed(0)
    against_torch(DenseNet(), densenet_loss(), images((3, 8, 8)), dtype=dtype, opt=opt)


def test_densenet_dropout_eval_and_bf16():
    torch.manual_seed(0)
    against_torch(DenseNet(drop=0.2), densenet_loss(drop=0.2), images((3, 8, 8), n=1))
    torch.manual_seed(0)
    learns(DenseNet(drop=0.1), densenet_loss(drop=0.1), images((3, 8, 8), n=1)[0][0])


@pytest.mark.parametrize("dtype,opt", [("float64", "adamw"), ("float32", "sgd")])
def test_mobilenet_v3_block(dtype, opt):
    torch.manual_seed(0)
    against_torch(MobileNetV3(), mbv3_loss, images((8, 12, 12)), dtype=dtype, opt=opt)


@pytest.mark.parametrize("net,loss", [(ResNeXt, resnext_loss()), (MobileNetV3, mbv3_loss)], ids=["resnext", "mbv3"])
def test_blocks_bf16_train(net, loss):
    torch.manual_seed(0)
    learns(net(), loss, images((3 if net is ResNeXt else 8, 12, 12), n=1)[0][0])


# --- 4. Kim's text CNN -----------------------------------------------------------------------------------------------
class CNN_Text(nn.Module):
    def __init__(self, V=30, D=12, C=4, Co=6, Ks=(2, 3, 4), kind="conv2d", drop=0.0):
        super().__init__()
        self.kind, self.embed = kind, nn.Embedding(V, D)
        self.convs1 = nn.ModuleList([nn.Conv2d(1, Co, (K, D)) if kind == "conv2d" else nn.Conv1d(D, Co, K)
                                     for K in Ks])
        self.dropout, self.fc1 = nn.Dropout(drop), nn.Linear(len(Ks) * Co, C)

    def forward(self, x):
        x = self.embed(x)  # (N, W, D)
        if self.kind == "conv2d":
            x = x.unsqueeze(1)  # (N, Ci, W, D)
            x = [F.relu(conv(x)).squeeze(3) for conv in self.convs1]  # [(N, Co, W), ...]*len(Ks)
            x = [F.max_pool1d(i, i.size(2)).squeeze(2) for i in x]  # [(N, Co), ...]*len(Ks)
        else:
            x = [F.relu(conv(x.permute(0, 2, 1))) for conv in self.convs1]
            x = [i.max(dim=2)[0] for i in x]
        return self.fc1(self.dropout(torch.cat(x, 1)))


def textcnn_loss(kind="conv2d", drop=0.0, n=3):
    def loss(p, x, y):
        x = btjit.embedding(x, p["embed.weight"])
        if kind == "conv2d":
            x = x.unsqueeze(1)
            x = [btjit.relu(conv(p, x, f"convs1.{i}")).squeeze(3) for i in range(n)]
            x = [btjit.max_pool1d(i, i.size(2)).squeeze(2) for i in x]
        else:
            x = [btjit.relu(btjit.conv1d(x.permute(0, 2, 1), p[f"convs1.{i}.weight"], p[f"convs1.{i}.bias"]))
                 for i in range(n)]
            x = [i.max(dim=2)[0] for i in x]
        return btjit.cross_entropy(linear(p, btjit.dropout(btjit.cat(x, 1), drop), "fc1"), y)
    return loss


def tokens(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 30, (8, 10)).astype(np.int32), rng.integers(0, 4, 8).astype(np.int32)) for _ in range(n)]


@pytest.mark.parametrize("kind", ["conv2d", "conv1d"])
@pytest.mark.parametrize("dtype,opt", [("float64", "adamw"), ("float32", "sgd")])
def test_kim_text_cnn(kind, dtype, opt):
    torch.manual_seed(0)
    against_torch(CNN_Text(kind=kind), textcnn_loss(kind), tokens(), dtype=dtype, opt=opt)


def test_kim_text_cnn_dropout_eval_and_bf16():
    torch.manual_seed(0)
    against_torch(CNN_Text(drop=0.5), textcnn_loss(drop=0.5), tokens(1))
    torch.manual_seed(0)
    learns(CNN_Text(kind="conv1d", drop=0.5), textcnn_loss("conv1d", drop=0.5), tokens(1)[0][0], classes=4)
