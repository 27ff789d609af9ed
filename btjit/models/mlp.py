"""The paper's makemore MLP (E5), written with btjit's public tensor API.

context characters (left-padded with '.', id 0) -> embedding (V, n_emb) -> concat (context*n_emb)
-> Linear n_hidden + tanh -> Linear V (linear logits) -> mean softmax cross-entropy.
Parameter names: emb (V, n_emb), w1 (context*n_emb, n_hidden), b1, w2 (n_hidden, V), b2.
With the paper's sizes (V 27, context 16, n_emb 64, n_hidden 1024): 1,079,003 parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 27
    context: int = 16
    n_emb: int = 64
    n_hidden: int = 1024


def init_params(cfg: MLPConfig, rng) -> dict:
    """makemore part-3 style init, so the first loss is ~ln(vocab): emb N(0,1), w1 N(0,1)*(5/3)/sqrt(fan_in),
    b1 N(0,1)*0.01, w2 N(0,1)*0.01, b2 0 (float32). Draws in that order."""
    rng = np.random.default_rng(rng)
    fan_in = cfg.context * cfg.n_emb
    f = np.float32
    return {"emb": rng.standard_normal((cfg.vocab_size, cfg.n_emb), dtype=f),
            "w1": rng.standard_normal((fan_in, cfg.n_hidden), dtype=f) * f(5 / 3 / np.sqrt(fan_in)),
            "b1": rng.standard_normal(cfg.n_hidden, dtype=f) * f(0.01),
            "w2": rng.standard_normal((cfg.n_hidden, cfg.vocab_size), dtype=f) * f(0.01),
            "b2": np.zeros(cfg.vocab_size, f)}


def logits_fn(cfg: MLPConfig):
    import btjit       # here, not at module level: the bench's peer processes import init_params without numba

    def logits(p, x):                                           # x (B, context) int
        e = btjit.take(p["emb"], x)                             # (B, context, n_emb)
        h = btjit.tanh(e.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
        return h @ p["w2"] + p["b2"]                            # (B, V)
    return logits


def loss_fn(cfg: MLPConfig):
    import btjit
    logits = logits_fn(cfg)

    def loss(p, x, y):
        return btjit.cross_entropy(logits(p, x), y)
    return loss
