"""btjit: trace a Python loss function once, train it natively.

    prog = btjit.trace(loss_fn, params, x0, y0, optimizer=btjit.optim.SGD(lr=0.1))
    loss = prog.step(x, y)
"""
from . import optim, threads
from .graph.trace import (TraceError, abs, arange, broadcast_to, causal_attention, concatenate, copy, cross_entropy,
                          equal, exp, gelu, layer_norm, log, log_softmax, matmul, max, maximum, mean, minimum,
                          relu, reshape, roll, setitem, sigmoid, softmax, split, sqrt, stack, sum, swapaxes, take,
                          tanh, transpose, where)
from .program import Program, trace
from .scalar import trace_scalar
from .threads import replicas_for, set_num_threads

__version__ = "0.1.0"
threads.set_num_threads(threads.default_threads())
__all__ = ["trace", "trace_scalar", "Program", "set_num_threads", "replicas_for", "optim", "TraceError",
           "abs", "arange", "broadcast_to", "causal_attention", "concatenate", "roll", "setitem", "stack",
           "copy", "cross_entropy", "equal", "exp", "gelu", "layer_norm", "log", "log_softmax", "matmul", "max",
           "maximum", "mean", "minimum", "relu", "reshape", "sigmoid", "softmax", "split", "sqrt", "sum", "swapaxes",
           "take", "tanh", "transpose", "where"]
