"""The built-in optimizers, each an `Optimizer` whose update is traced like a user's, with torch.optim's
semantics and argument names (single-tensor implementation, maximize, Adam's amsgrad, NAdam's and RAdam's
decoupled_weight_decay included), plus Lion (Chen et al. 2023, as lucidrains' lion-pytorch). Hyper-parameters
are arena slots; options that change the equations (nesterov, centered, amsgrad, maximize, whether momentum or a
decay term exists at all) are fixed when the program is traced.
"""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.graph.tracer import emit

from btjit.optim.base import Optimizer, OptimizerError


def _zeros(param):
    return np.zeros(np.shape(param))


def _check(who, **ranges):
    for k, (v, lo, hi) in ranges.items():
        if not lo <= v <= hi:
            raise OptimizerError(f"{who}: {k} must be in [{lo}, {hi}], got {v}")


def _betas(who, betas):
    """torch's betas=(beta1, beta2), each in [0, 1]; anything else an error saying so."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise OptimizerError(f"{who}: betas must be a pair of numbers (beta1, beta2), got {betas!r}")
    _check(who, beta1=(betas[0], 0.0, 1.0), beta2=(betas[1], 0.0, 1.0))
    return betas


INVALID = {"lr": "learning rate", "eps": "epsilon value", "weight_decay": "weight_decay value",
           "lr_decay": "lr_decay value", "momentum_decay": "momentum_decay value"}


def _nonnegative(opt):
    """torch's checks: lr, eps, weight_decay and lr_decay (the optimizer's and each group's) must be >= 0."""
    for where, hp in [("", opt.hp), *((f" in group {i}", g) for i, g in enumerate(opt.groups or ()))]:
        for k, what in INVALID.items():
            if isinstance(hp.get(k), (int, float)) and hp[k] < 0:
                raise OptimizerError(f"{type(opt).__name__}: Invalid {what}: {hp[k]}{where} ({k} must be >= 0)")


def _decay(opt, grad, param, hp, coupled=True):
    """The gradient torch's update reads: -grad if the optimizer maximizes, plus the coupled L2 decay
    weight_decay * param (if coupled and some group decays)."""
    grad = -grad if opt.maximize else grad
    return grad + hp["weight_decay"] * param if coupled and opt.nonzero("weight_decay") else grad


class _Torch(Optimizer):
    """A torch.optim optimizer: `maximize` (ascend the loss) fixed when the program is traced."""

    def __init__(self, maximize=False, **hp):
        super().__init__(**hp)
        _nonnegative(self)
        self.maximize = bool(maximize)


class SGD(_Torch):
    """torch.optim.SGD: momentum, dampening, nesterov, weight_decay (L2, added to the gradient), maximize."""

    def __init__(self, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, groups=None,
                 maximize=False):
        _check("SGD", momentum=(momentum, 0.0, 1.0), dampening=(dampening, 0.0, 1.0))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise OptimizerError("SGD: nesterov needs momentum > 0 and dampening = 0")
        super().__init__(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, groups=groups,
                         maximize=maximize)
        self.nesterov = bool(nesterov)

    def init(self, name, param):
        return {"momentum_buffer": _zeros(param)} if self.nonzero("momentum") else {}

    def update(self, p, g, s, hp, step):
        g = _decay(self, g, p, hp)
        if not self.nonzero("momentum"):
            return p - hp["lr"] * g, {}
        buf = hp["momentum"] * s["momentum_buffer"] + (1.0 - hp["dampening"]) * g
        buf = T.where(step == 1.0, g, buf)           # torch starts the buffer at the first gradient
        d = g + hp["momentum"] * buf if self.nesterov else buf
        return p - hp["lr"] * d, {"momentum_buffer": buf}


def _moments(s, g, hp):
    """torch's Adam moments (Adam, NAdam, RAdam): exp_avg by lerp (weight < 0.5), exp_avg_sq as b2 v + (1 - b2) g^2."""
    b1, b2 = hp["beta1"], hp["beta2"]
    return s["exp_avg"] + (1.0 - b1) * (g - s["exp_avg"]), b2 * s["exp_avg_sq"] + (1.0 - b2) * (g * g)


class Adam(_Torch):
    """torch.optim.Adam (weight_decay: L2 added to the gradient), amsgrad (the denominator from the largest second
    moment so far, state max_exp_avg_sq), maximize."""
    decoupled = False

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, groups=None,
                 maximize=False):
        _betas(type(self).__name__, betas)
        super().__init__(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, groups=groups,
                         maximize=maximize)
        self.amsgrad = bool(amsgrad)

    def init(self, name, param):
        return {"exp_avg": _zeros(param), "exp_avg_sq": _zeros(param),
                **({"max_exp_avg_sq": _zeros(param)} if self.amsgrad else {})}

    def update(self, p, g, s, hp, step):
        lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
        g = _decay(self, g, p, hp, coupled=not self.decoupled)
        if self.decoupled:                   # traced at weight_decay 0 too: prog.hp can set it later
            p = p * (1.0 - lr * hp["weight_decay"])
        m, v = _moments(s, g, hp)
        new = {"exp_avg": m, "exp_avg_sq": v}
        if self.amsgrad:
            v = new["max_exp_avg_sq"] = T.maximum(s["max_exp_avg_sq"], v)
        step_size = lr / (1.0 - b1 ** step)
        bc2_sqrt = T.sqrt(1.0 - b2 ** step)
        denom = T.sqrt(v) / bc2_sqrt + hp["eps"]
        return p + (-step_size) * m / denom, new    # torch's addcdiv


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay (p *= 1 - lr * weight_decay), default 0.01."""
    decoupled = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, groups=None,
                 maximize=False):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, groups=groups,
                         maximize=maximize)


class Adagrad(_Torch):
    """torch.optim.Adagrad: lr_decay, weight_decay, initial_accumulator_value, eps, maximize."""

    def __init__(self, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 groups=None, maximize=False):
        super().__init__(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, groups=groups,
                         maximize=maximize)
        self.initial_accumulator_value = float(initial_accumulator_value)

    def init(self, name, param):
        return {"sum": np.full(np.shape(param), self.initial_accumulator_value)}

    def update(self, p, g, s, hp, step):
        g = _decay(self, g, p, hp)
        clr = hp["lr"] / (1.0 + (step - 1.0) * hp["lr_decay"])
        acc = s["sum"] + g * g
        return p + (-clr) * g / (T.sqrt(acc) + hp["eps"]), {"sum": acc}


class Adadelta(_Torch):
    """torch.optim.Adadelta: lr (default 1.0), rho, eps, weight_decay, maximize."""

    def __init__(self, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, groups=None, maximize=False):
        _check("Adadelta", rho=(rho, 0.0, 1.0))
        super().__init__(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, groups=groups, maximize=maximize)

    def init(self, name, param):
        return {"square_avg": _zeros(param), "acc_delta": _zeros(param)}

    def update(self, p, g, s, hp, step):
        rho, eps = hp["rho"], hp["eps"]
        g = _decay(self, g, p, hp)
        sq = rho * s["square_avg"] + (1.0 - rho) * (g * g)
        delta = T.sqrt(s["acc_delta"] + eps) / T.sqrt(sq + eps) * g
        acc = rho * s["acc_delta"] + (1.0 - rho) * (delta * delta)
        return p - hp["lr"] * delta, {"square_avg": sq, "acc_delta": acc}


class RMSprop(_Torch):
    """torch.optim.RMSprop: alpha, eps, weight_decay, momentum, centered, maximize."""

    def __init__(self, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, groups=None,
                 maximize=False):
        _check("RMSprop", alpha=(alpha, 0.0, 1.0), momentum=(momentum, 0.0, 1.0))
        super().__init__(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, groups=groups,
                         maximize=maximize)
        self.centered = bool(centered)

    def init(self, name, param):
        st = {"square_avg": _zeros(param)}
        if self.nonzero("momentum"):
            st["momentum_buffer"] = _zeros(param)
        if self.centered:
            st["grad_avg"] = _zeros(param)
        return st

    def update(self, p, g, s, hp, step):
        a = hp["alpha"]
        g = _decay(self, g, p, hp)
        sq = a * s["square_avg"] + (1.0 - a) * (g * g)
        new = {"square_avg": sq}
        if self.centered:
            ga = s["grad_avg"] + (1.0 - a) * (g - s["grad_avg"])
            new["grad_avg"] = ga
            avg = T.sqrt(sq - ga * ga) + hp["eps"]
        else:
            avg = T.sqrt(sq) + hp["eps"]
        if self.nonzero("momentum"):
            buf = hp["momentum"] * s["momentum_buffer"] + g / avg
            new["momentum_buffer"] = buf
            return p - hp["lr"] * buf, new
        return p + (-hp["lr"]) * g / avg, new


class _AdamLike(_Torch):
    """torch's betas, eps and weight_decay: coupled (L2 added to the gradient), or with decoupled_weight_decay
    p *= 1 - lr * weight_decay, traced at 0 too (AdamW's)."""
    decoupled_weight_decay = False

    def __init__(self, lr, betas, eps, weight_decay, groups, maximize, **hp):
        _betas(type(self).__name__, betas)
        super().__init__(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, groups=groups,
                         maximize=maximize, **hp)

    def _decayed(self, p, g, hp):
        g = _decay(self, g, p, hp, coupled=not self.decoupled_weight_decay)
        return (p * (1.0 - hp["lr"] * hp["weight_decay"]) if self.decoupled_weight_decay else p), g


class NAdam(_AdamLike):
    """torch.optim.NAdam: momentum_decay (mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay)); their product,
    one number per param in torch, is the state mu_product of each element), decoupled_weight_decay, maximize."""

    def __init__(self, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, groups=None, maximize=False):
        super().__init__(lr, betas, eps, weight_decay, groups, maximize, momentum_decay=momentum_decay)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)

    def init(self, name, param):
        return {"exp_avg": _zeros(param), "exp_avg_sq": _zeros(param), "mu_product": np.ones(np.shape(param))}

    def update(self, p, g, s, hp, step):
        lr, b1, b2, psi = hp["lr"], hp["beta1"], hp["beta2"], hp["momentum_decay"]
        p, g = self._decayed(p, g, hp)
        mu = b1 * (1.0 - 0.5 * 0.96 ** (step * psi))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((step + 1.0) * psi))
        mu_product = s["mu_product"] * mu
        m, v = _moments(s, g, hp)
        denom = T.sqrt(v / (1.0 - b2 ** step)) + hp["eps"]
        p = p + (-lr * (1.0 - mu) / (1.0 - mu_product)) * (g / denom)
        p = p + (-lr * mu_next / (1.0 - mu_product * mu_next)) * (m / denom)
        return p, {"exp_avg": m, "exp_avg_sq": v, "mu_product": mu_product}


class RAdam(_AdamLike):
    """torch.optim.RAdam: the adaptive step where the variance's tractability rho_t > 5, else momentum SGD;
    decoupled_weight_decay, maximize."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
                 groups=None, maximize=False):
        super().__init__(lr, betas, eps, weight_decay, groups, maximize)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)

    def init(self, name, param):
        return {"exp_avg": _zeros(param), "exp_avg_sq": _zeros(param)}

    def update(self, p, g, s, hp, step):
        lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
        p, g = self._decayed(p, g, hp)
        m, v = _moments(s, g, hp)
        bc2 = 1.0 - b2 ** step
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * step * b2 ** step / bc2
        rect = T.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))
        corrected = m / (1.0 - b1 ** step)
        adaptive = T.sqrt(bc2) / (T.sqrt(v) + hp["eps"])
        p = p - T.where(rho_t > 5.0, corrected * lr * adaptive * rect, corrected * lr)
        return p, {"exp_avg": m, "exp_avg_sq": v}


class Adamax(_AdamLike):
    """torch.optim.Adamax: the infinity norm exp_inf = max(beta2 * exp_inf, |g| + eps); weight_decay, maximize."""

    def __init__(self, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=None, maximize=False):
        super().__init__(lr, betas, eps, weight_decay, groups, maximize)

    def init(self, name, param):
        return {"exp_avg": _zeros(param), "exp_inf": _zeros(param)}

    def update(self, p, g, s, hp, step):
        b1 = hp["beta1"]
        p, g = self._decayed(p, g, hp)
        m = s["exp_avg"] + (1.0 - b1) * (g - s["exp_avg"])
        u = T.maximum(hp["beta2"] * s["exp_inf"], T.abs(g) + hp["eps"])
        return p + (-hp["lr"] / (1.0 - b1 ** step)) * (m / u), {"exp_avg": m, "exp_inf": u}


def sign(x):
    """-1, 0 or 1 elementwise (one instruction of a fused chain)."""
    return emit("sign", (x,))


class Lion(Optimizer):
    """Lion (Chen et al. 2023): p = p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g); m = b2 * m + (1 - b2) * g."""

    def __init__(self, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, groups=None):
        _betas("Lion", betas)
        super().__init__(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, groups=groups)
        _nonnegative(self)

    def init(self, name, param):
        return {"exp_avg": _zeros(param)}

    def update(self, p, g, s, hp, step):
        m, b1, b2 = s["exp_avg"], hp["beta1"], hp["beta2"]
        c = b1 * m + (1.0 - b1) * g
        p = p * (1.0 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * sign(c)
        return p, {"exp_avg": b2 * m + (1.0 - b2) * g}


def one_pass(opt, p, g, s, hp, step, scale, flags):
    """(new_param, new_state) from one opt_update op (btjit/graph/ops/optim.py: the same arithmetic as the update
    method, in one kernel pass) when opt's update and init are the built-in SGD's, Adam's (AdamW's) or Adadelta's;
    None for any other optimizer, a subclass overriding either included. flags: "scale" (g is multiplied by the clip
    factor `scale`), "skip" (a NaN scale leaves every value as it was)."""
    cls = next((c for c in (SGD, Adam, Adadelta) if type(opt).update is c.update and type(opt).init is c.init), None)
    if cls is None or getattr(opt, "maximize", False) or getattr(opt, "amsgrad", False):
        return None
    flags = set(flags)
    if cls is Adam and opt.decoupled or "weight_decay" in hp and opt.nonzero("weight_decay"):
        flags.add("wd")                  # (AdamW's decay is traced at weight_decay 0 too, as its update's)
    if "momentum" in hp and opt.nonzero("momentum"):
        flags |= {"momentum", "dampening"}        # the buffer starts at the first gradient whatever dampening
    if cls is SGD:
        flags |= {"nesterov"} if opt.nesterov else set()
        scalars = (step, hp["lr"], scale, hp["weight_decay"], hp["momentum"], 1.0 - hp["dampening"])
    elif cls is Adadelta:
        scalars = (hp["lr"], scale, hp["weight_decay"], 1.0 - hp["rho"], hp["eps"])
    else:
        flags |= {"decoupled"} if opt.decoupled else set()
        scalars = (step, hp["lr"], scale, hp["weight_decay"], hp["beta1"], 1.0 - hp["beta1"], hp["beta2"],
                   1.0 - hp["beta2"], hp["eps"])
    outs = emit("opt_update", (p, g, *s.values(), *map(T.lift, scalars)), kind=cls.__name__.lower(),
                flags=tuple(sorted(flags)))
    outs = outs if isinstance(outs, tuple) else (outs,)
    return outs[0], dict(zip(s, outs[1:]))
