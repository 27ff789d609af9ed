"""The `btjit train` application: TOML configs into typed dataclasses (config.py; their rules: config_rules.py),
data and the bundled corpora (data.py), model files (usermodel.py) and the built-in models' registry (registry.py),
the training loop (trainer.py; its small pieces: runparts.py), reading the files a run is given (files.py), LR
schedules and gradient accumulation (schedule.py), checkpoints and run dirs (checkpoint.py, rundir.py), sampling
(sampling.py) and data-parallel training over MPI (distributed.py, compress.py; mpilaunch.py starts such a run
from Python).

    from btjit.train import train
    result = train(cfg, "runs/x")          # a Result; raises TrainError & co. with one-line messages
"""
from __future__ import annotations


def train(cfg: Config, run_dir, data_path=None, resume=False, threads=None, echo=None,
          resume_hint="--resume", distributed=None) -> Result:
    """Run (or resume) a training run; returns a Result. Raises TrainError & co. with one-line messages.
    distributed: True = data-parallel over MPI (mpi4py; run this under `mpiexec -n N`), False = one process,
    None = data-parallel exactly when an MPI launcher started this process with N > 1 (see btjit.train.distributed)."""
    from btjit.train import distributed as dist_mod
    from btjit.train.trainer import Trainer
    if dist_mod.wanted(distributed):
        return dist_mod.train(cfg, run_dir, data_path, resume, threads, echo, resume_hint)
    return Trainer(cfg, run_dir, data_path, resume, threads, echo, resume_hint).run()
