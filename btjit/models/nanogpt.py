"""nanoGPT's GPT (karpathy/nanoGPT model.py at HEAD), written with btjit's public tensor API as model.py writes it.

    x = drop(wte[idx] + wpe[:T])                              # (B,T,C)
    for each block:  x = x + resid_drop(c_proj(attn(ln_1(x))))  # c_attn C -> 3C, causal, dropout on the probs
                     x = x + drop(c_proj(gelu(c_fc(ln_2(x)))))   # C -> 4C -> C, exact (erf) GELU
    logits = ln_f(x) @ wte.T                                  # lm_head tied to wte (no bias)
    loss = cross_entropy(logits, targets, ignore_index=-1)

LayerNorm and every Linear take the `bias` option (bias=False: no bias params at all, as model.py); LayerNorm's
eps is 1e-5. Dropout (p = `dropout`) at model.py's four sites: the summed embeddings, the attention probabilities,
after the attention c_proj and after the MLP c_proj; off in eval mode. Initialisation as model.py: Linear and
Embedding weights N(0, 0.02), every `*.c_proj.weight` N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weight 1
(float32, numpy's generator, drawn in parameter order).

Parameter names are nanoGPT's state_dict keys (`transformer.wte.weight`, `transformer.h.0.attn.c_attn.weight`, ...;
`lm_head.weight` is `transformer.wte.weight`, as the tie makes it). Linear weights are stored (in, out) -- torch's
Linear.weight transposed, y = x @ w + b -- so a nanoGPT checkpoint loads with its 2-d Linear weights transposed.
Not here: the optimizer and the training loop (`btjit train`, configs/nanogpt_cpu.toml).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NanoGPTConfig:           # model.py's GPTConfig (vocab from the data; bias as train.py passes it)
    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def param_shapes(cfg: NanoGPTConfig) -> dict:
    """name -> shape, in model.py's state_dict order (without the tied lm_head.weight)."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg.block_size, C)}

    def ln(name):
        shapes[name + ".weight"] = (C,)
        if cfg.bias:
            shapes[name + ".bias"] = (C,)

    def linear(name, n_in, n_out):
        shapes[name + ".weight"] = (n_in, n_out)
        if cfg.bias:
            shapes[name + ".bias"] = (n_out,)

    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        ln(h + "ln_1")
        linear(h + "attn.c_attn", C, 3 * C)
        linear(h + "attn.c_proj", C, C)
        ln(h + "ln_2")
        linear(h + "mlp.c_fc", C, 4 * C)
        linear(h + "mlp.c_proj", 4 * C, C)
    ln("transformer.ln_f")
    return shapes


def init_params(cfg: NanoGPTConfig, rng) -> dict:
    """model.py's _init_weights and its c_proj re-draw (float32). `rng`: a numpy Generator or an int seed."""
    rng = np.random.default_rng(rng)
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        elif len(shape) == 1:                                    # LayerNorm weight
            out[name] = np.ones(shape, np.float32)
        else:
            std = proj_std if name.endswith("c_proj.weight") else 0.02
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return out


def n_params(cfg: NanoGPTConfig, non_embedding: bool = True) -> int:
    """model.py's get_num_params: the position embeddings left out by default ("0.80M" for the CPU recipe)."""
    n = sum(math.prod(s) for s in param_shapes(cfg).values())
    return n - cfg.block_size * cfg.n_embd if non_embedding else n


def logits_fn(cfg: NanoGPTConfig):
    import btjit       # here, not at module level: the bench's torch peer reads this file's config without numba
    bias, p_drop = cfg.bias, cfg.dropout

    def linear(p, name, x):
        y = x @ p[name + ".weight"]
        return y + p[name + ".bias"] if bias else y

    def layer_norm(p, name, x):
        return btjit.layer_norm(x, p[name + ".weight"], p[name + ".bias"] if bias else None)

    def drop(x):
        return btjit.dropout(x, p_drop)                          # the identity at p 0 and in eval mode

    def logits(p, idx):                                          # idx (B,T) int
        T = idx.shape[1]
        if T > cfg.block_size:
            raise ValueError(f"Cannot forward sequence of length {T}, block size is only {cfg.block_size}")
        wte = p["transformer.wte.weight"]
        x = drop(btjit.take(wte, idx) + p["transformer.wpe.weight"][:T])        # (B,T,C)
        for i in range(cfg.n_layer):
            h = f"transformer.h.{i}."
            qkv = linear(p, h + "attn.c_attn", layer_norm(p, h + "ln_1", x))      # (B,T,3C)
            y = btjit.causal_attention(qkv, cfg.n_head, dropout=p_drop)             # (B,T,C)
            x = x + drop(linear(p, h + "attn.c_proj", y))
            m = btjit.gelu(linear(p, h + "mlp.c_fc", layer_norm(p, h + "ln_2", x)), approximate="none")
            x = x + drop(linear(p, h + "mlp.c_proj", m))                         # (B,T,C)
        return layer_norm(p, "transformer.ln_f", x) @ wte.T                       # (B,T,V)
    return logits


def loss_fn(cfg: NanoGPTConfig):
    import btjit
    logits = logits_fn(cfg)

    def loss(p, idx, targets):
        return btjit.cross_entropy(logits(p, idx), targets, ignore_index=-1)
    return loss
