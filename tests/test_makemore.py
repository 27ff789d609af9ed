"""makemore's six models (btjit/models/makemore.py) against torch modules written here with makemore.py's
architecture and parameter names (weights loaded into both: btjit's (in, out) weight = torch's Linear.weight
transposed), at makemore's default sizes (n_layer 4, n_head 4, n_embd 64, n_embd2 64, block 16, vocab 27) on
makemore-format batches of names.txt words (x: 0 then the word, y: the word, 0, then -1 padding): the loss and
every gradient in float32 and float64, a 10-step AdamW trajectory with makemore's settings (lr 5e-4, betas
0.9/0.99, weight decay 0.01), and the parameter counts. Skipped without torch."""
import math
import re

import numpy as np
import pytest

import btjit
from btjit.train import data as D
from btjit.models import makemore as M

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
torch.set_num_threads(1)

CFG = M.MakemoreConfig()


# ---- the torch references: makemore.py's modules ---------------------------------------------------------
class Bigram(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(c.vocab_size, c.vocab_size))

    def forward(self, idx):
        return self.logits[idx]


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab_size + 1, c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.block_size * c.n_embd, c.n_embd2), nn.Tanh(),
                                 nn.Linear(c.n_embd2, c.vocab_size))

    def forward(self, idx):
        embs = []
        for _ in range(self.c.block_size):
            embs.append(self.wte(idx))
            idx = torch.roll(idx, 1, 1)
            idx[:, 0] = self.c.vocab_size
        return self.mlp(torch.cat(embs, -1))


class RNNCell(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.xh_to_h = nn.Linear(c.n_embd + c.n_embd2, c.n_embd2)

    def forward(self, xt, hprev):
        return torch.tanh(self.xh_to_h(torch.cat([xt, hprev], 1)))


class GRUCell(nn.Module):
    def __init__(self, c):
        super().__init__()
        for g in ("z", "r", "hbar"):
            setattr(self, f"xh_to_{g}", nn.Linear(c.n_embd + c.n_embd2, c.n_embd2))

    def forward(self, xt, hprev):
        xh = torch.cat([xt, hprev], 1)
        r = torch.sigmoid(self.xh_to_r(xh))
        hbar = torch.tanh(self.xh_to_hbar(torch.cat([xt, r * hprev], 1)))
        z = torch.sigmoid(self.xh_to_z(xh))
        return (1 - z) * hprev + z * hbar


class RNN(nn.Module):
    def __init__(self, c, cell):
        super().__init__()
        self.start = nn.Parameter(torch.zeros(1, c.n_embd2))
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.cell = RNNCell(c) if cell == "rnn" else GRUCell(c)
        self.lm_head = nn.Linear(c.n_embd2, c.vocab_size)

    def forward(self, idx):
        b, t = idx.shape
        emb, h, hs = self.wte(idx), self.start.expand((b, -1)), []
        for i in range(t):
            h = self.cell(emb[:, i, :], h)
            hs.append(h)
        return self.lm_head(torch.stack(hs, 1))


class BoWBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(c.block_size, c.block_size)).view(1, c.block_size, -1))
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(c.n_embd, c.n_embd2), c_proj=nn.Linear(c.n_embd2, c.n_embd)))

    def forward(self, x):
        B, T, C = x.shape
        att = torch.zeros((B, T, T), dtype=x.dtype).masked_fill(self.bias[:, :T, :T] == 0, float("-inf"))
        x = x + F.softmax(att, dim=-1) @ x
        return x + self.mlp.c_proj(torch.tanh(self.mlp.c_fc(x)))


class BoW(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.context_block = BoWBlock(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]).unsqueeze(0))
        return self.lm_head(self.context_block(x))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head
        self.register_buffer("bias", torch.tril(torch.ones(c.block_size, c.block_size)).view(1, 1, c.block_size, -1))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c.n_embd), Attention(c), nn.LayerNorm(c.n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(c.n_embd, 4 * c.n_embd), c_proj=nn.Linear(4 * c.n_embd, c.n_embd)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = self.mlp.c_fc(self.ln_2(x))
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))   # NewGELU
        return x + self.mlp.c_proj(h)


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]), ln_f=nn.LayerNorm(c.n_embd)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx):
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1]).unsqueeze(0))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))


TORCH = {"bigram": Bigram, "makemore_mlp": MLP, "rnn": lambda c: RNN(c, "rnn"), "gru": lambda c: RNN(c, "gru"),
         "bow": BoW, "transformer": Transformer}


def torch_loss(model, x, y):
    logits = model(torch.tensor(x, dtype=torch.long))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), torch.tensor(y, dtype=torch.long).view(-1),
                           ignore_index=-1)


def torch_name(kind, name):
    """btjit parameter name -> makemore's state_dict key (and whether the array is transposed)."""
    if name in ("logits", "start"):
        return name, False
    stem, _, suffix = name.rpartition(".")
    key = f"{name}.weight" if name in ("wte", "wpe") else stem + {"w": ".weight", "b": ".bias", "g": ".weight"}[suffix]
    if kind == "transformer":
        key = re.sub(r"^h(\d+)\.", r"h.\1.", key)
        key = key if key.startswith("lm_head") else "transformer." + key
    return key, suffix == "w"


def build(kind, dtype, seed=0):
    """btjit's init with a little noise (the zero-initialised tables too), loaded into a torch module."""
    rng = np.random.default_rng(seed)
    params = {k: (v + rng.normal(0, 0.1, v.shape)).astype(dtype)
              for k, v in M.model(kind, CFG).init_params(seed).items()}
    ref = TORCH[kind](CFG).to(torch.float64 if dtype == np.float64 else torch.float32)
    sd = dict(ref.named_parameters())
    names = {torch_name(kind, k)[0]: k for k in params}
    assert set(names) == set(sd), set(names) ^ set(sd)
    with torch.no_grad():
        for k, v in params.items():
            key, t = torch_name(kind, k)
            ref.get_parameter(key).copy_(torch.tensor(v.T if t else v))
    return params, ref


def grad_of(ref, kind, name):
    key, t = torch_name(kind, name)
    g = ref.get_parameter(key).grad.numpy()
    return g.T if t else g


def makemore_batch(words, vocab, block_size):
    """makemore's CharDataset.__getitem__ for each word, stacked."""
    xs, ys = [], []
    for w in words:
        ix = [vocab.stoi[ch] for ch in w]
        x, y = np.zeros(block_size, np.int64), np.zeros(block_size, np.int64)
        x[1:1 + len(ix)], y[:len(ix)] = ix, ix
        y[len(ix) + 1:] = -1
        xs.append(x), ys.append(y)
    return np.array(xs, np.int32), np.array(ys, np.int32)


WORDS = D.corpus_text("names").split()
VOCAB = D.Vocab.from_words(WORDS)


def batches(n, B=4, seed=0):
    rng = np.random.default_rng(seed)
    return [makemore_batch([WORDS[i] for i in rng.integers(0, len(WORDS), B)], VOCAB, CFG.block_size) for _ in range(n)]


def test_the_data_is_makemores():
    assert len(VOCAB) == CFG.vocab_size and max(map(len, WORDS)) + 1 == CFG.block_size
    x, y = makemore_batch(["emma"], VOCAB, 8)
    assert x.tolist() == [[0, 5, 13, 13, 1, 0, 0, 0]] and y.tolist() == [[5, 13, 13, 1, 0, -1, -1, -1]]


@pytest.mark.parametrize("kind,n_params", [("bigram", 729), ("makemore_mlp", 69147), ("rnn", 11803),
                                           ("gru", 28315), ("bow", 12827), ("transformer", 204544)])
def test_parameter_counts_are_makemores(kind, n_params):
    assert sum(v.size for v in M.model(kind).init_params(0).values()) == n_params
    assert sum(p.numel() for p in TORCH[kind](CFG).parameters()) == n_params


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", M.KINDS)
def test_loss_and_every_gradient_match_torch(kind, dtype):
    params, ref = build(kind, dtype)
    x, y = batches(1, seed=1)[0]
    assert (y == -1).any() and (y == 0).any()
    prog = btjit.trace(M.model(kind).loss, params, x, y, dtype=np.dtype(dtype).name, grad=True)
    loss = prog.value_and_grad(x, y)
    want = torch_loss(ref, x, y)
    want.backward()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert abs(loss - want.item()) <= tol * max(1.0, abs(want.item())), (loss, want.item())
    assert set(prog.grads) == set(params)
    for name, g in prog.grads.items():
        w = grad_of(ref, kind, name)
        scale = np.abs(w).max()
        assert scale > 0, name
        err = np.abs(g - w).max() / scale
        assert err <= (1e-4 if dtype == np.float32 else 1e-10), f"gradient of {name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", M.KINDS)
def test_adamw_trajectory_matches_torch(kind, dtype):
    """makemore's optimizer: AdamW lr 5e-4, betas (0.9, 0.99), weight decay 0.01, eps 1e-8; 10 steps: the loss of
    every step, then every parameter (float64: to 1e-10). float32: to 3e-5 (0.6% of the 10 * lr a parameter can
    move), leaving out the few entries whose gradient was never 0 nor above 100 * eps -- there Adam's normalised step
    turns the rounding of a near-zero gradient into a step of up to lr (e.g. the key bias of c_attn, whose
    gradient is zero up to rounding because softmax is shift-invariant); they are < 1% of the entries."""
    params, ref = build(kind, dtype, seed=2)
    data = batches(10, seed=3)
    prog = btjit.trace(M.model(kind).loss, params, *data[0], dtype=np.dtype(dtype).name, optimizer=btjit.optim.AdamW(
        lr=5e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01))
    opt = torch.optim.AdamW(ref.parameters(), lr=5e-4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    f32 = dtype == np.float32
    gmax = {k: 0.0 for k in params}
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        want = torch_loss(ref, x, y)
        want.backward()
        gmax = {k: np.maximum(g, np.abs(grad_of(ref, kind, k))) for k, g in gmax.items()}
        opt.step()
        got = prog.step(x, y)
        assert abs(got - want.item()) <= (2e-5 if f32 else 1e-12) * max(1.0, want.item()), \
            f"step {step}: {got} vs {want.item()}"
    moved = left_out = 0
    for name, v in prog.params.items():
        key, t = torch_name(kind, name)
        w = ref.get_parameter(key).detach().numpy()
        w = w.T if t else w
        keep = (gmax[name] >= 100 * 1e-8) | (gmax[name] == 0) if f32 else np.ones(v.shape, bool)
        left_out += (~keep).sum()
        # float32: 10 AdamW steps of lr 5e-4 move a param by up to 5e-3; the attention kernels' own summation
        # order (flash tiles, a vector exp) leaves ~1e-7 in the grads, which Adam's normalisation amplifies on
        # near-zero gradients: 6e-5 is ~1% of the distance moved
        np.testing.assert_allclose(v[keep], w[keep], rtol=0, atol=6e-5 if f32 else 1e-10, err_msg=name)
        moved += np.abs(v - params[name]).max() > 1e-3      # AdamW moved it by ~steps * lr
    assert moved == len(params) and left_out < 0.01 * sum(v.size for v in params.values())


def test_sampling_position_depends_only_on_the_past():
    """Every model is causal: logits at position t do not change when later tokens do (the sampler relies on it)."""
    x, _ = batches(1, B=2, seed=4)[0]
    x2 = x.copy()
    x2[:, 6:] = (x2[:, 6:] + 3) % CFG.vocab_size
    for kind in M.KINDS:
        params, _ = build(kind, np.float64, seed=5)
        prog = btjit.trace(M.model(kind).logits, params, x, optimizer=None, dtype="float64")
        a, b = np.array(prog(x)), np.array(prog(x2))
        np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-12, atol=1e-12, err_msg=kind)
        assert np.abs(a[:, 6:] - b[:, 6:]).max() > 0.01, kind
