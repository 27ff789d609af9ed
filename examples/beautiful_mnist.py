"""tinygrad's examples/beautiful_mnist.py net for `btjit train` ([model] kind = "python", beautiful_mnist.toml):
conv 5x5 1->32, relu, conv 5x5 32->32, relu, BatchNorm2d, max_pool 2; conv 3x3 32->64, relu, conv 3x3 64->64,
relu, BatchNorm2d, max_pool 2; flatten, linear 576->10; sparse categorical cross-entropy; Adam, batch 512.
The batch norms need btjit.batch_norm and buffers (running statistics, init_buffers): with cfg.batch_norm =
false the net runs without them (what btjit without them can train). x: (B, 1, 28, 28) or (B, 28, 28)."""
import numpy as np

import btjit

CONVS = (("l1", 1, 32, 5), ("l2", 32, 32, 5), ("l3", 32, 64, 3), ("l4", 64, 64, 3))


def uniform(rng, shape, fan_in):    # tinygrad's Conv2d / Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def init_params(cfg, rng):
    p = {}
    for name, cin, cout, k in CONVS:
        p[f"{name}.weight"] = uniform(rng, (cout, cin, k, k), cin * k * k)
        p[f"{name}.bias"] = uniform(rng, (cout,), cin * k * k)
    if cfg.batch_norm:
        for name, c in (("bn1", 32), ("bn2", 64)):
            p[f"{name}.weight"], p[f"{name}.bias"] = np.ones(c, np.float32), np.zeros(c, np.float32)
    p["fc.weight"], p["fc.bias"] = uniform(rng, (576, 10), 576), uniform(rng, (10,), 576)
    return p


def init_buffers(cfg):              # the batch norms' running statistics (btjit's buffers)
    return {f"{n}.{s}": (np.zeros if s == "running_mean" else np.ones)(c, np.float32)
            for n, c in (("bn1", 32), ("bn2", 64)) for s in ("running_mean", "running_var")} if cfg.batch_norm else {}


def _block(p, x, a, b, bn, cfg):
    x = btjit.relu(btjit.conv2d(x, p[f"{a}.weight"], p[f"{a}.bias"]))
    x = btjit.relu(btjit.conv2d(x, p[f"{b}.weight"], p[f"{b}.bias"]))
    if cfg.batch_norm:
        x = btjit.batch_norm(x, p[f"{bn}.weight"], p[f"{bn}.bias"], p[f"{bn}.running_mean"], p[f"{bn}.running_var"])
    return btjit.max_pool2d(x, 2)


def logits(p, x, cfg):
    x = btjit.reshape(x, (x.shape[0], 1, 28, 28))
    x = _block(p, x, "l1", "l2", "bn1", cfg)                  # 28 -> 24 -> 20 -> (B, 32, 10, 10)
    x = _block(p, x, "l3", "l4", "bn2", cfg)                  # 10 -> 8 -> 6 -> (B, 64, 3, 3)
    return btjit.flatten(x) @ p["fc.weight"] + p["fc.bias"]   # (B, 10)


def loss(p, x, y, cfg):
    return btjit.cross_entropy(logits(p, x, cfg), y)
