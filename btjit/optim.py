"""Optimizers, run inside the native step: one kernel pass over the contiguous param/grad/state slices.

Hyper-parameters live in arena slots (not in compiled code), so `prog.lr = x` takes effect at the next
step without recompiling. Semantics follow torch.optim.SGD and torch.optim.AdamW.
"""
from __future__ import annotations

from dataclasses import dataclass

HYPER = ("lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "clip_norm", "clip_scale")


@dataclass
class SGD:
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    @property
    def n_state(self):
        return 1 if self.momentum else 0

    def hyper(self):
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def rows(self, L, plan, h):
        p0, n = plan.params_span
        return [L.row("k_sgd", op_=p0, og=plan.grads_start, obuf=plan.state_start(0), n=n, olr=h["lr"],
                      omom=h["momentum"], owd=h["weight_decay"], oscale=h["clip_scale"], has_buf=self.n_state)]


@dataclass
class AdamW:
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    n_state = 2

    def hyper(self):
        return {"lr": self.lr, "beta1": self.betas[0], "beta2": self.betas[1], "eps": self.eps,
                "weight_decay": self.weight_decay}

    def rows(self, L, plan, h):
        p0, n = plan.params_span
        return [L.row("k_adamw", op_=p0, og=plan.grads_start, om=plan.state_start(0), ov=plan.state_start(1), n=n,
                      olr=h["lr"], ob1=h["beta1"], ob2=h["beta2"], oeps=h["eps"], owd=h["weight_decay"],
                      ostep=plan.int_state, oscale=h["clip_scale"])]


def update_rows(opt, clip_norm, skip_nonfinite, L, plan):
    """Tape rows of the update: the gradient-norm row (for clipping by global norm, and for skipping the
    update when a gradient is NaN/Inf), then the optimizer."""
    h = {k: plan.hyper_off + i for i, k in enumerate(HYPER)}
    rows = []
    if clip_norm or skip_nonfinite:
        rows.append(L.row("k_clip_scale", og=plan.grads_start, n=plan.params_span[1], omax=h["clip_norm"],
                          oscale=h["clip_scale"]))
    return rows + opt.rows(L, plan, h)
