"""btjit: trace a Python loss function once, train it natively.

    prog = btjit.trace(loss_fn, params, x0, y0, optimizer=btjit.optim.SGD(lr=0.1))
    loss = prog.step(x, y)
    prog.export("out/")                      # a native library; btjit.runtime.load("out/") runs it without numba

The API below is imported on first use (btjit/_api.py): `import btjit.runtime` loads no compiler.
"""
__version__ = "0.2.0"
__all__ = ["trace", "trace_scalar", "Program", "set_num_threads", "replicas_for", "optim", "TraceError",
           "abs", "arange", "broadcast_to", "causal_attention", "concatenate", "flip", "roll", "setitem", "stack",
           "copy", "cross_entropy", "equal", "exp", "gelu", "layer_norm", "log", "log_softmax", "matmul", "max",
           "maximum", "mean", "minimum", "relu", "reshape", "sigmoid", "softmax", "split", "sqrt", "sum", "swapaxes",
           "take", "tanh", "transpose", "where", "clip", "erf", "log1p", "logsumexp", "nll_loss", "silu", "softplus",
           "std", "var", "stop_gradient"]
__all__ += ["leaky_relu", "elu", "relu6", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy",
            "binary_cross_entropy_with_logits", "group_norm", "instance_norm", "one_hot", "embedding"]
__all__ += ["scaled_dot_product_attention", "dropout", "dropout2d", "rand_like", "randn_like", "is_training", "assign",
            "batch_norm"]     # randomness inside the step (kernels/rng.py)
__all__ += ["conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d", "max_pool1d", "max_pool2d", "avg_pool1d",
            "avg_pool2d", "adaptive_avg_pool2d", "interpolate", "flatten", "pad", "pixel_shuffle",
            "adaptive_max_pool2d", "adaptive_avg_pool1d", "adaptive_max_pool1d"]
__all__ += ["sin", "cos", "hardtanh", "hardsigmoid", "hardswish", "logsigmoid", "mish", "selu", "celu", "softsign",
            "prelu", "glu", "normalize", "cosine_similarity", "kl_div", "huber_loss", "rsqrt", "cat",
            "repeat_interleave", "unbind"]
__all__ += ["topk", "sort", "argsort", "floor", "ceil", "round", "trunc", "remainder", "fmod", "floor_divide",
            "cumsum", "cumprod", "diff"]
__all__ += ["linear", "einsum", "rand", "randn", "bernoulli"]
__all__ += ["outer"]
__all__ += ["unfold", "fold", "pixel_unshuffle", "channel_shuffle", "local_response_norm", "lp_pool1d", "lp_pool2d"]
__all__ += ["min", "argmax", "argmin", "prod", "expand_dims", "squeeze", "tril", "triu", "zeros_like", "ones_like",
            "full_like", "moveaxis", "take_along_axis", "sign", "logaddexp", "tile"]
__all__ += ["pairwise_distance", "margin_ranking_loss", "triplet_margin_loss", "hinge_embedding_loss",
            "soft_margin_loss", "cosine_embedding_loss", "poisson_nll_loss", "gaussian_nll_loss", "tanhshrink",
            "softshrink", "hardshrink"]


SUBMODULES = ("testing", "runtime", "micrograd")     # btjit.testing.check_grads(...) after a plain `import btjit`


def __getattr__(name):
    if name in __all__:
        from btjit import _api
        return getattr(_api, name)
    if name in SUBMODULES:
        import importlib
        return importlib.import_module(f"btjit.{name}")
    raise AttributeError(f"module 'btjit' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
