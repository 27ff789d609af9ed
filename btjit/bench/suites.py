"""Which code runs each suite of `btjit bench` (the CLI's one entry point): run(suite, ...) -> (rows, format_table),
where format_table(rows, markdown=..., command=...) renders them through btjit.bench.report. Options a suite does
not take are ignored by it. Not here: measuring (harness.py and the *_suite.py modules) or formatting.
"""
from __future__ import annotations

import json
from pathlib import Path

SUITES = ("paper", "scale", "compile", "footprint", "mpi", "nanogpt")


def _peers_list(peers):
    return None if peers is None else [p for p in peers.split(",") if p and p != "none"]


def run(suite, only=None, peers=None, threads=None, reps=5, json_path=None, use_compile=False, steps=None,
        progress=print, precision="fp32"):
    """Run `suite`; threads None or 0 = every core the process may run on (the nanogpt suite: None = each side's
    own default). Writes JSON to json_path when given. progress(str) gets one line per measurement."""
    from btjit.host.threads import cores
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    if precision != "fp32" and suite != "scale":
        raise ValueError(f"--precision applies to --suite scale (the nanogpt suite has a btjit-bf16 row), "
                         f"not to --suite {suite}")
    n = threads or cores()
    if suite == "nanogpt":              # nanoGPT's CPU recipe end to end, btjit train beside PyTorch eager
        from btjit.bench import nanogpt_suite as mod
        impls = only if only is not None else (["btjit"] + _peers_list(peers) if peers is not None else None)
        rows = mod.run(only=impls, steps=steps, threads=threads, progress=progress)
    elif suite == "mpi":                # E6 data-parallel over MPI at 1 and 2 ranks
        from btjit.bench import mpi as mod
        from btjit.train.distributed import require_mpi
        require_mpi()
        rows = mod.run(reps=reps, threads=n, progress=lambda r: progress(
            f"  {r['ranks']} rank(s) {r['compressor']:<6} {r['scaling']:<6} {r['status']}"))
    elif suite == "compile":            # fresh process -> first step: cold / cached / warm library, JAX jit
        from btjit.bench import compile_suite as mod
        return mod.run(json_path=json_path, progress=progress, only=only), mod.format_table
    elif suite == "scale":              # the GPT grown: E6, S1-S4
        from btjit.bench import scale_suite as mod
        impls = None if peers is None else ["btjit"] + _peers_list(peers)
        rows = mod.run(only=only, threads=n, reps=reps, compile=use_compile, impls=impls, progress=progress,
                       precision=precision)
    elif suite == "footprint":          # in-process / btjit.runtime / C host, peak RSS and step
        from btjit.bench import footprint as mod
        rows = mod.run(only=only, peers=peers, reps=reps, progress=progress)
    else:                               # the paper's E1-E6 beside every installed peer
        from btjit.bench import harness as mod
        rows = mod.run_bench(suite=suite, only=only, peers=peers, threads=n, reps=reps,
                             json_path=str(json_path) if json_path else None, compile=use_compile,
                             progress=lambda r: progress(f"  {r['workload']:<6s} {r['impl']:<14s} {r['status']}"))
        return rows, mod.format_table
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows, mod.format_table
