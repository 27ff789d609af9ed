"""Batch normalization: `btjit.batch_norm` (torch.nn.functional.batch_norm's semantics, any channel axis) and
its fused ops -- `batchnorm` (one kernel: the batch statistics and the normalized output) and
`batchnorm_grad` (one kernel: dx, dw, db) -- with shape rules, numpy references, lowerings and gradient
cases. The running statistics are buffers updated by btjit.assign; eval mode is ordinary elementwise ops."""
from __future__ import annotations

import numpy as np

from btjit.graph import state, trace as T

from btjit.graph.optable import Case, F, ShapeError, _float, op, par_parts


def _pcq(shape, axis):
    """(P, C, Q): the axes before `axis` merged, the channel axis, the axes after it merged."""
    return int(np.prod(shape[:axis], dtype=np.int64)), shape[axis], int(np.prod(shape[axis + 1:], dtype=np.int64))


def _bn_rule(types, attrs, fd):
    _float(types, "")
    sx, ax = types[0][0], attrs["axis"]
    if not 0 <= ax < len(sx):
        raise ShapeError(f"axis {ax} out of range for a {len(sx)}-d input")
    C = sx[ax]
    for (s, _), what in zip(types[1:3], ("weight", "bias")):
        if tuple(s) != (C,):
            raise ShapeError(f"{what} must have shape ({C},) (the channels along axis {ax}), got {tuple(s)}")
    return [(tuple(sx), fd)] + [((C,), fd)] * 3


def _bn_ref(xs, a):
    x, w, b = xs
    P, C, Q = _pcq(x.shape, a["axis"])
    x3 = x.reshape(P, C, Q)
    mean = x3.mean((0, 2))
    var = ((x3 - mean[:, None]) ** 2).mean((0, 2))
    rstd = 1.0 / np.sqrt(var + a["eps"])
    y = (x3 - mean[:, None]) * (rstd * w)[:, None] + b[:, None]
    return y.reshape(x.shape), mean, var, rstd


def _bn_grad_rule(types, attrs, fd):
    sx, C = types[0][0], types[1][0][0]
    return [(tuple(sx), fd), ((C,), fd), ((C,), fd)]


def _bn_grad_ref(xs, a):
    x, w, mean, rstd, dy = xs
    P, C, Q = _pcq(x.shape, a["axis"])
    x3, g3 = x.reshape(P, C, Q), dy.reshape(P, C, Q)
    xh = (x3 - mean[:, None]) * rstd[:, None]
    db, dw = g3.sum((0, 2)), (g3 * xh).sum((0, 2))
    n = P * Q
    dx = (w * rstd)[:, None] * (g3 - db[:, None] / n - xh * dw[:, None] / n)
    return dx.reshape(x.shape), dw, db


def _lower_bn(e, L):
    x, w, b = e.ins
    P, C, Q = _pcq(x.shape, e.attrs["axis"])
    y, mean, var, rstd = (L.off(v) for v in e.outs)
    return [L.row("k_batchnorm_fwd", split=par_parts(L, x.size, C), ox=L.off(x), ow=L.off(w), ob=L.off(b), oy=y,
                   omean=mean, ovar=var, orstd=rstd, P=P, C=C, Q=Q, oeps=L.const(e.attrs["eps"]))]


def _lower_bn_grad(e, L):
    x, w, mean, rstd, dy = e.ins
    P, C, Q = _pcq(x.shape, e.attrs["axis"])
    dx, dw, db = (L.off(v) for v in e.outs)
    return [L.row("k_batchnorm_bwd", split=par_parts(L, x.size, C), ox=L.off(x),
                   ow=L.off(w), omean=L.off(mean), orstd=L.off(rstd), ody=L.off(dy), odx=dx, odw=dw, odb=db, P=P,
                   C=C, Q=Q)]


def _bn_vjp(gs, xs, outs, a):
    # mean, var and rstd feed only the running statistics (assigns: no gradient); gs[1:] are None
    return list(T.emit("batchnorm_grad", (xs[0], xs[1], outs[1], outs[3], gs[0]), **a))


_CASES = [((F(6, 4), F(4), F(4)), 1), ((F(3, 4, 5), F(4), F(4)), 1), ((F(2, 3, 2, 3), F(3), F(3)), 1),
          ((F(2, 5, 3), F(3), F(3)), 2)]
op("batchnorm", infer=_bn_rule, ref=_bn_ref, lower=_lower_bn, vjp=_bn_vjp,
   cases=[Case(args, {"axis": ax, "eps": 1e-5}) for args, ax in _CASES])
op("batchnorm_grad", infer=_bn_grad_rule, ref=_bn_grad_ref, lower=_lower_bn_grad, internal=True,
   cases=[Case((F(6, 4), F(4), F(4), F(4, dom="pos"), F(6, 4)), {"axis": 1, "eps": 1e-5}),
          Case((F(3, 4, 5), F(4), F(4), F(4, dom="pos"), F(3, 4, 5)), {"axis": 1, "eps": 1e-5})])


def batch_norm(x, weight, bias, running_mean, running_var, training=None, momentum=0.1, eps=1e-5, axis=1):
    """torch.nn.functional.batch_norm with the channels along `axis` (1: (N, C), (N, C, L), (N, C, H, W); -1:
    makemore's (B, T, C)). Training (default: btjit.is_training()) normalizes with the batch's mean and biased
    variance over every axis but `axis`, and assigns the running statistics (buffers, or None):
    running = (1 - momentum) * running + momentum * batch, with the unbiased variance. Eval normalizes with
    the running statistics. weight / bias may be None (1 / 0)."""
    x = T.lift(x)
    if x.ndim < 2 or not -x.ndim <= axis < x.ndim:
        raise T.TraceError(f"batch_norm: axis {axis} is not a channel axis of a {x.ndim}-d input {x.shape} (it needs "
                           f"a batch axis besides) — {T.user_src()}")
    axis %= x.ndim
    C = x.shape[axis]
    if not isinstance(momentum, (int, float)):
        raise T.TraceError(f"batch_norm: momentum must be a number, got {momentum!r} — {T.user_src()}")
    w = T.lift(np.ones(C) if weight is None else weight)
    b = T.lift(np.zeros(C) if bias is None else bias)
    stats = [s for s in (running_mean, running_var) if s is not None]
    for v, what in ((w, "weight"), (b, "bias"), *zip(map(T.lift, stats), ("running_mean", "running_var"))):
        if v.shape != (C,):
            raise T.TraceError(f"batch_norm: {what} has shape {v.shape}, the input {x.shape} has {C} channels along "
                               f"axis {axis} — {T.user_src()}")
    if len(stats) == 1:
        raise T.TraceError(f"batch_norm: give both running_mean and running_var, or neither — {T.user_src()}")
    training = state.is_training() if training is None else bool(training)
    if training and stats:
        kinds = T.current_graph().state_vars()
        for v, what in zip(stats, ("running_mean", "running_var")):
            if not (isinstance(v, T.Tracer) and kinds.get(v.node.id, ("",))[0] == "buffer"):
                raise T.TraceError(
                    f"batch_norm: {what} must be a buffer (p[name] of a name in btjit.trace(..., buffers=)) or None; "
                    f"btjit's order is batch_norm(x, weight, bias, running_mean, running_var), torch.nn.functional"
                    f".batch_norm's (input, running_mean, running_var, weight, bias): pass them by keyword — "
                    f"{T.user_src()}")
    if training or not stats:
        n = x.size // C
        if n < 2 and training:
            raise T.TraceError(f"batch_norm: training needs more than one value per channel, input {x.shape} — "
                               f"{T.user_src()}")
        y, mean, var, _ = T.emit("batchnorm", (x, w, b), axis=axis, eps=float(eps))
        if training and stats:
            state.assign(running_mean, running_mean * (1.0 - momentum) + mean * float(momentum))
            state.assign(running_var, running_var * (1.0 - momentum) + var * (momentum * n / (n - 1)))
        return y
    shape = (1,) * axis + (C,) + (1,) * (x.ndim - axis - 1)
    scale = T.reshape(w / T.sqrt(T.lift(running_var) + float(eps)), shape)
    return (x - T.reshape(T.lift(running_mean), shape)) * scale + T.reshape(b, shape)
