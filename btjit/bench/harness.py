# btjit/bench/harness.py -- the parent side of `btjit bench`: runs every (workload, impl) measurement in its
# own subprocess (`python btjit/bench/run_one.py ...` run by path so a peer's process never imports
# btjit/__init__.py; thread env vars set in the child's environment),
# survives crashes and timeouts (row status "error: ..."), adds the ratio vs the btjit row of the same
# workload (time_impl / time_btjit: > 1 means btjit is faster), prints a table and writes JSON.
# Imports only the standard library and the framework-free registries, so the parent stays light.
# API for the CLI: run_bench(...) -> list[dict], format_table(rows) -> str (btjit.bench.report renders it).
# Standalone: python -m btjit.bench.harness --only E1,E6b1 --peers torch,jax --reps 3 --json out.json
import json
import os
import subprocess
import sys
from pathlib import Path

from btjit.bench.report import Table, machine_info, render
from btjit.bench.run_one import thread_env
from btjit.bench.workloads import PAPER_SUITE, WORKLOADS

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITES = {"paper": PAPER_SUITE}


def _base_row(impl, workload_id, status, note="", **kw):
    return dict(workload=workload_id, impl=impl, status=status, time_s=None, times_s=[], note=note,
                peak_rss_mb=None, compile_s=None, data=None, check=None, check_ok=None, **kw)


def measure(impl, workload_id, threads=1, reps=5, min_time=0.2, seed=0, timeout=1200.0, python=None):
    """Run one measurement in a fresh subprocess -> row dict (never raises)."""
    cmd = [python or sys.executable, str(Path(__file__).resolve().with_name("run_one.py")), "--impl", impl, "--workload", workload_id,
           "--threads", str(threads), "--reps", str(reps), "--min-time", str(min_time), "--seed", str(seed)]
    env = thread_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return _base_row(impl, workload_id, f"error: timeout after {timeout:.0f} s", threads=threads)
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("workload") == workload_id:
                return row
    tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
    return _base_row(impl, workload_id, f"error: exit code {proc.returncode}: {tail}"[:400], threads=threads)


def _as_list(x, default):
    if x is None:
        return list(default)
    if isinstance(x, str):
        return [] if x.strip().lower() in ("", "none") else [s.strip() for s in x.split(",") if s.strip()]
    return list(x)


def run_bench(suite="paper", only=None, peers=None, threads=1, reps=5, json_path=None, compile=False,
              min_time=0.2, timeout=1200.0, seed=0, progress=None):
    """Run the suite; returns the rows (btjit first in each workload). peers=None -> the default peers,
    peers="none" or [] -> btjit only. compile=True adds torch.compile rows for E5/E6. progress(row) is
    called after every measurement (e.g. click.echo of a one-liner)."""
    from btjit.bench import peers as registry
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    workloads = _as_list(only, SUITES[suite])
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"unknown workload(s) {bad} (known: {', '.join(WORKLOADS)})")
    impls = ["btjit", "btjit.many"] + [p for p in _as_list(peers, registry.DEFAULT_PEERS) if not p.startswith("btjit")]
    if compile and "torch" in impls and "torch.compile" not in impls:
        impls.insert(impls.index("torch") + 1, "torch.compile")
    rows = []
    for w in workloads:
        for impl in impls:
            sup = registry.supports(impl, w)
            if sup is None:
                continue
            if sup is not True:
                row = _base_row(impl, w, "n/a", note=str(sup), threads=threads)
            else:
                row = measure(impl, w, threads, reps, min_time, seed, timeout)
            rows.append(row)
            if progress is not None:
                progress(row)
    add_ratios(rows)
    if json_path:
        write_json(json_path, rows, dict(suite=suite, only=workloads, impls=impls, threads=threads,
                                         reps=reps, min_time=min_time, compile=compile))
    return rows


def add_ratios(rows):
    ref = {r["workload"]: r["time_s"] for r in rows
           if r["impl"] == "btjit" and r.get("status") == "ok" and r.get("time_s")}
    for r in rows:
        t, b = r.get("time_s"), ref.get(r["workload"])
        r["ratio_vs_btjit"] = (t / b) if (t and b) else None
    return rows


def write_json(path, rows, args=None):
    Path(path).write_text(json.dumps(dict(machine=machine_info(), args=args or {}, rows=rows), indent=1))


def fmt_time(s):
    if s is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _note(r):
    status, note = r.get("status", "?"), r.get("note") or ""
    parts = [] if status == "ok" else [status + (": " + note if note else "")]
    if status == "ok" and note:
        parts.append(note)
    if r.get("data") == "generated":
        parts.append("generated data")
    return "; ".join(parts)


def format_table(rows, machine=None, markdown=False, command=None):
    """The table the CLI prints (btjit.bench.report.render). machine=None: this machine, False: no heading."""
    body = []
    for r in rows:
        ratio = r.get("ratio_vs_btjit")
        body.append((r["workload"], r["impl"], fmt_time(r.get("time_s")),
                     "-" if ratio is None else f"{ratio:.3g}",
                     "-" if r.get("peak_rss_mb") is None else f"{r['peak_rss_mb']:.0f}",
                     "-" if r.get("compile_s") is None else f"{r['compile_s']:.2f}", _note(r)))
    t = Table(("workload", "impl", "time/iter", "x vs btjit", "peak RSS MB", "compile s", "note"), body,
              ["x vs btjit = time_impl / time_btjit (> 1: btjit faster); every core unless --threads; "
               "time/iter = median over repetitions; compile s kept apart from step time."], align="llrrrr",
              title="paper: the BurTorch paper's workloads E1-E6")
    return render(t, markdown, machine, command)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="btjit bench harness (the CLI wraps run_bench)")
    ap.add_argument("--suite", default="paper")
    ap.add_argument("--only", default=None, help="E1,E6b1,...")
    ap.add_argument("--peers", default=None, help="torch,jax,micrograd,autograd or none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args(argv)
    show = lambda r: print(f"  {r['workload']:6s} {r['impl']:14s} {fmt_time(r.get('time_s')):>10s}  "
                           f"{r.get('status')}", file=sys.stderr, flush=True)
    rows = run_bench(a.suite, a.only, a.peers, a.threads, a.reps, a.json, a.compile, a.min_time, progress=show)
    print(format_table(rows))


if __name__ == "__main__":
    main()
