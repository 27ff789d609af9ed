"""Update rules as researchers write them (tests/optim_rules3.py) against references over 15 steps of a small MLP
(a 3-d weight, two param groups by ndim with weight decay and lr_scale, prog.lr halved mid-run), in float64 (1e-10)
and float32 (1e-5, relative to each array's scale), each on btjit's own gradients (prog.grads after each step):
torch.optim's SGD (nesterov, dampening), Adagrad (lr_decay), RMSprop (centered, momentum), ASGD and Rprop by hand
and built in, against torch.optim; AdEMAMix, Schedule-Free AdamW, Sophia, gradient centralization, AdaGrad-Norm,
Lookahead, an EMA of the weights, LAMB, LARS, AdaBelief, Adan and Signum against numpy transcriptions written
here (and tests/optim_zoo.py's), the params and every state."""
import math

import numpy as np
import pytest

import btjit.optim as O
import optim_numpy as N
import optim_rules3 as R
import optim_zoo as Z
from optim_rules3 import CHANGE, GROUPS, NO_WD, SHAPES, close, run

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])


def check(prog, params, state, dtype):
    """prog's params and its optimizer state against the reference's ({param: {state name: value}})."""
    for k in SHAPES:
        close(prog.params[k], params[k], dtype, k)
        for n, views in prog.opt_state.items():
            close(views[k], state[k][n], dtype, f"{n} of {k}")


# ----------------------------------------------------------------------------- torch.optim's rules, by hand
def torch_run(cls, kw, opt, grads, dtype):
    """torch.optim's cls on btjit's gradients, opt's groups as torch's (lr * lr_scale), its lr halved mid-run."""
    torch = pytest.importorskip("torch")
    before = torch.get_default_dtype()          # torch keeps ASGD's eta and mu in the default dtype
    torch.set_default_dtype(torch.float64 if dtype == np.float64 else torch.float32)
    try:
        p = {k: torch.tensor(v) for k, v in R.params0(dtype).items()}
        groups = [{"params": [p[k] for k in names], "lr": hp["lr"] * hp["lr_scale"],
                   **({"weight_decay": hp["weight_decay"]} if "weight_decay" in hp else {})}
                  for names, hp in O.resolve_groups(opt, p)]
        topt = getattr(torch.optim, cls)(groups, lr=opt.hp["lr"], foreach=False, **kw)
        for t, g in enumerate(grads):
            for grp in topt.param_groups if t == CHANGE else ():
                grp["lr"] /= 2
            for k, v in g.items():
                p[k].grad = torch.tensor(v)
            topt.step()
    finally:
        torch.set_default_dtype(before)
    return ({k: v.numpy() for k, v in p.items()},
            {k: {n: np.asarray(v) for n, v in topt.state[p[k]].items() if n != "step"} for k in p})


# (btjit optimizer, torch's class and arguments)
TORCH = {
    "sgd_nesterov": (lambda: R.HandSGD(0.05, momentum=0.9, weight_decay=0.01, nesterov=True, groups=GROUPS),
                     ("SGD", dict(momentum=0.9, nesterov=True))),
    "sgd_dampening": (lambda: R.HandSGD(0.05, momentum=0.9, dampening=0.3, weight_decay=0.01, groups=GROUPS),
                      ("SGD", dict(momentum=0.9, dampening=0.3))),
    "adagrad": (lambda: R.HandAdagrad(0.1, lr_decay=0.05, initial_accumulator_value=0.1, groups=GROUPS),
                ("Adagrad", dict(lr_decay=0.05, initial_accumulator_value=0.1))),
    "rmsprop": (lambda: R.HandRMSprop(0.01, momentum=0.9, centered=True, groups=GROUPS),
                ("RMSprop", dict(momentum=0.9, centered=True))),
    "asgd": (lambda: R.HandASGD(0.05, lambd=0.01, t0=4, groups=GROUPS), ("ASGD", dict(lambd=0.01, t0=4))),
    "rprop": (lambda: R.HandRprop(0.01, groups=NO_WD), ("Rprop", {})),
    "builtin_sgd": (lambda: O.SGD(0.05, momentum=0.9, dampening=0.3, weight_decay=0.01, groups=GROUPS),
                    ("SGD", dict(momentum=0.9, dampening=0.3))),
    "builtin_sgd_nesterov": (lambda: O.SGD(0.05, momentum=0.9, nesterov=True, groups=GROUPS),
                             ("SGD", dict(momentum=0.9, nesterov=True))),
    "builtin_adagrad": (lambda: O.Adagrad(0.1, lr_decay=0.05, initial_accumulator_value=0.1, groups=GROUPS),
                        ("Adagrad", dict(lr_decay=0.05, initial_accumulator_value=0.1))),
    "builtin_rmsprop": (lambda: O.RMSprop(0.01, momentum=0.9, centered=True, groups=GROUPS),
                        ("RMSprop", dict(momentum=0.9, centered=True))),
}


@DTYPES
@pytest.mark.parametrize("name", list(TORCH))
def test_torch_rules_by_hand_and_built_in_match_torch(name, dtype):
    make, (cls, kw) = TORCH[name]
    prog, grads, _ = run(make(), dtype)
    check(prog, *torch_run(cls, kw, make(), grads, dtype), dtype)


def test_init_reads_its_groups_hyper_parameters():
    """torch starts Rprop's step sizes and ASGD's eta at the group's lr: init's self.hp is the param's group's."""
    for make, state in (TORCH["rprop"][0], "step_size"), (TORCH["asgd"][0], "eta"):
        prog = R.trace(make(), np.float64)
        for k, v in prog.opt_state[state].items():
            assert np.all(v == make().hp["lr"] * (0.5 if len(SHAPES[k]) < 2 else 1.0)), (state, k)
    assert prog.opt_state["eta"]["w1"].shape == () and prog.opt_state["ax"]["w1"].shape == SHAPES["w1"]


# ----------------------------------------------------------------------------- numpy transcriptions
def ademamix(p, g, s, hp, t):
    b1, b2, b3 = hp["betas"]
    a = t / hp["T"]
    b3 = min(math.exp(math.log(b1) * math.log(b3) / ((1 - a) * math.log(b3) + a * math.log(b1))), b3)
    s["m1"] = b1 * s["m1"] + (1 - b1) * g
    s["m2"] = b3 * s["m2"] + (1 - b3) * g
    s["nu"] = b2 * s["nu"] + (1 - b2) * g * g
    alpha = min(t * hp["alpha"] / hp["T"], hp["alpha"])
    u = (s["m1"] / (1 - b1 ** t) + alpha * s["m2"]) / (np.sqrt(s["nu"] / (1 - b2 ** t)) + hp["eps"])
    return p - hp["lr"] * (u + hp["weight_decay"] * p)


def schedule_free(y, g, s, hp, t):
    b1, b2 = hp["betas"]
    lr = hp["lr"] * min(1.0, t / hp["warmup_steps"]) * math.sqrt(1 - b2 ** t)
    s["v"] = b2 * s["v"] + (1 - b2) * g * g
    s["z"] = s["z"] - lr * g / (np.sqrt(s["v"]) + hp["eps"]) - lr * hp["weight_decay"] * y
    s["weight_sum"] = s["weight_sum"] + lr * lr
    c = lr * lr / s["weight_sum"]
    s["x"] = (1 - c) * s["x"] + c * s["z"]
    return (1 - b1) * s["z"] + b1 * s["x"]


def sophia(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    s["exp_avg"] = b1 * s["exp_avg"] + (1 - b1) * g
    if t % hp["k"] == 1:
        s["hessian"] = b2 * s["hessian"] + (1 - b2) * g * g
    ratio = np.clip(np.abs(s["exp_avg"]) / (hp["rho"] * s["hessian"] + 1e-15), None, 1.0)
    return p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * np.sign(s["exp_avg"]) * ratio


def adam(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    return N.adam(p, g, s, {**hp, "beta1": b1, "beta2": b2, "weight_decay": 0.0}, t)


def centralized_adam(p, g, s, hp, t):
    if g.ndim > 1:
        g = g - g.reshape(len(g), -1).mean(1).reshape((-1,) + (1,) * (g.ndim - 1))
    return adam(p, g, s, hp, t)


def adagrad_norm(p, g, s, hp, t):
    s["acc"] = s["acc"] + np.sum(g * g)
    return p - hp["lr"] * g / (np.sqrt(s["acc"]) + hp["eps"])


def lookahead(p, g, s, hp, t):
    s["buf"] = hp["momentum"] * s["buf"] + g
    fast = p - hp["lr"] * s["buf"]
    if t % hp["k"]:
        return fast
    s["slow"] = s["slow"] + hp["alpha"] * (fast - s["slow"])
    return s["slow"].copy()


def adam_ema(p, g, s, hp, t):
    p = adam(p, g, s, hp, t)
    d = min(hp["ema_decay"], (1 + t) / (10 + t))
    s["ema"] = d * s["ema"] + (1 - d) * p
    return p


TRUST = []                  # LAMB's trust ratios before clipping (the test checks that some was clipped)


def lamb(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    s["exp_avg"] = b1 * s["exp_avg"] + (1 - b1) * g
    s["exp_avg_sq"] = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    u = (s["exp_avg"] / (1 - b1 ** t)) / (np.sqrt(s["exp_avg_sq"] / (1 - b2 ** t)) + hp["eps"]) + \
        hp["weight_decay"] * p
    wn, un = np.linalg.norm(p), np.linalg.norm(u)
    TRUST.append(wn / un)
    return p - hp["lr"] * (min(wn / un, 10.0) if wn > 0 and un > 0 else 1.0) * u


def lars(p, g, s, hp, t):
    pn, gn = np.linalg.norm(p), np.linalg.norm(g)
    trust = hp["trust_coef"] * pn / (gn + hp["weight_decay"] * pn) if hp["adapt"] and pn > 0 and gn > 0 else 1.0
    s["mu"] = hp["momentum"] * s["mu"] + hp["lr"] * trust * (g + hp["weight_decay"] * p)
    return p - s["mu"]


LARS_GROUPS = [GROUPS[0], {**GROUPS[1], "adapt": 0.0}]        # the biases excluded from the trust ratio
# (rule, its numpy transcription)
NUMPY = {
    "ademamix": (lambda: R.AdEMAMix(0.01, T=10, weight_decay=0.01, groups=GROUPS), ademamix),
    "schedule_free": (lambda: R.ScheduleFreeAdamW(0.01, weight_decay=0.01, groups=GROUPS), schedule_free),
    "sophia": (lambda: R.Sophia(0.01, weight_decay=0.01, groups=GROUPS), sophia),
    "centralized": (lambda: R.CentralizedAdam(0.01, groups=NO_WD), centralized_adam),
    "adagrad_norm": (lambda: R.AdaGradNorm(0.1, groups=NO_WD), adagrad_norm),
    "lookahead": (lambda: R.Lookahead(0.05, k=4, groups=NO_WD), lookahead),
    "adam_ema": (lambda: R.AdamEMA(0.01, groups=NO_WD), adam_ema),
    "lamb": (lambda: R.LAMB(0.01, eps=5.0, weight_decay=0.01, groups=GROUPS), lamb),
    "lars": (lambda: R.LARS(0.5, weight_decay=0.01, groups=LARS_GROUPS), lars),
    "adabelief": (lambda: Z.AdaBelief(0.01, eps=1e-12, weight_decay=0.01, groups=GROUPS), Z.adabelief),
    "adan": (lambda: Z.Adan(0.01, weight_decay=0.01, groups=GROUPS), Z.adan),
    "signum": (lambda: Z.Signum(0.01, weight_decay=0.01, groups=GROUPS), Z.signum),
}


def numpy_run(fn, opt, grads, state0, dtype):
    """fn's steps in dtype on btjit's gradients from init's state, each param with its group's hyper-parameters
    (lr * lr_scale, halved mid-run): (params, {param: {state name: value}})."""
    p, s = R.params0(dtype), {k: {n: v.copy() for n, v in st.items()} for k, st in state0.items()}
    groups = [(names, {**hp, "lr": hp["lr"] * hp["lr_scale"]}) for names, hp in O.resolve_groups(opt, p)]
    for t, g in enumerate(grads, 1):
        for names, hp in groups:
            hp["lr"] = hp["lr"] / 2 if t == CHANGE + 1 else hp["lr"]
            for k in names:
                p[k] = np.asarray(fn(p[k], g[k], s[k], hp, t), dtype)
                s[k] = {n: np.asarray(v, dtype) for n, v in s[k].items()}
    return p, s


@DTYPES
@pytest.mark.parametrize("name", list(NUMPY))
def test_rules_match_their_numpy_transcriptions(name, dtype):
    make, fn = NUMPY[name]
    TRUST.clear()
    prog, grads, state0 = run(make(), dtype)
    check(prog, *numpy_run(fn, make(), grads, state0, dtype), dtype)
    if name == "lamb":                                      # its trust ratio clipped at 10 at some steps, not all
        assert min(TRUST) < 10 < max(TRUST)
    if name in ("adagrad_norm", "schedule_free"):           # a 0-d init state updated by a number stays one
        state = "acc" if name == "adagrad_norm" else "weight_sum"
        assert {k: v.shape for k, v in prog.opt_state[state].items()} == {k: () for k in SHAPES}
