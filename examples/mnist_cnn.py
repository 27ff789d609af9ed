"""pytorch/examples' MNIST net (mnist/main.py) for `btjit train` (configs/mnist_cnn.toml, [model] kind = "python"):
conv 3x3 1->32, relu, conv 3x3 32->64, relu, max_pool 2, dropout 0.25, flatten, linear 9216->128, relu,
dropout 0.5, linear 128->10, log_softmax, nll_loss. Parameter names as its state_dict; linear weights are
stored (in, out) -- torch's transposed -- because btjit writes x @ W.
Dropout is left out until btjit has btjit.dropout (cfg.dropout must stay 0); nll_loss of the log-probabilities
is written as cross_entropy of them (the same value: log_softmax of log-probabilities is themselves).
x: (B, 1, 28, 28) or (B, 28, 28) in [0, 1] (an "arrays" .npz of uint8 pixels); y: (B,) digits."""
import numpy as np

import btjit

MEAN, STD = 0.1307, 0.3081          # pytorch/examples' transforms.Normalize((0.1307,), (0.3081,))


def uniform(rng, shape, fan_in):    # torch's default init of conv and linear layers
    return rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))


def init_params(cfg, rng):
    if getattr(cfg, "dropout", 0):
        raise ValueError("dropout needs btjit.dropout, which this btjit does not have yet: set dropout = 0")
    return {"conv1.weight": uniform(rng, (32, 1, 3, 3), 9), "conv1.bias": uniform(rng, (32,), 9),
            "conv2.weight": uniform(rng, (64, 32, 3, 3), 288), "conv2.bias": uniform(rng, (64,), 288),
            "fc1.weight": uniform(rng, (9216, 128), 9216), "fc1.bias": uniform(rng, (128,), 9216),
            "fc2.weight": uniform(rng, (128, 10), 128), "fc2.bias": uniform(rng, (10,), 128)}


def logits(p, x):                   # log-probabilities (B, 10), as the net's forward returns
    x = btjit.reshape(x, (x.shape[0], 1, 28, 28))
    x = (x - MEAN) * (1 / STD)
    x = btjit.relu(btjit.conv2d(x, p["conv1.weight"], p["conv1.bias"]))          # (B, 32, 26, 26)
    x = btjit.relu(btjit.conv2d(x, p["conv2.weight"], p["conv2.bias"]))          # (B, 64, 24, 24)
    x = btjit.flatten(btjit.max_pool2d(x, 2))                                    # (B, 9216)
    x = btjit.relu(x @ p["fc1.weight"] + p["fc1.bias"])
    return btjit.log_softmax(x @ p["fc2.weight"] + p["fc2.bias"])


def loss(p, x, y):
    return btjit.cross_entropy(logits(p, x), y)      # = nll_loss(log_softmax(...), y)
