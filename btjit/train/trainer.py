# btjit/train/trainer.py -- the Trainer, the training loop of `btjit train`: data, model (btjit.train.registry; the
# user's model file is copied into the run dir, and --resume uses that copy), one traced program (btjit.trace), the
# start-up banner, the LR of each step and gradient accumulation (btjit.train.schedule), progress lines, val loss,
# the best-val checkpoint, samples, the JSONL metrics log, checkpoints, Ctrl+C (finish the step, save, exit
# 0), --resume (bit-exact: the batch RNG state is checkpointed) and NaN/Inf handling. Not here: the run dir
# checks and lock (btjit.train.rundir), the compiler (btjit.trace), the models (btjit.models, btjit.train.usermodel),
# argument parsing (btjit.cli), the run's small pieces (TrainError, Result, set_threads, seeds, build_program, ...:
# btjit.train.runparts, re-exported here). Errors are TrainError (or Config/Data/CheckpointError, ModelFileError),
# one line each.
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

import btjit
from btjit.kernels.library import LIBRARY
from btjit.train import arrays
from btjit.train import checkpoint as ckpt_mod
from btjit.train import data as data_mod
from btjit.train import rundir
from btjit.train import schedule as sched_mod
from btjit.train import usermodel
from btjit.train.checkpoint import CheckpointError
from btjit.train.config import Config, ModelConfig
from btjit.train.runparts import (CONFIG_FILE, METRICS, Result, TrainError, build_program, check_world_size,
                                  data_file, first_nonfinite, make_optimizer, optim_line, resume_notes, seeds,
                                  set_threads)

__all__ = ["CONFIG_FILE", "METRICS", "MAX_SKIPS", "Result", "TrainError", "Trainer", "build_program",
           "check_world_size", "first_nonfinite", "make_optimizer", "seeds", "set_threads", "trim_metrics"]

MAX_SKIPS = 100   # consecutive non-finite steps tolerated with on_nonfinite = "skip"
trim_metrics = rundir.trim_metrics


class Trainer:
    def __init__(self, cfg: Config, run_dir, data_path=None, resume=False, threads=None,
                 echo=None, resume_hint="--resume"):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.echo = echo or (lambda s="": print(s, flush=True))
        self.resume_hint = resume_hint
        self.lock = None
        try:
            self._setup(cfg, data_path, resume, threads)
        except BaseException:
            if self.lock is not None:
                self.lock.abandon()
                self.lock = None
            raise

    def _setup(self, cfg, data_path, resume, threads):
        t = cfg.train
        self._prepare(resume)
        self.model_file = usermodel.for_run(cfg.model, self.run_dir, self.resumed, self.echo)   # kind "python"
        self.optim_file = cfg.optim.file and usermodel.file_for_run(cfg.optim.file, self.run_dir, self.resumed,
                                                                    self.echo, "optimizer")
        self.threads = set_threads(threads if threads is not None else t.threads)
        vocab = data_mod.Vocab(self.resumed.meta["vocab"]) if self.resumed else None
        self.data_file = data_file(self.resumed, cfg, data_path, self.echo)
        read = data_path if data_path is not None or cfg.data.path else self.data_file
        self.ds = arrays.load(cfg, read, vocab)              # any format (the text ones: data_mod.load)
        self.param_rng, self.rng, _, self.sample_rng = seeds(t.seed)
        self.lr_at = sched_mod.for_config(cfg)
        self._build_program()
        self.accum = sched_mod.Accumulator(self.prog)
        self.step, self.last_ckpt, self.best = 0, None, None   # best: {"step", "val_loss"} of best.npz
        self.log_losses = []            # the losses since the last progress line (checkpointed, for --resume)
        if self.resumed:
            self._restore(self.resumed)
        self.sampler = None
        self.metrics_path = self.run_dir / METRICS
        self._write_run_files(resume)

    def release(self) -> None:
        """Release the run dir lock (at the end of run(), or when set-up fails)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---- set-up (btjit.train.distributed.DistributedTrainer overrides these hooks) ----------------------
    @property
    def local_batch_size(self) -> int:
        """Sequences (samples) this process computes per step: train.batch_size in a single process."""
        return self.cfg.train.batch_size

    def _prepare(self, resume):
        try:
            self.lock = rundir.prepare(self.run_dir, resume)
        except rundir.RunDirError as e:
            raise TrainError(str(e)) from None
        note = self.lock.note()
        if note:
            self.echo(note)
        self.resumed = self._find_checkpoint() if resume else None

    def _restore(self, ck):
        check_world_size(ck, 1)
        self._load_program_state(ck)
        self.rng = ckpt_mod.rng_from_state(ck.meta["rng_state"])
        self._restore_run_state(ck)

    def _restore_run_state(self, ck):   # the loop's state besides the program and the batch RNG
        self.step, self.last_ckpt, self.best = ck.step, ck.path, ck.meta.get("best")
        self.log_losses = [float(v) for v in ck.meta.get("log_losses", [])]
        if "sample_rng_state" in ck.meta:
            self.sample_rng = ckpt_mod.rng_from_state(ck.meta["sample_rng_state"])

    def _load_program_state(self, ck):
        state = {k: v for k, v in ck.state.items() if not k.startswith("dist/")}
        for note in resume_notes(ck, self.cfg, getattr(self.prog, "replicas", 1)):
            self.echo(note)
        try:
            ckpt_mod.check_compatible(ckpt_mod.Checkpoint(ck.path, ck.step, state, ck.meta), self.prog.state_dict())
        except CheckpointError as e:            # the model was checked (_find_checkpoint): the optimizer changed?
            saved, now = ck.meta.get("config", {}).get("optim", {}), self.cfg.to_dict()["optim"]
            diff = [k for k in ("name", "file", "decay", "groups", "hp") if saved.get(k) != now.get(k)]
            if not diff:
                raise
            k = diff[0]
            raise TrainError(f"--resume: {ck.path.name} was trained with optim.{k} = {saved.get(k)!r}, the config "
                             f"says {now.get(k)!r}: its optimizer state does not fit ({e})") from None
        self.prog.load_state_dict(state)

    def _write_run_files(self, resume):
        for f in (self.model_file, self.optim_file):
            if f:
                f.copy_into(self.run_dir)
        rundir.start_metrics(self.metrics_path, self.step if resume else None, self.echo)
        (self.run_dir / CONFIG_FILE).write_text(rundir.CONFIG_HEADER + self.cfg.to_toml())

    def _find_checkpoint(self):
        ck, skipped = ckpt_mod.latest_valid(self.run_dir)
        for path, why in skipped:
            bad = path.with_name(path.name + ".corrupt")
            os.replace(path, bad)
            self.echo(f"warning: skipped {why}; moved it to {bad.name}")
        if ck is None:
            raise TrainError(f"--resume: no valid checkpoint in {self.run_dir}")
        saved = ck.meta.get("config", {}).get("model", {})
        now = self.cfg.to_dict()["model"]
        default = dataclasses.asdict(ModelConfig())      # a key newer than the checkpoint had its default
        diff = [k for k in now if saved.get(k, default.get(k)) != now[k] and k != "file"]   # file: the run dir's copy
        if diff:
            k = diff[0]
            raise TrainError(f"--resume: {ck.path.name} was trained with model.{k} = {saved.get(k)!r}, "
                             f"the config says {now[k]!r}")
        if skipped:
            self.echo(f"resuming from the newest valid checkpoint {ck.path.name} (step {ck.step})")
        return ck

    def _build_program(self):
        from btjit.train.registry import model_for
        cfg = self.cfg
        self.model = model_for(cfg.model, len(self.ds.vocab), self.model_file, cfg.data.format)
        x, y = self.ds.batch("train", self.local_batch_size, np.random.default_rng(0))
        replicas = btjit.replicas_for(len(y), y.size, self.threads) if self.model.mean_over_batch else 1
        t0 = time.perf_counter()
        self.prog = build_program(cfg, self.model, self.model.init_params(self.param_rng), x, y, replicas,
                                  self.optim_file, defer_kernels=True)
        progs = [self.prog]
        if not getattr(self.ds, "classes", 0):          # evaluate()'s program, on a val batch as it takes them:
            xv, yv = self.ds.batch("val", cfg.train.batch_size, np.random.default_rng(0))   # its entries compile
            with self.model.guard("tracing loss(p, x, y) for evaluation"):                 # with the step's
                progs.append(self.prog.eval_program(xv, yv, defer=True))
        report = LIBRARY.ensure(self.prog.graph.float_dtype, np.concatenate([p.tape[:, 0] for p in progs]))
        for p in progs:
            p.load_kernels(report)
        self.build_seconds = time.perf_counter() - t0
        per_sample = self.model.format in ("lines", "arrays")
        self.tokens_per_step = (len(y) if per_sample else x.size) * cfg.train.grad_accum
        self.classifier, self.val_acc = None, None     # a classification run's evaluator and its last accuracy

    def banner(self):
        import numba
        from importlib import metadata
        try:
            ver = metadata.version("btjit")
        except metadata.PackageNotFoundError:
            ver = "dev"
        p, t = self.prog, self.cfg.train
        tr, cs = getattr(p, "trace_seconds", 0.0), getattr(p, "compile_seconds", 0.0)
        plan = getattr(p, "plan_seconds", None)
        times = f"trace {tr:.2f} s + " + (f"plan {plan:.2f} s + " if plan is not None else "") + \
            f"compile {cs:.2f} s (btjit.trace wall time {self.build_seconds:.2f} s)"
        reps, used = getattr(p, "replicas", 1), getattr(p, "threads", 1)
        how = f"{reps} data-parallel replicas" if reps > 1 else "threaded kernels" if used > 1 else "one thread"
        self.echo(f"btjit {ver} | numba {numba.__version__} | numpy {np.__version__} | "
                  f"threads {used} of {self.threads} ({how}) | {t.dtype}" +
                  (f", products {p.precision}" if getattr(p, "precision", "fp32") != "fp32" else ""))
        self.echo(f"model: {self.model.arch} | {p.n_params:,} params | arena {p.arena_bytes / 1e6:.2f} MB")
        self.echo(self.ds.describe())
        self.echo(optim_line(self.cfg, getattr(p, "optimizer", None)))
        self.echo(f"program: {times}")
        where = f"resumed from {self.last_ckpt.name} at step {self.step}" if self.resumed else "new run"
        self.echo(f"run dir: {self.run_dir} ({where})")

    # ---- pieces of the loop ---------------------------------------------------------------------
    def log(self, **event):
        event["time"] = round(time.time(), 3)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(event) + "\n")

    def evaluate(self) -> float:
        """Mean loss over eval_batches val batches in eval mode; the same batches every time (fixed seed).
        Classification ("arrays" with class ids): the cross-entropy of logits(p, x) over the whole val split, and
        val_acc."""
        t = self.cfg.train
        if getattr(self.ds, "classes", 0):
            if self.classifier is None:
                self.classifier = arrays.Classifier(self.model, t.batch_size, t.dtype)
            val, self.val_acc = self.classifier.evaluate(self.ds, self.prog.params, self.prog.buffers)
            return val
        rng = seeds(t.seed)[2]
        losses = [self.prog.eval(*self.ds.batch("val", t.batch_size, rng)) for _ in range(t.eval_batches)]
        return float(np.mean(losses))

    def sample(self) -> str:
        from btjit.train.sampling import Sampler, SampleError
        if self.sampler is None:
            self.sampler = Sampler(self.model, self.ds.vocab, self.prog.params, self.cfg.train.dtype,
                                   self.prog.buffers)
        else:
            self.sampler.set_params(self.prog.params, self.prog.buffers)
        try:
            return self.sampler.generate("", self.cfg.train.sample_chars, self.sample_rng)
        except SampleError as e:                  # diverged: one line, as save()'s check of the params
            bad = first_nonfinite(self.prog.params)
            raise TrainError(f"cannot sample at step {self.step}: {e}{f' ({bad} is not finite)' if bad else ''}; "
                             f"not saved. {self._last_good()}") from None

    def meta(self) -> dict:
        """The metadata of a checkpoint written now."""
        return {"rng_state": ckpt_mod.rng_state(self.rng), "sample_rng_state": ckpt_mod.rng_state(self.sample_rng),
                "config": self.cfg.to_dict(), "data_file": self.data_file,   # the file read (btjit export's default)
                "vocab": self.ds.vocab.chars, "data": self.ds.name, "n_params": int(self.prog.n_params),
                "best": self.best, "log_losses": list(self.log_losses), "replicas": getattr(self.prog, "replicas", 1),
                **({"model_file": self.model_file.meta()} if self.model_file else {}),
                **({"optimizer_file": self.optim_file.meta()} if self.optim_file else {})}

    def track_best(self, val: float) -> None:
        """After a val loss at step > 0: write best.npz when it is the lowest so far (a tie keeps the older)."""
        if self.step == 0 or not math.isfinite(val) or (self.best is not None and val >= self.best["val_loss"]):
            return
        self.best = {"step": self.step, "val_loss": val}
        self._save_best()
        self.log(event="best", step=self.step, val_loss=val, path=ckpt_mod.BEST)

    def _save_best(self) -> None:
        try:
            ckpt_mod.save_best(self.run_dir, self.step, self.prog.state_dict(), self.meta())
        except CheckpointError as e:
            raise TrainError(f"stopped at step {self.step}: {e}. {self._last_good()}") from None

    def save(self) -> Path:
        bad = first_nonfinite(self.prog.params)
        if bad is not None:
            raise TrainError(f"parameter {bad} is not finite at step {self.step}; not saved. {self._last_good()}")
        meta = self.meta()
        try:
            path = ckpt_mod.save(self.run_dir, self.step, self.prog.state_dict(), meta,
                                 keep=self.cfg.train.keep_checkpoints)
        except CheckpointError as e:
            raise TrainError(f"stopped at step {self.step}: {e}. {self._last_good()}") from None
        self.last_ckpt = path
        self.log(event="checkpoint", step=self.step, path=path.name)
        return path

    def _last_good(self) -> str:
        return f"Last good checkpoint: {self.last_ckpt}" if self.last_ckpt else "No checkpoint was saved yet."

    def _nonfinite(self, loss) -> None:
        bad = first_nonfinite(self.prog.grads)
        where = f" (first non-finite gradient: {bad})" if bad else ""
        what = f"loss is {loss}" if not math.isfinite(loss) else f"a gradient is not finite (loss {loss:.4f})"
        raise TrainError(f"{what} at step {self.step + 1}{where}; stopped before the update. {self._last_good()}")

    # ---- one training step (hooks: DistributedTrainer averages gradients across processes) --------
    def _next_batches(self):
        """The micro-batches of the next update: train.grad_accum batches of local_batch_size."""
        return [self.ds.batch("train", self.local_batch_size, self.rng) for _ in range(self.cfg.train.grad_accum)]

    def _train_step(self, batches, stop) -> float:
        if len(batches) == 1:
            return self.prog.step(*batches[0])     # forward, backward and update in one native call
        return self.accum.step(batches)

    def _stop_requested(self, stop) -> bool:
        return stop["sigint"]

    def _acc(self) -> tuple[str, dict]:
        """The last evaluation's accuracy for the val line and its metrics event (classification runs)."""
        return ("", {}) if self.val_acc is None else (f" | val acc {100 * self.val_acc:.2f}%",
                                                      {"val_acc": self.val_acc})

    def _progress_extra(self) -> tuple[str, dict]:
        """Extra text for the progress line and fields for its metrics event (since the last one)."""
        return "", {}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> Result:
        t, prog = self.cfg.train, self.prog
        self.banner()
        stop = {"sigint": False}
        old = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame):
                if stop["sigint"]:
                    raise KeyboardInterrupt
                stop["sigint"] = True
                self.echo("\ninterrupt: finishing the current step, then saving (Ctrl+C again to abort)")
            old = signal.signal(signal.SIGINT, on_sigint)
        try:
            return self._loop(t, prog, stop)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
            self.release()

    def _loop(self, t, prog, stop) -> Result:
        val, width = None, len(str(t.steps))
        if self.step == 0:
            val = self.evaluate()
            self.echo(f"step {0:>{width}}: val loss {val:.4f}{self._acc()[0]}")
            self.log(event="val", step=0, val_loss=val, **self._acc()[1])
        if self.step >= t.steps:
            self.echo(f"already at step {self.step} of {t.steps}: nothing to do (raise train.steps to train further)")
            return Result(self.step, self.last_ckpt)
        t_start, losses, step_time, timed, skips = time.perf_counter(), self.log_losses, 0.0, 0, 0
        first = self.step
        while self.step < t.steps:
            batches = self._next_batches()
            prog.lr = self.lr_at(self.step)         # the schedule's LR of this update, before the native step
            t0 = time.perf_counter()
            loss = self._train_step(batches, stop)
            step_time += time.perf_counter() - t0
            timed += 1
            self.step += 1
            skip = t.on_nonfinite == "skip"
            bad_grad = prog.last_step_skipped   # the native step found a NaN/Inf gradient and left params alone
            if skip and bad_grad:
                loss = float("nan")
            if math.isfinite(loss) and not bad_grad:
                skips = 0
                losses.append(loss)
            elif not skip:
                self.step -= 1
                self.log(event="nonfinite", step=self.step + 1, loss=str(loss))
                self._nonfinite(loss)
            else:
                skips += 1
                if skips <= 3:
                    bad = first_nonfinite(prog.grads)
                    self.echo(f"step {self.step}: non-finite loss or update ({loss}"
                              + (f", first non-finite gradient: {bad}" if bad else "") + "), step skipped"
                              + (" (further skips are logged in metrics.jsonl only)" if skips == 3 else ""))
                self.log(event="skip", step=self.step, loss=str(loss))
                if skips >= MAX_SKIPS:
                    raise TrainError(f"{skips} non-finite steps in a row at step {self.step}; stopped. "
                                     f"{self._last_good()}")
            s, saved = self.step, False
            if losses and (s % t.log_interval == 0 or s == t.steps):
                ms = 1000.0 * step_time / timed
                tps = self.tokens_per_step / (ms / 1000.0) if ms > 0 else 0.0
                done = s - first
                eta = (time.perf_counter() - t_start) / done * (t.steps - s)
                extra, fields = self._progress_extra()
                self.echo(f"step {s:>{width}}/{t.steps} ({100 * s // t.steps:3d}%) | loss {np.mean(losses):.4f} "
                          f"| lr {prog.lr:.3g} | {ms:.2f} ms/step | {tps / 1000:.1f}k tok/s{extra} | eta {eta:.0f} s")
                self.log(event="train", step=s, loss=float(np.mean(losses)), ms_per_step=round(ms, 4),
                         tokens_per_s=round(tps, 1), lr=prog.lr, **fields)
                losses.clear()
                step_time, timed = 0.0, 0
            if (t.eval_interval and s % t.eval_interval == 0) or s == t.steps:
                val = self.evaluate()
                self.echo(f"step {s:>{width}}: val loss {val:.4f}{self._acc()[0]}")
                self.log(event="val", step=s, val_loss=val, **self._acc()[1])
                self.track_best(val)
            if t.sample_interval and s % t.sample_interval == 0 and self.ds.format != "arrays":
                self.echo(f"--- sample at step {s} ---\n{self.sample()}\n---")
            if (t.checkpoint_interval and s % t.checkpoint_interval == 0) or s == t.steps:
                self.save()
                saved = True
            if self._stop_requested(stop):
                path = self.last_ckpt if saved else self.save()
                self.echo(f"interrupted at step {s}: saved {path}; continue with {self.resume_hint}")
                return Result(s, path, interrupted=True, val_loss=val)
        total = time.perf_counter() - t_start
        self.echo(f"done: {self.step - first} steps in {total:.1f} s; checkpoint {self.last_ckpt}")
        return Result(self.step, self.last_ckpt, val_loss=val)
