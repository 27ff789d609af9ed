"""btjit's public API (what `import btjit` exposes), imported on first use by btjit/__init__.py so that
`import btjit.runtime` -- an exported program, ctypes and numpy only -- never loads numba."""
from btjit import optim
from btjit.host import threads
from btjit.graph.trace import (TraceError, abs, arange, broadcast_to, causal_attention, concatenate, copy, cross_entropy,
                          equal, exp, gelu, layer_norm, log, log_softmax, matmul, max, maximum, mean, minimum,
                          relu, reshape, roll, setitem, sigmoid, softmax, split, sqrt, stack, sum, swapaxes, take,
                          tanh, transpose, where)
from btjit.core.program import Program, trace
from btjit.scalar.front import trace_scalar
from btjit.host.threads import replicas_for, set_num_threads
from btjit.graph.state import assign, is_training
from btjit.graph.ops.batchnorm import batch_norm
