"""`Program`: a traced function as a native training step (btjit/core/tracing.py's `trace()` makes it).

Program plans the arena, lowers the graph to a kernel tape and loads the tape's kernels from the library; it owns
the arena and the tape; `step()` is one native call of the fixed executor (forward, backward, update).
The arena's memory is btjit/core/arena.py's; the bounds of index inputs are btjit/core/bounds.py's.
"""
from __future__ import annotations

import time

import numba
import numpy as np

from btjit.graph import rng, trace as T
from btjit.graph.ir import np_dtype
from btjit.graph.lower import Lowering, assign_rows, lower_eqns
from btjit.graph.memory import Shared, plan as make_plan, storage_roots
from btjit.core import executor as X
from btjit.core.arena import aligned_rows as _aligned_rows, arena as _arena
from btjit.core.bounds import index_bounds as _index_bounds
from btjit.host import threads as _threads
from btjit.kernels import amx, bf16, gemm_rule
from btjit.kernels.common import SPLIT
from btjit.kernels.rng import KEY_REPLICA
from btjit.kernels.library import LIBRARY
from btjit.export.runner import Runner, Views

_threads.set_num_threads(_threads.default_threads())   # every core the process may run on (btjit/host/threads.py)


class Program(Runner):
    """A compiled program over one arena (one per replica with replicas > 1: rows of `_A`, and views,
    optimizer state and updates are replica 0's). Views (`params`, `grads`, `inputs`, `outputs`) alias the
    arena."""

    def __init__(self, graph, init_params, update, clip_norm, skip_nonfinite, pinned, trace_seconds,
                 replicas=1, n_threads=1, seed=0, init_buffers=None, share=None, precision="fp32", defer=False):
        t0 = time.perf_counter()
        optimizer = update and update.opt
        self.graph, self.optimizer, self.clip_norm, self.replicas = graph, optimizer, clip_norm, replicas
        n_state = len(update.state_names) if update else 0
        shared = share and Shared(share.plan.param_off, share.plan.buffer_off, share._A.size)
        self.plan = p = make_plan(graph, pinned, n_state, update.n_hyper if update else 0, shared)
        self._hyper, self._group_hyper = update.slot_offsets(p) if update else ({}, [])
        self._hp_untraced = sorted(update.untraced) if update else []      # prog.hp refuses a nonzero value
        self._bounds = _index_bounds(graph)
        self._flag = p.int_state + 1
        L = Lowering(p, const_base=p.float_size, threads=max(1, n_threads // replicas),
                     checked={v.id for v in graph.inputs} | {v.id for v in graph.consts}, root=storage_roots(graph),
                     flag=self._flag, precision=precision)
        self._inv_replicas = L.const(1.0 / replicas)
        checks = [L.row("k_check_index", oidx=p.off[graph.inputs[i].id], n=graph.inputs[i].size, hi=hi,
                        oflag=self._flag, ok=ok or 0) for i, (hi, ok) in sorted(self._bounds.items())]
        fwd, fwd_labels = lower_eqns(graph.eqns[:graph.n_forward], L)
        fwd, fwd_labels = checks + fwd, ["check_index"] * len(checks) + fwd_labels
        bwd, bwd_labels = lower_eqns(graph.eqns[graph.n_forward:graph.n_backward], L)
        replica_threads, L.threads = L.threads, max(1, n_threads)    # the update runs alone, after the replicas
        upd = update.rows(graph, L, self._hyper, skip_nonfinite) if update else []
        self._computed_checks = L.computed_checks
        bufs = {v.id for v in graph.buffers.values()}          # the buffers' copies first: apply_assigns runs them
        asg_buf = assign_rows(graph, L, lambda a: a.target.id in bufs)
        asg = asg_buf + assign_rows(graph, L, lambda a: a.target.id not in bufs)
        self.has_assigns = bool(asg)
        self._buffer_rows = (len(fwd) + len(bwd) + len(upd), len(fwd) + len(bwd) + len(upd) + len(asg_buf))
        asg += rng.step_rows(upd, L, p, self._hyper)    # the int step count from the optimizer's step slot
        self.row_labels = fwd_labels + [f"{op} (bwd)" for op in bwd_labels] + \
            [f"update:{type(optimizer).__name__}"] * len(upd) + ["assign"] * len(asg)
        self.n_fwd, self.n_bwd = len(fwd), len(fwd) + len(bwd)
        rows = fwd + bwd + upd + asg
        self.tape = np.array(rows, np.int64).reshape(len(rows), -1)
        split = bool((self.tape[:, SPLIT] > 1).any())
        # what the step uses: at most the threads asked for (replicas beyond them take turns on those threads)
        self.threads = min(max(1, n_threads), max(replicas * replica_threads, L.threads) if split else replicas)
        bf = next((e for e in (LIBRARY.entry_of(op)[0] for op in self.tape[:, 0]) if e.startswith(bf16.KERNELS)), None)
        self.precision = amx.describe(bf) if bf else "fp32"
        fdt = np_dtype(graph.float_dtype)
        self.dtype = np.dtype(fdt)
        # replica r's arenas are rows r of A / IA (one row, and A[0] is self.a, without replicas)
        self._full, self._A = _arena(replicas, p.float_size + len(L.consts), fdt, share)
        self._IA = np.zeros((replicas, max(p.int_size, 1)), np.int32)
        self.a, self.ia = self._A[0], self._IA[0]
        self.a[p.float_size:p.float_size + len(L.consts)] = L.consts
        for v, c in graph.consts.items():
            (self.ia if v.dtype == "i32" else self.a)[p.off[v.id]:p.off[v.id] + v.size] = c.ravel()
        view = lambda v, off=None, r=0: (self._IA if v.dtype == "i32" else self._A)[r,  # noqa: E731
            (p.off[v.id] if off is None else off):][:v.size].reshape(v.shape)
        self.params = Views({k: view(v) for k, v in graph.params.items()}, "param")
        self.buffers = Views({k: view(v) for k, v in graph.buffers.items()}, "buffer")
        self.grads = Views({k: view(v, p.param_off[k] + p.params_span[1]) for k, v in graph.params.items()}, "grad")
        self._in_shards = [[view(v, r=r) for v in graph.inputs] for r in range(replicas)]   # batch slots
        self._in = self._in_shards[0]
        self.inputs = dict(zip(graph.input_names, self._in))
        self.outputs = Views({k: view(v) for k, v in graph.outputs.items()}, "output")
        self._in_types = [((v.shape[0] * replicas,) + v.shape[1:] if replicas > 1 else v.shape,
                           np.dtype(np.int32) if v.dtype == "i32" else self.dtype) for v in graph.inputs]
        for k, v in ({} if share else {**init_params, **(init_buffers or {})}).items():
            (self.params if k in self.params else self.buffers)[k][...] = v
        self._evals, self._retrace = {}, None       # eval programs by batch shape; trace() sets _retrace
        if update:
            update.write_initial(self.a, p)
        self._A[1:], self._IA[1:] = self.a, self.ia            # constants; params are copied every step
        rng.set_key(self._IA, p.int_state, seed)
        self.trace_seconds = trace_seconds
        self.plan_seconds = time.perf_counter() - t0
        self.kernels = None if defer else LIBRARY.ensure(graph.float_dtype, self.tape[:, 0])  # the entries it runs
        if not defer:
            gemm_rule.settle_ew_stream(self.tape)
        self._table = LIBRARY.tables[graph.float_dtype]
        self._out, self._out_var = self.outputs["out"], graph.outputs["out"]
        t1 = time.perf_counter()
        self._run(self.a, self.ia, self.tape[:0], 0, 0)   # compile (or load) the executor now: runs no rows
        if replicas > 1:
            self._run_replicas(0, 0)                 # and the replicas' driver
        self.compile_seconds = (self.kernels.seconds if self.kernels else 0.0) + time.perf_counter() - t1
        self.input_names = graph.input_names
        self.n_rows = self.tape.shape[0]
        self.has_optimizer, self.has_grad = optimizer is not None, graph.loss is not None
        self._rng_ticks = graph.rng_key is not None and optimizer is None    # forward() counts its calls
        self._int_state, self._span = p.int_state, p.params_span[1]
        self._state = [(f"opt/{k}", p.state_start(j)) for j, k in enumerate(update.state_names if update else ())]
        self._state_shapes = update.odd_shapes() if update else {}

    # ------------------------------------------------------------------ running (Runner's hooks)
    def _exec(self, stop, split=None):
        if self.replicas == 1:
            X.run(self.a, self.ia, self.tape, self._table, 0, stop)
        else:
            self._run_replicas(stop if split is None else split, stop)

    def _store_shards(self, i, x):
        n = self._in[i].shape[0]
        for r, shards in enumerate(self._in_shards):
            shards[i][...] = x[r * n:(r + 1) * n]

    def _input_values(self, i):
        return np.concatenate([s[i].ravel() for s in self._in_shards])

    def _clear_flag(self):
        self._IA[:, self._flag] = 0

    def load_kernels(self, report):
        """The library entries of a program traced with _defer_kernels, loaded by the caller's LIBRARY.ensure
        (`report`, which may have compiled several programs' entries in one parallel batch)."""
        self.kernels, self.compile_seconds = report, self.compile_seconds + report.seconds
        gemm_rule.settle_ew_stream(self.tape)

    def eval_program(self, *batch, defer=False):
        """The program prog.eval runs for batches shaped like `batch` (traced on the first call)."""
        key = tuple((np.shape(x), np.asarray(x).dtype.kind in "iu") for x in batch)
        ev = self._evals.get(key)
        if ev is None:
            if self._retrace is None:
                raise RuntimeError("prog.eval needs the traced function: trace the program with btjit.trace")
            try:
                ev = self._evals[key] = self._retrace(self, *batch, defer=defer)
            except T.TraceError as e:
                step = [tuple(v.shape) for v in self.graph.inputs]
                if not self.buffers or [k[0] for k in key] == step:
                    raise
                bufs = ", ".join(f"{k} {v.shape}" for k, v in self.buffers.items())
                raise T.TraceError(f"{e}\n(prog.eval traced fn on batch shapes {[k[0] for k in key]}, the step's are "
                                   f"{step}; the buffers keep their shapes -- {bufs} -- so a buffer sized by the "
                                   f"batch needs eval batches of the step's size)") from None
        return ev

    def apply_assigns(self) -> None:
        """Write the values the last forward (forward() or value_and_grad()) assigned to the buffers into them,
        as step() does when it ends, the optimizer untouched. Gradient accumulation calls it after every
        micro-batch but the last (whose update applies them): batch norm's running statistics move once per
        micro-batch, as torch's do once per forward."""
        self._run(self.a, self.ia, self.tape, *self._buffer_rows)

    def rng_part(self, i: int) -> None:
        """Draw the random numbers of part i of a batch made of equal parts (gradient accumulation's i-th
        micro-batch): replica r draws as replica i * replicas + r (btjit/kernels/rng.py numbers an op's elements
        from that index times its size), so k micro-batches of B draw the masks one step on the k B batch draws,
        new ones for each micro-batch. rng_part(0) restores the program's own numbering."""
        R = self._IA.shape[0]
        self._IA[:, self._int_state + KEY_REPLICA] = i * R + np.arange(R)

    def eval(self, *batch):
        """fn evaluated in eval mode (btjit.is_training() False, no assign applied) on this program's params and
        buffers: a float for a scalar result, else a copy of the array. The eval program is traced and compiled
        on the first call for each batch shape; it shares this program's arena memory for params and buffers
        (an edit through prog.params is seen by both), its activations its own. A data-parallel program
        (replicas > 1) evaluates on one replica's threads, with one replica's kernels."""
        return self.eval_program(*batch).forward(*batch)

    def export(self, path, extra_files=None):
        """Write this program as a self-contained native library dir (btjit/export.py): btjit.runtime.load(path)
        runs it without numba, examples/c/train.c from C. extra_files: {name: bytes} also written. Returns
        the dir."""
        from btjit.export.build import export_program
        return export_program(self, path, extra_files)

    def _run(self, a, ia, tape, start, stop):
        X.run(a, ia, tape, self._table, start, stop)

    def _run_replicas(self, split, stop):
        p0, npar = self.plan.params_span
        args = (self._A, self._IA, self.tape, self._table, split, stop, self._flag, p0, npar, self.plan.grads_start,
                npar if split > self.n_fwd else 0, self.plan.off[self._out_var.id], self._inv_replicas)
        pool = numba.get_num_threads()
        if pool == self.threads:
            X.step(*args)
            return
        numba.set_num_threads(self.threads)     # the replicas on this program's threads, not the pool's count
        try:                                    # (which another program may have grown, or the user shrunk)
            X.step(*args)
        finally:
            numba.set_num_threads(pool)

    def profile(self, *batch, reps=200, print_table=True):
        """Time every tape row of one step (forward, backward, update) on a scratch copy of the arena and
        group by op kind. Returns rows of {op, calls, total_us, share}; prints a table."""
        import time as _t
        self._load(batch)
        a, ia = _aligned_rows(1, self.a.size, self.a.dtype)[0, :self.a.size], self.ia.copy()
        a[:] = self.a               # aligned as the arena (a plain copy is 16-byte aligned: GEMMs 5-15% slower)
        z = np.zeros((0, self.tape.shape[1]), np.int64)
        t0 = _t.perf_counter()
        for _ in range(reps):
            self._run(a, ia, z, 0, 0)
        empty = (_t.perf_counter() - t0) / reps
        per = {}
        for i, label in enumerate(self.row_labels):
            self._run(a, ia, self.tape, i, i + 1)                   # warm
            t0 = _t.perf_counter()
            for _ in range(reps):
                self._run(a, ia, self.tape, i, i + 1)
            dt = max((_t.perf_counter() - t0) / reps - empty, 0.0)
            c = per.setdefault(label, [0, 0.0])
            c[0] += 1
            c[1] += dt * 1e6
        total = sum(v[1] for v in per.values()) or 1.0
        rows = sorted(({"op": k, "calls": v[0], "total_us": v[1], "share": v[1] / total} for k, v in per.items()),
                      key=lambda r: -r["total_us"])
        if print_table:
            print(f"{'op':<28s} {'calls':>5s} {'total µs':>10s} {'share':>6s}")
            for r in rows:
                print(f"{r['op']:<28s} {r['calls']:>5d} {r['total_us']:>10.1f} {100 * r['share']:>5.1f}%")
            print(f"{'total':<28s} {len(self.row_labels):>5d} {total:>10.1f}")
        return rows

    @property
    def arena_bytes(self) -> int:
        return self._A.nbytes + self._IA.nbytes

    @property
    def memory(self) -> dict:
        return {"planned_bytes": self.arena_bytes, "naive_bytes": self.plan.naive_bytes * self.replicas,
                "minimum_bytes": self.plan.min_bytes * self.replicas}

    def __repr__(self):
        return (f"Program({len(self.graph.eqns)} eqns, {self.tape.shape[0]} kernel rows, {self.n_params} params, "
                f"arena {self.arena_bytes / 1e6:.2f} MB, {self.dtype})")

    # ------------------------------------------------------------------ split step (data parallel, issue 6)
    # step() == value_and_grad() + apply_update(); in between, btjit.train.distributed averages grad_slice in place.
    @property
    def param_slice(self) -> np.ndarray:
        """A view of the whole params region of the arena (contiguous; alignment padding included)."""
        p0, n = self.plan.params_span
        return self.a[p0:p0 + n]

    @property
    def grad_slice(self) -> np.ndarray:
        """A view of the whole grads region (same layout as param_slice), e.g. for one in-place Allreduce."""
        return self.a[self.plan.grads_start:self.plan.grads_start + self.plan.params_span[1]]

    def apply_update(self) -> None:
        """Run only the update rows (norm clip / non-finite skip, then the optimizer) on the current grads."""
        if self.optimizer is None:
            raise RuntimeError("this program was traced without an optimizer; nothing to apply")
        self._run(self.a, self.ia, self.tape, self.n_bwd, self.tape.shape[0])
