"""pytorch/examples' MNIST net (mnist/main.py) for `btjit train` (configs/mnist_cnn.toml, [model] kind = "python"):
conv 3x3 1->32, relu, conv 3x3 32->64, relu, max_pool 2, dropout 0.25, flatten, linear 9216->128, relu,
dropout 0.5, linear 128->10, log_softmax, nll_loss. Parameter names as its state_dict; linear weights are
stored (in, out) -- torch's transposed -- because btjit writes x @ W.
Its two dropouts take cfg.dropout1 and cfg.dropout2 (0.25 and 0.5 in configs/mnist_cnn.toml; off in eval); nll_loss
of the log-probabilities is btjit.nll_loss, as the net writes it.
x: (B, 1, 28, 28) or (B, 28, 28) in [0, 1] (an "arrays" .npz of uint8 pixels); y: (B,) digits."""
import numpy as np

import btjit

MEAN, STD = 0.1307, 0.3081          # pytorch/examples' transforms.Normalize((0.1307,), (0.3081,))


def uniform(rng, shape, fan_in):    # torch's default init of conv and linear layers
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def init_params(cfg, rng):
    return {"conv1.weight": uniform(rng, (32, 1, 3, 3), 9), "conv1.bias": uniform(rng, (32,), 9),
            "conv2.weight": uniform(rng, (64, 32, 3, 3), 288), "conv2.bias": uniform(rng, (64,), 288),
            "fc1.weight": uniform(rng, (9216, 128), 9216), "fc1.bias": uniform(rng, (128,), 9216),
            "fc2.weight": uniform(rng, (128, 10), 128), "fc2.bias": uniform(rng, (10,), 128)}


def logits(p, x, cfg=None):         # log-probabilities (B, 10), as the net's forward returns
    d1, d2 = (getattr(cfg, "dropout1", 0.0), getattr(cfg, "dropout2", 0.0)) if cfg is not None else (0.0, 0.0)
    x = btjit.reshape(x, (x.shape[0], 1, 28, 28))
    x = (x - MEAN) * (1 / STD)
    x = btjit.relu(btjit.conv2d(x, p["conv1.weight"], p["conv1.bias"]))          # (B, 32, 26, 26)
    x = btjit.relu(btjit.conv2d(x, p["conv2.weight"], p["conv2.bias"]))          # (B, 64, 24, 24)
    x = btjit.flatten(btjit.dropout(btjit.max_pool2d(x, 2), d1))                 # (B, 9216)
    x = btjit.dropout(btjit.relu(x @ p["fc1.weight"] + p["fc1.bias"]), d2)
    return btjit.log_softmax(x @ p["fc2.weight"] + p["fc2.bias"])


def loss(p, x, y, cfg=None):
    return btjit.nll_loss(logits(p, x, cfg), y)
