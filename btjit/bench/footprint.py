"""`btjit bench --suite footprint` (issue 18): peak RSS and step time of the paper's E1 and E6 batch 64 for
btjit in-process, for the same program exported (prog.export / f.export) and run by btjit.runtime (ctypes and
numpy, no numba), and by the C host (examples/c/train.c, no Python), beside the installed peers.

One process per measurement. The in-process and peer rows are `btjit bench`'s own (harness.measure: the
same program, params and batch). The export is written by a child process (the bench's btjit runner's
program or scalar function, with its batch); the runtime row is a fresh interpreter that imports only
btjit.runtime, loads the export, warms up and times `reps` loops of steps (median per step); the C host is
compiled with the system C compiler and run for a fixed number of steps, its time the seconds it reports
inside the library. The runtime's and the C host's peak RSS are GNU time's. BurTorch is not installed here: its peak RSS is the issue's
measurement on this project's machines (E1 3.6 MB, E6 batch 64 18.4 MB), shown for reference.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from btjit.bench import harness
from btjit.bench.run_one import thread_env

WORKLOADS = ("E1", "E6b64")
BURTORCH_RSS_MB = {"E1": 3.6, "E6b64": 18.4}          # issue 18's measurement (BurTorch C++), for reference
C_STEPS = {"E1": 1_000_000, "E6b64": 300}
REPO = Path(__file__).resolve().parents[2]

EXPORT_CHILD = r"""
import sys, numpy as np
from btjit.bench import btjit_impl
wid, out = sys.argv[1], sys.argv[2]
r = btjit_impl.make(wid)
if hasattr(r, "prog"):
    import io
    buf = io.BytesIO(); np.savez(buf, x=r.x, y=r.y)
    r.prog.export(out, {"batch.npz": buf.getvalue()})
else:
    r.f.export(out)
    np.save(out + "/args.npy", np.array([r.a, r.b]))
"""

RUNTIME_CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import btjit.export.runtime as R
d, reps = Path(sys.argv[1]), int(sys.argv[2])
p = R.load(d)
if (d / "batch.npz").exists():
    b = np.load(d / "batch.npz"); x, y = b["x"], b["y"]
    step, n = (lambda: p.step(x, y)), 50
else:
    a, bb = np.load(d / "args.npy").tolist()
    step, n = (lambda: p(a, bb)), 100000
for _ in range(n):
    step()
times = []
for _ in range(reps):
    t = time.perf_counter()
    for _ in range(n):
        step()
    times.append((time.perf_counter() - t) / n)
mods = [m for m in ("numba", "llvmlite", "scipy") if m in sys.modules]
print(json.dumps({"time_s": sorted(times)[len(times) // 2], "times_s": times, "imported": mods}))
"""


def _row(wid, impl, status="ok", **kw):
    return dict(workload=wid, impl=impl, status=status, time_s=kw.pop("time_s", None),
                peak_rss_mb=kw.pop("peak_rss_mb", None), note=kw.pop("note", ""), **kw)


def _child(args, env, cwd=None):
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd)
    if p.returncode:
        raise RuntimeError(" | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])[:400])
    return p.stdout


def timed_run(cmd, env):
    """(stdout, stderr, peak RSS MB or None) of cmd, the RSS by GNU time (a small parent: a child forked from
    this interpreter counts, in its own ru_maxrss, the interpreter's pages it held before exec)."""
    timer = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    p = subprocess.run(([timer, "-f", "maxrss_kb %M"] if timer else []) + cmd, capture_output=True, text=True,
                       env=env)
    if p.returncode:
        raise RuntimeError(" | ".join(p.stderr.strip().splitlines()[-3:])[:400])
    rss = round(float(p.stderr.rsplit("maxrss_kb ", 1)[1].split()[0]) / 1024, 1) if timer else None
    return p.stdout, p.stderr, rss


def measure_export(wid, reps, tmp: Path) -> list:
    """The runtime row and the C host row of workload wid (exported into tmp)."""
    env = thread_env(1)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = tmp / wid
    try:
        _child([sys.executable, "-c", EXPORT_CHILD, wid, str(out)], env)
    except RuntimeError as e:
        return [_row(wid, "btjit.runtime", f"error: export: {e}"), _row(wid, "btjit C host", "error: no export")]
    rows = []
    try:
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
        stdout, _, rss = timed_run(pin + [sys.executable, "-c", RUNTIME_CHILD, str(out), str(reps)], env)
        r = json.loads(stdout.strip().splitlines()[-1])
        note = "imported " + ", ".join(r["imported"]) if r["imported"] else "no numba, llvmlite or scipy imported"
        rows.append(_row(wid, "btjit.runtime", time_s=r["time_s"], peak_rss_mb=rss, note=note))
    except (RuntimeError, ValueError, IndexError) as e:
        rows.append(_row(wid, "btjit.runtime", f"error: {e}"))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return rows + [_row(wid, "btjit C host", "n/a", note="no C compiler")]
    exe = tmp / f"train_{wid}"
    try:
        _child([cc, "-O2", "-I", str(out), "-o", str(exe), str(REPO / "examples/c/train.c"),
                str(out / "libbtjit.so"), f"-Wl,-rpath,{out}"], env)
        _, err, rss = timed_run([str(exe), str(out), str(C_STEPS[wid])], env)
        busy = float(err.split("steps: ")[1].split()[0])        # "N steps: S s in btjit, T s in all"
        rows.append(_row(wid, "btjit C host", time_s=busy / C_STEPS[wid], peak_rss_mb=rss,
                         note=f"examples/c/train.c, {C_STEPS[wid]} steps"))
    except (RuntimeError, IndexError, ValueError, OSError) as e:
        rows.append(_row(wid, "btjit C host", f"error: {e}"))
    return rows


def run(only=None, peers=None, reps=5, progress=lambda s: None) -> list:
    wids = [w.strip() for w in only.split(",")] if only else list(WORKLOADS)
    unknown = [w for w in wids if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)} for the footprint suite (known: "
                         f"{', '.join(WORKLOADS)})")
    impls = ["btjit"] + [p for p in (peers.split(",") if peers else ["torch", "jax"]) if p and p != "none"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="btjit_footprint_") as tmp:
        for wid in wids:
            for impl in impls:
                progress(f"  {wid} {impl}")
                rows.append(harness.measure(impl, wid, threads=1, reps=reps))
            progress(f"  {wid} export -> btjit.runtime, C host")
            rows += measure_export(wid, reps, Path(tmp))
            rows.append(_row(wid, "BurTorch (ref.)", "reference", peak_rss_mb=BURTORCH_RSS_MB.get(wid),
                             note="issue 18's measurement, not run here"))
    return rows


def format_table(rows, machine=None, markdown=False, command=None) -> str:
    """The suite's table (btjit.bench.report.render). machine=None: this machine, False: no heading."""
    from btjit.bench.report import Table, render
    body = []
    for r in rows:
        t = harness.fmt_time(r["time_s"]) if r.get("time_s") else "-"
        rss = f"{r['peak_rss_mb']:.1f}" if r.get("peak_rss_mb") is not None else "-"
        note = r.get("note", "") if r["status"] in ("ok", "reference") else r["status"]
        body.append((r["workload"], r["impl"], t, rss, note))
    return render(Table(("workload", "impl", "step", "peak RSS MB", "note"), body, [],
                        "footprint: in-process, btjit.runtime and the C host", "llrr"), markdown, machine, command)
