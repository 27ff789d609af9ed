"""Update rules written against btjit.optim.Optimizer as researchers write them (numpy functions, Python operators,
`if p.ndim` on shapes, reductions): torch.optim's SGD (nesterov, dampening), Adagrad (lr_decay), RMSprop (centered,
momentum), ASGD and Rprop by hand; AdEMAMix, Schedule-Free AdamW, Sophia with a clipped ratio, gradient
centralization, AdaGrad-Norm, Lookahead synced by `step % k`, an EMA of the weights, LAMB, LARS, SGLD; and the
small MLP they run on. tests/test_optim_rules3.py checks them against torch.optim and numpy transcriptions,
tests/test_optim_rules3_runs.py in runs (btjit train, the runtime, bf16, state_dict) and for their errors."""
import numpy as np

import btjit
from btjit.optim import Optimizer
from optim_zoo import zeros
from test_optim_perparam import data as perparam_data


class HandSGD(Optimizer):
    def __init__(self, lr, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, groups=None):
        super().__init__(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, groups=groups)
        self.nesterov = nesterov

    init = zeros("momentum_buffer")

    def update(self, p, g, s, hp, step):
        g = g + hp["weight_decay"] * p
        buf = np.where(step == 1, g, hp["momentum"] * s["momentum_buffer"] + (1 - hp["dampening"]) * g)
        d = g + hp["momentum"] * buf if self.nesterov else buf
        return p - hp["lr"] * d, {"momentum_buffer": buf}


class HandAdagrad(Optimizer):
    def __init__(self, lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10, initial_accumulator_value=0.0,
                 groups=None):
        super().__init__(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, groups=groups)
        self.init_acc = initial_accumulator_value

    def init(self, name, p):
        return {"sum": np.full_like(p, self.init_acc)}

    def update(self, p, g, s, hp, step):
        g = g + hp["weight_decay"] * p
        clr = hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
        acc = s["sum"] + np.square(g)
        return p - clr * g / (np.sqrt(acc) + hp["eps"]), {"sum": acc}


class HandRMSprop(Optimizer):
    def __init__(self, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, groups=None):
        super().__init__(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, groups=groups)
        self.centered = centered

    init = zeros("square_avg", "grad_avg", "momentum_buffer")

    def update(self, p, g, s, hp, step):
        a = hp["alpha"]
        g = g + hp["weight_decay"] * p
        sq = a * s["square_avg"] + (1 - a) * g ** 2
        ga = a * s["grad_avg"] + (1 - a) * g
        avg = np.sqrt(sq - ga ** 2 if self.centered else sq) + hp["eps"]
        buf = hp["momentum"] * s["momentum_buffer"] + g / avg
        return p - hp["lr"] * buf, {"square_avg": sq, "grad_avg": ga, "momentum_buffer": buf}


class HandASGD(Optimizer):
    """torch's per-param eta and mu as 0-d states, started from the hyper-parameters (init reads self.hp)."""

    def __init__(self, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, groups=groups)

    def init(self, name, p):
        return {"ax": np.zeros_like(p), "eta": np.array(self.hp["lr"]), "mu": np.array(1.0)}

    def update(self, p, g, s, hp, step):
        g = g + hp["weight_decay"] * p
        eta, mu = s["eta"], s["mu"]
        p = p * (1 - hp["lambd"] * eta) - eta * g
        ax = np.where(mu != 1, s["ax"] + (p - s["ax"]) * mu, p)
        eta = hp["lr"] / (1 + hp["lambd"] * hp["lr"] * step) ** hp["alpha"]
        mu = 1 / np.maximum(1, step - hp["t0"])
        return p, {"ax": ax, "eta": eta, "mu": mu}


class HandRprop(Optimizer):
    def __init__(self, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0), groups=None):
        super().__init__(lr=lr, etas=etas, step_sizes=step_sizes, groups=groups)

    def init(self, name, p):
        return {"prev": np.zeros_like(p), "step_size": np.full_like(p, self.hp["lr"])}

    def update(self, p, g, s, hp, step):
        eta_minus, eta_plus = hp["etas"]
        sign = np.sign(g * s["prev"])
        factor = np.where(sign > 0, eta_plus, np.where(sign < 0, eta_minus, 1.0))
        size = np.clip(s["step_size"] * factor, *hp["step_sizes"])
        g = np.where(sign < 0, 0.0, g)
        return p - np.sign(g) * size, {"prev": g, "step_size": size}


class AdEMAMix(Optimizer):
    """Pagliardini et al. 2024: a fast and a slow EMA of the gradient; alpha and beta3 warm up over T steps."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, T=10, eps=1e-8, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, alpha=alpha, T=T, eps=eps, weight_decay=weight_decay, groups=groups)

    init = zeros("m1", "m2", "nu")

    def update(self, p, g, s, hp, step):
        (b1, b2, b3), T = hp["betas"], hp["T"]
        alpha = np.minimum(step * hp["alpha"] / T, hp["alpha"])
        a = step / T
        b3 = np.minimum(np.exp(np.log(b1) * np.log(b3) / ((1 - a) * np.log(b3) + a * np.log(b1))), b3)
        m1 = b1 * s["m1"] + (1 - b1) * g
        m2 = b3 * s["m2"] + (1 - b3) * g
        nu = b2 * s["nu"] + (1 - b2) * g * g
        u = (m1 / (1 - b1 ** step) + alpha * m2) / (np.sqrt(nu / (1 - b2 ** step)) + hp["eps"])
        return p - hp["lr"] * (u + hp["weight_decay"] * p), {"m1": m1, "m2": m2, "nu": nu}


class ScheduleFreeAdamW(Optimizer):
    """Defazio et al. 2024, Algorithm 1: the param is y = (1 - b1) z + b1 x; z takes the AdamW step at y, x the
    average of the z's weighted by lr_t^2 (c = lr_t^2 / sum of lr_i^2), lr_t warmed up and bias corrected."""

    def __init__(self, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=5, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
                         groups=groups)

    def init(self, name, y):
        return {"z": y.copy(), "x": y.copy(), "v": np.zeros_like(y), "weight_sum": 0.0}

    def update(self, y, g, s, hp, step):
        b1, b2 = hp["betas"]
        lr = hp["lr"] * np.minimum(1.0, step / hp["warmup_steps"]) * np.sqrt(1 - b2 ** step)
        v = b2 * s["v"] + (1 - b2) * g * g
        z = s["z"] - lr * (g / (np.sqrt(v) + hp["eps"]) + hp["weight_decay"] * y)
        weight_sum = s["weight_sum"] + lr ** 2
        c = lr ** 2 / weight_sum
        x = (1 - c) * s["x"] + c * z
        return (1 - b1) * z + b1 * x, {"z": z, "x": x, "v": v, "weight_sum": weight_sum}


class Sophia(Optimizer):
    """SophiaG's clipped update with an EMA of g * g as the curvature estimate, refreshed every k steps."""

    def __init__(self, lr=1e-3, betas=(0.965, 0.99), rho=0.04, k=2, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, rho=rho, k=k, weight_decay=weight_decay, groups=groups)

    init = zeros("exp_avg", "hessian")

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        m = b1 * s["exp_avg"] + (1 - b1) * g
        h = np.where(step % hp["k"] == 1, b2 * s["hessian"] + (1 - b2) * g * g, s["hessian"])
        ratio = np.minimum(np.abs(m) / (hp["rho"] * h + 1e-15), 1.0)
        p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(m) * ratio
        return p, {"exp_avg": m, "hessian": h}


class CentralizedAdam(Optimizer):
    """Gradient centralization (Yong et al. 2020): for a param of >= 2 dims the gradient minus its mean over all
    axes but the first, then Adam."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, groups=groups)

    init = zeros("exp_avg", "exp_avg_sq")

    def update(self, p, g, s, hp, step):
        if g.ndim >= 2:
            g = g - g.mean(axis=tuple(range(1, g.ndim)), keepdims=True)
        return adam(p, g, s, hp, step)


def adam(p, g, s, hp, step):
    """Adam's step and its new state {exp_avg, exp_avg_sq}."""
    b1, b2 = hp["betas"]
    m = b1 * s["exp_avg"] + (1 - b1) * g
    v = b2 * s["exp_avg_sq"] + (1 - b2) * g ** 2
    return p - hp["lr"] * m / (1 - b1 ** step) / (np.sqrt(v / (1 - b2 ** step)) + hp["eps"]), {"exp_avg": m,
                                                                                                "exp_avg_sq": v}


class AdaGradNorm(Optimizer):
    """Ward et al. 2019: one scalar accumulator per param."""

    def __init__(self, lr=0.1, eps=1e-8, groups=None):
        super().__init__(lr=lr, eps=eps, groups=groups)

    def init(self, name, p):
        return {"acc": np.zeros(())}

    def update(self, p, g, s, hp, step):
        acc = s["acc"] + (g * g).sum()
        return p - hp["lr"] * g / (np.sqrt(acc) + hp["eps"]), {"acc": acc}


class Lookahead(Optimizer):
    """Zhang et al. 2019 around momentum SGD: every k steps the slow weights move alpha towards the fast ones."""

    def __init__(self, lr=0.1, momentum=0.9, k=3, alpha=0.5, groups=None):
        super().__init__(lr=lr, momentum=momentum, k=k, alpha=alpha, groups=groups)

    def init(self, name, p):
        return {"slow": p.copy(), "buf": np.zeros_like(p)}

    def update(self, p, g, s, hp, step):
        buf = hp["momentum"] * s["buf"] + g
        fast = p - hp["lr"] * buf
        sync = step % hp["k"] == 0
        slow = np.where(sync, s["slow"] + hp["alpha"] * (fast - s["slow"]), s["slow"])
        return np.where(sync, slow, fast), {"slow": slow, "buf": buf}


class AdamEMA(Optimizer):
    """Adam, and a Polyak average of the weights (decay warmed up as min(decay, (1 + t) / (10 + t)))."""

    def __init__(self, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, ema_decay=0.9, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, ema_decay=ema_decay, groups=groups)

    def init(self, name, p):
        return {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p), "ema": np.array(p, copy=True)}

    def update(self, p, g, s, hp, step):
        p, new = adam(p, g, s, hp, step)
        d = np.minimum(hp["ema_decay"], (1 + step) / (10 + step))
        return p, {**new, "ema": d * s["ema"] + (1 - d) * p}


class LAMB(Optimizer):
    """You et al. 2019 with bias correction; the trust ratio |p| / |u| clipped to [0, 10] (1 where a norm is 0)."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)

    init = zeros("exp_avg", "exp_avg_sq")

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        m = b1 * s["exp_avg"] + (1 - b1) * g
        v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
        u = (m / (1 - b1 ** step)) / (np.sqrt(v / (1 - b2 ** step)) + hp["eps"]) + hp["weight_decay"] * p
        w_norm, u_norm = np.linalg.norm(p), np.linalg.norm(u)
        trust = np.where((w_norm > 0) & (u_norm > 0), np.clip(w_norm / u_norm, 0, 10), 1.0)
        return p - hp["lr"] * trust * u, {"exp_avg": m, "exp_avg_sq": v}


class LARS(Optimizer):
    """You et al. 2017 with momentum; a group with adapt=0 (the biases) takes plain momentum SGD."""

    def __init__(self, lr=0.1, momentum=0.9, trust_coef=0.001, weight_decay=0.0, adapt=1.0, groups=None):
        super().__init__(lr=lr, momentum=momentum, trust_coef=trust_coef, weight_decay=weight_decay, adapt=adapt,
                         groups=groups)

    init = zeros("mu")

    def update(self, p, g, s, hp, step):
        p_norm, g_norm = np.sqrt((p ** 2).sum()), np.sqrt(np.sum(g ** 2))
        trust = hp["trust_coef"] * p_norm / (g_norm + hp["weight_decay"] * p_norm)
        trust = np.where((hp["adapt"] > 0) & (p_norm > 0) & (g_norm > 0), trust, 1.0)
        mu = hp["momentum"] * s["mu"] + hp["lr"] * trust * (g + hp["weight_decay"] * p)
        return p - mu, {"mu": mu}


class SGLD(Optimizer):
    """Welling & Teh 2011: half a gradient step plus Gaussian noise of variance lr * temperature."""

    def __init__(self, lr=1e-3, temperature=1.0, groups=None):
        super().__init__(lr=lr, temperature=temperature, groups=groups)

    def update(self, p, g, s, hp, step):
        noise = btjit.randn_like(p) * np.sqrt(hp["lr"] * hp["temperature"])
        return p - hp["lr"] / 2 * g + noise, {}


# the model they run on: an MLP with a 3-d weight (reshaped), a tall matrix and two biases, two param groups
SHAPES = {"w1": (6, 3, 4), "b1": (12,), "w2": (12, 3), "b2": (3,)}
GROUPS = [{"params": lambda name, shape: len(shape) >= 2, "weight_decay": 0.01},
          {"params": lambda name, shape: len(shape) < 2, "weight_decay": 0.0, "lr_scale": 0.5}]
NO_WD = [{k: v for k, v in g.items() if k != "weight_decay"} for g in GROUPS]
STEPS, CHANGE = 15, 7                   # prog.lr is halved before step CHANGE + 1
TOL = {np.float64: 1e-10, np.float32: 1e-5}


def params0(dtype):
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(dtype) for k, s in SHAPES.items()}


def data(dtype, steps=STEPS):
    return perparam_data(dtype, steps)                # (x (8, 6), y (8, 3)) a step


def loss(p, x, y):
    h = np.tanh(x @ p["w1"].reshape(6, 12) + p["b1"])
    return btjit.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def trace(opt, dtype, **kw):
    return btjit.trace(loss, params0(dtype), *data(dtype, 1)[0], optimizer=opt, dtype=dtype, **kw)


def run(opt, dtype, steps=STEPS, prog=None, start=0, **kw):
    """btjit's steps [start, steps) of a program of opt (or prog), prog.lr halved before step CHANGE + 1:
    (prog, [the gradients of each step], {param: {state: its initial value}})."""
    prog = prog or trace(opt, dtype, **kw)
    state0 = {k: {n: v[k].copy() for n, v in prog.opt_state.items() if k in v} for k in SHAPES}
    grads = []
    for t, b in enumerate(data(dtype, steps)[start:], start):
        if t == CHANGE:
            prog.lr = prog.lr / 2
        prog.step(*b)
        grads.append({k: v.copy() for k, v in prog.grads.items()})
    return prog, grads, state0


def close(got, want, dtype, what):
    """got == want within TOL[dtype], relative to want's scale (a difference of two values can be ~0)."""
    want = np.broadcast_to(want, np.shape(got))
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * max(np.abs(want).max(), 1e-3),
                               err_msg=what)
