"""`btjit bench --suite nanogpt` (issue 32 item 4): nanoGPT's CPU recipe end to end, in the same run --

  btjit  `btjit train configs/nanogpt_cpu.toml` (the real trainer, a child process, its default threads);
  btjit-bf16  the same with `--set train.precision=bf16` (bf16 products, float32 sums);
  torch  nanoGPT's model.py and train.py loop in PyTorch eager (btjit/bench/peers/nanogpt_torch.py, a child run by
         path: no btjit imported) on the same config, data (the bundled Tiny Shakespeare, 90/10) and schedule,
         at torch's default threads;
  torch-bf16  the same under torch.autocast("cpu", torch.bfloat16) (`--set train.precision="bf16"`).

Each row: wall time in all (Popen to exit: start-up, compile, training, every eval), steps, ms/step (the timed
steps only), the val losses at every eval and the last one, params, threads. `steps` shortens the recipe (a smoke
test: the same config with train.steps = steps, and the warm-up cut to fit). Errors become rows with status
"error: ...", never exceptions.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "nanogpt_cpu.toml"
PEER = Path(__file__).resolve().parent / "peers" / "nanogpt_torch.py"
IMPLS = ("btjit", "btjit-bf16", "torch", "torch-bf16")
README_CLAIM = "nanoGPT's README: ~3 minutes, loss 1.88 on an unnamed Mac (2023-02 code: tanh GELU, weight decay 1e-2)"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run(cmd, timeout):
    """-> (CompletedProcess or None, wall seconds, error status or None)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - t0, f"error: timeout after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        return proc, wall, f"error: exit code {proc.returncode}: {tail}"[:400]
    return proc, wall, None


def metrics_row(metrics_path: Path) -> dict:
    """steps, ms_per_step (step-weighted over the train events) and val losses of a run's metrics.jsonl."""
    events = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    last, total_ms, steps = 0, 0.0, 0
    for e in events:
        if e.get("event") == "train":
            total_ms += e["ms_per_step"] * (e["step"] - last)
            steps, last = e["step"], e["step"]
    vals = [[e["step"], e["val_loss"]] for e in events if e.get("event") == "val"]
    return dict(steps=steps, ms_per_step=total_ms / steps if steps else None, val_losses=vals,
                val_loss=vals[-1][1] if vals else None)


def overrides(config, steps) -> list:
    """The `--set` overrides both sides get for a run shortened to `steps`: train.steps, and a warm-up cut to
    fit (steps - 1) when the recipe's is longer (the trainer refuses a warm-up that outlasts the run)."""
    if not steps:
        return []
    import tomllib
    warmup = tomllib.loads(Path(config).read_text()).get("optim", {}).get("warmup_steps", 0)
    return [f"train.steps={steps}"] + ([f"optim.warmup_steps={steps - 1}"] if warmup >= steps else [])


def run_btjit(config=CONFIG, steps=None, threads=None, timeout=3600.0, precision="fp32") -> dict:
    with tempfile.TemporaryDirectory(prefix="btjit_nanogpt_") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "btjit", "train", str(config), "--out", str(out)]
        sets = overrides(config, steps) + ([f"train.precision={precision}"] if precision != "fp32" else [])
        cmd += [a for kv in sets for a in ("--set", kv)]
        cmd += ["--threads", str(threads)] if threads is not None else []
        proc, wall, err = _run(cmd, timeout)
        row = dict(impl="btjit" if precision == "fp32" else f"btjit-{precision}", status=err or "ok", wall_s=wall,
                   command=" ".join(cmd[2:]))
        if err:
            return row
        row.update(metrics_row(out / "metrics.jsonl"))
    text = proc.stdout
    m = re.search(r"threads (\d+)", text)
    row["threads"] = int(m.group(1)) if m else None
    m = re.search(r"\| ([\d,]+) params", text)
    row["n_params"] = int(m.group(1).replace(",", "")) if m else None
    m = re.search(r"btjit\.trace wall time ([\d.]+) s", text)
    row["startup_s"] = float(m.group(1)) if m else None
    return row


def run_torch(config=CONFIG, steps=None, threads=None, timeout=3600.0, precision="fp32") -> dict:
    sets = overrides(config, steps) + ([f'train.precision="{precision}"'] if precision != "fp32" else [])
    cmd = [sys.executable, str(PEER), str(config)] + [a for kv in sets for a in ("--set", kv)] \
        + (["--threads", str(threads)] if threads is not None else [])
    proc, wall, err = _run(cmd, timeout)
    if err:
        status = "not installed (torch)" if "No module named 'torch'" in err else err
        return dict(impl="torch" if precision == "fp32" else f"torch-{precision}", status=status, wall_s=None)
    row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    row["wall_s"] = wall
    return row


def run(only=None, steps=None, threads=None, config=CONFIG, progress=None) -> list:
    """The suite's rows, btjit first. only: a subset of IMPLS (a list or "btjit,torch"); threads None: each
    side's default."""
    impls = IMPLS if only is None else [s.strip() for s in (only.split(",") if isinstance(only, str) else only)
                                        if s.strip() and s.strip() != "none"]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise ValueError(f"unknown implementation(s) {', '.join(bad)} for the nanogpt suite (known: {', '.join(IMPLS)})")
    rows = []
    for impl in impls:
        precision = "bf16" if impl.endswith("-bf16") else "fp32"
        row = run_torch(config, steps, threads, precision=precision) if impl.startswith("torch") else \
            run_btjit(config, steps, threads, precision=precision)
        rows.append(row)
        if progress is not None:
            progress(f"  {impl:<10s} {row['status']}" + (f" {row['wall_s']:.1f} s" if row.get("wall_s") else ""))
    return rows


def format_table(rows, machine=None, markdown=False, command=None) -> str:
    """The suite's table (btjit.bench.report.render). machine=None: this machine, False: no heading."""
    from btjit.bench.report import Table, render
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append((r["impl"],) + ("-",) * 7 + (r["status"],))
            continue
        step, val = r["val_losses"][-1] if r.get("val_losses") else ("-", None)
        body.append((r["impl"], r["steps"], f"{r['wall_s']:.1f}", f"{r['ms_per_step']:.2f}",
                     "-" if val is None else f"{val:.4f}", step, f"{r['n_params']:,}" if r.get("n_params") else "-",
                     r.get("threads") or "-", f"start-up {r['startup_s']:.1f} s" if r.get("startup_s") else ""))
    head = ("impl", "steps", "wall s", "ms/step", "val loss", "at step", "params", "threads", "note")
    notes = ["nanoGPT's CPU recipe (configs/nanogpt_cpu.toml): 4 layers, 4 heads, n_embd 128, block 64, batch 12, "
             "AdamW 1e-3 -> 1e-4 cosine, 100 warm-up, clip 1.0, 2001 steps; eval every 250 on 20 batches. wall s = "
             "the whole process (start-up, compile, training, evals); ms/step = the timed steps only.",
             README_CLAIM]
    return render(Table(head, body, notes, "nanogpt: nanoGPT's CPU recipe end to end", "lrrrrrrrl"), markdown, machine,
                  command)
