"""Vision transformers as their authors write them, beside the same net in torch (float64: the loss and every
gradient at each step of a short AdamW or SGD-momentum trajectory, the params after it, prog.eval against
model.eval() with the dropouts on; float32; bf16 products training), and the torch spellings they use:

1. timm's VisionTransformer at toy size: patch embedding by a strided conv or by a reshape/permute "rearrange" and
   a Linear, the cls token expanded over the batch and concatenated, a learnable position embedding, pre-norm
   blocks with attention written by hand (qkv reshaped to (B, N, 3, heads, hd), permuted, unbound) or by
   F.scaled_dot_product_attention, a GELU MLP, dropout, the final LayerNorm, the cls token or mean pooling.
2. lucidrains' vit-pytorch ViT with einops (rearrange, repeat) and F.linear.
3. torch's in-place methods (timm's DropPath: x.new_empty(shape).bernoulli_(keep).div_(keep); LayerScale's
   x.mul_(gamma)), torch.rand / randn / bernoulli, x.repeat(*sizes), x.new_*, x.to(), narrow, unflatten.
The CNN blocks (ConvNeXt, ResNeXt, DenseNet, MobileNetV3, Kim's text CNN) are in tests/test_cnn_blocks.py."""
import types

import numpy as np
import pytest

import btjit
import btjit.testing
from cnn_zoo_harness import close as _close

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
TOL = {"float64": 1e-10, "float32": 1e-4}


def against_torch(net, loss, batches, dtype="float64", opt="adamw"):
    """net: a torch module; loss(p, x, y): the same net in btjit over net's state_dict names. Trains both on
    batches[:-1], comparing the loss and every gradient at each step, then the params and buffers; then
    prog.eval against model.eval() on the last batch. Returns the program."""
    net = net.to(getattr(torch, dtype)).train()
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    bufs = {k: v.numpy().copy() for k, v in net.named_buffers() if not k.endswith("num_batches_tracked")}
    if opt == "sgd":
        topt, bopt = torch.optim.SGD(net.parameters(), 0.05, momentum=0.9), btjit.optim.SGD(0.05, momentum=0.9)
    else:
        topt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05)
        bopt = btjit.optim.AdamW(1e-2, weight_decay=0.05)
    batches = [(x.astype(dtype) if x.dtype.kind == "f" else x, y) for x, y in batches]
    prog = btjit.trace(loss, params, *batches[0], optimizer=bopt, dtype=dtype, buffers=bufs)
    tol = TOL[dtype]

    def tloss(x, y):
        x = torch.tensor(x) if x.dtype.kind == "f" else torch.tensor(x).long()
        return F.cross_entropy(net(x), torch.tensor(y).long())
    for x, y in batches[:-1]:
        topt.zero_grad()
        want = tloss(x, y)
        want.backward()
        _close(prog.step(x, y), want.item(), tol, "loss")
        for k, v in net.named_parameters():
            _close(prog.grads[k], v.grad.numpy(), tol * 10, "grad " + k)
        topt.step()
    for k, v in net.named_parameters():
        _close(prog.params[k], v.detach().numpy(), tol * 10, k)
    for k, v in net.named_buffers():
        if k in bufs:
            _close(prog.buffers[k], v.numpy(), tol * 10, k)
    net.eval()
    with torch.no_grad():
        _close(prog.eval(*batches[-1]), tloss(*batches[-1]).item(), tol * 10, "eval loss")
    return prog


def images(shape, n=4, B=8, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(B,) + shape), rng.integers(0, classes, B).astype(np.int32)) for _ in range(n)]


def learns(net, loss, x, classes=10, steps=20, **kw):
    """precision="bf16" on a learnable toy task (labels a fixed linear function of x): the loss falls."""
    params = {k: v.detach().float().numpy().copy() for k, v in net.named_parameters()}
    bufs = {k: v.float().numpy().copy() for k, v in net.named_buffers() if not k.endswith("num_batches_tracked")}
    x = x.astype(np.float32) if x.dtype.kind == "f" else x
    y = ((x.reshape(len(x), -1) @ np.random.default_rng(1).normal(size=(x[0].size, classes))).argmax(1)
         if x.dtype.kind == "f" else x[:, 0] % classes).astype(np.int32)
    prog = btjit.trace(loss, params, x, y, optimizer=btjit.optim.AdamW(3e-3), buffers=bufs, precision="bf16", **kw)
    losses = [prog.step(x, y) for _ in range(steps)]
    assert prog.precision.startswith("bf16") and np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses
    return prog


def linear(p, x, name):                       # nn.Linear as the module calls it
    return btjit.linear(x, p[name + ".weight"], p[name + ".bias"])


def ln(p, x, name, eps=1e-5):
    return btjit.layer_norm(x, p[name + ".weight"], p[name + ".bias"], eps)


# --- 1. timm's VisionTransformer (toy size) --------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim, heads, sdpa, drop):
        super().__init__()
        self.num_heads, self.head_dim, self.fused_attn = heads, dim // heads, sdpa
        self.scale = self.head_dim ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.attn_drop, self.proj_drop = nn.Dropout(drop), nn.Dropout(drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


class Block(nn.Module):
    def __init__(self, dim, heads, sdpa, drop):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), Attention(dim, heads, sdpa, drop), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(drop), nn.Linear(4 * dim, dim),
                                 nn.Dropout(drop))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img=16, patch=4, cin=1, dim=32, depth=2, heads=4, sdpa=False, embed="conv", pool="cls",
                 drop=0.0):
        super().__init__()
        self.patch, self.embed, self.pool = patch, embed, pool
        self.patch_embed = (nn.Conv2d(cin, dim, patch, stride=patch) if embed == "conv" else
                            nn.Linear(patch * patch * cin, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(drop)
        self.blocks = nn.Sequential(*[Block(dim, heads, sdpa, drop) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x):
        B, C, H, W = x.shape
        if self.embed == "conv":
            x = self.patch_embed(x).flatten(2).transpose(1, 2)
        else:
            p = self.patch
            x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).reshape(B, -1, p * p * C)
            x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = self.norm(self.blocks(self.pos_drop(x + self.pos_embed)))
        return self.head(x[:, 0] if self.pool == "cls" else x.mean(dim=1))


def vit_loss(heads=4, sdpa=False, embed="conv", pool="cls", drop=0.0, patch=4, depth=2, **_):
    def attention(p, x, name):
        B, N, C = x.shape
        qkv = linear(p, x, name + ".qkv").reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if sdpa:
            x = btjit.scaled_dot_product_attention(q, k, v, dropout_p=drop if btjit.is_training() else 0.0)
        else:
            q = q * (C // heads) ** -0.5
            attn = q @ k.transpose(-2, -1)
            attn = btjit.dropout(attn.softmax(dim=-1), drop)
            x = attn @ v
        return btjit.dropout(linear(p, x.transpose(1, 2).reshape(B, N, C), name + ".proj"), drop)

    def mlp(p, x, name):
        x = btjit.dropout(btjit.gelu(linear(p, x, name + ".0")), drop)
        return btjit.dropout(linear(p, x, name + ".3"), drop)

    def loss(p, x, y):
        B, C, H, W = x.shape
        if embed == "conv":
            x = btjit.conv2d(x, p["patch_embed.weight"], p["patch_embed.bias"], stride=patch).flatten(2)
            x = x.transpose(1, 2)
        else:
            P = patch
            x = x.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 3, 5, 1).reshape(B, -1, P * P * C)
            x = linear(p, x, "patch_embed")
        x = btjit.cat((p["cls_token"].expand(B, -1, -1), x), dim=1)
        x = btjit.dropout(x + p["pos_embed"], drop)
        for i in range(depth):
            x = x + attention(p, ln(p, x, f"blocks.{i}.norm1"), f"blocks.{i}.attn")
            x = x + mlp(p, ln(p, x, f"blocks.{i}.norm2"), f"blocks.{i}.mlp")
        x = ln(p, x, "norm")
        return btjit.cross_entropy(linear(p, x[:, 0] if pool == "cls" else x.mean(dim=1), "head"), y)
    return loss


VITS = [dict(), dict(sdpa=True), dict(embed="rearrange", pool="mean"), dict(embed="rearrange", sdpa=True)]


@pytest.mark.parametrize("cfg", VITS, ids=["conv-hand-cls", "conv-sdpa-cls", "rearrange-hand-mean",
                                           "rearrange-sdpa-cls"])
def test_timm_vit_float64_adamw(cfg):
    torch.manual_seed(0)
    against_torch(ViT(**cfg), vit_loss(**cfg), images((1, 16, 16)))


@pytest.mark.parametrize("cfg", VITS[:2], ids=["hand", "sdpa"])
def test_timm_vit_float32(cfg):
    # SGD: the k bias has a gradient of exactly zero in theory (a constant added to every score of a query), and
    # Adam would turn float32's rounding of it into whole steps
    torch.manual_seed(0)
    against_torch(ViT(**cfg), vit_loss(**cfg), images((1, 16, 16)), dtype="float32", opt="sgd")


@pytest.mark.parametrize("sdpa", [False, True])
def test_timm_vit_dropout_eval_and_gradient(sdpa):
    """The dropouts (attention probabilities, projections, MLP, position embedding) on: prog.eval is
    model.eval(); a training step draws; its gradients are the finite differences' of the same masks."""
    torch.manual_seed(0)
    cfg = dict(img=8, sdpa=sdpa, drop=0.2, embed="rearrange", depth=1, dim=16, heads=2)
    prog = against_torch(ViT(**cfg), vit_loss(**cfg), images((1, 8, 8), n=1))
    x, y = images((1, 8, 8), n=1, seed=3)[0]
    assert abs(prog.step(x, y) - prog.eval(x, y)) > 1e-6
    torch.manual_seed(0)
    params = {k: v.detach().double().numpy() for k, v in ViT(**cfg).named_parameters()}
    assert btjit.testing.check_grads(vit_loss(**cfg), params, x, y, seed=1) < 1e-5


def test_timm_vit_rgb_32x32_dim64():
    torch.manual_seed(0)
    cfg = dict(img=32, cin=3, dim=64, sdpa=True)
    against_torch(ViT(**cfg), vit_loss(**cfg), images((3, 32, 32)))


@pytest.mark.parametrize("cfg", [dict(drop=0.1), dict(sdpa=True, embed="rearrange", pool="mean", drop=0.1)])
def test_timm_vit_bf16_trains(cfg):
    torch.manual_seed(0)
    learns(ViT(**cfg), vit_loss(**cfg), np.random.default_rng(0).normal(size=(8, 1, 16, 16)))


# --- 2. lucidrains' vit-pytorch ViT (einops' rearrange and repeat, F.linear) ---------------------------------------
class LucidAttention(nn.Module):
    def __init__(self, dim, heads, dim_head, dropout):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.norm, self.attend, self.dropout = nn.LayerNorm(dim), nn.Softmax(dim=-1), nn.Dropout(dropout)
        self.to_qkv = nn.Linear(dim, dim_head * heads * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim_head * heads, dim), nn.Dropout(dropout))

    def forward(self, x):
        einops = pytest.importorskip("einops")
        qkv = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = map(lambda t: einops.rearrange(t, "b n (h d) -> b h n d", h=self.heads), qkv)
        attn = self.dropout(self.attend(torch.matmul(q, k.transpose(-1, -2)) * self.scale))
        return self.to_out(einops.rearrange(torch.matmul(attn, v), "b h n d -> b n (h d)"))


class LucidViT(nn.Module):
    def __init__(self, image_size=16, patch_size=4, dim=32, depth=2, heads=4, dim_head=8, mlp_dim=64, channels=1,
                 dropout=0.0, emb_dropout=0.0):
        super().__init__()
        patch_dim, self.p = channels * patch_size ** 2, patch_size
        self.to_patch_embedding = nn.Sequential(nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim), nn.LayerNorm(dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2 + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.dropout = nn.Dropout(emb_dropout)
        self.layers = nn.ModuleList([nn.ModuleList([LucidAttention(dim, heads, dim_head, dropout), nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim),
            nn.Dropout(dropout))]) for _ in range(depth)])
        self.norm, self.mlp_head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, img):
        einops = pytest.importorskip("einops")
        x = einops.rearrange(img, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=self.p, p2=self.p)
        x = self.to_patch_embedding(x)
        b, n, _ = x.shape
        x = torch.cat((einops.repeat(self.cls_token, "1 1 d -> b 1 d", b=b), x), dim=1)
        x += self.pos_embedding[:, :(n + 1)]
        x = self.dropout(x)
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.mlp_head(self.norm(x)[:, 0])


def lucid_loss(p, img, y, heads=4, depth=2, patch=4, drop=0.0):
    einops = pytest.importorskip("einops")
    x = einops.rearrange(img, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch, p2=patch)
    x = ln(p, linear(p, ln(p, x, "to_patch_embedding.0"), "to_patch_embedding.1"), "to_patch_embedding.2")
    b, n, _ = x.shape
    x = btjit.cat((einops.repeat(p["cls_token"], "1 1 d -> b 1 d", b=b), x), dim=1)
    x += p["pos_embedding"][:, :(n + 1)]
    x = btjit.dropout(x, drop)
    for i in range(depth):
        a = f"layers.{i}.0."
        qkv = btjit.linear(ln(p, x, a + "norm"), p[a + "to_qkv.weight"]).chunk(3, dim=-1)
        q, k, v = map(lambda t: einops.rearrange(t, "b n (h d) -> b h n d", h=heads), qkv)
        attn = btjit.dropout(btjit.softmax(btjit.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1), drop)
        x = btjit.dropout(linear(p, einops.rearrange(btjit.matmul(attn, v), "b h n d -> b n (h d)"), a + "to_out.0"),
                          drop) + x
        f = f"layers.{i}.1."
        h = btjit.dropout(btjit.gelu(linear(p, ln(p, x, f + "0"), f + "1")), drop)
        x = btjit.dropout(linear(p, h, f + "4"), drop) + x
    return btjit.cross_entropy(linear(p, ln(p, x, "norm")[:, 0], "mlp_head"), y)


def test_lucidrains_vit_with_einops():
    pytest.importorskip("einops")
    torch.manual_seed(0)
    against_torch(LucidViT(), lucid_loss, images((1, 16, 16)))
    torch.manual_seed(0)
    against_torch(LucidViT(dropout=0.1, emb_dropout=0.1), lambda p, x, y: lucid_loss(p, x, y, drop=0.1),
                  images((1, 16, 16), n=1))


# --- 3. torch's spellings: in-place methods, x.repeat(*sizes), x.new_*, to, narrow, unflatten, F.linear, einsum ----
TORCH_LIB = types.SimpleNamespace(linear=F.linear, einsum=torch.einsum)
SPELLINGS = {
    "in-place": lambda L, x, w: (x * 1).mul_(x).add_(x, alpha=2).div_(3).clamp_(-1, 2).sub_(w[0, :4]).tanh_(),
    "layer-scale": lambda L, x, w: (x * 2).mul_(w[1, :4]),        # timm's LayerScale(inplace=True)
    "repeat(*sizes)": lambda L, x, w: x.repeat(2, 1, 1) * x.repeat((2, 2, 1)).sum(1, keepdim=True) * w[0, 0],
    "new_*, fill_, copy_, zero_": lambda L, x, w: (x.new_ones(2, 3, 4).fill_(2.0) * x + x.new_full((4,), 3.0) +
                                                   x.new_zeros((3, 4)).copy_(w[:3, :4]) + x.clone().zero_()),
    "narrow, unflatten, to": lambda L, x, w: x.narrow(2, 1, 2).unflatten(1, (1, 3)).to(torch.float64).to(x.device)
    * w[0, 0],
    "F.linear": lambda L, x, w: L.linear(x, w, w[:, 0]) + L.linear(x, w[0] + 1)[..., None],
    "einsum": lambda L, x, w: L.einsum("bij,kj->bik", x, w) + L.einsum("bij,bkj->bik", [x, x]).sum(-1, keepdim=True),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_torch_spellings(name):
    fn = SPELLINGS[name]
    rng = np.random.default_rng(0)
    p = {"x": rng.normal(size=(2, 3, 4)), "w": rng.normal(size=(5, 4))}
    prog = btjit.trace(lambda p: btjit.sum(fn(btjit, p["x"], p["w"]) ** 2), p, grad=True, dtype="float64")
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    want = (fn(TORCH_LIB, t["x"], t["w"]) ** 2).sum()
    want.backward()
    _close(prog.value_and_grad(), want.item(), 1e-12, "loss")
    for k in p:
        _close(prog.grads[k], t[k].grad.numpy(), 1e-12, k)


def test_torch_random_spellings_statistics():
    """torch.rand(B, 1, 1, 1) / randn / bernoulli and x.new_empty(shape).bernoulli_(p), uniform_, normal_: the
    right shapes and distributions, new every step, no gradient."""
    def fn(p):
        x = p["w"] * 1.0
        out = {"rand": btjit.rand(4000, 1, 1, 1), "randn": btjit.randn((4000,), dtype=x.dtype, device=x.device),
               "bern": btjit.bernoulli(x.new_full((4000,), 0.25)), "bern_": x.new_empty(4000, 1).bernoulli_(0.7),
               "uniform_": x.new_empty(4000).uniform_(-2, 2), "normal_": x.new_zeros(4000).normal_(1.0, 3.0)}
        return btjit.sum(x * out["rand"].mean()), out
    prog = btjit.trace(fn, {"w": np.ones(3)}, grad=True, dtype="float64")
    prog.value_and_grad()
    o = {k: v.copy() for k, v in prog.outputs.items()}
    assert o["rand"].shape == (4000, 1, 1, 1) and 0 <= o["rand"].min() and o["rand"].max() < 1
    assert abs(o["rand"].mean() - 0.5) < 0.03 and abs(o["randn"].mean()) < 0.08 and abs(o["randn"].std() - 1) < 0.06
    assert set(np.unique(o["bern"])) == {0.0, 1.0} and abs(o["bern"].mean() - 0.25) < 0.03
    assert o["bern_"].shape == (4000, 1) and abs(o["bern_"].mean() - 0.7) < 0.03
    assert -2 <= o["uniform_"].min() and o["uniform_"].max() < 2 and abs(o["uniform_"].mean()) < 0.1
    assert abs(o["normal_"].mean() - 1.0) < 0.25 and abs(o["normal_"].std() - 3.0) < 0.2
    np.testing.assert_allclose(prog.grads["w"], o["rand"].mean())
    prog.value_and_grad()
    assert not np.array_equal(prog.outputs["rand"], o["rand"])


@pytest.mark.parametrize("call,message", [
    (lambda x: x.add_(np.ones((5, 2, 3))), "add_: an in-place op keeps the shape (2, 3), its result is (5, 2, 3)"),
    (lambda x: x.frobnicate_(), "traced values have no attribute 'frobnicate_'"),
    (lambda x: x.to(torch.int64), "to: only float dtypes and devices, got torch.int64"),
    (lambda x: btjit.rand(2, 3, dtype=torch.int32), "rand: dtype must be a float one"),
    (lambda x: btjit.linear(x, np.ones((4, 2))), "linear: weight (4, 2) must be (out_features, 3)"),
])
def test_torch_spelling_errors(call, message):
    with pytest.raises((btjit.TraceError, AttributeError)) as e:
        btjit.trace(lambda p, x: btjit.sum(call(x)), {"w": np.ones(2)}, np.ones((2, 3)), grad=True)
    assert message in str(e.value) and "test_vit_and_blocks.py:" in str(e.value), str(e.value)
