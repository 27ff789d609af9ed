"""The built-in optimizers' one-pass update: `opt_update`, torch.optim.SGD, Adam/AdamW or Adadelta over one param
group's flat slice, emitted by btjit/optim/build.py in place of the traced equations of their `update`
(the same arithmetic: those equations are its reference). Inputs: the param, the gradient, the state (in
the optimizer's state order), then the scalars SCALARS[kind] names; outputs: the new param and state, always
computed in place (optim/build.py pins them to their regions). Lowered to k_opt_sgd / k_opt_adam / k_opt_adadelta
(btjit/kernels/optim.py; a row split over the threads from PAR_EW_ELEMENTS elements)."""
from __future__ import annotations

import numpy as np

from btjit.kernels import optim as K

from btjit.graph.optable import ShapeError, op, par_parts

FIELD = {"t": "ot", "lr": "olr", "scale": "oscale", "weight_decay": "owd", "momentum": "omom",
         "1-dampening": "o1damp", "beta1": "ob1", "1-beta1": "o1b1", "beta2": "ob2", "1-beta2": "o1b2", "eps": "oeps",
         "1-rho": "o1rho"}
SCALARS = {"sgd": ("t", "lr", "scale", "weight_decay", "momentum", "1-dampening"),
           "adam": ("t", "lr", "scale", "weight_decay", "beta1", "1-beta1", "beta2", "1-beta2", "eps"),
           "adadelta": ("lr", "scale", "weight_decay", "1-rho", "eps")}
STATE = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "adadelta": ("square_avg", "acc_delta")}
STATE_FIELDS = {"sgd": ("ob",), "adam": ("om", "ov"), "adadelta": ("osq", "oacc")}   # the kernels' row fields
FLAGS = {"scale": K.SCALE, "skip": K.SKIP, "wd": K.WD, "decoupled": K.DECOUPLED, "momentum": K.MOMENTUM,
         "dampening": K.DAMPENING, "nesterov": K.NESTEROV}


def _nstate(a):
    return len(STATE[a["kind"]]) if a["kind"] != "sgd" or "momentum" in a["flags"] else 0


def _rule(types, attrs, fd):
    n = 2 + _nstate(attrs)
    if len(types) != n + len(SCALARS[attrs["kind"]]):
        raise ShapeError(f"opt_update {attrs['kind']} takes {n} slices and its scalars")
    if any(s != types[0][0] for s, _ in types[1:n]) or any(s != () for s, _ in types[n:]):
        raise ShapeError("opt_update: the slices must share one shape, the scalars be scalars")
    return [(types[0][0], fd)] * (n - 1)


def ref(xs, a):
    """numpy's transcription of SGD.update / Adam.update / Adadelta.update (btjit/optim/builtin.py) with the clip
    scale."""
    ns, fl = _nstate(a), a["flags"]
    p, g, st = xs[0], xs[1], list(xs[2:2 + ns])
    s = dict(zip(SCALARS[a["kind"]], (float(x) for x in xs[2 + ns:])))
    if "skip" in fl and s["scale"] != s["scale"]:
        return (p, *st)
    g = g * s["scale"] if "scale" in fl else g
    if a["kind"] == "sgd":
        g = g + s["weight_decay"] * p if "wd" in fl else g
        if "momentum" not in fl:
            return (p - s["lr"] * g,)
        b = g if "dampening" in fl and s["t"] == 1 else s["momentum"] * st[0] + s["1-dampening"] * g
        return (p - s["lr"] * (g + s["momentum"] * b if "nesterov" in fl else b), b)
    if a["kind"] == "adadelta":
        g = g + s["weight_decay"] * p if "wd" in fl else g
        sq = st[0] + s["1-rho"] * (g * g - st[0])
        d = np.sqrt((st[1] + s["eps"]) / (sq + s["eps"])) * g
        return (p - s["lr"] * d, sq, st[1] + s["1-rho"] * (d * d - st[1]))
    if "wd" in fl:
        p, g = (p * (1 - s["lr"] * s["weight_decay"]), g) if "decoupled" in fl else (p, g + s["weight_decay"] * p)
    m = st[0] + s["1-beta1"] * (g - st[0])
    v = s["beta2"] * st[1] + s["1-beta2"] * g * g
    step = s["lr"] / (1 - (1 - s["1-beta1"]) ** s["t"])        # the kernel's: of the exact 1 - beta slots
    denom = np.sqrt(v) / np.sqrt(1 - (1 - s["1-beta2"]) ** s["t"]) + s["eps"]
    return (p - step * m / denom, m, v)


def lower(e, L):
    a, ns = e.attrs, _nstate(e.attrs)
    for x, y in zip((e.ins[0], *e.ins[2:2 + ns]), e.outs):
        if L.off(x) != L.off(y):
            raise AssertionError("opt_update: its outputs must be computed in place (optim/build.py pins them)")
    offs = [L.off(v) for v in e.ins]
    sc = {FIELD[k]: L.off(v) for k, v in zip(SCALARS[a["kind"]], e.ins[2 + ns:])}
    flags = sum(FLAGS[f] for f in a["flags"])
    n = e.ins[0].size
    state = dict(zip(STATE_FIELDS[a["kind"]], offs[2:2 + ns] or [0]))
    return [L.row(f"k_opt_{a['kind']}", split=par_parts(L, n, n), op_=offs[0], og=offs[1], n=n, flags=flags, **state,
                   **sc)]


op("opt_update", infer=_rule, ref=ref, lower=lower, internal=True, nondiff=True)
