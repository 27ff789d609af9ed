"""A model file for `btjit train` ([model] kind = "python"): a one-layer tanh RNN over makemore-style words.
btjit calls init_params(cfg, rng) once, traces loss(p, x, y) for training and logits(p, x) for samples."""
import numpy as np

import btjit


def init_params(cfg, rng):          # cfg: vocab_size and every [model] key; rng: a numpy Generator
    V, E, H = cfg.vocab_size, cfg.n_embd, cfg.hidden

    def linear(n_in, n_out):
        return rng.uniform(-1, 1, (n_in, n_out)).astype(np.float32) / np.sqrt(n_in)
    return {"wte": rng.standard_normal((V, E), dtype=np.float32), "h0": np.zeros((1, H), np.float32),
            "wx": linear(E, H), "wh": linear(H, H), "b": np.zeros(H, np.float32), "head": linear(H, V)}


def logits(p, x):                   # x: (B, T) int, 0 then a word
    emb = btjit.take(p["wte"], x)                            # (B, T, E)
    h, hs = p["h0"].expand((x.shape[0], -1)), []
    for t in range(x.shape[1]):
        h = btjit.tanh(emb[:, t] @ p["wx"] + h @ p["wh"] + p["b"])
        hs.append(h)
    return btjit.stack(hs, 1) @ p["head"]                    # (B, T, V)


def loss(p, x, y):                  # y: (B, T) int, the next characters, -1 after the word's end
    lg = logits(p, x)
    return btjit.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), ignore_index=-1)
