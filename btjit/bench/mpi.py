# btjit/bench/mpi.py -- `btjit bench --suite mpi`: the paper's E6 step (mini GPT-3, SGD) data-parallel over
# MPI, at 1 and 2 ranks: step time, compute time, communication time, bytes each rank hands to MPI per step,
# and parallel efficiency. Each case is one `mpiexec -n N python -m mpi4py -m btjit.bench.mpi --worker` job.
#   strong scaling: global batch 64 = 2 x 32 per rank   efficiency = T(1 rank, 64) / (N * T(N ranks, 64/N))
#   weak scaling:   64 per rank (global 128)             efficiency = T(1 rank, 64) / T(N ranks, 64 each)
# (both are throughput(N) / (N * throughput(1)), with throughput = global batch / step time).
# Standalone: python -m btjit.bench.mpi [--reps 10] [--steps 20] [--ratio 0.01] [--json out.json]
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# (ranks, batch per rank, compressor, scaling)
CASES = [(1, 64, "none", "base"), (2, 32, "none", "strong"), (2, 32, "topk", "strong"),
         (2, 32, "randk", "strong"), (2, 64, "none", "weak")]


def worker(a) -> None:
    import time

    import numpy as np
    from mpi4py import MPI

    import btjit
    from btjit.bench import workloads as W
    from btjit.train.distributed import DataParallel
    from btjit.models import gpt
    from btjit.train.trainer import set_threads
    set_threads(a.threads)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    s = W.WORKLOADS["E6b64"].settings
    itos, train, _val, source = W.e6_corpus()
    params = W.e6_init(len(itos), seed=0)
    x, y = W.e6_batch(train, a.batch * size, s["block"], seed=0)          # the global batch, then my shard
    xs, ys = (np.ascontiguousarray(v[rank * a.batch:(rank + 1) * a.batch]) for v in (x, y))
    cfg = gpt.GPTConfig(vocab_size=len(itos), block_size=s["block"], n_layer=s["n_layer"], n_head=s["n_head"],
                        n_embd=s["n_embd"])
    prog = btjit.trace(gpt.loss_fn(cfg), params, xs, ys, optimizer=btjit.optim.SGD(lr=s["lr"]))
    dp = DataParallel(prog, comm, a.compressor, a.ratio)

    def timed(fn):
        """(step s, comm s) of the best rep: per rep the slowest rank counts; over reps the fastest, since other
        processes on a shared machine can only add time."""
        out = []
        for _ in range(a.reps):
            comm.Barrier()
            c0, t0 = dp.comm_seconds, time.perf_counter()
            for _ in range(a.steps):
                fn()
            out.append(((time.perf_counter() - t0) / a.steps, (dp.comm_seconds - c0) / a.steps))
        per_rep = np.max(np.array(comm.allgather(out)), axis=0)           # (reps, 2): slowest rank
        return per_rep[int(np.argmin(per_rep[:, 0]))]

    def compute():
        prog.value_and_grad(xs, ys)
        prog.apply_update()

    for _ in range(5):
        dp.step(xs, ys)
    t_compute = timed(compute)[0]
    t_step, t_comm = timed(lambda: dp.step(xs, ys))
    comm_ms = 1000 * t_comm
    if rank == 0:
        print(json.dumps(dict(ranks=size, batch_per_rank=a.batch, global_batch=a.batch * size,
                              compressor=a.compressor, ratio=a.ratio if a.compressor != "none" else None,
                              step_ms=1000 * t_step, compute_ms=1000 * t_compute, comm_ms=comm_ms,
                              bytes_per_step=dp.bytes_last, dense_bytes=dp.dense_bytes, n_params=prog.n_params,
                              data=source, mpi=MPI.Get_library_version().splitlines()[0].strip())), flush=True)


def run(reps=10, steps=20, ratio=0.01, threads=1, cases=CASES, progress=None, timeout=600.0) -> list[dict]:
    """Run every case in its own mpiexec job; returns rows with speedup and efficiency vs the 1-rank row."""
    from btjit.train.mpilaunch import mpiexec_command
    rows = []
    for n, batch, comp, scaling in cases:
        argv, env = mpiexec_command(n)
        env = {**os.environ, **env, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
        # python -m mpi4py: an exception on one rank aborts the job instead of leaving the others waiting
        cmd = argv + [sys.executable, "-m", "mpi4py", "-m", "btjit.bench.mpi", "--worker", "--batch", str(batch),
                      "--compressor", comp, "--ratio", str(ratio), "--reps", str(reps), "--steps", str(steps),
                      "--threads", str(threads)]
        row = dict(ranks=n, batch_per_rank=batch, global_batch=n * batch, compressor=comp, scaling=scaling)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            got = [l for l in p.stdout.splitlines() if l.startswith("{")]
            if p.returncode == 0 and got:
                row.update(json.loads(got[-1]), scaling=scaling, status="ok")
            else:
                tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-2:])
                row["status"] = f"error: exit {p.returncode}: {tail}"[:300]
        except subprocess.TimeoutExpired:
            row["status"] = f"error: timeout after {timeout:.0f} s"
        rows.append(row)
        if progress:
            progress(row)
    base = next((r for r in rows if r["ranks"] == 1 and r.get("status") == "ok"), None)
    for r in rows:
        if base and r.get("status") == "ok":
            thr, thr1 = r["global_batch"] / r["step_ms"], base["global_batch"] / base["step_ms"]
            r["speedup"] = thr / thr1                       # throughput (sequences/s) relative to 1 rank
            r["efficiency"] = thr / (r["ranks"] * thr1)
    return rows


def format_table(rows, machine=None, markdown=False, command=None) -> str:
    """The suite's table (btjit.bench.report.render). machine=None: this machine, False: no heading."""
    from btjit.bench.report import Table, render
    body = []
    for r in rows:
        comp = r["compressor"] + (f" {r['ratio']:g}" if r.get("ratio") else "")
        lead = (r["ranks"], f"{r['batch_per_rank']}x{r['ranks']}", comp, r["scaling"])
        if r.get("status") != "ok":
            body.append(lead + ("-",) * 6 + (r.get("status"),))
            continue
        body.append(lead + (f"{r['step_ms']:.2f}", f"{r['compute_ms']:.2f}", f"{r['comm_ms']:.3f}",
                            f"{r['bytes_per_step']:,}", f"{r.get('speedup', float('nan')):.2f}",
                            f"{r.get('efficiency', float('nan')):.0%}", ""))
    notes = ["batch = per rank x ranks; bytes/step = what one rank hands to MPI per step"]
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        r = ok[0]
        notes.append(f"{r['n_params']:,} params, dense gradient {r['dense_bytes']:,} bytes; data: {r['data']}; "
                     f"{' '.join(r['mpi'].split())}")
    head = ("ranks", "batch", "compressor", "scaling", "step ms", "compute", "comm ms", "bytes/step", "speedup",
            "effic.", "note")
    return render(Table(head, body, notes, title="mpi: E6 (mini GPT-3, SGD) data-parallel over MPI ranks",
                        align="rrll" + "r" * 6), markdown, machine, command)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--compressor", default="none")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    rows = run(a.reps, a.steps, a.ratio, a.threads,
               progress=lambda r: print(f"  {r['ranks']} rank(s) {r['compressor']:<6} {r['scaling']:<6} "
                                        f"{r['status']}", file=sys.stderr, flush=True))
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
