"""Update rules written against the public optimizer API as a user writes them (numpy functions and Python
operators on the traced values, no btjit internals): torch.optim's NAdam, RAdam, Adamax, Rprop and ASGD, and
signSGD / Signum, AdaBelief, Adan, SGDW, an error-feedback SGD, Lion, Yogi and Lookahead (its phase counted in
the state), none of which need btjit's help.
tests/test_optim_zoo.py runs them against torch.optim and the numpy transcriptions below."""
import numpy as np

from btjit.optim import Optimizer


def zeros(*names):
    return lambda self, name, p: {k: np.zeros_like(p) for k in names}


class NAdam(Optimizer):
    def __init__(self, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
                         groups=groups)

    def init(self, name, p):                  # torch's mu_product is one number per param: here one per element
        return {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p), "mu_product": np.ones_like(p)}

    def update(self, p, g, s, hp, step):
        (b1, b2), lr, psi = hp["betas"], hp["lr"], hp["momentum_decay"]
        g = g + hp["weight_decay"] * p
        mu = b1 * (1 - 0.5 * 0.96 ** (step * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((step + 1) * psi))
        mu_product = s["mu_product"] * mu
        m = b1 * s["exp_avg"] + (1 - b1) * g
        v = b2 * s["exp_avg_sq"] + (1 - b2) * g ** 2
        denom = np.sqrt(v / (1 - b2 ** step)) + hp["eps"]
        p = p - lr * (1 - mu) / (1 - mu_product) * g / denom - lr * mu_next / (1 - mu_product * mu_next) * m / denom
        return p, {"exp_avg": m, "exp_avg_sq": v, "mu_product": mu_product}


class RAdam(Optimizer):
    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)

    init = zeros("exp_avg", "exp_avg_sq")

    def update(self, p, g, s, hp, step):
        (b1, b2), lr = hp["betas"], hp["lr"]
        g = g + hp["weight_decay"] * p
        m = b1 * s["exp_avg"] + (1 - b1) * g
        v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * step * b2 ** step / bc2
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        adaptive = bc2 ** 0.5 / (np.sqrt(v) + hp["eps"])
        p = p - np.where(rho_t > 5, m / bc1 * lr * adaptive * rect, m / bc1 * lr)
        return p, {"exp_avg": m, "exp_avg_sq": v}


class Adamax(Optimizer):
    def __init__(self, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)

    init = zeros("exp_avg", "exp_inf")

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        g = g + hp["weight_decay"] * p
        m = b1 * s["exp_avg"] + (1 - b1) * g
        u = np.maximum(b2 * s["exp_inf"], abs(g) + hp["eps"])
        return p - hp["lr"] / (1 - b1 ** step) * m / u, {"exp_avg": m, "exp_inf": u}


class Rprop(Optimizer):
    def __init__(self, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), groups=None):
        super().__init__(lr=lr, etas=etas, step_sizes=step_sizes, groups=groups)

    init = zeros("prev", "step_size")

    def update(self, p, g, s, hp, step):
        (eta_minus, eta_plus), (lo, hi) = hp["etas"], hp["step_sizes"]
        prod = g * s["prev"]
        factor = np.where(prod > 0, eta_plus, np.where(prod < 0, eta_minus, 1))
        size = np.where(step == 1, hp["lr"], s["step_size"])      # torch starts every step size at lr
        size = np.clip(size * factor, lo, hi)
        g = np.where(prod < 0, 0, g)
        return p - np.sign(g) * size, {"prev": g, "step_size": size}


class ASGD(Optimizer):
    """torch's eta and mu are computed after a step for the next (so a hyper-parameter changed between steps
    reaches them a step late): state too, started at lr and 1 at the first step."""

    def __init__(self, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, groups=groups)

    init = zeros("ax", "eta", "mu")

    def update(self, p, g, s, hp, step):
        lr, lambd = hp["lr"], hp["lambd"]
        g = g + hp["weight_decay"] * p
        eta, mu = np.where(step == 1, lr, s["eta"]), np.where(step == 1, 1, s["mu"])
        p = p * (1 - lambd * eta) - eta * g
        ax = np.where(mu == 1, p, s["ax"] + (p - s["ax"]) * mu)
        new = {"eta": lr / (1 + lambd * lr * step) ** hp["alpha"], "mu": 1 / np.maximum(1, step - hp["t0"])}
        return p, {"ax": ax, **{k: v + 0 * p for k, v in new.items()}}


class Signum(Optimizer):
    """signSGD with momentum (Bernstein et al. 2018), decoupled weight decay; momentum=0 is signSGD."""

    def __init__(self, lr=1e-3, momentum=0.9, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay, groups=groups)

    init = zeros("momentum_buffer")

    def update(self, p, g, s, hp, step):
        m = hp["momentum"] * s["momentum_buffer"] + (1 - hp["momentum"]) * g
        return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(m), {"momentum_buffer": m}


class AdaBelief(Optimizer):
    """Zhuang et al. 2020 (adabelief-pytorch, decoupled decay, no rectification)."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-16, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)

    init = zeros("exp_avg", "exp_avg_var")

    def update(self, p, g, s, hp, step):
        (b1, b2), eps = hp["betas"], hp["eps"]
        m = b1 * s["exp_avg"] + (1 - b1) * g
        v = b2 * s["exp_avg_var"] + (1 - b2) * (g - m) ** 2 + eps
        denom = np.sqrt(v) / np.sqrt(1 - b2 ** step) + eps
        p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] / (1 - b1 ** step) * m / denom
        return p, {"exp_avg": m, "exp_avg_var": v}


class Adan(Optimizer):
    """Xie et al. 2022 (lucidrains' adan-pytorch): the gradient's difference from the previous step's."""

    def __init__(self, lr=1e-3, betas=(0.02, 0.08, 0.01), eps=1e-8, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)

    init = zeros("m", "v", "n", "prev_grad")

    def update(self, p, g, s, hp, step):
        (b1, b2, b3), lr = hp["betas"], hp["lr"]
        diff = np.where(step == 1, 0.0, g - s["prev_grad"])
        m = (1 - b1) * s["m"] + b1 * g
        v = (1 - b2) * s["v"] + b2 * diff
        n = (1 - b3) * s["n"] + b3 * (g + (1 - b2) * diff) ** 2
        cm, cv, cn = (1 / (1 - (1 - b) ** step) for b in (b1, b2, b3))
        p = (p - lr / (np.sqrt(n * cn) + hp["eps"]) * (m * cm + (1 - b2) * v * cv)) / (1 + hp["weight_decay"] * lr)
        return p, {"m": m, "v": v, "n": n, "prev_grad": g}


class SGDW(Optimizer):
    """SGD with momentum (torch's buffer) and decoupled weight decay (Loshchilov & Hutter)."""

    def __init__(self, lr=1e-2, momentum=0.9, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay, groups=groups)

    init = zeros("momentum_buffer")

    def update(self, p, g, s, hp, step):
        buf = np.where(step == 1, g, hp["momentum"] * s["momentum_buffer"] + g)
        return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * buf, {"momentum_buffer": buf}


class ErrorFeedbackSGD(Optimizer):
    """SGD on a compressed gradient, the compression's error carried to the next step (Karimireddy et al.
    2019): the compressor keeps the elements of magnitude >= threshold, else sends scale * sign."""

    def __init__(self, lr=1e-2, threshold=0.5, scale=0.1, groups=None):
        super().__init__(lr=lr, threshold=threshold, scale=scale, groups=groups)

    init = zeros("error")

    def update(self, p, g, s, hp, step):
        c = g + s["error"]
        sent = np.where(abs(c) >= hp["threshold"], c, hp["scale"] * np.sign(c))
        return p - hp["lr"] * sent, {"error": c - sent}


class HandLion(Optimizer):
    def __init__(self, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, weight_decay=weight_decay, groups=groups)

    init = zeros("exp_avg")

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        c = b1 * s["exp_avg"] + (1 - b1) * g
        p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(c)
        return p, {"exp_avg": b2 * s["exp_avg"] + (1 - b2) * g}


class LookaheadSGD(Optimizer):
    """Lookahead (Zhang et al. 2019) around SGD: every k steps the slow weights move alpha of the way to the fast
    ones and the fast restart there; the step's phase is counted in the state (btjit has no %)."""

    def __init__(self, lr=0.1, k=5, alpha=0.5, groups=None):
        super().__init__(lr=lr, k=k, alpha=alpha, groups=groups)

    def init(self, name, p):
        return {"slow": np.array(p), "phase": 0.0}

    def update(self, p, g, s, hp, step):
        fast = p - hp["lr"] * g
        phase = np.where(s["phase"] + 1 >= hp["k"], 0, s["phase"] + 1)
        slow = np.where(phase == 0, s["slow"] + hp["alpha"] * (fast - s["slow"]), s["slow"])
        return np.where(phase == 0, slow, fast), {"slow": slow, "phase": phase}


class Yogi(Optimizer):
    """Zaheer et al. 2018: v moves by sign(v - g^2) * g^2 (additive, not Adam's multiplicative)."""

    def __init__(self, lr=1e-2, betas=(0.9, 0.999), eps=1e-3, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, groups=groups)

    init = zeros("exp_avg", "exp_avg_sq")

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        m = b1 * s["exp_avg"] + (1 - b1) * g
        v = s["exp_avg_sq"] - (1 - b2) * np.sign(s["exp_avg_sq"] - g * g) * g * g
        return p - hp["lr"] * m / (np.sqrt(v) + hp["eps"]), {"exp_avg": m, "exp_avg_sq": v}


# numpy transcriptions of the rules torch.optim does not have: step(p, g, s, hp, t) -> p, s updated in place
def signum(p, g, s, hp, t):
    s["momentum_buffer"] = hp["momentum"] * s["momentum_buffer"] + (1 - hp["momentum"]) * g
    return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(s["momentum_buffer"])


def adabelief(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    s["exp_avg"] = b1 * s["exp_avg"] + (1 - b1) * g
    s["exp_avg_var"] = b2 * s["exp_avg_var"] + (1 - b2) * (g - s["exp_avg"]) ** 2 + hp["eps"]
    denom = np.sqrt(s["exp_avg_var"]) / np.sqrt(1 - b2 ** t) + hp["eps"]
    return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] / (1 - b1 ** t) * s["exp_avg"] / denom


def adan(p, g, s, hp, t):
    b1, b2, b3 = hp["betas"]
    diff = 0.0 if t == 1 else g - s["prev_grad"]
    s["m"] = (1 - b1) * s["m"] + b1 * g
    s["v"] = (1 - b2) * s["v"] + b2 * diff
    s["n"] = (1 - b3) * s["n"] + b3 * (g + (1 - b2) * diff) ** 2
    s["prev_grad"] = g
    cm, cv, cn = (1 / (1 - (1 - b) ** t) for b in (b1, b2, b3))
    step = hp["lr"] / (np.sqrt(s["n"] * cn) + hp["eps"]) * (s["m"] * cm + (1 - b2) * s["v"] * cv)
    return (p - step) / (1 + hp["weight_decay"] * hp["lr"])


def sgdw(p, g, s, hp, t):
    s["momentum_buffer"] = g if t == 1 else hp["momentum"] * s["momentum_buffer"] + g
    return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * s["momentum_buffer"]


def error_feedback_sgd(p, g, s, hp, t):
    c = g + s["error"]
    sent = np.where(np.abs(c) >= hp["threshold"], c, hp["scale"] * np.sign(c))
    s["error"] = c - sent
    return p - hp["lr"] * sent


def lion(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    c = b1 * s["exp_avg"] + (1 - b1) * g
    s["exp_avg"] = b2 * s["exp_avg"] + (1 - b2) * g
    return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(c)



def lookahead_sgd(p, g, s, hp, t):
    fast = p - hp["lr"] * g
    s["phase"] = np.asarray(t % int(hp["k"]), p.dtype)
    if s["phase"]:
        return fast
    s["slow"] = s["slow"] + hp["alpha"] * (fast - s["slow"])
    return s["slow"].copy()


def yogi(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    s["exp_avg"] = b1 * s["exp_avg"] + (1 - b1) * g
    s["exp_avg_sq"] = s["exp_avg_sq"] - (1 - b2) * np.sign(s["exp_avg_sq"] - g * g) * g * g
    return p - hp["lr"] * s["exp_avg"] / (np.sqrt(s["exp_avg_sq"]) + hp["eps"])
