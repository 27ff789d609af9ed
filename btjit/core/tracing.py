"""`trace()`: from a Python loss function to a Program (btjit/core/program.py).

Record fn into a Graph -> autodiff -> the optimizer's update -> pin loss/outputs/grads -> dead-code elimination ->
fusion -> verify; Program then plans the arena, lowers the graph to a kernel tape and loads its kernels.
"""
from __future__ import annotations

import inspect
import sys
import time
import warnings

import numpy as np

from btjit.graph import (autodiff, fuse, fuse_act, fuse_ew, numpy_fns, numpy_more,  # noqa: F401 -- np.* registered
                         sort_fns, trace as T)
from btjit.graph.ir import Graph, verify
from btjit.graph.memory import pin
from btjit.graph.ops import TABLE
from btjit.graph.ops.winograd import use_winograd
from btjit.host import threads as _threads
from btjit.kernels.common import MAX_THREADS
from btjit.optim.build import Update
from btjit.optim.inplace import assign_in_place
from btjit.export.runner import Named
from btjit.core.program import Program


def _arg_names(fn, n):
    try:
        names = list(inspect.signature(fn).parameters)[1:1 + n]
    except (TypeError, ValueError):
        names = []
    return names + [f"arg{i}" for i in range(len(names), n)]


def trace(fn, params, *batch, optimizer=None, clip_norm=None, skip_nonfinite=False, dtype="float32", grad=None,
          replicas=1, fuse_elementwise=True, threads=None, clip_value=None, seed=0, buffers=None, training=True,
          precision="fp32", _share=None, _defer_kernels=False):
    """Trace fn(params, *batch) once and compile it. With an optimizer (a btjit.optim.Optimizer: its update is
    traced after the backward: one fused pass per param group, or per param), `step()` trains; without one, `forward()`
    (and `value_and_grad()` for a scalar output) evaluate. clip_norm: clip gradients by global norm;
    clip_value: clip each gradient element to [-clip_value, clip_value] (both arena slots, `prog.hp`).
    skip_nonfinite: a step whose gradients contain NaN/Inf leaves params and optimizer state untouched
    (`prog.last_step_skipped` tells).

    replicas=R > 1: data parallel on R threads of one process. Every batch argument's first axis is cut into
    R equal shards; each replica (its own arena, traced for one shard) runs forward and backward on its shard
    on its own thread, then the grads and the loss are averaged and ONE update is applied. That is the step
    on the whole batch exactly when fn's scalar result is a mean over the first batch axis (the mean losses
    of btjit.models are); fn may return nothing else.

    fuse_elementwise: chains of elementwise ops run as one row each (btjit/graph/fuse_ew.py); False keeps
    one row per op (the reference the fused chains are tested against).

    threads: how many threads the step may use (default: btjit.set_num_threads's, which starts at every core
    the process may run on or $BTJIT_NUM_THREADS; 0 = every core). Each kernel decides for itself whether its
    work is large enough to split (GEMMs by blocks of rows, the attention by blocks of sequences), and a split
    kernel computes bit for bit what it does on one thread, so the result does not depend on the thread count
    (replicas, which sum their gradients, do). `prog.threads` is what the step uses: 1 when no kernel splits.

    seed: of the random numbers drawn inside the step (btjit.dropout, rand_like, ...): each is a pure function
    of the seed, the step count, the call's place in fn and the element (btjit/kernels/rng.py).

    buffers={name: array}: state the step reads and writes but does not train (running statistics, a carried
    hidden state). fn sees them in its first argument beside the params; `btjit.assign(p[name], value)` writes
    one when the step ends; `prog.buffers[name]` views them. training: what btjit.is_training() returns
    inside fn (prog.eval traces fn again with training=False).

    precision="bf16": every matrix product (matmul, linear, convolution) reads its operands rounded to bfloat16
    (nearest even) and sums in float32, on the CPU's AVX512-BF16 instruction where it has one (`prog.precision`
    says which); params, gradients, optimizer state and everything else stay float32."""
    t0 = time.perf_counter()
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    fd = {"float32": "f32", "float64": "f64", "f32": "f32", "f64": "f64"}.get(name)
    if fd is None:
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be \"fp32\" or \"bf16\", got {precision!r}")
    if precision == "bf16" and fd != "f32":
        raise ValueError("precision=\"bf16\" needs dtype float32 (its products sum in float32)")
    if _threads.whole(replicas) is None or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    replicas = _threads.whole(replicas)
    g = Graph(float_dtype=fd, training=bool(training), precision=precision)
    if not isinstance(params, dict):
        raise TypeError("params must be a dict of name -> numpy float array")
    buffers = {} if buffers is None else buffers
    if not isinstance(buffers, dict):
        raise TypeError("buffers must be a dict of name -> numpy float array")
    if buffers and replicas > 1:
        raise ValueError(f"replicas={replicas}: buffers are not supported with replicas (each replica would "
                         f"update its own copy)")
    for kind, src in (("parameter", params), ("buffer", buffers)):
        for name, v in src.items():
            arr = np.asarray(v)
            if arr.dtype.kind != "f":
                raise TypeError(f"{kind} {name!r} has dtype {arr.dtype}; {kind}s must be float arrays")
            if kind == "buffer" and name in params:
                raise ValueError(f"buffer {name!r} has the name of a parameter; fn sees both in one dict")
    _warn_tied(params)
    update = Update(optimizer, params, clip_norm, clip_value) if optimizer is not None else None
    for name in (update.order if update else params):         # the arena holds each param group contiguously
        g.params[name] = g.new_var(np.shape(params[name]), fd)
    for name, v in buffers.items():
        g.buffers[name] = g.new_var(np.shape(v), fd)
    names = _arg_names(fn, len(batch))
    for name, x in zip(names, batch):
        try:
            x = np.asarray(x)
        except ValueError as err:
            raise TypeError(f"batch argument {name!r} is not an array ({err}); pass the batch as separate "
                            f"arrays: btjit.trace(fn, params, x, y)") from None
        if x.dtype.kind not in "iuf":
            raise TypeError(f"batch argument {name!r} has dtype {x.dtype}; use float or integer arrays")
        if replicas > 1 and (x.ndim == 0 or x.shape[0] % replicas):
            raise ValueError(f"batch argument {name!r} has shape {x.shape}: replicas={replicas} needs a first "
                             f"axis divisible by {replicas}")
        shard = (x.shape[0] // replicas,) + x.shape[1:] if replicas > 1 else x.shape
        g.inputs.append(g.new_var(shard, "i32" if x.dtype.kind in "iu" else fd))
        g.input_names.append(name)
    if "einops" in sys.modules:         # einops.rearrange / repeat / reduce on traced values
        from btjit.graph import einops_backend  # noqa: F401
    with T.building(g):
        ptr = Named({k: T.Tracer(v, g) for k, v in {**g.params, **g.buffers}.items()}, "param or buffer", "p")
        res = fn(ptr, *[T.Tracer(v, g) for v in g.inputs])
    g.memo.clear()                  # the passes below rewrite the graph: nothing is reused past here
    out, aux = (res if isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict) else (res, {}))
    if not isinstance(out, T.Tracer):
        raise T.TraceError(f"the traced function must return a traced value (got {type(out).__name__})")
    for what, v in [("the returned value", out), *((f"output {k!r}", v) for k, v in aux.items())]:
        if not isinstance(v, T.Tracer):
            raise T.TraceError(f"{what} is not a traced value")
        if v.graph is not g:
            raise T.TraceError(f"{what} is a traced value from another btjit.trace call (kept in a global or "
                               f"closure); tracers are only valid inside the function being traced")
    if "out" in aux:                    # prog.outputs["out"] is the returned value itself
        raise T.TraceError("an output named 'out' would replace the returned value (prog.outputs['out'] is that "
                           "value): give it another name")
    if replicas > 1 and (aux or out.shape != ()):
        raise T.TraceError(f"replicas={replicas} averages one scalar over the replicas; the traced function "
                           f"returns {'outputs ' + ', '.join(map(repr, aux)) if aux else f'shape {out.shape}'}")
    g.outputs = {"out": out.node, **{k: v.node for k, v in aux.items()}}
    fuse.fuse_attention(g, TABLE)
    fuse_act.fuse_activations(g)
    fuse.fold_embedding_matmul(g)
    fuse.fuse_linear(g)
    fuse.fuse_residual(g)
    fuse.fuse_relu(g)
    g.n_forward = len(g.eqns)
    grad = (optimizer is not None) if grad is None else grad
    if grad:
        if out.shape != () or out.node.dtype == "i32":
            raise T.TraceError(f"the loss must be a float scalar to differentiate, got shape {out.shape}")
        g.loss = out.node
        grads = autodiff.differentiate(g)
        fuse.fuse_grad_accumulation(g)
        fuse.fuse_scatter_sum(g)
        fuse.fuse_pool_grad(g)
        fuse.fold_transposed_operands(g)
        fuse.crop_padded_input_grad(g)
        for name in g.params:
            if name not in grads:
                warnings.warn(f"btjit: parameter {name!r} does not reach the loss; its gradient is always zero",
                              stacklevel=2)
    else:
        grads = {}
    n_threads = _threads.resolve(threads)
    use_winograd(g, min(max(1, n_threads // replicas), MAX_THREADS))     # the threads a replica's rows split over
    pinned = pin(g, grads)
    g.n_backward = len(g.eqns)
    if update:
        update.trace_into(g, skip_nonfinite)
    live = g.kept()
    autodiff.eliminate_dead_code(g, live)
    if fuse_elementwise:
        fuse_ew.fuse_elementwise(g)
        autodiff.eliminate_dead_code(g, live)
    assign_in_place(g, pinned)
    verify(g, TABLE)
    prog = Program(g, params, update, clip_norm, skip_nonfinite, pinned, time.perf_counter() - t0, replicas,
                   n_threads, seed, buffers, _share, precision, _defer_kernels)
    # eval: a data-parallel step's on one replica's threads
    eval_threads = threads if replicas == 1 else max(1, n_threads // replicas)
    prog._retrace = lambda share, *b, defer=False: trace(
        fn, share.params, *b, dtype=dtype, buffers=share.buffers, fuse_elementwise=fuse_elementwise,
        threads=eval_threads, training=False, grad=False, precision=precision, _share=share, _defer_kernels=defer)
    return prog


def _warn_tied(params):
    """Two params that are one array (torch's state_dict() lists a tied weight under both names: llama2.c's
    tok_embeddings.weight and output.weight, nanoGPT's wte and lm_head) would train as two params apart."""
    seen = {}
    for name, v in params.items():
        if isinstance(v, np.ndarray) and v.size:
            other = seen.setdefault(v.__array_interface__["data"][0], name)
            if other != name:
                warnings.warn(f"btjit: parameters {other!r} and {name!r} are one array (tied weights?): btjit "
                              f"trains them as two parameters that drift apart; pass it once and use it at both "
                              f"places", stacklevel=3)
