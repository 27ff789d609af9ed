"""btjit's public API (what `import btjit` exposes), imported on first use by btjit/__init__.py so that
`import btjit.runtime` -- an exported program, ctypes and numpy only -- never loads numba."""
from . import optim, threads
from .graph.trace import (TraceError, abs, arange, broadcast_to, causal_attention, concatenate, copy, cross_entropy,
                          equal, exp, gelu, layer_norm, log, log_softmax, matmul, max, maximum, mean, minimum,
                          relu, reshape, roll, setitem, sigmoid, softmax, split, sqrt, stack, sum, swapaxes, take,
                          tanh, transpose, where)
from .graph.trace import assign, is_training
from .graph.ops.batchnorm import batch_norm
from .program import Program, trace
from .scalar import trace_scalar
from .threads import replicas_for, set_num_threads
