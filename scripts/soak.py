#!/usr/bin/env python
"""Soak test: a long `btjit train` run of the paper's GPT (configs/gpt3_tiny.toml) at batch size 1, with
the resident set size (RSS) sampled every --every steps. Exits 1 if RSS grew by more than --max-growth-mb
after the warm-up (by then every periodic action -- eval, sample, checkpoint, log -- has run at least once),
so a leak of ~100 bytes per step shows up over the default 20,000 steps. No timing is asserted.

    python scripts/soak.py                          # 20,000 steps, RSS every 1,000 (a few minutes)
    python scripts/soak.py --steps 3000 --every 500 --warmup 1000     # the short form CI runs
    python scripts/soak.py --json soak.json         # also write the samples

It drives the real training loop (btjit.train.trainer.Trainer: data batches, the native step, val loss, samples,
checkpoints, the metrics log) in a temporary run dir unless --out is given.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mb() -> float:
    """Current resident set size in MB (Linux /proc; elsewhere the peak RSS, which also shows growth)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2 ** 20 if sys.platform == "darwin" else peak / 2 ** 10


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20000, help="training steps (default 20000)")
    ap.add_argument("--every", type=int, default=1000, help="sample RSS every this many steps (default 1000)")
    ap.add_argument("--warmup", type=int, default=2000,
                    help="steps before the baseline sample (default 2000)")
    ap.add_argument("--interval", type=int, default=None,
                    help="eval/sample/checkpoint every this many steps (default: --every)")
    ap.add_argument("--max-growth-mb", type=float, default=2.0,
                    help="fail if RSS grows more than this after the warm-up (default 2.0)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--config", default=str(ROOT / "configs" / "gpt3_tiny.toml"))
    ap.add_argument("--out", default=None, help="run dir (default: a temporary dir, removed afterwards)")
    ap.add_argument("--json", default=None, help="write {steps, samples: [[step, rss_mb], ...], ...} here")
    ap.add_argument("--quiet", action="store_true", help="only the RSS lines and the verdict")
    ap.add_argument("--leak-bytes-per-step", type=int, default=0, help=argparse.SUPPRESS)  # self-test of the check
    a = ap.parse_args(argv)
    if a.every < 1 or a.steps < 1 or not 0 <= a.warmup < a.steps:
        ap.error("need --steps >= 1, --every >= 1 and 0 <= --warmup < --steps")

    from btjit.train import config as C
    from btjit.train.trainer import Trainer
    interval = a.interval or a.every
    cfg = C.load(a.config, [f"train.steps={a.steps}", f"train.batch_size={a.batch_size}",
                            f"train.eval_interval={interval}", "train.eval_batches=4",
                            f"train.sample_interval={interval}", "train.sample_chars=32",
                            f"train.checkpoint_interval={interval}", "train.keep_checkpoints=2",
                            f"train.log_interval={interval}"])
    tmp = None if a.out else tempfile.TemporaryDirectory(prefix="btjit_soak_")
    run_dir = Path(a.out or tmp.name) / "run"
    echo = (lambda s="": None) if a.quiet else (lambda s="": print(s, flush=True))
    trainer = Trainer(cfg, run_dir, echo=echo)

    samples, count, leak = [], {"n": 0}, []
    real_step = trainer.prog.step
    t0 = time.perf_counter()

    def step(*batch):                    # the loop's own step, plus an RSS sample every `every` steps
        loss = real_step(*batch)
        count["n"] += 1
        if a.leak_bytes_per_step:
            leak.append(bytearray(b"x" * a.leak_bytes_per_step))
        if count["n"] % a.every == 0 or count["n"] == a.warmup:
            samples.append((count["n"], rss_mb()))
            print(f"soak: step {count['n']:>7d}  rss {samples[-1][1]:8.2f} MB", flush=True)
        return loss
    trainer.prog.step = step             # an instance attribute: the training loop calls this one
    trainer.run()
    seconds = time.perf_counter() - t0
    if tmp is not None:
        tmp.cleanup()

    base = [r for s, r in samples if s == a.warmup] or [samples[0][1]]
    after = [r for s, r in samples if s >= a.warmup]
    growth = max(after) - base[0]
    ok = count["n"] == a.steps and growth <= a.max_growth_mb
    result = {"steps": count["n"], "samples": samples, "baseline_mb": base[0], "growth_mb": growth,
              "max_growth_mb": a.max_growth_mb, "seconds": seconds, "ok": ok}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    verdict = "OK" if ok else "FAIL"
    print(f"soak: {verdict}: {count['n']} steps at batch {a.batch_size}; RSS {base[0]:.2f} MB at step {a.warmup}, "
          f"max {max(after):.2f} MB after it: growth {growth:+.2f} MB (limit {a.max_growth_mb} MB); "
          f"{seconds:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
