"""The pieces of a `btjit train` run that stand outside the Trainer: TrainError and Result, the run's file names,
threads and seeds (set_threads, seeds), the optimizer and the traced training program of a config (make_optimizer,
build_program: also `btjit export`'s), the non-finite check, the world-size check of a resume and the banner's
optimizer line (optim_line), the notes of a resume that cannot be bit-exact (resume_notes), the data file a run
reads (data_file, recorded_data_file: also `btjit export`'s).
btjit.train.trainer re-exports all of them.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import btjit
from btjit.host.threads import default_threads
from btjit.train import usermodel
from btjit.train.config import Config, ConfigError

METRICS, CONFIG_FILE = "metrics.jsonl", "config.toml"


class TrainError(Exception):
    """The run cannot start or had to stop; str(e) is one readable line."""


@dataclass
class Result:
    step: int                       # steps completed
    checkpoint: Path | None         # the last checkpoint written (or resumed from)
    interrupted: bool = False
    val_loss: float | None = None


def set_threads(n: int) -> int:
    """Use n threads for btjit's native code (BLAS and numba), also in child processes. 0 (the config's default)
    is btjit's default: $BTJIT_NUM_THREADS where set, else every core the process may run on."""
    n = btjit.set_num_threads(n or default_threads())
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = str(n)
    return n


def seeds(seed: int):
    """One seed drives everything: (param init, train batches, eval batches, samples) generators."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]


def first_nonfinite(arrays: dict) -> str | None:
    for name, a in arrays.items():
        if not np.all(np.isfinite(a)):
            return name
    return None


def make_optimizer(o, optim_file=None, params=None):
    """The optimizer of an [optim] section (btjit.optim.from_section; optim_file: the user's, a ModelFile of kind
    "optimizer"), its groups checked on params if given: a bad argument or group is a ConfigError."""
    guard = optim_file and (lambda: usermodel.guard(optim_file.name, str(optim_file.path), "making the optimizer"))
    try:
        opt = btjit.optim.from_section(o, optim_file and optim_file.module, guard or contextlib.nullcontext)
        if params is not None:
            btjit.optim.resolve_groups(opt, params)
        return opt
    except btjit.optim.OptimizerError as e:
        raise ConfigError(f"[optim]: {e}") from None


def build_program(cfg: Config, model, params, x, y, replicas=1, optim_file=None, defer_kernels=False):
    """The training program of a config: the model's loss traced on a batch like (x, y) with the config's
    optimizer (optim_file: the user's, [optim] file), clipping and dtype (`btjit train` and `btjit export`)."""
    o = cfg.optim
    opt = make_optimizer(o, optim_file, params)
    in_optim = usermodel.guard(optim_file.name, str(optim_file.path), "tracing its init and update", own_only=True) \
        if optim_file else contextlib.nullcontext()
    with model.guard("tracing loss(p, x, y)"), in_optim:
        return btjit.trace(model.loss, params, x, y, optimizer=opt, clip_norm=o.clip_norm or None,
                           clip_value=o.clip_value or None, dtype=cfg.train.dtype, buffers=model.buffers(),
                           skip_nonfinite=True,    # a non-finite gradient never updates (stop or skip)
                           replicas=replicas,      # replicas average losses: only for a mean over the batch
                           seed=cfg.train.seed,    # of the random numbers inside the step (dropout)
                           precision=cfg.train.precision, _defer_kernels=defer_kernels)


def check_world_size(ck, n: int) -> None:
    """Resume only with the number of processes that wrote the checkpoint (each has its own batch stream)."""
    had = int(ck.meta.get("distributed", {}).get("world_size", 1))
    if had != n:
        how = f"mpiexec -n {had} btjit train ... --resume" if had > 1 else "btjit train ... --resume (one process)"
        raise TrainError(f"--resume: {ck.path.name} was written by a run on {had} process(es), this run has {n}; "
                         f"resume it with the same number: {how}")


def optim_line(cfg, opt) -> str:
    """The banner's optimizer line: the optimizer (a user file's class and file), its schedule and hyper-parameters,
    batch, steps, seed. opt: the program's optimizer (or None)."""
    from btjit.optim.base import fmt
    from btjit.train import schedule
    t, o = cfg.train, cfg.optim
    accum = f" x {t.grad_accum} micro-batches = {t.batch_size * t.grad_accum}" if t.grad_accum > 1 else ""
    if o.file or o.name not in ("sgd", "adam", "adamw"):    # the optimizer's own hyper-parameters
        hp = "".join(f" {k} {fmt(v)}" for k, v in (opt.hp if opt else {}).items() if k not in ("lr", "weight_decay"))
    else:
        hp = f" momentum {o.momentum:g}" if o.name == "sgd" else f" betas {tuple(o.betas)} eps {o.eps:g}"
    name = f"{type(opt).__name__} ({Path(o.file).name})" if o.file and opt else o.name
    groups = f" groups {len(opt.groups)}" if opt and opt.groups else ""
    return (f"optim: {name} {schedule.describe(cfg)}{hp} weight_decay {o.weight_decay:g}{groups}" +
            (f" clip_norm {o.clip_norm:g}" if o.clip_norm else "") +
            f" | batch {t.batch_size}{accum} | {t.steps} steps | seed {t.seed}")


def resume_notes(ck, cfg, replicas: int) -> list[str]:
    """The notes of a --resume that cannot end bit-identical to an uninterrupted run: the checkpoint was trained
    in another train.dtype or train.precision, or as another number of data-parallel replicas (--threads)."""
    saved, now = ck.meta.get("config", {}).get("train", {}), cfg.to_dict()["train"]
    diff = [(f"train.{k} = {saved[k]!r}", repr(now[k])) for k in ("dtype", "precision")
            if k in saved and saved[k] != now[k]]
    if ck.meta.get("replicas", replicas) != replicas:       # the batch cut into other shards: other sums
        diff.append((f"{ck.meta['replicas']} data-parallel replica(s)", f"{replicas} (see --threads)"))
    return [f"note: {ck.path.name} was trained with {a}, this run continues in {b}: it will not be bit-identical to an "
            f"uninterrupted run" for a, b in diff]


def recorded_data_file(ck) -> str | None:
    """The data file the checkpoint's run read, where it still is (its data_file; a checkpoint older than that entry:
    its data name when that is a file here); None for a bundled corpus."""
    name = ck.meta.get("data_file") or ck.meta.get("data")
    return name if name and not name.startswith("<") and Path(name).is_file() else None


def data_file(ck, cfg, data_path, echo) -> str | None:
    """The data file a run reads, resolved (None: the bundled corpus): --data (data_path), else data.path; on
    --resume without either, the file the checkpoint's run read (noted). Another file than the checkpoint's is
    noted."""
    read = recorded_data_file(ck) if ck else None
    if data_path is None and not cfg.data.path and read:
        echo(f"note: --resume reads {read}, the --data file {ck.path.name} was trained on")
        return read
    f = cfg.data.path if data_path is None else data_path
    f = str(Path(f).resolve()) if f else None
    if ck and ck.meta.get("data_file", f) != f:
        echo(f"note: {ck.path.name} was trained on {ck.meta.get('data_file') or ck.meta.get('data')}; this run reads "
             f"{f or 'the bundled corpus'}")
    return f
