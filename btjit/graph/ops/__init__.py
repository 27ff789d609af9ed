"""THE op table. Each op is defined once, in one module of this package (elementwise, layout, matmul, nn, random,
batchnorm, conv, winograd, pool, optim; the machinery in graph/optable.py): shape rule, VJP rule (written with the tracer
API, so it emits IR), numpy reference, lowering to kernel rows, and gradient-check cases. Tests are parametrized
over TABLE; adding an op = adding an entry.

Lowering uses a context `L` (graph/lower.py): L.off(var) arena offset, L.const(x) offset of a float
constant, L.scratch int32 scratch offset, L.row(kernel_name, name=value...) builds one tape row from the
kernel's row declaration (`@row` in btjit/kernels).
"""
from btjit.graph.ops import (batchnorm, conv, elementwise, layout, matmul, nn, optim, pool,  # noqa: F401 -- each
                             random, winograd)    # registers its ops in TABLE
from btjit.graph.ops.matmul import micro_gemm, split_gemm  # noqa: F401
from btjit.graph.ops.nn import IGNORE_NONE  # noqa: F401
from btjit.graph.optable import TABLE, Case, OpDef, ShapeError, bstrides, cstrides, loop_nest  # noqa: F401
