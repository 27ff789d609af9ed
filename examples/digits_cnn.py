"""A small CNN for the bundled 8x8 digits (configs/digits_cnn.toml, [model] kind = "python"): conv 3x3 1->32, relu,
conv 3x3 32->32, relu, max_pool 2, conv 3x3 32->64, relu, global average pooling, linear 64->10, cross-entropy.
x: (B, 1, 8, 8) floats in [0, 1]; y: (B,) class ids; cfg.vocab_size is the number of classes (10)."""
import numpy as np

import btjit


def uniform(rng, shape, fan_in):    # torch's default init of conv and linear layers: U(-1/sqrt(fan_in), ..)
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def init_params(cfg, rng):
    c1, c2 = cfg.channels1, cfg.channels2
    return {"conv1_w": uniform(rng, (c1, 1, 3, 3), 9), "conv1_b": uniform(rng, (c1,), 9),
            "conv2_w": uniform(rng, (c1, c1, 3, 3), 9 * c1), "conv2_b": uniform(rng, (c1,), 9 * c1),
            "conv3_w": uniform(rng, (c2, c1, 3, 3), 9 * c1), "conv3_b": uniform(rng, (c2,), 9 * c1),
            "fc_w": uniform(rng, (c2, cfg.vocab_size), c2), "fc_b": uniform(rng, (cfg.vocab_size,), c2)}


def logits(p, x):
    x = btjit.relu(btjit.conv2d(x, p["conv1_w"], p["conv1_b"], padding=1))      # (B, 32, 8, 8)
    x = btjit.relu(btjit.conv2d(x, p["conv2_w"], p["conv2_b"], padding=1))      # (B, 32, 8, 8)
    x = btjit.max_pool2d(x, 2)                                                   # (B, 32, 4, 4)
    x = btjit.relu(btjit.conv2d(x, p["conv3_w"], p["conv3_b"], padding=1))      # (B, 64, 4, 4)
    x = btjit.flatten(btjit.adaptive_avg_pool2d(x, 1))                           # (B, 64)
    return x @ p["fc_w"] + p["fc_b"]                                             # (B, 10)


def loss(p, x, y):
    return btjit.cross_entropy(logits(p, x), y)
