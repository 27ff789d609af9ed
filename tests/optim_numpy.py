"""numpy transcriptions of the optimizers btjit.optim builds in (torch.optim's single-tensor code, Lion's
paper), one step on one param: step(p, g, state, hp, t) -> new p, state updated in place; t is 1-based.
The tests in test_optim.py check btjit's traced updates against these and against torch.optim."""
import numpy as np


def sgd(p, g, s, hp, t, nesterov=False, maximize=False):
    g = (-g if maximize else g) + hp["weight_decay"] * p
    if hp["momentum"]:
        b = g.copy() if t == 1 else hp["momentum"] * s["momentum_buffer"] + (1 - hp["dampening"]) * g
        s["momentum_buffer"] = b
        g = g + hp["momentum"] * b if nesterov else b
    return p - hp["lr"] * g


def adam(p, g, s, hp, t, decoupled=False, amsgrad=False, maximize=False):
    g = -g if maximize else g
    if decoupled:
        p = p * (1 - hp["lr"] * hp["weight_decay"])
    else:
        g = g + hp["weight_decay"] * p
    s["exp_avg"] = hp["beta1"] * s["exp_avg"] + (1 - hp["beta1"]) * g
    s["exp_avg_sq"] = hp["beta2"] * s["exp_avg_sq"] + (1 - hp["beta2"]) * g * g
    step_size = hp["lr"] / (1 - hp["beta1"] ** t)
    v = s["exp_avg_sq"]
    if amsgrad:
        v = s["max_exp_avg_sq"] = np.maximum(s["max_exp_avg_sq"], v)
    denom = np.sqrt(v) / np.sqrt(1 - hp["beta2"] ** t) + hp["eps"]
    return p - step_size * s["exp_avg"] / denom


def adamw(p, g, s, hp, t):
    return adam(p, g, s, hp, t, decoupled=True)


def adagrad(p, g, s, hp, t):
    g = g + hp["weight_decay"] * p
    s["sum"] = s["sum"] + g * g
    clr = hp["lr"] / (1 + (t - 1) * hp["lr_decay"])
    return p - clr * g / (np.sqrt(s["sum"]) + hp["eps"])


def adadelta(p, g, s, hp, t, maximize=False):
    g = (-g if maximize else g) + hp["weight_decay"] * p
    rho, eps = hp["rho"], hp["eps"]
    s["square_avg"] = rho * s["square_avg"] + (1 - rho) * g * g
    delta = np.sqrt(s["acc_delta"] + eps) / np.sqrt(s["square_avg"] + eps) * g
    s["acc_delta"] = rho * s["acc_delta"] + (1 - rho) * delta * delta
    return p - hp["lr"] * delta


def rmsprop(p, g, s, hp, t, centered=False):
    g = g + hp["weight_decay"] * p
    a = hp["alpha"]
    s["square_avg"] = a * s["square_avg"] + (1 - a) * g * g
    avg = s["square_avg"]
    if centered:
        s["grad_avg"] = a * s["grad_avg"] + (1 - a) * g
        avg = avg - s["grad_avg"] ** 2
    avg = np.sqrt(avg) + hp["eps"]
    if hp["momentum"]:
        s["momentum_buffer"] = hp["momentum"] * s["momentum_buffer"] + g / avg
        return p - hp["lr"] * s["momentum_buffer"]
    return p - hp["lr"] * g / avg


def lion(p, g, s, hp, t):
    c = hp["beta1"] * s["exp_avg"] + (1 - hp["beta1"]) * g
    p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(c)
    s["exp_avg"] = hp["beta2"] * s["exp_avg"] + (1 - hp["beta2"]) * g
    return p


def run(step, params, grads_at, groups, n_steps, init_state, **kw):
    """n_steps of `step` on params {name: array} with grads_at(t, params) -> {name: grad}; groups: [(names,
    hp)] (hp with the group's lr). Returns (params, {state name: {param: array}})."""
    p = {k: v.astype(np.float64).copy() for k, v in params.items()}
    st = {n: init_state(n, v) for n, v in p.items()}
    for t in range(1, n_steps + 1):
        g = grads_at(t, p)
        for names, hp in groups:
            for n in names:
                p[n] = step(p[n], g[n], st[n], hp, t, **kw)
    return p, st
