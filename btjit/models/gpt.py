"""The paper's miniaturized GPT-3 (E6), written with btjit's public tensor API.

Token + learned position embeddings; n_layer pre-LayerNorm blocks of causal multi-head self-attention
(q/k/v projection without bias, as in Karpathy's gpt.py, output projection with bias) and an MLP
C -> 4C -> C (ReLU, or GELU); residuals; final LayerNorm; linear head with bias; mean cross-entropy over
all B*T positions; dropout (while training, off by default) where nanoGPT has it: on the embeddings' sum, the
attention probabilities and both residual projections. Weights are stored (in, out): y = x @ w + b. On 65 characters with the paper's sizes:
46,337 parameters.

Parameter names: wte (V,C), wpe (T,C), h{i}.ln1.g/b, h{i}.attn.qkv.w (C,3C) [q | k | v columns],
h{i}.attn.proj.w/b, h{i}.ln2.g/b, h{i}.mlp.fc.w/b, h{i}.mlp.proj.w/b, lnf.g/b, head.w (C,V), head.b.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 24
    block_size: int = 8
    activation: str = "relu"      # or "gelu" (tanh approximation)
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {self.activation!r}")


def param_shapes(cfg: GPTConfig) -> dict:
    C, V = cfg.n_embd, cfg.vocab_size
    shapes = {"wte": (V, C), "wpe": (cfg.block_size, C)}
    for i in range(cfg.n_layer):
        h = f"h{i}."
        shapes.update({h + "ln1.g": (C,), h + "ln1.b": (C,), h + "attn.qkv.w": (C, 3 * C),
                       h + "attn.proj.w": (C, C), h + "attn.proj.b": (C,), h + "ln2.g": (C,), h + "ln2.b": (C,),
                       h + "mlp.fc.w": (C, 4 * C), h + "mlp.fc.b": (4 * C,), h + "mlp.proj.w": (4 * C, C),
                       h + "mlp.proj.b": (C,)})
    shapes.update({"lnf.g": (C,), "lnf.b": (C,), "head.w": (C, V), "head.b": (V,)})
    return shapes


def init_params(cfg: GPTConfig, rng) -> dict:
    """N(0, 0.02) for Linear and Embedding weights, zero biases, LayerNorm gain 1 / bias 0 (float32).
    `rng` is a numpy Generator or an int seed; draws happen in param_shapes order."""
    rng = np.random.default_rng(rng)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".g"):
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".b"):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return out


def logits_fn(cfg: GPTConfig):
    import btjit       # here, not at module level: the bench's peer processes import init_params without numba
    act = btjit.relu if cfg.activation == "relu" else btjit.gelu

    def logits(p, idx):                                     # idx (B, T) int
        T = idx.shape[1]
        drop = lambda v: btjit.dropout(v, cfg.dropout)     # noqa: E731 -- the identity at 0 and in eval
        x = drop(btjit.take(p["wte"], idx) + p["wpe"][:T])  # (B, T, C)
        for i in range(cfg.n_layer):
            h = f"h{i}."
            a = btjit.layer_norm(x, p[h + "ln1.g"], p[h + "ln1.b"])
            y = btjit.causal_attention(a @ p[h + "attn.qkv.w"], cfg.n_head, dropout=cfg.dropout)
            x = x + drop(y @ p[h + "attn.proj.w"] + p[h + "attn.proj.b"])
            m = btjit.layer_norm(x, p[h + "ln2.g"], p[h + "ln2.b"])
            m = act(m @ p[h + "mlp.fc.w"] + p[h + "mlp.fc.b"])
            x = x + drop(m @ p[h + "mlp.proj.w"] + p[h + "mlp.proj.b"])
        x = btjit.layer_norm(x, p["lnf.g"], p["lnf.b"])
        return x @ p["head.w"] + p["head.b"]                # (B, T, V)
    return logits


def loss_fn(cfg: GPTConfig):
    import btjit
    logits = logits_fn(cfg)

    def loss(p, idx, targets):
        return btjit.cross_entropy(logits(p, idx), targets)
    return loss
