"""More of torch.nn.functional, composed of the op table's ops as btjit/graph/functional.py's activations are:
the activations hardtanh, hardsigmoid, hardswish, logsigmoid, mish, selu, celu, softsign, prelu and glu; normalize
and cosine_similarity; the losses kl_div and huber_loss. Each is torch's formula; its elementwise parts fuse into
one row forward and one backward.
"""
from __future__ import annotations

import numpy as np

from btjit.graph.functional import _pair, _reduced, elu, logsumexp, relu6, softplus
from btjit.graph.numpy_fns import full_like, moveaxis, norm, outer, repeat, tile
from btjit.graph.numpy_more import einsum as np_einsum
from btjit.graph.rng import bernoulli, rand, randn
from btjit.graph.trace import (IN_PLACE, METHODS, TraceError, Tracer, abs, broadcast_to, concatenate, exp, lift, log,
                               log1p, matmul, maximum, minimum, reshape, sigmoid, sqrt, sum, tanh, transpose, user_src,
                               where)

_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def hardsigmoid(x, inplace=False):
    """relu6(x + 3) / 6."""
    return relu6(lift(x) + 3.0) * (1.0 / 6.0)


def hardswish(x, inplace=False):
    """x * relu6(x + 3) / 6 (MobileNetV3's)."""
    x = lift(x)
    return x * hardsigmoid(x)


def logsigmoid(x):
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)), finite for every x (at 0 the gradient is 1/2)."""
    x = lift(x)
    return minimum(0.0, x, ties="first") - log1p(exp(-where(x >= 0.0, x, -x)))


def mish(x, inplace=False):
    """x * tanh(softplus(x))."""
    x = lift(x)
    return x * tanh(softplus(x))


def selu(x, inplace=False):
    """scale * elu(x, alpha) with torch's (self-normalizing) constants."""
    return elu(x, _SELU_ALPHA) * _SELU_SCALE


def celu(x, alpha=1.0, inplace=False):
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    x = lift(x)
    return where(x > 0.0, x, (exp(minimum(x, 0.0, ties="first") * (1.0 / alpha)) - 1.0) * float(alpha))


def softsign(x):
    """x / (1 + |x|)."""
    x = lift(x)
    return x / (abs(x) + 1.0)


def prelu(x, weight):
    """x where x > 0, else weight * x; weight is one number or one per channel (axis 1 of x, as torch's)."""
    x, w = lift(x), lift(weight)
    if w.size != 1:
        if x.ndim < 2 or w.shape != (x.shape[1],):
            raise TraceError(f"prelu: weight {w.shape} must have one element or one per channel (axis 1 of x "
                             f"{x.shape}) — {user_src()}")
        w = reshape(w, (w.size,) + (1,) * (x.ndim - 2))
    return where(x > 0.0, x, x * w)


def glu(x, dim=-1, *, axis=None):
    """a * sigmoid(b) for the two halves a, b of x along dim (axis= as numpy's spelling, as softmax's)."""
    x, dim = lift(x), dim if axis is None else axis
    ax = dim % x.ndim if -x.ndim <= dim < x.ndim else None
    if ax is None or x.shape[ax] % 2:
        raise TraceError(f"glu: dim {dim} of x {x.shape} must exist and have an even size — {user_src()}")
    h, lead = x.shape[ax] // 2, (slice(None),) * ax
    return x[lead + (slice(0, h),)] * sigmoid(x[lead + (slice(h, None),)])


def _pnorm(x, p, dim):
    if p == 2:
        return norm(x, None, dim, keepdims=True)
    if p == 1:
        return sum(abs(x), dim, keepdims=True)
    return sum(abs(x) ** float(p), dim, keepdims=True) ** (1.0 / p)


def normalize(x, p=2.0, dim=1, eps=1e-12, *, axis=None):
    """x / max(||x||_p, eps) along dim (torch.nn.functional.normalize; axis= as numpy's spelling)."""
    x, dim = lift(x), dim if axis is None else axis
    return x / maximum(_pnorm(x, p, dim), float(eps), ties="first")


def cosine_similarity(x1, x2, dim=1, eps=1e-8, *, axis=None):
    """sum((x1 / max(||x1||, eps)) * (x2 / max(||x2||, eps)), dim), torch's formula (each side normalized
    first); x1 and x2 broadcast; axis= as numpy's spelling."""
    dim = dim if axis is None else axis
    return sum(normalize(x1, 2, dim, eps) * normalize(x2, 2, dim, eps), dim)


def kl_div(input, target, reduction="mean", log_target=False):  # noqa: A002 -- torch's names
    """torch's: target * (log target - input) pointwise (0 where target is 0), or exp(target) * (target - input)
    with log_target; reduction "mean" (over every element, torch's default), "batchmean" (the sum over the
    batch size: the KL divergence), "sum" or "none"."""
    if reduction not in ("mean", "batchmean", "sum", "none"):
        raise TraceError(f"kl_div: reduction must be 'mean', 'batchmean', 'sum' or 'none', got {reduction!r} — "
                         f"{user_src()}")
    x, t = _pair("kl_div", input, target)
    if log_target:
        per = exp(t) * (t - x)
    else:
        per = t * log(where(t > 0.0, t, 1.0)) - t * x
    if reduction == "batchmean":
        return sum(per) * (1.0 / (x.shape[0] if x.ndim else 1))
    return _reduced("kl_div", per, reduction)


def huber_loss(input, target, reduction="mean", delta=1.0):  # noqa: A002
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta), d = input - target."""
    x, t = _pair("huber_loss", input, target)
    d = abs(x - t)
    return _reduced("huber_loss", where(d < float(delta), d * d * 0.5, (d - 0.5 * delta) * float(delta)), reduction)


# ----------------------------------------------------------------------------- torch's tensor functions and methods
def rsqrt(x):
    """torch.rsqrt: 1 / sqrt(x) (llama's RMSNorm)."""
    return 1.0 / sqrt(lift(x))


def cat(tensors, dim=0):
    """torch.cat: concatenate along dim."""
    return concatenate(tensors, dim)


def repeat_interleave(x, repeats, dim=None):
    """torch's x.repeat_interleave(n, dim): each entry n times along dim (flattened first without a dim)."""
    return repeat(x, repeats, dim)


def unbind(x, dim=0):
    """torch's x.unbind(dim): the slices along dim, a tuple."""
    x = lift(x)
    x = moveaxis(x, dim, 0) if dim % x.ndim else x
    return tuple(x[i] for i in range(x.shape[0]))


def linear(input, weight, bias=None):  # noqa: A002 -- torch's names
    """torch.nn.functional.linear: input @ weight.T + bias, weight (out, in) as nn.Linear stores it (or (in,))."""
    x, w = lift(input), lift(weight)
    if w.ndim not in (1, 2) or not x.ndim or x.shape[-1] != w.shape[-1]:
        raise TraceError(f"linear: weight {w.shape} must be (out_features, {x.shape[-1] if x.ndim else '?'}) for "
                         f"input {x.shape} (nn.Linear's layout: (out, in)) — {user_src()}")
    y = matmul(x, transpose(w) if w.ndim == 2 else w)
    return y if bias is None else y + bias


def einsum(equation, *operands):
    """torch.einsum / np.einsum: one or two operands (also as a list: einsum("ij,jk", [a, b]))."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return np_einsum(equation.replace(" ", ""), *operands)


def _torch_repeat(x, *sizes, **kw):
    """x.repeat: torch's x.repeat(*sizes) (np.tile) for three or more sizes or one tuple of them, else numpy's
    x.repeat(n, axis) (each element n times)."""
    if not kw and (len(sizes) > 2 or len(sizes) == 1 and isinstance(sizes[0], (tuple, list))):
        return tile(x, sizes[0] if len(sizes) == 1 else sizes)
    return repeat(x, *sizes, **kw)


def _to(x, *args, **kw):
    """torch's x.to(dtype / device / other): a float dtype or a device leaves x as it is (an integer x becomes
    the program's float dtype); other dtypes are refused."""
    for a in list(args) + list(kw.values()):
        if isinstance(a, Tracer) or any(f in str(a) for f in ("float", "double")):
            x = x.astype(float)
        elif not (isinstance(a, (str, bool)) or type(a).__name__ == "device"):
            raise TraceError(f"to: only float dtypes and devices, got {a!r} — {user_src()}")
    return x


def _new(x, size, value):
    """torch's x.new_zeros(size) / new_ones / new_full / new_empty: a constant of the program's float dtype."""
    size = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], (int, np.integer)) else tuple(size)
    return broadcast_to(lift(float(value), x), size)


def _narrow(x, dim, start, length):
    dim = dim % x.ndim
    return x[(slice(None),) * dim + (slice(start, start + length),)]


def _windows(x, dimension, size, step):
    """torch's x.unfold(dimension, size, step): the windows of `size` every `step` along dimension, as a new last
    axis (dimension's size becomes the number of windows); one gather of their elements, then a reshape."""
    d, size, step = dimension % x.ndim, int(size), int(step)
    n = x.shape[d]
    if size < 1 or step < 1 or size > n:
        raise TraceError(f"unfold: size {size} and step {step} must be >= 1 and size at most dimension {dimension}'s "
                         f"{n} (shape {x.shape}) — {user_src()}")
    k = (n - size) // step + 1
    ids = (np.arange(k)[:, None] * step + np.arange(size)).ravel()
    y = reshape(x[(slice(None),) * d + (ids,)], x.shape[:d] + (k, size) + x.shape[d + 1:])
    return moveaxis(y, d + 1, -1)


def _unflatten(x, dim, sizes):
    dim = dim % x.ndim
    return reshape(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1:])


IN_PLACE.update({
    "zero_": lambda x: full_like(x, 0.0), "fill_": lambda x, v: broadcast_to(lift(v, x), x.shape),
    "copy_": lambda x, src: broadcast_to(lift(src, x), x.shape),
    "uniform_": lambda x, a=0.0, b=1.0: rand(x.shape) * float(b - a) + float(a),
    "normal_": lambda x, mean=0.0, std=1.0: randn(x.shape) * float(std) + float(mean)})
METHODS.update({
    "new_zeros": lambda x, *size, **kw: _new(x, size, 0.0), "new_empty": lambda x, *size, **kw: _new(x, size, 0.0),
    "new_ones": lambda x, *size, **kw: _new(x, size, 1.0), "new_full": lambda x, size, v, **kw: _new(x, (size,), v),
    "bernoulli": lambda x, p=None, **kw: bernoulli(x, p), "to": _to, "narrow": _narrow, "unflatten": _unflatten,
    "unfold": _windows,
    "repeat": _torch_repeat, "view_as": lambda x, other: reshape(x, other.shape),
    "reshape_as": lambda x, other: reshape(x, other.shape)})
METHODS.update({
    "rsqrt": rsqrt, "repeat_interleave": repeat_interleave, "unbind": unbind, "outer": outer, "log1p": log1p,
    "logsumexp": lambda x, dim, keepdim=False: logsumexp(x, dim, keepdim), "reciprocal": lambda x: 1.0 / x,
    "neg": lambda x: -x, "add": lambda x, y, alpha=1.0: x + y * alpha if alpha != 1.0 else x + y,
    "sub": lambda x, y, alpha=1.0: x - y * alpha if alpha != 1.0 else x - y, "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y, "where": lambda x, cond, y: where(cond, x, y), "maximum": maximum,
    "minimum": minimum, "dim": lambda x: x.ndim, "ndimension": lambda x: x.ndim})
