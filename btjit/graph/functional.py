"""Public tensor functions of the neural-network kind, as torch.nn.functional names them: softmax, log_softmax,
cross_entropy, layer_norm, causal_attention (one fused op each), and silu, softplus, logsumexp, nll_loss, the
activations leaky_relu, elu, relu6 and the losses mse, l1, smooth_l1, binary_cross_entropy(_with_logits) (composed
of the op table's ops: their elementwise parts become one fused-chain row forward and one backward, their
gradients come from their parts' VJP rules).

Not here: the tracer and the numpy-like functions (btjit.graph.trace), the ops themselves (btjit.graph.ops).
"""
from __future__ import annotations

import numpy as np

from btjit.graph.trace import (TraceError, Tracer, _norm_axes, abs, arange, current_graph, emit, equal, exp, lift, log,
                               log1p, max, maximum, mean, minimum, reshape, stop_gradient, sum, swapaxes, transpose,
                               user_src, where)
from btjit.graph.indexing import take


def softmax(x, axis=-1, *, dim=None):
    """Softmax over `axis` (torch's dim); the fused op runs on the last axis, another axis is swapped there
    and back."""
    return _on_axis("softmax", lift(x), axis if dim is None else dim)


def log_softmax(x, axis=-1, *, dim=None):
    return _on_axis("log_softmax", lift(x), axis if dim is None else dim)


def _on_axis(op, x, axis):
    (ax,) = _norm_axes(axis, x.ndim, op)
    if ax == x.ndim - 1:
        return emit(op, (x,))
    return swapaxes(emit(op, (swapaxes(x, ax, -1),)), ax, -1)


def _classes_last(logits, targets):
    """torch's layout of a loss over positions -- logits (N, C, d1, ...) with targets (N, d1, ...) -- as btjit's
    (classes on the last axis). Where both layouts fit (C == the last dim), btjit's is taken."""
    shape = targets.shape if isinstance(targets, Tracer) else np.shape(targets)
    if logits.ndim >= 3 and tuple(shape) == logits.shape[:1] + logits.shape[2:] and tuple(shape) != logits.shape[:-1]:
        return transpose(logits, (0, *range(2, logits.ndim), 1))
    return logits


def class_targets(op, logits, targets, ignore_index, reduction, reductions):
    """Check a loss's reduction, ignore_index and class-id targets for logits (..., C): constant targets
    must be integers in [0, C) (or ignore_index) and become an int32 constant."""
    if reduction not in reductions:
        raise TraceError(f"{op}: reduction must be {' or '.join(map(repr, reductions))}, got {reduction!r} — "
                         f"{user_src()}")
    if ignore_index is not None and (not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool)
                                     or not -2 ** 31 <= ignore_index < 2 ** 31):
        raise TraceError(f"{op}: ignore_index must be an int32 class id or None, got {ignore_index!r} — "
                         f"{user_src()}")
    if isinstance(targets, Tracer):
        return targets
    t = np.asarray(targets)                  # constant targets: integer, in range (never read outside a row)
    if t.dtype.kind not in "iu":
        raise TraceError(f"{op}: targets must be integer class ids, got {t.dtype} — {user_src()}")
    n = logits.shape[-1] if logits.ndim else 0
    bad = t[(t != ignore_index) if ignore_index is not None else np.ones(t.shape, bool)]
    if bad.size and (bad.min() < 0 or bad.max() >= n):
        raise TraceError(f"{op}: target values must be in [0, {n})"
                         f"{'' if ignore_index is None else f' or {ignore_index}'}, got min {bad.min()} max "
                         f"{bad.max()}{_IGNORE_HINT if ignore_index is None and bad.min() == -100 else ''} — "
                         f"{user_src()}")
    return Tracer(current_graph().const(t, "i32"), current_graph())


_IGNORE_HINT = "; torch's cross_entropy / nll_loss ignore -100 by default, btjit's only with ignore_index=-100"


def cross_entropy(logits, targets, ignore_index=None, reduction="mean", label_smoothing=0.0, weight=None):
    """Softmax cross-entropy of logits (..., V) against integer class ids (...), with torch's semantics:
    reduction "mean" (over the kept positions), "sum" or "none"; positions whose target equals ignore_index
    (e.g. -1, makemore's and nanoGPT's padding) add nothing and get zero gradient. A batch with every position
    ignored gives NaN ("mean") or 0 ("sum"), and zero gradients -- as torch. torch's layout, logits (N, C, d1,
    ...) with targets (N, d1, ...), is taken too. label_smoothing eps: the target is (1 - eps) one-hot plus eps
    spread evenly over the classes, as torch. weight: torch's class weights (C,), each class's terms times its
    weight, "mean" divided by the sum of the kept positions' target weights. Float targets of the logits' shape
    are class probabilities (mixup, distillation), as torch: the classes on axis 1 (0 of a 1-d input), "mean" over
    the positions. The fused op computes "mean" and "sum" of class ids without smoothing or weights; the other
    cases are composed (log_softmax, nll_loss)."""
    logits = lift(logits)
    if not 0.0 <= label_smoothing <= 1.0:
        raise TraceError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing!r} — {user_src()}")
    if _probabilities(logits, targets):
        return _soft_cross_entropy(logits, lift(targets), ignore_index, reduction, float(label_smoothing), weight)
    logits = _classes_last(logits, targets)
    targets = class_targets("cross_entropy", logits, targets, ignore_index, reduction, ("mean", "sum", "none"))
    if label_smoothing or reduction == "none" or weight is not None:
        return _smoothed(log_softmax(logits), targets, ignore_index, reduction, float(label_smoothing), weight)
    attrs = {k: v for k, v in (("ignore_index", None if ignore_index is None else int(ignore_index)),
                               ("reduction", reduction)) if v not in (None, "mean")}
    return emit("cross_entropy", (logits, targets), **attrs)[0]


def _probabilities(logits, targets) -> bool:
    """Whether targets are class probabilities: floats of the logits' shape."""
    kind = targets.dtype.kind if isinstance(targets, Tracer) else np.asarray(targets).dtype.kind
    shape = targets.shape if isinstance(targets, Tracer) else np.shape(targets)
    return kind == "f" and tuple(shape) == logits.shape


def _class_weight(fn, weight, C, ndim=1, axis=0):
    """weight (C,) as a Tracer shaped to broadcast along `axis` of an ndim-d value (None stays None)."""
    if weight is None:
        return None
    w = lift(weight)
    if w.shape != (C,):
        raise TraceError(f"{fn}: weight must hold one value per class, shape ({C},), got {w.shape} — {user_src()}")
    return reshape(w, (C,) + (1,) * (ndim - axis - 1))


def _soft_cross_entropy(logits, t, ignore_index, reduction, eps, weight):
    """torch's cross_entropy of class probabilities t: -sum_c w_c t_c log softmax(logits)_c over axis 1."""
    if ignore_index is not None:
        raise TraceError(f"cross_entropy: ignore_index goes with class-id targets, not class probabilities "
                         f"{t.shape} — {user_src()}")
    if reduction not in ("mean", "sum", "none"):
        raise TraceError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r} — "
                         f"{user_src()}")
    ax = 1 if logits.ndim >= 2 else 0
    C = logits.shape[ax]
    logp = log_softmax(logits, ax)
    w = _class_weight("cross_entropy", weight, C, logits.ndim, ax)
    t = t * (1.0 - eps) + eps / C if eps else t
    return _reduced("cross_entropy", -sum(logp * t if w is None else logp * t * w, ax), reduction)


def _smoothed(logp, targets, ignore_index, reduction, eps, weight=None):
    """cross_entropy from log-probabilities and checked targets (a Tracer): (1 - eps) nll + eps * the mean of
    -w logp over the classes, per position (0 where ignored), reduced as torch (over the kept positions' target
    weights with weights)."""
    per, keep = _nll_terms(logp, targets, ignore_index, weight, "cross_entropy")
    if eps:
        w = _class_weight("cross_entropy", weight, logp.shape[-1])
        smooth = -sum(logp if w is None else logp * w, -1) * (1.0 / logp.shape[-1])
        kept = _kept(targets, ignore_index)
        per = per * (1.0 - eps) + (smooth if kept is None else smooth * kept) * eps
    return _reduced("cross_entropy", per, reduction, keep)


def _ln_args(weight=None, bias=None, eps=1e-5):
    return weight, bias, eps


def layer_norm(x, weight_or_shape=None, *args, **kwargs):
    """layer_norm(x, weight, bias=None, eps=1e-5): LayerNorm over the last axis (biased variance, as torch);
    weight or bias None: none (nanoGPT's bias=False), computed as ones / zeros. torch's signature, layer_norm(x,
    normalized_shape, weight=None, bias=None, eps=1e-5) with a tuple or list of ints second, normalizes over the
    last len(normalized_shape) axes."""
    x = lift(x)
    s = weight_or_shape
    if isinstance(s, (tuple, list)) and all(isinstance(d, (int, np.integer)) for d in s):
        shape, (weight, bias, eps) = tuple(int(d) for d in s), _ln_args(*args, **kwargs)
        if x.shape[x.ndim - len(shape):] != shape:
            raise TraceError(f"layer_norm: normalized_shape {shape} is not the end of the input's {x.shape} — "
                             f"{user_src()}")
        n = int(np.prod(shape))
        flat = lambda v: None if v is None else reshape(lift(v), (n,))          # noqa: E731
        y = layer_norm(reshape(x, x.shape[:x.ndim - len(shape)] + (n,)), flat(weight), flat(bias), eps)
        return reshape(y, x.shape)
    weight, bias, eps = _ln_args(*args, **kwargs) if s is None else _ln_args(s, *args, **kwargs)
    C = x.shape[-1] if x.ndim else 1
    w = lift(np.ones(C) if weight is None else weight)
    b = lift(np.zeros(C) if bias is None else bias)
    return emit("layernorm", (x, w, b), eps=float(eps))[0]


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.group_norm: x (N, C, ...) normalized over each group of C / num_groups channels and
    the other axes (biased variance), then weight and bias per channel. instance_norm is num_groups = C."""
    x = lift(x)
    N, C, G = x.shape[0], x.shape[1], int(num_groups)
    if G < 1 or C % G:
        raise TraceError(f"group_norm: {C} channels do not split into {G} groups — {user_src()}")
    d = reshape(x, (N, G, -1))
    d = d - mean(d, 2, keepdims=True)
    y = reshape(d * ((mean(d * d, 2, keepdims=True) + float(eps)) ** -0.5), x.shape)
    per_channel = (C,) + (1,) * (x.ndim - 2)
    y = y if weight is None else y * reshape(lift(weight), per_channel)
    return y if bias is None else y + reshape(lift(bias), per_channel)


def instance_norm(x, weight=None, bias=None, eps=1e-5):
    """torch's instance norm with the input's statistics (nn.InstanceNorm*d's default): each (sample, channel)
    normalized over its other axes."""
    x = lift(x)
    return group_norm(x, x.shape[1], weight, bias, eps)


def embedding(input, weight, padding_idx=None):  # noqa: A002 -- torch's names
    """torch.nn.functional.embedding: the rows of weight at the integer ids of input; the row padding_idx (negative:
    from the end) gets no gradient, as torch's."""
    if padding_idx is None:
        return take(weight, input)
    weight = lift(weight)
    V = weight.shape[0]
    if not isinstance(padding_idx, (int, np.integer)) or not -V <= padding_idx < V:
        raise TraceError(f"embedding: padding_idx must be an int in [-{V}, {V}), got {padding_idx!r} — {user_src()}")
    ids = lift(np.asarray(input, np.int32)) if not isinstance(input, Tracer) else input
    keep = reshape(ids != lift(int(padding_idx) % V, ids), ids.shape + (1,))
    return where(keep, take(weight, ids), take(stop_gradient(weight), ids))


def one_hot(y, num_classes):
    """torch.nn.functional.one_hot as floats of the program's dtype: (..., num_classes), 1 at each class id."""
    y = lift(np.asarray(y, np.int32)) if not isinstance(y, Tracer) else y
    return equal(reshape(y, y.shape + (1,)), arange(int(num_classes)))


def causal_attention(qkv, n_head):
    """Fused causal self-attention: qkv (B, T, 3C) holding q | k | v -> (B, T, C), n_head heads of C/n_head."""
    return emit("causal_attention", (lift(qkv),), n_head=int(n_head))[0]


def gelu(x, approximate="none"):
    """GELU as torch: "none" (torch's default) x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); "tanh" the tanh
    approximation (GPT-2's NewGELU: one kernel forward, one backward)."""
    if approximate == "tanh":
        return emit("gelu", (lift(x),))
    if approximate != "none":
        raise TraceError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r} — {user_src()}")
    return emit("gelu_erf", (lift(x),))


def silu(x, inplace=False):
    """SiLU (swish): x * sigmoid(x), torch.nn.functional.silu (one fused instruction forward, one backward)."""
    return emit("silu", (lift(x),))


def softplus(x, beta=1.0, threshold=20.0):
    """torch.nn.functional.softplus: log(1 + exp(beta x)) / beta, and x itself where beta x > threshold."""
    x = lift(x)
    z = x if beta == 1.0 else x * float(beta)
    sp = log1p(exp(minimum(z, float(threshold), ties="first")))   # exp never overflows; log1p: tiny values exact
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


def nll_loss(logp, target, ignore_index=None, reduction="mean", weight=None):
    """torch.nn.functional.nll_loss: -logp[..., target] for log-probabilities logp (..., C) (the class axis
    last, as btjit.cross_entropy: (N, C) as torch; torch's (N, C, d1, ...) with targets (N, d1, ...) is taken
    too) and integer class ids target (...). reduction "mean" (over the positions not ignored), "sum" or "none"
    (shape (...), 0 at ignored positions). Positions whose target equals ignore_index add nothing and get zero
    gradient; "mean" with every position ignored gives NaN and zero gradients, as torch. weight: torch's class
    weights (C,), -weight[target] logp[..., target], "mean" divided by the kept positions' weights' sum. Class ids
    outside [0, C) are an error (checked before the step runs)."""
    logp = _classes_last(lift(logp), target)
    target = class_targets("nll_loss", logp, target, ignore_index, reduction, ("mean", "sum", "none"))
    per, keep = _nll_terms(logp, target, ignore_index, weight)
    return _reduced("nll_loss", per, reduction, keep)


def _nll_terms(logp, target, ignore_index, weight, fn="nll_loss"):
    """(-w[target] logp[..., target] per position, 0 where ignored; what "mean" divides by per position: 1 / 0 for
    kept / ignored, w[target] with weights; None for all ones)."""
    if target.node.dtype != "i32" or logp.ndim == 0 or target.shape != logp.shape[:-1]:
        raise TraceError(f"nll_loss: target must be integer class ids of shape {logp.shape[:-1]} for logp of shape "
                         f"{logp.shape} (classes on the last axis), got {target.dtype} {target.shape} — {user_src()}")
    C = logp.shape[-1]
    ok = None if ignore_index is None else int(ignore_index)
    target = emit("check_index", (target,), hi=C, **({} if ok is None else {"ok": ok}))
    onehot = one_hot(target, C)                                              # (..., C) 0/1
    keep = _kept(target, ignore_index)                                       # (...) 0/1
    if keep is not None:
        onehot = onehot * reshape(keep, keep.shape + (1,))
    w = _class_weight(fn, weight, C)
    if w is not None:
        onehot = onehot * w
        keep = sum(onehot, -1)                                               # w[target], 0 where ignored
    return -sum(logp * onehot, -1), keep


def _kept(targets, ignore_index):
    """1 where a position's target is not ignore_index (None without one)."""
    return None if ignore_index is None else targets != lift(int(ignore_index), targets)


def _reduced(fn, per, reduction, keep=None):
    """Per-position losses reduced as torch: "none" as they are, "sum", or "mean" over the kept positions (keep:
    1 where kept; NaN where none is, and for an empty batch)."""
    if reduction == "none":
        return per
    if reduction not in ("mean", "sum"):
        raise TraceError(f"{fn}: reduction must be 'mean', 'sum' or 'none', got {reduction!r} — {user_src()}")
    total = sum(per)
    if reduction == "sum":
        return total
    if keep is None:
        return total * (1.0 / per.size if per.size else np.nan)
    count = sum(keep)                        # the kept positions (their weights' sum: may be below 1)
    return where(count > 0.0, total / where(count > 0.0, count, 1.0), np.nan)


# ----------------------------------------------------------------------------- activations and losses as torch
def leaky_relu(x, negative_slope=0.01, inplace=False):
    x = lift(x)
    return where(x > 0.0, x, x * float(negative_slope))


def elu(x, alpha=1.0, inplace=False):
    x = lift(x)
    return where(x > 0.0, x, (exp(minimum(x, 0.0, ties="first")) - 1.0) * float(alpha))    # exp of the kept branch only


def hardtanh(x, min_val=-1.0, max_val=1.0, inplace=False):
    """x clamped to [min_val, max_val]; its gradient passes strictly inside (torch's rule: 0 at the bounds, where
    clamp's passes)."""
    x = maximum(x, float(min_val), ties="second")
    return minimum(x, float(max_val), ties="second")


def relu6(x, inplace=False):
    return hardtanh(x, 0.0, 6.0)


def _pair(fn, x, t):
    x, t = lift(x), lift(t)
    if x.shape != t.shape:
        raise TraceError(f"{fn}: input {x.shape} and target {t.shape} must have one shape — {user_src()}")
    return x, t


def mse_loss(input, target, reduction="mean"):  # noqa: A002 -- torch's names
    x, t = _pair("mse_loss", input, target)
    return _reduced("mse_loss", (x - t) * (x - t), reduction)


def l1_loss(input, target, reduction="mean"):  # noqa: A002
    x, t = _pair("l1_loss", input, target)
    return _reduced("l1_loss", abs(x - t), reduction)


def smooth_l1_loss(input, target, reduction="mean", beta=1.0):  # noqa: A002
    """torch's smooth L1 (Huber with 1 / beta): 0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta."""
    x, t = _pair("smooth_l1_loss", input, target)
    d = abs(x - t)
    per = d if beta == 0 else where(d < float(beta), d * d * (0.5 / beta), d - 0.5 * beta)
    return _reduced("smooth_l1_loss", per, reduction)


def binary_cross_entropy(input, target, reduction="mean", weight=None):  # noqa: A002
    """torch's: -(t log p + (1 - t) log(1 - p)), each log clamped at -100 as torch clamps it; weight (broadcast
    to the input) multiplies each term."""
    p, t = _pair("binary_cross_entropy", input, target)
    per = -(t * maximum(log(p), -100.0, ties="first") + (1.0 - t) * maximum(log(1.0 - p), -100.0, ties="first"))
    return _reduced("binary_cross_entropy", _weighted("binary_cross_entropy", per, weight), reduction)


def _weighted(fn, per, weight):
    if weight is None:
        return per
    w = lift(weight)
    try:
        fits = np.broadcast_shapes(w.shape, per.shape) == per.shape
    except ValueError:
        fits = False
    if not fits:
        raise TraceError(f"{fn}: weight {w.shape} does not broadcast to the input's {per.shape} — {user_src()}")
    return per * w


def binary_cross_entropy_with_logits(input, target, reduction="mean", pos_weight=None, weight=None):  # noqa: A002
    """torch's, computed stably: (1 - t) x + (1 + (w - 1) t) (log1p(exp(-|x|)) + max(-x, 0)), w = pos_weight
    (1 if None); weight (broadcast to the input) multiplies each term."""
    x, t = _pair("binary_cross_entropy_with_logits", input, target)
    # softplus(-x), its two kinks at 0 taken from one side (|x|' = 1, max(0, -x)' = 0) so they cancel: the
    # gradient at x = 0 is sigmoid(0) - t, as torch's
    soft = log1p(exp(-where(x >= 0.0, x, -x))) + maximum(0.0, -x, ties="first")
    per = (1.0 - t) * x + (soft if pos_weight is None else (1.0 + (lift(pos_weight) - 1.0) * t) * soft)
    return _reduced("binary_cross_entropy_with_logits", _weighted("binary_cross_entropy_with_logits", per, weight),
                    reduction)
