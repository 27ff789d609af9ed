"""Karpathy's makemore model family (makemore.py), written with btjit's public tensor API the way makemore
writes them: Bigram, MLP, RNN, GRU, BoW and Transformer, each a character model of (B, T) int token ids (0 is
the start/stop token) -> (B, T, vocab) logits, trained with cross_entropy(..., ignore_index=-1) against
makemore's targets (the next characters, -1 after a word's end; btjit.train.data's "words" format).

    model = makemore.model("transformer", makemore.MakemoreConfig())
    params = model.init_params(rng);  model.loss(p, x, y);  model.logits(p, x)

Sizes are makemore's defaults (n_layer 4, n_head 4, n_embd 64, n_embd2 64, block_size 16 = names.txt's
longest name + 1, vocab 27). Initialisation is torch's default, as makemore.py uses it: Linear weight and bias
U(-1/sqrt(fan_in), 1/sqrt(fan_in)), Embedding N(0, 1), LayerNorm 1 / 0, the bigram table and the RNN start
state 0 (float32; draws in parameter order). Parameter names are makemore's module paths (transformer.h.0.
attn.c_attn -> "h0.attn.c_attn"); every weight is stored (in, out), torch's Linear.weight transposed: y = x @ w + b.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

KINDS = ("bigram", "makemore_mlp", "rnn", "gru", "bow", "transformer")   # [model] kind values


@dataclass(frozen=True)
class MakemoreConfig:          # makemore.py's ModelConfig and its defaults
    vocab_size: int = 27
    block_size: int = 16
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    n_embd2: int = 64


# ---- parameters: name -> shape, and torch's default init of each ------------------------------------------
def _linear(name, n_in, n_out, bias=True):
    out = {name + ".w": ("linear", (n_in, n_out))}
    if bias:
        out[name + ".b"] = ("linear", (n_out,))
    return out


def param_specs(kind: str, c: MakemoreConfig) -> dict:
    """name -> (init, shape); init is "zeros", "ones", "normal" (N(0,1)) or "linear" (U(+-1/sqrt(fan_in)))."""
    V, E, E2, T = c.vocab_size, c.n_embd, c.n_embd2, c.block_size
    if kind == "bigram":
        return {"logits": ("zeros", (V, V))}
    if kind == "makemore_mlp":          # V + 1 embeddings: the last is the <BLANK> before a word's start
        return {"wte": ("normal", (V + 1, E)), **_linear("mlp.0", T * E, E2), **_linear("mlp.2", E2, V)}
    if kind in ("rnn", "gru"):
        cell = _linear("cell.xh_to_h", E + E2, E2) if kind == "rnn" else \
            {k: v for g in ("z", "r", "hbar") for k, v in _linear(f"cell.xh_to_{g}", E + E2, E2).items()}
        return {"start": ("zeros", (1, E2)), "wte": ("normal", (V, E)), **cell, **_linear("lm_head", E2, V)}
    if kind == "bow":
        return {"wte": ("normal", (V, E)), "wpe": ("normal", (T, E)), **_linear("context_block.mlp.c_fc", E, E2),
                **_linear("context_block.mlp.c_proj", E2, E), **_linear("lm_head", E, V)}
    if kind == "transformer":
        specs = {"wte": ("normal", (V, E)), "wpe": ("normal", (T, E))}
        for i in range(c.n_layer):
            h = f"h{i}."
            specs.update({h + "ln_1.g": ("ones", (E,)), h + "ln_1.b": ("zeros", (E,)),
                          **_linear(h + "attn.c_attn", E, 3 * E), **_linear(h + "attn.c_proj", E, E),
                          h + "ln_2.g": ("ones", (E,)), h + "ln_2.b": ("zeros", (E,)),
                          **_linear(h + "mlp.c_fc", E, 4 * E), **_linear(h + "mlp.c_proj", 4 * E, E)})
        return {**specs, "ln_f.g": ("ones", (E,)), "ln_f.b": ("zeros", (E,)), **_linear("lm_head", E, V, bias=False)}
    raise ValueError(f"unknown makemore model kind {kind!r}; one of: {', '.join(KINDS)}")


def init_params(kind: str, c: MakemoreConfig, rng) -> dict:
    rng = np.random.default_rng(rng)
    specs, out = param_specs(kind, c), {}
    for name, (init, shape) in specs.items():
        if init == "linear":
            fan_in = specs[name[:-2] + ".w"][1][0]
            bound = 1.0 / math.sqrt(fan_in)
            out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
        elif init == "normal":
            out[name] = rng.standard_normal(shape, dtype=np.float32)
        else:
            out[name] = (np.ones if init == "ones" else np.zeros)(shape, np.float32)
    return out


# ---- the models, as makemore.py writes their forward() -----------------------------------------------------
def _lin(p, name, x):
    return x @ p[name + ".w"] + p[name + ".b"] if name + ".b" in p else x @ p[name + ".w"]


def masked_fill(x, mask, value):
    """torch's x.masked_fill(mask, value)."""
    import btjit
    return btjit.where(mask, value, x) if not isinstance(x, np.ndarray) else np.where(mask, value, x)


def bigram(c, p, idx):
    return p["logits"][idx]                                         # a table lookup: (b, t, V)


def mlp(c, p, idx):
    import btjit
    embs = []                   # position t sees the tokens at t, t-1, ..., t-block_size+1
    for k in range(c.block_size):
        tok_emb = btjit.take(p["wte"], idx)                         # (b, t, n_embd)
        idx = btjit.roll(idx, 1, 1)
        idx[:, 0] = c.vocab_size                                    # the <BLANK> token id
        embs.append(tok_emb)
    x = btjit.concatenate(embs, -1)                                 # (b, t, n_embd * block_size)
    return _lin(p, "mlp.2", btjit.tanh(_lin(p, "mlp.0", x)))


def rnn_cell(p, xt, hprev):
    import btjit
    xh = btjit.concatenate([xt, hprev], 1)
    return btjit.tanh(_lin(p, "cell.xh_to_h", xh))


def gru_cell(p, xt, hprev):
    import btjit
    xh = btjit.concatenate([xt, hprev], 1)
    r = btjit.sigmoid(_lin(p, "cell.xh_to_r", xh))                 # reset gate
    hprev_reset = r * hprev
    xhr = btjit.concatenate([xt, hprev_reset], 1)
    hbar = btjit.tanh(_lin(p, "cell.xh_to_hbar", xhr))              # candidate state
    z = btjit.sigmoid(_lin(p, "cell.xh_to_z", xh))                  # update gate
    return (1 - z) * hprev + z * hbar


def recurrent(cell):
    def forward(c, p, idx):
        import btjit
        b, t = idx.shape
        emb = btjit.take(p["wte"], idx)                             # (b, t, n_embd)
        hprev = p["start"].expand((b, -1))                          # the learned start state, per row
        hiddens = []
        for i in range(t):
            xt = emb[:, i, :]                                       # (b, n_embd)
            ht = cell(p, xt, hprev)                                 # (b, n_embd2)
            hprev = ht
            hiddens.append(ht)
        hidden = btjit.stack(hiddens, 1)                            # (b, t, n_embd2)
        return _lin(p, "lm_head", hidden)
    return forward


def causal_bow(c, x):
    """Causal bag of words: position t is the mean of x[:, :t+1] (a softmax over a masked zero matrix)."""
    B, T, C = x.shape
    bias = np.tril(np.ones((c.block_size, c.block_size))).reshape(1, c.block_size, c.block_size)
    att = np.zeros((B, T, T))
    att = masked_fill(att, bias[:, :T, :T] == 0, float("-inf"))
    import btjit
    att = btjit.softmax(att, -1)
    return att @ x                                                  # (B, T, T) x (B, T, C) -> (B, T, C)


def bow(c, p, idx):
    import btjit
    b, t = idx.shape
    pos = btjit.arange(0, t)
    x = btjit.take(p["wte"], idx) + btjit.take(p["wpe"], pos)
    x = x + causal_bow(c, x)                                        # BoWBlock
    x = x + _lin(p, "context_block.mlp.c_proj", btjit.tanh(_lin(p, "context_block.mlp.c_fc", x)))
    return _lin(p, "lm_head", x)


def new_gelu(x):
    import btjit
    return 0.5 * x * (1.0 + btjit.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3.0)))


def causal_self_attention(c, p, h, x):
    import btjit
    B, T, C = x.shape
    nh = c.n_head
    q, k, v = btjit.split(_lin(p, h + "attn.c_attn", x), 3, axis=2)     # torch: .split(n_embd, dim=2)
    k = k.reshape(B, T, nh, C // nh).swapaxes(1, 2)                     # (B, nh, T, hs)
    q = q.reshape(B, T, nh, C // nh).swapaxes(1, 2)
    v = v.reshape(B, T, nh, C // nh).swapaxes(1, 2)
    att = (q @ k.swapaxes(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
    bias = np.tril(np.ones((c.block_size, c.block_size))).reshape(1, 1, c.block_size, c.block_size)
    att = masked_fill(att, bias[:, :, :T, :T] == 0, float("-inf"))
    att = btjit.softmax(att, -1)
    y = att @ v                                                         # (B, nh, T, hs)
    y = y.swapaxes(1, 2).reshape(B, T, C)                               # (B, T, C): heads side by side
    return _lin(p, h + "attn.c_proj", y)


def transformer(c, p, idx):
    import btjit
    b, t = idx.shape
    pos = btjit.arange(0, t)
    x = btjit.take(p["wte"], idx) + btjit.take(p["wpe"], pos)
    for i in range(c.n_layer):                                          # Block
        h = f"h{i}."
        x = x + causal_self_attention(c, p, h, btjit.layer_norm(x, p[h + "ln_1.g"], p[h + "ln_1.b"]))
        m = btjit.layer_norm(x, p[h + "ln_2.g"], p[h + "ln_2.b"])
        x = x + _lin(p, h + "mlp.c_proj", new_gelu(_lin(p, h + "mlp.c_fc", m)))
    x = btjit.layer_norm(x, p["ln_f.g"], p["ln_f.b"])
    return _lin(p, "lm_head", x)


FORWARD = {"bigram": bigram, "makemore_mlp": mlp, "rnn": recurrent(rnn_cell), "gru": recurrent(gru_cell),
           "bow": bow, "transformer": transformer}


@dataclass(frozen=True)
class Model:
    """One family member at one config: init_params(rng) -> dict, logits(p, idx), loss(p, idx, targets)."""
    kind: str
    cfg: MakemoreConfig

    def init_params(self, rng) -> dict:
        return init_params(self.kind, self.cfg, rng)

    @property
    def logits(self) -> Callable:
        fwd, c = FORWARD[self.kind], self.cfg
        return lambda p, idx: fwd(c, p, idx)

    @property
    def loss(self) -> Callable:
        logits = self.logits

        def loss(p, idx, targets):
            import btjit
            lg = logits(p, idx)
            return btjit.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), ignore_index=-1)
        return loss


def model(kind: str, cfg: MakemoreConfig = MakemoreConfig()) -> Model:
    if kind not in FORWARD:
        raise ValueError(f"unknown makemore model kind {kind!r}; one of: {', '.join(KINDS)}")
    if kind == "transformer" and cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    return Model(kind, cfg)
