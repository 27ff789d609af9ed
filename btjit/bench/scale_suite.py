"""`btjit bench --suite scale` (issue 16): the paper's GPT grown as a user grows it -- E6 and S1-S4 -- for btjit,
PyTorch eager (SDPA attention), JAX jit and, with --compile, torch.compile; the same params and batch (random
tokens, vocab 65) in every implementation, SGD lr 3e-4, one process per measurement.

Columns: step ms (median of `reps` timed loops after two warm-up steps), each peer's time over btjit's,
btjit's achieved GFLOP/s (2 x the step's multiply-adds / time), the FLOP floor (the step's multiply-adds
over the measured single-thread sgemm peak of the fastest BLAS installed: numpy's OpenBLAS or torch's),
btjit's time over it, the first-step gradients' agreement with torch (max over params of
max|g - g_torch| / max|g_torch|), and peak RSS (GNU time). Multiply-adds per step: forward = B*T*(12 C^2 +
C V) for the linear layers + B*T*(T+1)*C for causal attention's two products, backward twice that.
With precision "bf16" (`--precision bf16`): btjit traced with precision="bf16" beside its float32 step
("btjit-fp32") and PyTorch eager under torch.autocast("cpu", torch.bfloat16); JAX and torch.compile are not run.
Child: `python -m btjit.bench.scale_suite --child S2 --impl btjit [--threads N] [--grads out.npz] [--precision bf16]`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

SIZES = {   # id -> (n_embd, n_head, T, batch, n_layer)
    "E6": (24, 6, 8, 64, 6), "S1": (64, 4, 32, 32, 4), "S2": (128, 4, 64, 16, 4),
    "S3": (192, 6, 128, 8, 6), "S4": (384, 6, 256, 4, 6)}
VOCAB, LR = 65, 3e-4
IMPLS = ("btjit", "torch", "jax", "torch.compile")


def step_macs(size) -> int:
    C, _, T, B, L = SIZES[size]
    fwd = L * B * T * (12 * C * C + (T + 1) * C) + B * T * C * VOCAB
    return 3 * fwd


def _data(size):
    import numpy as np
    from btjit.models import gpt
    C, H, T, B, L = SIZES[size]
    cfg = gpt.GPTConfig(vocab_size=VOCAB, n_layer=L, n_head=H, n_embd=C, block_size=T)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    y = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    return cfg, gpt.init_params(cfg, 0), x, y


def _make(size, impl, threads, precision="fp32"):
    """-> (step(), first-step grads {name: array}). impl "btjit-fp32": btjit in float32 whatever precision says."""
    import numpy as np
    cfg, params, x, y = _data(size)
    if impl.startswith("btjit"):
        import btjit
        from btjit.models import gpt
        prec = "fp32" if impl == "btjit-fp32" else precision
        btjit.set_num_threads(threads)
        reps = btjit.replicas_for(len(y), y.size, threads)
        g = btjit.trace(gpt.loss_fn(cfg), params, x, y, grad=True, precision=prec)
        g.value_and_grad(x, y)
        grads = {k: v.copy() for k, v in g.grads.items()}
        prog = btjit.trace(gpt.loss_fn(cfg), params, x, y, optimizer=btjit.optim.SGD(lr=LR), replicas=reps,
                           precision=prec)
        return (lambda: prog.step(x, y)), grads
    if impl.startswith("torch"):
        import torch
        from btjit.bench.peers.torch_peer import gpt_loss
        torch.set_num_threads(threads)
        P = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
        tx, ty = torch.from_numpy(x).long(), torch.from_numpy(y).long()
        fn = (lambda P, a, b: gpt_loss(P, a, b, cfg.n_layer, cfg.n_head))
        if precision == "bf16":
            plain = fn

            def fn(P, a, b):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return plain(P, a, b).float()
        if impl == "torch.compile":
            fn = torch.compile(fn)
        fn(P, tx, ty).backward()
        grads = {k: v.grad.numpy().copy() for k, v in P.items()}
        opt = torch.optim.SGD(list(P.values()), lr=LR)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = fn(P, tx, ty)
            loss.backward()
            opt.step()
            return loss.item()
        return step, grads
    import jax
    import jax.numpy as jnp
    from btjit.bench.peers.jax_peer import gpt_loss
    P = {k: jnp.asarray(v) for k, v in params.items()}
    vg = jax.jit(jax.value_and_grad(lambda P, a, b: gpt_loss(P, a, b, cfg.n_layer, cfg.n_head)))
    jx, jy = jnp.asarray(x), jnp.asarray(y)
    grads = {k: np.asarray(v) for k, v in vg(P, jx, jy)[1].items()}
    upd = jax.jit(lambda P, a, b: (lambda lg: (lg[0], jax.tree_util.tree_map(lambda p, g: p - LR * g, P, lg[1])))(
        vg(P, a, b)))
    state = {"P": P}

    def step():
        loss, state["P"] = upd(state["P"], jx, jy)
        return float(loss)
    return step, grads


def child(size, impl, threads, reps, grads_path, precision="fp32"):
    import numpy as np
    from btjit.bench.run_one import pin_cpus
    pin_cpus(threads)
    step, grads = _make(size, impl, threads, precision)
    if grads_path:
        np.savez(grads_path, **grads)
    for _ in range(2):
        step()
    n, t0 = 1, time.perf_counter()
    step()
    one = time.perf_counter() - t0
    n = max(1, int(0.3 / max(one, 1e-9)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            step()
        times.append((time.perf_counter() - t) / n)
    print(json.dumps({"time_s": sorted(times)[len(times) // 2], "times_s": times}))


def sgemm_peak_gflops() -> float:
    """The single-thread float32 GEMM peak of the fastest installed BLAS (numpy's; torch's if installed)."""
    code = ("import time, numpy as np\nbest = 0.0\na = np.random.rand(1024, 1024).astype(np.float32)\n"
            "for lib in ('numpy', 'torch'):\n    try:\n        if lib == 'torch':\n            import torch\n"
            "            torch.set_num_threads(1); x = torch.from_numpy(a); mm = lambda: torch.mm(x, x)\n"
            "        else:\n            mm = lambda: a @ a\n    except ImportError:\n        continue\n"
            "    mm()\n    for _ in range(5):\n        t = time.perf_counter(); mm(); mm(); mm()\n"
            "        best = max(best, 3 * 2 * 1024 ** 3 / (time.perf_counter() - t) / 1e9)\nprint(best)\n")
    from btjit.bench.footprint import timed_run
    from btjit.bench.run_one import thread_env
    try:
        out, _, _ = timed_run([sys.executable, "-c", code], thread_env(1))
        return float(out.strip().splitlines()[-1])
    except (RuntimeError, ValueError, IndexError):
        return float("nan")


def _agreement(g, ref) -> float:
    import numpy as np
    return max(float(np.abs(g[k] - ref[k]).max() / max(np.abs(ref[k]).max(), 1e-30)) for k in ref)


def run(only=None, impls=None, threads=1, reps=5, compile=False, progress=lambda s: None, precision="fp32") -> list:
    import numpy as np
    from btjit.bench.footprint import timed_run
    from btjit.bench.run_one import thread_env
    sizes = [s.strip() for s in only.split(",")] if only else list(SIZES)
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise ValueError(f"unknown size(s) {', '.join(unknown)} for the scale suite (known: {', '.join(SIZES)})")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    if precision == "bf16":     # btjit in bf16 and in float32, torch under autocast
        impls = ["btjit", "btjit-fp32"] + [i for i in (impls or ["torch"]) if i == "torch"]
    impls = list(impls or [i for i in IMPLS if compile or i != "torch.compile"])
    env = thread_env(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] +
                                        [p for p in [env.get("PYTHONPATH")] if p])
    peak = sgemm_peak_gflops()
    rows = []
    with tempfile.TemporaryDirectory(prefix="btjit_scale_") as tmp:
        for size in sizes:
            grads = {}
            for impl in impls:
                progress(f"  {size} {impl}")
                gp = os.path.join(tmp, f"{size}_{impl}.npz")
                row = dict(size=size, impl=impl, threads=threads, status="ok", time_s=None, peak_rss_mb=None,
                           precision="fp32" if impl == "btjit-fp32" else precision)
                try:
                    out, _, rss = timed_run([sys.executable, "-m", "btjit.bench.scale_suite", "--child", size,
                                             "--impl", impl, "--threads", str(threads), "--reps", str(reps),
                                             "--grads", gp, "--precision", precision], env)
                    row.update(json.loads(out.strip().splitlines()[-1]), peak_rss_mb=rss)
                    grads[impl] = dict(np.load(gp))
                except (RuntimeError, ValueError, IndexError) as e:
                    row["status"] = "not installed" if "No module named" in str(e) else f"error: {e}"[:300]
                rows.append(row)
            macs = step_macs(size)
            for row in (r for r in rows if r["size"] == size):
                if row["time_s"]:
                    row["gflops"] = 2 * macs / row["time_s"] / 1e9
                    row["floor_s"] = 2 * macs / (peak * 1e9)
                if row["impl"] in grads and "torch" in grads:
                    row["grad_vs_torch"] = _agreement(grads[row["impl"]], grads["torch"])
    return rows


def format_table(rows, machine=None, markdown=False, command=None) -> str:
    """The suite's table (btjit.bench.report.render). machine=None: this machine, False: no heading."""
    from btjit.bench.report import Table, render
    base = {r["size"]: r["time_s"] for r in rows if r["impl"] == "btjit" and r["time_s"]}
    body = []
    for r in rows:
        if not r["time_s"]:
            body.append((r["size"], r["impl"] + (" bf16" if r.get("precision") == "bf16" else ""), *"-" * 7, r["status"]))
            continue
        ratio = f"{r['time_s'] / base[r['size']]:.2f}x" if r["size"] in base else "-"
        g = f"{r['grad_vs_torch']:.1e}" if r.get("grad_vs_torch") is not None else "-"
        body.append((r["size"], r["impl"] + (" bf16" if r.get("precision") == "bf16" else ""), f"{r['time_s'] * 1e3:.2f}", ratio, f"{r['gflops']:.1f}",
                     f"{r['floor_s'] * 1e3:.2f}", f"{r['time_s'] / r['floor_s']:.2f}x", g,
                     f"{r['peak_rss_mb'] or 0:.0f}", ""))
    head = ("size", "impl", "step ms", "vs btjit", "GFLOP/s", "floor ms", "x floor", "grad vs torch", "RSS MB", "note")
    notes = ["vs btjit: the implementation's step time over btjit's (> 1: btjit faster); x floor: over the FLOP floor"]
    return render(Table(head, body, notes, "scale: the paper's GPT grown", "llrrrrrrrl"), markdown, machine, command)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child")
    ap.add_argument("--impl", default="btjit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grads")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--only")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.impl, a.threads, a.reps, a.grads, a.precision)
    else:
        print(format_table(run(a.only, threads=a.threads, reps=a.reps, progress=print)))


if __name__ == "__main__":
    main()
