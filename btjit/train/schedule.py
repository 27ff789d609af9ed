# btjit/schedule.py -- what each optimizer update of `btjit train` does around the native step:
#   * its learning rate: the [optim] schedule ("constant", "cosine" = warmup + cosine decay to lr_min,
#     "linear" = warmup + linear decay to lr_min, "step" = torch's StepLR: times gamma every step_size steps),
#     nanoGPT's get_lr semantics, a pure function of the step
#     index, so a resumed run sets exactly the LRs of an uninterrupted one; the trainer writes it into the
#     program's hyper-parameter slot (`prog.lr = ...`) before each native step;
#   * its micro-batches: gradient accumulation (`train.grad_accum = k`): prog.value_and_grad() on each of k
#     micro-batches (each with its own dropout masks and its buffers' assigns), the gradients summed in one
#     buffer, their mean copied back into the arena's grads region (prog.grad_slice), then
#     prog.apply_update() (clip / non-finite skip + optimizer rows): for a mean loss this is one step on the
#     k-times batch.
# No config parsing here (btjit.train.config validates the keys) and no numpy at import.
from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear", "step")


def lr_at(it: int, lr: float, schedule: str = "constant", warmup_steps: int = 0, decay_steps: int = 0,
          lr_min: float = 0.0, gamma: float = 0.1, step_size: int = 1) -> float:
    """The learning rate of update `it` (0-based: the first step of a run is it = 0).

    nanoGPT's train.py get_lr (https://github.com/karpathy/nanoGPT/blob/master/train.py), with warmup_iters =
    warmup_steps, lr_decay_iters = decay_steps, min_lr = lr_min:
        if it < warmup_iters: return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters: return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (learning_rate - min_lr)
    "linear" takes coeff = 1 - decay_ratio instead; "constant" is lr after the (optional) warm-up and ignores
    decay_steps and lr_min. decay_steps must be > warmup_steps for "cosine" and "linear". "step" is torch's
    StepLR counted in updates from the end of the warm-up: lr * gamma ** ((it - warmup_steps) // step_size)
    (pytorch/examples' MNIST: step_size = the updates of an epoch, gamma 0.7); it ignores decay_steps and lr_min."""
    if it < warmup_steps:
        return lr * (it + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return lr
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "step":
        return lr * gamma ** ((it - warmup_steps) // step_size)
    if it > decay_steps:
        return lr_min
    ratio = (it - warmup_steps) / (decay_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if schedule == "cosine" else 1.0 - ratio
    return lr_min + coeff * (lr - lr_min)


def decay_end(optim_cfg, steps: int) -> int:
    """optim.decay_steps, or train.steps when it is 0 (decay over the whole run)."""
    return optim_cfg.decay_steps or steps


def for_config(cfg):
    """it -> learning rate for a btjit.train.config.Config (its [optim] schedule over train.steps)."""
    o = cfg.optim
    end = decay_end(o, cfg.train.steps)
    return lambda it: lr_at(it, o.lr, o.schedule, o.warmup_steps, end, o.lr_min, o.gamma, o.step_size)


def describe(cfg) -> str:
    """The schedule for the banner, e.g. 'cosine 0.003 -> 0.0003 over 3000 steps, warmup 100'."""
    o = cfg.optim
    warm = f", warmup {o.warmup_steps}" if o.warmup_steps else ""
    if o.schedule == "constant":
        return f"constant lr {o.lr:g}{warm}"
    if o.schedule == "step":
        return f"step lr {o.lr:g}, x {o.gamma:g} every {o.step_size} steps{warm}"
    return f"{o.schedule} lr {o.lr:g} -> {o.lr_min:g} by step {decay_end(o, cfg.train.steps)}{warm}"


class Accumulator:
    """Gradient accumulation for a Program traced with an optimizer: step(batches) = one update from the
    mean gradient of the micro-batches (each a tuple of batch arrays); returns the mean loss."""

    def __init__(self, prog, rank: int = 0, ranks: int = 1):
        self.prog, self.rank, self.ranks = prog, rank, ranks     # ranks: data-parallel processes (MPI)
        self.grads = prog.grad_slice                 # the arena's whole grads region (a view)
        self.sum = None                              # the running sum (allocated at the first k > 1)

    def grad(self, batches) -> float:
        """Mean loss over the micro-batches; leaves the mean of their gradients in prog.grad_slice. Micro-batch i
        of rank r draws the random numbers of part i N + r of one batch of k N parts (prog.rng_part: its own
        dropout masks, on every rank its own), and the buffers' assigns of every micro-batch but the last (which
        the update applies) are applied after it: batch norm's running statistics move k times an update, as
        torch's do over k forwards."""
        k, total = len(batches), 0.0
        if k == 1 and self.ranks == 1:
            return self.prog.value_and_grad(*batches[0])
        try:
            for i, batch in enumerate(batches):
                self.prog.rng_part(i * self.ranks + self.rank)
                total += self.prog.value_and_grad(*batch)
                if k == 1:
                    return total
                if i < k - 1:
                    self.prog.apply_assigns()
                if i == 0:
                    if self.sum is None:
                        self.sum = self.grads.copy()
                    self.sum[...] = self.grads
                else:
                    self.sum += self.grads
        finally:
            self.prog.rng_part(0)
        self.grads[...] = self.sum
        self.grads /= k
        return total / k

    def step(self, batches) -> float:
        loss = self.grad(batches)
        self.prog.apply_update()
        return loss
