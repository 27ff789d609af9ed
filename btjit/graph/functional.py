"""Public tensor functions composed of the op table's ops, as torch.nn.functional names them: silu, softplus,
logsumexp, nll_loss. No kernels of their own: their elementwise parts become one fused-chain row forward and
one backward (graph/fuse_ew.py), their gradients come from their parts' VJP rules.

Not here: the functions that are one op each (btjit.graph.trace) and the ops themselves (btjit.graph.ops).
"""
from __future__ import annotations

import numpy as np

from btjit.graph.trace import (TraceError, _norm_axes, arange, class_targets, emit, equal, exp, lift, log, log1p, max,
                    maximum, minimum, reshape, sigmoid, sum, user_src, where)


def silu(x):
    """SiLU (swish): x * sigmoid(x), torch.nn.functional.silu."""
    x = lift(x)
    return x * sigmoid(x)


def softplus(x, beta=1.0, threshold=20.0):
    """torch.nn.functional.softplus: log(1 + exp(beta x)) / beta, and x itself where beta x > threshold."""
    x = lift(x)
    z = x if beta == 1.0 else x * float(beta)
    sp = log1p(exp(minimum(z, float(threshold))))         # exp never overflows; log1p keeps tiny values exact
    return where(z > float(threshold), x, sp if beta == 1.0 else sp * (1.0 / beta))


def logsumexp(x, axis=None, keepdims=False):
    """log(sum(exp(x), axis)) computed stably (the max subtracted first), as torch.logsumexp /
    scipy.special.logsumexp: a row of -inf gives -inf, a row holding +inf gives +inf."""
    x = lift(x)
    axes = _norm_axes(axis, x.ndim, "logsumexp")
    m = max(x, axes, keepdims=True)
    m = where(abs(m) < np.inf, m, 0.0)                    # infinite max (all -inf, or +inf): shift by 0
    out = log(sum(exp(x - m), axes, keepdims=True)) + m
    return out if keepdims else reshape(out, tuple(d for i, d in enumerate(x.shape) if i not in axes))


def nll_loss(logp, target, ignore_index=None, reduction="mean"):
    """torch.nn.functional.nll_loss: -logp[..., target] for log-probabilities logp (..., C) (the class axis
    last, as btjit.cross_entropy: (N, C) as torch; transpose torch's (N, C, d) layout first) and integer class
    ids target (...). reduction "mean" (over the positions not ignored), "sum" or "none" (shape (...), 0 at
    ignored positions). Positions whose target equals ignore_index add nothing and get zero gradient; "mean"
    with every position ignored gives NaN and zero gradients, as torch. Class ids outside [0, C) are an error
    (checked before the step runs)."""
    logp = lift(logp)
    target = class_targets("nll_loss", logp, target, ignore_index, reduction, ("mean", "sum", "none"))
    if target.node.dtype != "i32" or logp.ndim == 0 or target.shape != logp.shape[:-1]:
        raise TraceError(f"nll_loss: target must be integer class ids of shape {logp.shape[:-1]} for logp of shape "
                         f"{logp.shape} (classes on the last axis), got {target.dtype} {target.shape} — {user_src()}")
    C = logp.shape[-1]
    ok = None if ignore_index is None else int(ignore_index)
    target = emit("check_index", (target,), hi=C, **({} if ok is None else {"ok": ok}))
    onehot = equal(reshape(target, target.shape + (1,)), arange(C))          # (..., C) 0/1
    keep = None if ok is None else (target != lift(ok, target))             # (...) 0/1
    if keep is not None:
        onehot = onehot * reshape(keep, keep.shape + (1,))
    picked = sum(logp * onehot, -1)                                          # (...)
    if reduction == "none":
        return -picked
    total = -sum(picked)
    if reduction == "sum":
        return total
    if keep is None:
        return total * (1.0 / target.size if target.size else np.nan)
    count = sum(keep)
    return where(count > 0.0, total / maximum(count, 1.0), np.nan)

