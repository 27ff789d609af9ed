# btjit/bench/run_one.py -- ONE measurement in ONE process: `python -m btjit.bench.run_one --impl NAME
# --workload ID [--threads N] [--reps R] [--min-time S] [--seed K]` prints one JSON row on stdout (the last
# line). Thread env vars are set here before any impl is imported (the parent harness also puts them in
# the child's environment, which is what counts for libraries imported by btjit/__init__.py).
# Timing: make() (setup_s; the impl's own compile_seconds kept apart), check(), one first step
# (first_step_s), one untimed warm-up of the runner's min_iters iterations (default 1), a calibration from
# there that sizes n (>= min_iters) so one repetition takes >= min_time, then `reps` timed loops of n
# steps; time_s = median of per-iteration times. The loop is a plain Python
# `for` calling step() (~50 ns/call of overhead, included) unless the runner has run(n).
# Run as a script (`python .../btjit/bench/run_one.py ...`, what the harness does) and a peer's process never
# executes btjit/__init__.py (which pulls in numba, ~100 MB RSS): a bare `btjit` package stub is registered
# instead. The btjit impl, and `python -m btjit.bench.run_one`, import the real package (see base_rss_mb).
# Not here: tables, ratios, subprocess handling (harness.py).
import argparse
import os
import sys
from pathlib import Path

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS")
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def thread_env(threads, base=None):
    """The environment for a measurement with `threads` threads (a copy of base / os.environ)."""
    env = dict(os.environ if base is None else base)
    for k in THREAD_VARS:
        env[k] = str(threads)
    if int(threads) == 1 and "xla_cpu_multi_thread_eigen" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + XLA_ONE_THREAD).strip()
    return env


def pin_cpus(threads):
    """Pin this process to `threads` CPUs: thread-count env vars are only advice (JAX's XLA runtime, for
    one, keeps a second busy thread with every flag set: measured 6.0 ms of CPU per 3.3 ms E5 step), so
    --threads N is enforced with the CPU affinity, the same for every implementation."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > threads:
            os.sched_setaffinity(0, cpus[:threads])
    except (AttributeError, OSError):
        pass


def peak_rss_mb():
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024     # bytes on macOS, KB on Linux


def measure(impl, workload_id, threads=1, reps=5, min_time=0.2, seed=0):
    """-> row dict. Never raises for impl problems: they become the row's status."""
    import statistics
    import time
    row = dict(workload=workload_id, impl=impl, status="ok", time_s=None, times_s=[], iters=0, reps=reps,
               threads=threads, peak_rss_mb=None, base_rss_mb=round(peak_rss_mb(), 1), compile_s=None,
               setup_s=None, first_step_s=None, data=None, check=None, check_ok=None, note="", loop="python")
    from btjit.bench import peers, workloads
    if workload_id not in workloads.WORKLOADS:
        row["status"] = f"error: unknown workload {workload_id!r}"
        return row
    row["version"] = peers.package_version(impl)
    try:
        module, extra = peers.load(impl)
    except ImportError as e:
        row["status"] = "not available" if impl.startswith("btjit") else "not installed"
        row["note"] = f"{type(e).__name__}: {e}"[:300]
        return row
    except Exception as e:                                  # a broken impl module must not kill the bench
        row["status"] = f"error: import {type(e).__name__}: {e}"[:300]
        return row
    try:
        t0 = time.perf_counter()
        runner = module.make(workload_id, threads=threads, seed=seed, **extra)
        row["setup_s"] = time.perf_counter() - t0
    except peers.NotApplicable as e:
        row["status"], row["note"] = "n/a", str(e)
        return row
    except Exception as e:
        row["status"] = f"error: make {type(e).__name__}: {e}"[:300]
        return row
    try:
        row["compile_s"] = getattr(runner, "compile_seconds", None)
        row["data"] = getattr(runner, "data", None)
        row["note"] = getattr(runner, "note", "") or ""
        check = runner.check()
        row["check"] = {k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "__float__") else v)
                        for k, v in check.items()}
        row["check_ok"], msg = workloads.check_ok(workload_id, row["check"])
        if not row["check_ok"]:
            row["note"] = f"WRONG: {msg}; " + row["note"]
        t0 = time.perf_counter()
        runner.step()
        row["first_step_s"] = time.perf_counter() - t0

        step, run = runner.step, getattr(runner, "run", None)
        if run is not None:
            row["loop"] = "runner.run(n)"

        def timed(n):
            t = time.perf_counter()
            if run is not None:
                run(n)
            else:
                for _ in range(n):
                    step()
            return time.perf_counter() - t

        n0 = max(1, int(getattr(runner, "min_iters", 1)))   # e.g. one f.many chunk: never time fewer
        timed(n0)                                           # warm-up: nothing first-call is calibrated
        n, t = n0, timed(n0)                                # calibration
        while t < 0.5 * min_time:
            n = max(2 * n, int(n * 0.6 * min_time / max(t, 1e-9)))
            t = timed(n)
        n = max(n0, round(n * min_time / t))
        times = [timed(n) / n for _ in range(reps)]
        row.update(time_s=statistics.median(times), times_s=times, iters=n)
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {e}"[:300]
    row["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--impl", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    os.environ.update(thread_env(a.threads))               # before any impl import
    pin_cpus(a.threads)
    if not a.impl.startswith("btjit") and "btjit" not in sys.modules:   # script mode, peer: skip btjit/__init__.py
        import types
        pkg = types.ModuleType("btjit")
        pkg.__path__ = [str(Path(__file__).resolve().parents[1])]
        sys.modules["btjit"] = pkg
    import json
    row = measure(a.impl, a.workload, a.threads, a.reps, a.min_time, a.seed)
    sys.stdout.flush()
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(here)]   # no top-level `peers`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
