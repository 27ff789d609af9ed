"""More of torch.nn.functional's losses and shrink activations, composed of the primitives with torch's formulas
and reductions: pairwise_distance, margin_ranking_loss, triplet_margin_loss, hinge_embedding_loss,
soft_margin_loss, cosine_embedding_loss, poisson_nll_loss, gaussian_nll_loss; tanhshrink, softshrink,
hardshrink. Labels y are +1 / -1 where torch's are."""
from __future__ import annotations

import math

from btjit.graph.functional import _pair, _reduced
from btjit.graph.trace import (TraceError, abs, exp, lift, log, log1p, maximum, minimum, reshape, sqrt,
                               stop_gradient, sum, tanh, user_src, where)


def tanhshrink(x):
    """x - tanh(x)."""
    x = lift(x)
    return x - tanh(x)


def softshrink(x, lambd=0.5):
    """x - lambd above lambd, x + lambd below -lambd, 0 between."""
    x, lam = lift(x), float(lambd)
    return where(x > lam, x - lam, where(x < -lam, x + lam, 0.0))


def hardshrink(x, lambd=0.5):
    """x where |x| > lambd, else 0."""
    x = lift(x)
    return where(abs(x) > float(lambd), x, 0.0)


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """||x1 - x2 + eps||_p over the last axis, as torch's."""
    d = abs(lift(x1) - lift(x2) + float(eps))
    p = float(p)
    return sqrt(sum(d * d, -1, keepdims=keepdim)) if p == 2.0 else sum(d ** p, -1, keepdims=keepdim) ** (1.0 / p)


def _labels(fn, x, y):
    y = lift(y, x)
    if y.shape != x.shape:
        raise TraceError(f"{fn}: labels y {y.shape} must have the input's shape {x.shape} — {user_src()}")
    return y


def margin_ranking_loss(input1, input2, target, margin=0.0, reduction="mean"):
    """max(0, -y (x1 - x2) + margin)."""
    x1, x2 = _pair("margin_ranking_loss", input1, input2)
    y = _labels("margin_ranking_loss", x1, target)
    return _reduced("margin_ranking_loss", maximum(-y * (x1 - x2) + float(margin), 0.0), reduction)


def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2.0, eps=1e-6, swap=False, reduction="mean"):
    """max(d(a, p) - d(a, n) + margin, 0) with d = pairwise_distance (swap: d(a, n) = min(d(a, n), d(p, n)))."""
    d_ap = pairwise_distance(anchor, positive, p, eps)
    d_an = pairwise_distance(anchor, negative, p, eps)
    if swap:
        d_an = minimum(d_an, pairwise_distance(positive, negative, p, eps))
    return _reduced("triplet_margin_loss", maximum(d_ap - d_an + float(margin), 0.0), reduction)


def hinge_embedding_loss(input, target, margin=1.0, reduction="mean"):  # noqa: A002 -- torch's names
    """x where y == 1, max(0, margin - x) where y == -1."""
    x = lift(input)
    y = _labels("hinge_embedding_loss", x, target)
    return _reduced("hinge_embedding_loss", where(y == 1.0, x, maximum(float(margin) - x, 0.0)), reduction)


def soft_margin_loss(input, target, reduction="mean"):  # noqa: A002
    """log(1 + exp(-y x)), computed as max(z, 0) + log1p(exp(-|z|)) with z = -y x."""
    x = lift(input)
    z = -_labels("soft_margin_loss", x, target) * x
    return _reduced("soft_margin_loss", maximum(z, 0.0) + log1p(exp(-abs(z))), reduction)


def cosine_embedding_loss(input1, input2, target, margin=0.0, reduction="mean"):
    """1 - cos(x1, x2) where y == 1, max(0, cos - margin) where y == -1; cos over the last axis with torch's
    1e-12 added to each squared norm."""
    x1, x2 = _pair("cosine_embedding_loss", input1, input2)
    cos = sum(x1 * x2, -1) / sqrt((sum(x1 * x1, -1) + 1e-12) * (sum(x2 * x2, -1) + 1e-12))
    y = _labels("cosine_embedding_loss", cos, target)
    return _reduced("cosine_embedding_loss", where(y == 1.0, 1.0 - cos, maximum(cos - float(margin), 0.0)),
                    reduction)


def poisson_nll_loss(input, target, log_input=True, full=False, eps=1e-8, reduction="mean"):  # noqa: A002
    """exp(x) - t x (log_input), else x - t log(x + eps); full adds Stirling's t log t - t + log(2 pi t) / 2
    where t > 1."""
    x, t = _pair("poisson_nll_loss", input, target)
    per = exp(x) - t * x if log_input else x - t * log(x + float(eps))
    if full:
        ts = maximum(t, 1.0)                    # the term's value where t > 1 (its log finite elsewhere)
        per = per + where(t > 1.0, ts * log(ts) - ts + 0.5 * log(2.0 * math.pi * ts), 0.0)
    return _reduced("poisson_nll_loss", per, reduction)


def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):  # noqa: A002
    """(log max(var, eps) + (x - t)^2 / max(var, eps)) / 2 (+ log(2 pi) / 2 with full); var of the input's
    shape, or one axis fewer / a last axis of 1 (one variance per row). As torch, the clamp at eps passes the
    gradient to var unchanged."""
    x, t = _pair("gaussian_nll_loss", input, target)
    v = lift(var, x)
    if v.shape == x.shape[:-1]:
        v = reshape(v, v.shape + (1,))
    if v.shape != x.shape and v.shape != x.shape[:-1] + (1,):
        raise TraceError(f"gaussian_nll_loss: var {v.shape} must have the input's shape {x.shape}, or one value "
                         f"per row — {user_src()}")
    v = v + stop_gradient(maximum(v, float(eps)) - v)
    per = 0.5 * (log(v) + (x - t) * (x - t) / v)
    return _reduced("gaussian_nll_loss", per + 0.5 * math.log(2 * math.pi) if full else per, reduction)
