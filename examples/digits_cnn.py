"""A small CNN for the bundled 8x8 digits (configs/digits_cnn.toml, [model] kind = "python"): conv 3x3 1->16,
relu, conv 3x3 16->32, relu, max_pool 2, flatten, linear 512->64, relu, linear 64->10, cross-entropy.
x: (B, 1, 8, 8) floats in [0, 1]; y: (B,) class ids; cfg.vocab_size is the number of classes (10)."""
import numpy as np

import btjit


def uniform(rng, shape, fan_in):    # torch's default init of conv and linear layers: U(-1/sqrt(fan_in), ..)
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def init_params(cfg, rng):
    c1, c2, h = cfg.channels1, cfg.channels2, cfg.hidden
    return {"conv1_w": uniform(rng, (c1, 1, 3, 3), 9), "conv1_b": uniform(rng, (c1,), 9),
            "conv2_w": uniform(rng, (c2, c1, 3, 3), 9 * c1), "conv2_b": uniform(rng, (c2,), 9 * c1),
            "fc1_w": uniform(rng, (c2 * 16, h), c2 * 16), "fc1_b": uniform(rng, (h,), c2 * 16),
            "fc2_w": uniform(rng, (h, cfg.vocab_size), h), "fc2_b": uniform(rng, (cfg.vocab_size,), h)}


def logits(p, x):
    x = btjit.relu(btjit.conv2d(x, p["conv1_w"], p["conv1_b"], padding=1))      # (B, 16, 8, 8)
    x = btjit.relu(btjit.conv2d(x, p["conv2_w"], p["conv2_b"], padding=1))      # (B, 32, 8, 8)
    x = btjit.flatten(btjit.max_pool2d(x, 2))                                    # (B, 512)
    x = btjit.relu(x @ p["fc1_w"] + p["fc1_b"])
    return x @ p["fc2_w"] + p["fc2_b"]                                           # (B, 10)


def loss(p, x, y):
    return btjit.cross_entropy(logits(p, x), y)
