# btjit/distributed.py -- synchronous data-parallel training over MPI (mpi4py), `mpiexec -n N btjit train`.
#
# Every rank holds the same compiled Program (traced with the per-rank batch B/N). A step on each rank:
#   prog.value_and_grad(shard)        forward + backward, natively, on this rank's shard of the global batch
#   Allreduce(IN_PLACE, grad_slice)   ONE collective over the whole contiguous grads region of the arena,
#   grad_slice *= 1/N                 then the mean: the mean of per-rank means of equal-sized shards is the
#                                     gradient of the global-batch mean loss
#   prog.apply_update()               the same update (clip/skip + optimizer) on every rank
# Then the loss and a Ctrl+C flag go through a 2-number Allreduce (one latency, 16 bytes), so every rank
# sees the same global loss and takes the same decisions (log, stop on NaN, skip, interrupt).
# With train.grad_accum = k each rank first averages its k micro-batches' gradients locally
# (btjit.train.schedule.Accumulator), then the ranks average once: one Allreduce per update, not per micro-batch.
# With [distributed] compressor = "topk" | "randk" the gradient goes through EF21 (btjit.train.compress) instead.
#
# Pieces: launch detection and the mpi4py import with an install hint (wanted, require_mpi); DataParallel
# (the step above, usable on any traced Program: the notebook/script API); DistributedTrainer (btjit
# train's loop on N ranks: rank 0 alone logs, evaluates, samples and writes checkpoints; per-rank batch
# RNGs; resume with the same N); train() (guards the run so an error on one rank cannot leave the others
# hanging). Starting an N-rank run from Python or a notebook: btjit/train/mpilaunch.py.
from __future__ import annotations

import os
import pickle
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from btjit.train.schedule import Accumulator
from btjit.train.trainer import TrainError, Trainer, check_world_size, seeds

INSTALL_HINT = ("pip install 'btjit[mpi]' (mpi4py and an MPICH from PyPI; on a cluster: pip install mpi4py, "
                "which also runs on the system's MPI)")
# Variables an MPI launcher sets in each process it starts: (size variable, rank variable).
LAUNCH_ENV = (("PMI_SIZE", "PMI_RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
              ("PMIX_SIZE", "PMIX_RANK"), ("MPI_LOCALNRANKS", "MPI_LOCALRANKID"))
ABORT_GRACE = 10.0      # seconds the other ranks get to fail too before a failing rank aborts the job


class DistributedError(TrainError):
    """MPI is missing or unusable, or ranks disagree; str(e) is one readable line."""


# ---- launch detection and MPI ---------------------------------------------------------------------
def launched() -> tuple[int, int]:
    """(world size, rank) as announced by an MPI launcher in the environment; (1, 0) if none."""
    for size_var, rank_var in LAUNCH_ENV:
        try:
            return int(os.environ[size_var]), int(os.environ.get(rank_var, "0"))
        except (KeyError, ValueError):
            continue
    return 1, 0


def wanted(flag: bool | None) -> bool:
    """Resolve --distributed/--no-distributed: None means 'if an MPI launcher started N > 1 of us'."""
    return launched()[0] > 1 if flag is None else bool(flag)


def require_mpi():
    """Import mpi4py (initializing MPI) or raise DistributedError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError:
        n = launched()[0]
        why = (f"this process was started by an MPI launcher as one of {n}, but mpi4py is not installed, so "
               f"the processes cannot cooperate (--no-distributed trains {n} independent copies)") if n > 1 \
            else "distributed training needs mpi4py"
        raise DistributedError(f"{why}: {INSTALL_HINT}") from None
    return MPI


def world():
    return require_mpi().COMM_WORLD


def root_do(comm, fn):
    """Run fn() on rank 0 only and hand its result, or its exception, to every rank (raised everywhere):
    file-system work (run dir, checkpoints) then fails on all ranks alike instead of leaving some waiting."""
    res, err = None, None
    if comm.Get_rank() == 0:
        try:
            res = fn()
        except Exception as e:      # noqa: BLE001 -- re-raised on every rank below
            err = e
            try:
                pickle.dumps(e)
            except Exception:       # noqa: BLE001
                err = DistributedError(f"{type(e).__name__}: {e}")
    res, err = comm.bcast((res, err), root=0)
    if err is not None:
        raise err
    return res


# ---- the data-parallel step ---------------------------------------------------------------------------
class DataParallel:
    """Synchronous data parallelism for a traced Program with an optimizer, under `mpiexec -n N`.

        prog = btjit.trace(loss_fn, params, x_shard, y_shard, optimizer=...)   # the per-rank batch shape
        dp = btjit.train.distributed.DataParallel(prog)             # broadcasts rank 0's parameters
        loss = dp.step(x_shard, y_shard)                      # the global mean loss, the same on every rank

    compressor: "none" (one dense in-place Allreduce of the grads region), "topk" or "randk" (EF21 error
    feedback, `ratio` of the entries sent). `bytes_last` / `bytes_total`: what this rank handed to MPI."""

    def __init__(self, prog, comm=None, compressor: str = "none", ratio: float = 0.01, seed: int = 0,
                 broadcast: bool = True):
        from btjit.train import compress
        self.MPI = require_mpi()
        if prog.optimizer is None:
            raise DistributedError("DataParallel needs a program traced with an optimizer")
        if compressor not in compress.KINDS:
            raise DistributedError(f"compressor must be one of {', '.join(compress.KINDS)}, got {compressor!r}")
        self.prog, self.comm = prog, comm if comm is not None else self.MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.grads = prog.grad_slice
        self._scale = prog.dtype.type(1.0 / self.size)
        self._msg = np.zeros(2, np.float64)             # [sum of losses, ranks asking to stop]
        self.compressor = compressor
        self.ef = None
        if compressor != "none":
            self.ef = compress.EF21(compressor, ratio, self.grads.size, self._valid_indices(), prog.dtype, seed)
        self.steps, self.bytes_last, self.bytes_total, self.comm_seconds = 0, 0, 0, 0.0
        self.stop_requested = False
        self.accum = Accumulator(prog, self.rank, self.size)      # each rank its own dropout masks
        if broadcast:
            self.broadcast_params()

    def _valid_indices(self) -> np.ndarray:
        """Positions of real parameters in the grads region (the rest is alignment padding)."""
        p0 = self.prog.plan.params_span[0]
        parts = [np.arange(self.prog.plan.param_off[k] - p0, self.prog.plan.param_off[k] - p0 + v.size)
                 for k, v in self.prog.params.items()]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def broadcast_params(self) -> None:
        """Copy rank 0's parameters to every rank (one Bcast of the params region)."""
        self.comm.Bcast(self.prog.param_slice, root=0)

    def step(self, *batch, stop: bool = False) -> float:
        """Forward + backward on this rank's shard, average the gradients, apply the update. Returns the
        mean loss over all ranks. `stop`: this rank asks to stop; afterwards `stop_requested` tells whether
        any rank asked (the same answer everywhere)."""
        return self.step_batches([batch], stop=stop)

    def step_batches(self, batches, stop: bool = False) -> float:
        """step() over this rank's micro-batches (gradient accumulation): one update from the mean gradient
        of every rank's micro-batches; returns the mean loss over all of them."""
        loss = self.accum.grad(batches)
        t0 = time.perf_counter()
        msg, MPI = self._msg, self.MPI
        sent = self.reduce_grads()
        msg[0], msg[1] = loss, 1.0 if stop else 0.0
        self.comm.Allreduce(MPI.IN_PLACE, msg, op=MPI.SUM)
        self.comm_seconds += time.perf_counter() - t0
        self.prog.apply_update()
        self.steps += 1
        self.bytes_last = sent + msg.nbytes
        self.bytes_total += self.bytes_last
        self.stop_requested = bool(msg[1] > 0)
        return float(msg[0] / self.size)

    def reduce_grads(self) -> int:
        """Replace this rank's gradient (prog.grad_slice) by the average over ranks; returns bytes sent."""
        if self.ef is not None:
            return self.ef.reduce(self.grads, self.comm)
        self.comm.Allreduce(self.MPI.IN_PLACE, self.grads, op=self.MPI.SUM)
        if self.size > 1:
            self.grads *= self._scale
        return self.grads.nbytes

    @property
    def dense_bytes(self) -> int:
        """Bytes per step without compression: the whole grads region."""
        return self.grads.nbytes

    def fingerprint(self) -> int:
        """crc32 of params, grads and optimizer state: equal on every rank while they are in sync."""
        p0, n = self.prog.plan.params_span
        return zlib.crc32(self.prog.a[p0:p0 + (2 + self.prog.plan.n_state) * n].view(np.uint8))

    def in_sync(self) -> bool:
        """Collective: do all ranks hold bit-identical params, grads and optimizer state?"""
        return len(set(self.comm.allgather(self.fingerprint()))) == 1


def rank_rng(seed: int, rank: int, size: int) -> np.random.Generator:
    """The train-batch generator of one rank. One process: the single-process stream (seeds(seed)[1]);
    N ranks: child `rank` of that stream's seed sequence, so each rank draws its own reproducible shards."""
    if size == 1:
        return seeds(seed)[1]
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[1].spawn(size)[rank])


# ---- btjit train on N ranks ---------------------------------------------------------------------------
class DistributedTrainer(Trainer):
    """btjit.train.trainer.Trainer on every rank of an MPI job. train.batch_size is the GLOBAL batch: each rank
    draws batch_size / N sequences from its own generator. Rank 0 alone prints, logs, evaluates, samples
    and writes checkpoints (with every rank's batch-generator state and, with compression, EF21 state)."""

    def __init__(self, cfg, run_dir, data_path=None, resume=False, threads=None, echo=None,
                 resume_hint="--resume", comm=None):
        self.comm = comm if comm is not None else world()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        B = cfg.train.batch_size
        if B % self.size:
            raise DistributedError(f"train.batch_size ({B}) must be divisible by the number of processes "
                                   f"({self.size}): each computes batch_size / {self.size} sequences per step")
        self.dp = None
        self._mark = (0, 0.0, 0)
        quiet = lambda s="": None  # noqa: E731
        echo = echo or (lambda s="": print(s, flush=True))
        if self.size > 1:
            resume_hint = f"mpiexec -n {self.size} {resume_hint}"
        super().__init__(cfg, run_dir, data_path, resume, threads, echo if self.rank == 0 else quiet,
                         resume_hint)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def local_batch_size(self) -> int:
        return self.cfg.train.batch_size // self.size

    # ---- set-up hooks
    def _prepare(self, resume):
        def work():
            Trainer._prepare(self, resume)
            return self.resumed
        self.resumed = root_do(self.comm, work)

    def _build_program(self):
        self.rng = rank_rng(self.cfg.train.seed, self.rank, self.size)
        # rank 0 first: it compiles (or loads) the executor, the others then load it from the disk cache
        root_do(self.comm, lambda: Trainer._build_program(self))
        if not self.is_root:
            Trainer._build_program(self)
        if self.prog.buffers:
            raise DistributedError(f"the model has buffers ({', '.join(self.prog.buffers)}): a distributed run "
                                   f"would update one copy per rank from its own batches; train it in one process")
        self.tokens_per_step *= self.size
        d = self.cfg.distributed
        self.dp = DataParallel(self.prog, self.comm, d.compressor, d.ratio, seed=self.cfg.train.seed)

    def _restore(self, ck):
        check_world_size(ck, self.size)
        self._load_program_state(ck)
        meta = ck.meta.get("distributed", {})
        states = meta.get("rng_states") or [ck.meta["rng_state"]]
        from btjit.train import checkpoint as ckpt_mod
        self.rng = ckpt_mod.rng_from_state(states[self.rank])
        ef = self.dp.ef
        if ef is not None:
            same = (meta.get("compressor"), meta.get("ratio")) == (ef.kind, ef.ratio)
            key = f"dist/ef_local/{self.rank}"
            if same and key in ck.state:
                ef.load(ck.state, ck.state[key])
            else:
                self.echo(f"note: {ck.path.name} has no {ef.kind} error-feedback state for ratio {ef.ratio:g}; "
                          f"it restarts with one dense step")
        self._restore_run_state(ck)

    def _write_run_files(self, resume):
        if self.is_root:
            super()._write_run_files(resume)

    def banner(self):
        super().banner()
        d = self.cfg.distributed
        comp = "dense Allreduce" if d.compressor == "none" else f"{d.compressor} ratio {d.ratio:g} + EF21"
        lib = " ".join(self.dp.MPI.Get_library_version().splitlines()[0].split()) if self.is_root else ""
        self.echo(f"distributed: {self.size} processes ({lib}) | batch {self.local_batch_size} per process | "
                  f"{comp} | {self.dp.dense_bytes:,} gradient bytes dense")

    # ---- loop hooks
    def _train_step(self, batches, stop) -> float:
        return self.dp.step_batches(batches, stop=stop["sigint"])

    def _stop_requested(self, stop) -> bool:
        return self.dp.stop_requested

    def _progress_extra(self):
        dp = self.dp
        steps, secs, nbytes = dp.steps - self._mark[0], dp.comm_seconds - self._mark[1], dp.bytes_total - self._mark[2]
        self._mark = (dp.steps, dp.comm_seconds, dp.bytes_total)
        if not steps:
            return "", {}
        ms, b = 1000.0 * secs / steps, nbytes / steps
        return (f" | comm {ms:.2f} ms, {b / 1e3:.1f} kB/step",
                {"comm_ms_per_step": round(ms, 4), "comm_bytes_per_step": int(round(b)),
                 "ranks": self.size})

    def log(self, **event):
        if self.is_root:
            super().log(**event)

    def evaluate(self) -> float:
        """Rank 0: the same val batches (global size) as one process, split into per-rank-sized chunks."""
        val = None
        if self.is_root:
            t = self.cfg.train
            rng = seeds(t.seed)[2]
            losses = []
            for _ in range(t.eval_batches):
                x, y = self.ds.batch("val", t.batch_size, rng)
                losses += [self.prog.eval(xs, ys) for xs, ys in zip(np.split(x, self.size), np.split(y, self.size))]
            val = float(np.mean(losses))
        return self.comm.bcast(val, root=0)

    def sample(self) -> str:
        return super().sample() if self.is_root else ""

    def _save_best(self) -> None:
        """Rank 0 writes best.npz (the ranks' parameters are identical); an error stops every rank."""
        root_do(self.comm, lambda: Trainer._save_best(self))

    def save(self) -> Path:
        from btjit.train import checkpoint as ckpt_mod
        from btjit.train.trainer import first_nonfinite
        bad = first_nonfinite(self.prog.params)
        if bad is not None:
            raise TrainError(f"parameter {bad} is not finite at step {self.step}; not saved. {self._last_good()}")
        if not self.dp.in_sync():
            raise DistributedError(f"step {self.step}: the processes' parameters differ (they should be "
                                   f"bit-identical); not saved. {self._last_good()}")
        rngs = self.comm.gather(ckpt_mod.rng_state(self.rng), root=0)
        ef = self.dp.ef
        ef_locals = self.comm.gather(ef.g_local, root=0) if ef is not None else None

        def write():
            state = self.prog.state_dict()
            if ef is not None:
                state.update(ef.shared_state())
                state.update({f"dist/ef_local/{r}": g for r, g in enumerate(ef_locals)})
            d = self.cfg.distributed
            meta = dict(self.meta(), rng_state=rngs[0],
                        distributed={"world_size": self.size, "rng_states": rngs, "compressor": d.compressor,
                                     "ratio": d.ratio})
            try:
                return ckpt_mod.save(self.run_dir, self.step, state, meta, keep=self.cfg.train.keep_checkpoints)
            except ckpt_mod.CheckpointError as e:
                raise TrainError(f"stopped at step {self.step}: {e}. {self._last_good()}") from None

        path = root_do(self.comm, write)
        self.last_ckpt = path
        self.log(event="checkpoint", step=self.step, path=path.name)
        return path


def _fail(comm, err: BaseException) -> None:
    """After an exception on this rank: if every rank fails within ABORT_GRACE seconds (a collective error,
    e.g. a non-finite loss, which all ranks see alike), return so it is raised normally; otherwise print it
    and abort the whole job, since the other ranks would wait for this one forever."""
    if comm.Get_size() == 1:
        return
    req = comm.Ibarrier()
    deadline = time.monotonic() + ABORT_GRACE
    while time.monotonic() < deadline:
        if req.Test():
            return
        time.sleep(0.005)
    msg = " ".join(str(err).split()) or type(err).__name__
    print(f"error (rank {comm.Get_rank()}): {type(err).__name__}: {msg}; aborting the MPI job",
          file=sys.stderr, flush=True)
    comm.Abort(1)


def train(cfg, run_dir, data_path=None, resume=False, threads=None, echo=None, resume_hint="--resume",
          comm=None):
    """btjit.train.train(..., distributed=True): data-parallel training on the ranks of `comm` (default
    MPI.COMM_WORLD). Run it on every rank (`mpiexec -n N python script.py`); returns the same Result on all."""
    comm = comm if comm is not None else world()
    try:
        return DistributedTrainer(cfg, run_dir, data_path, resume, threads, echo, resume_hint, comm).run()
    except BaseException as e:
        _fail(comm, e)
        raise
