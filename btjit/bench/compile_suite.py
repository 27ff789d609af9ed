"""`btjit bench --suite compile` (issue 15, item 5): how long a FRESH PROCESS takes from start to its first
step returned, for six programs, with the kernel library cold, cached and warm, beside JAX's jit time.

Holds: the program definitions P1-P6 (PROGRAMS; build() for btjit, jax_build() for JAX, including a
makemore-style tanh RNN written with btjit's public API), the child entry point
(`python -m btjit.bench.compile_suite --child P3 [--jax]`: builds and traces one program, runs its first step
and prints ONE JSON line with its own timings and the kernel entries it compiled), measure() (one child in
its own process, timed from just before Popen to the child's first-step stamp), measure_cli() (`btjit
train configs/gpt3_tiny.toml --set train.steps=1 --set optim.warmup_steps=0` wall time and its banner's compile seconds), run() (the
whole suite -> rows) and format_table(rows).
Columns: cold = an empty BTJIT_CACHE_DIR; cached = the same program again on that dir; warm = the first run
of the program in ONE shared dir where the main job (the CLI row's command) ran first, then the programs above
it; precompiled = its first run after `btjit precompile` in an empty dir (the precompile's seconds reported too).
Children run with one-thread env vars but are NOT pinned to one CPU: the library compiles missing kernels in
worker processes over the process's CPU affinity, and that parallel cold compile is what is measured.
The executor itself (btjit/executor.py, numba cache=True) is cached in the package's __pycache__, not in
BTJIT_CACHE_DIR: "cold" means an empty kernel library, not a fresh install.
Standalone: python -m btjit.bench.compile_suite [--only P1,P6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT_BASE = dict(n_layer=6, n_head=6, n_embd=24, block=8, batch=64, lr=3e-4, act="relu", opt="sgd")
PROGRAMS = {   # id -> (title, settings)
    "P1": ("E6 GPT, SGD", dict(GPT_BASE, model="gpt")),
    "P2": ("GPT, AdamW", dict(GPT_BASE, model="gpt", opt="adamw")),
    "P3": ("GPT, grad only", dict(GPT_BASE, model="gpt", opt=None)),
    "P4": ("GPT, GELU", dict(GPT_BASE, model="gpt", act="gelu")),
    "P5": ("GPT C32 H4 T16 B16", dict(GPT_BASE, model="gpt", n_embd=32, n_head=4, block=16, batch=16)),
    "P6": ("tanh RNN, AdamW", dict(model="rnn", vocab=27, block=16, n_embd=64, hidden=64, batch=32, lr=3e-4,
                                   opt="adamw")),
}
REPO = Path(__file__).resolve().parents[2]
CLI_CONFIG = REPO / "configs" / "gpt3_tiny.toml"


# ----------------------------------------------------------------------------- the programs (numpy data)
def data(pid):
    """-> (params, x, y, vocab) as numpy: the E6 batch / a makemore batch (generated text if no data file)."""
    import numpy as np
    from btjit.bench import workloads as W
    s = PROGRAMS[pid][1]
    if s["model"] == "gpt":
        from btjit.models import gpt
        itos, train, _val, _src = W.e6_corpus()
        x, y = W.e6_batch(train, s["batch"], s["block"], seed=0)
        return gpt.init_params(gpt_config(pid, len(itos)), 0), x, y, len(itos)
    X, Y, itos, _src = W.e5_dataset(context=s["block"])         # (N, T) contexts and the char after each
    xb, yb = W.e5_batch(X, Y, s["batch"], seed=0)
    xy = np.concatenate([xb, yb[:, None]], axis=1)              # targets: the next char at every position
    x, y = np.ascontiguousarray(xy[:, :-1]), np.ascontiguousarray(xy[:, 1:])
    V, E, H = len(itos), s["n_embd"], s["hidden"]
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    params = {"emb": f32(V, E), "h0": np.zeros((1, H), np.float32),
              "W": f32(E + H, H) * np.float32(5 / 3 / math.sqrt(E + H)), "b": np.zeros(H, np.float32),
              "Wout": f32(H, V) * np.float32(0.01), "bout": np.zeros(V, np.float32)}   # loss ~ ln V at init
    return params, x, y, V


def gpt_config(pid, vocab):
    from btjit.models import gpt
    s = PROGRAMS[pid][1]
    return gpt.GPTConfig(vocab_size=vocab, n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                         block_size=s["block"], activation=s["act"])


def rnn_loss(p, x, y):
    """Makemore-style tanh RNN: h_t = tanh([emb(x_t), h_{t-1}] @ W + b), logits_t = h_t @ Wout + bout."""
    import btjit
    B, T = x.shape
    V, H = p["Wout"].shape[1], p["W"].shape[1]
    e = btjit.take(p["emb"], x)                                   # (B, T, E)
    h = btjit.broadcast_to(p["h0"], (B, H))
    logits = []
    for t in range(T):
        h = btjit.tanh(btjit.concatenate([e[:, t], h], axis=1) @ p["W"] + p["b"])
        logits.append(btjit.reshape(h @ p["Wout"] + p["bout"], (B, 1, V)))
    return btjit.cross_entropy(btjit.concatenate(logits, axis=1), y)   # mean over all B*T positions


def build(pid):
    """-> (loss_fn, params, x, y, optimizer or None for grad only)."""
    import btjit
    from btjit.models import gpt
    s = PROGRAMS[pid][1]
    params, x, y, vocab = data(pid)
    loss = gpt.loss_fn(gpt_config(pid, vocab)) if s["model"] == "gpt" else rnn_loss
    opt = {"sgd": lambda: btjit.optim.SGD(lr=s["lr"]), "adamw": lambda: btjit.optim.AdamW(lr=s["lr"]),
           None: lambda: None}[s["opt"]]()
    return loss, params, x, y, opt


# ----------------------------------------------------------------------------- the same programs in JAX
def jax_gpt_loss(P, x, y, n_head, act):
    """btjit/bench/peers/jax_peer.py's gpt_loss with the MLP activation as an argument."""
    import jax
    import jax.numpy as jnp
    from btjit.bench.peers.jax_peer import _cross_entropy, _layer_norm
    B, T = x.shape
    C = P["wte"].shape[1]
    hs = C // n_head
    mask = jnp.tril(jnp.ones((T, T), bool))
    h = (P["wte"][x] + P["wpe"][:T]).reshape(B * T, C)
    i = 0
    while f"h{i}.ln1.g" in P:
        p = f"h{i}."
        a = _layer_norm(h, P[p + "ln1.g"], P[p + "ln1.b"])
        qkv = (a @ P[p + "attn.qkv.w"]).reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)
        att = (qkv[0] @ qkv[1].transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))          # (B, NH, T, T)
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
        o = (att @ qkv[2]).transpose(0, 2, 1, 3).reshape(B * T, C)
        h = h + o @ P[p + "attn.proj.w"] + P[p + "attn.proj.b"]
        m = _layer_norm(h, P[p + "ln2.g"], P[p + "ln2.b"])
        m = act(m @ P[p + "mlp.fc.w"] + P[p + "mlp.fc.b"])
        h = h + m @ P[p + "mlp.proj.w"] + P[p + "mlp.proj.b"]
        i += 1
    h = _layer_norm(h, P["lnf.g"], P["lnf.b"])
    return _cross_entropy(h @ P["head.w"] + P["head.b"], y.reshape(-1))


def jax_rnn_loss(P, x, y):
    """rnn_loss in JAX."""
    import jax.numpy as jnp
    from btjit.bench.peers.jax_peer import _cross_entropy
    B, T = x.shape
    e = P["emb"][x]
    h = jnp.broadcast_to(P["h0"], (B, P["W"].shape[1]))
    logits = []
    for t in range(T):
        h = jnp.tanh(jnp.concatenate([e[:, t], h], axis=1) @ P["W"] + P["b"])
        logits.append(h @ P["Wout"] + P["bout"])
    lg = jnp.stack(logits, axis=1)                                # (B, T, V)
    return _cross_entropy(lg.reshape(B * T, -1), y.reshape(-1))


def jax_child(pid):
    """First call of jax.jit(value_and_grad + the update), blocking; the same data and hyperparameters."""
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import_s = time.perf_counter() - t0
    loss_fn, params, x, y, opt = build(pid)                      # btjit's optimizer object: its hyperparameters
    s = PROGRAMS[pid][1]
    if s["model"] == "gpt":
        act = jax.nn.relu if s["act"] == "relu" else (lambda v: jax.nn.gelu(v, approximate=True))
        loss_fn = lambda P, x, y: jax_gpt_loss(P, x, y, s["n_head"], act)   # noqa: E731
    else:
        loss_fn = jax_rnn_loss
    P = {k: jnp.asarray(v) for k, v in params.items()}
    x, y = jnp.asarray(x), jnp.asarray(y)
    vg = jax.value_and_grad(loss_fn)
    tmap = jax.tree_util.tree_map
    if opt is None:
        fn, args = jax.jit(vg), (P, x, y)
    elif s["opt"] == "sgd":
        def sgd_step(P, x, y):
            loss, g = vg(P, x, y)
            return loss, tmap(lambda p, d: p - opt.lr * d, P, g)
        fn, args = jax.jit(sgd_step), (P, x, y)
    else:                                                        # AdamW exactly as btjit's k_adamw
        b1, b2 = opt.betas

        def adamw_step(P, S, x, y):
            loss, g = vg(P, x, y)
            m, v, t = S
            t = t + 1.0
            m = tmap(lambda m, d: b1 * m + (1 - b1) * d, m, g)
            v = tmap(lambda v, d: b2 * v + (1 - b2) * d * d, v, g)
            bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
            P = tmap(lambda p, m, v: p * (1 - opt.lr * opt.weight_decay) - (opt.lr / bc1) * m /
                     (jnp.sqrt(v / bc2) + opt.eps), P, m, v)
            return loss, P, (m, v, t)
        zeros = tmap(jnp.zeros_like, P)
        fn, args = jax.jit(adamw_step), (P, (zeros, zeros, jnp.float32(0.0)), x, y)
    t1 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return dict(jit_s=time.perf_counter() - t1, jax_import_s=import_s, loss=float(out[0]),
                jax=jax.__version__)


# ----------------------------------------------------------------------------- the child
def btjit_child(pid):
    import btjit
    from btjit.kernels import library
    t0 = time.perf_counter()
    loss_fn, params, x, y, opt = build(pid)
    t1 = time.perf_counter()
    prog = btjit.trace(loss_fn, params, x, y, **(dict(optimizer=opt) if opt else dict(grad=True)))
    t2 = time.perf_counter()
    loss = prog.step(x, y) if opt else prog.value_and_grad(x, y)
    t3 = time.perf_counter()
    k = prog.kernels
    return dict(data_s=t1 - t0, trace_wall_s=t2 - t1, first_step_s=t3 - t2, loss=loss,
                ln_vocab=math.log(params["emb" if "emb" in params else "wte"].shape[0]),
                trace_s=prog.trace_seconds, plan_s=getattr(prog, "plan_seconds", None),
                compile_s=prog.compile_seconds, kernels_s=k.seconds, entries=len(k.entries),
                compiled=list(k.compiled), cache_dir=str(library.cache_dir()))


def child(pid, impl):
    t_main = time.time()                         # `python -m` imported btjit (and numba) before this line
    out = jax_child(pid) if impl == "jax" else btjit_child(pid)
    print(json.dumps(dict(out, program=pid, impl=impl, t_main=t_main, t_done=time.time())), flush=True)


# ----------------------------------------------------------------------------- the parent
def child_env(cache_dir):
    from btjit.bench.run_one import thread_env
    env = thread_env(1)                          # one-thread env vars; no CPU pinning (see the docstring)
    env["BTJIT_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def measure(pid, cache_dir, impl="btjit", timeout=900):
    """One fresh process -> dict: the child's JSON plus ready_s (just before Popen -> first step returned)
    and import_s (just before Popen -> the child's main: interpreter + import btjit); or status 'error: ...'."""
    cmd = [sys.executable, "-m", "btjit.bench.compile_suite", "--child", pid] + (["--jax"] if impl == "jax" else [])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=child_env(cache_dir), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(program=pid, impl=impl, status=f"error: timeout {timeout} s")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(program=pid, impl=impl, status=f"error: rc {p.returncode}: {tail}"[:300])
    r = json.loads(lines[-1])
    r.update(status="ok", ready_s=r["t_done"] - t0, import_s=r["t_main"] - t0, exit_s=time.time() - r["t_done"])
    return r


def measure_cli(cache_dir, out_dir, timeout=900):
    """`btjit train configs/gpt3_tiny.toml --set train.steps=1` in a fresh process: wall to exit, and the
    compile seconds its banner prints ("program: trace ... + compile X s")."""
    if not CLI_CONFIG.is_file():
        return dict(status=f"n/a ({CLI_CONFIG} not found)")
    cmd = [sys.executable, "-m", "btjit", "train", str(CLI_CONFIG), "--set", "train.steps=1", "--set",
           "optim.warmup_steps=0", "--out", str(out_dir)]           # (a 1-step run has no room for a warm-up)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=child_env(cache_dir), capture_output=True, text=True, timeout=timeout,
                           cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return dict(status=f"error: timeout {timeout} s")
    wall = time.time() - t0
    m = re.search(r"program: .*?compile ([0-9.]+) s", p.stdout + p.stderr)
    if p.returncode:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(status=f"error: rc {p.returncode}: {tail}"[:300], wall_s=wall)
    return dict(status="ok", wall_s=wall, compile_s=float(m.group(1)) if m else None)


def jax_available():
    return subprocess.run([sys.executable, "-c", "import jax"], capture_output=True).returncode == 0


def run(json_path=None, progress=print, only=None):
    """The whole suite -> rows (one per program, plus the CLI row); optionally written to json_path."""
    pids = [p.strip() for p in only.split(",")] if only else list(PROGRAMS)
    unknown = [p for p in pids if p not in PROGRAMS]
    if unknown:
        raise ValueError(f"unknown program(s) {', '.join(unknown)}; choose from {', '.join(PROGRAMS)}")
    has_jax = jax_available()
    show = lambda what, m: progress(f"  {what:<18s} " + (f"{m['ready_s']:6.2f} s, {len(m['compiled'])} compiled"
                                    if m.get("status") == "ok" else m.get("status")))   # noqa: E731
    with tempfile.TemporaryDirectory(prefix="btjit-compile-suite-") as tmp:
        tmp = Path(tmp)
        rows = {pid: dict(program=pid, title=PROGRAMS[pid][0], settings=PROGRAMS[pid][1]) for pid in pids}
        for pid in pids:
            r = rows[pid]
            r["cold"] = measure(pid, tmp / f"cold-{pid}")
            show(f"{pid} cold", r["cold"])
            r["cached"] = measure(pid, tmp / f"cold-{pid}")
            show(f"{pid} cached", r["cached"])
            if has_jax:
                r["jax"] = measure(pid, tmp / "jax", impl="jax")
                progress(f"  {pid + ' jax':<18s} " + (f"{r['jax']['jit_s']:6.2f} s jit" if r["jax"]["status"] == "ok"
                                                      else r["jax"]["status"]))
            else:
                r["jax"] = dict(status="n/a (jax not installed)")
        seed = measure_cli(tmp / "warm", tmp / "cli-run-warm")     # the main job fills the warm column's library
        progress(f"  {'warm: main job':<18s} " + (f"{seed['wall_s']:6.2f} s" if seed["status"] == "ok"
                                                   else seed["status"]))
        for pid in pids:
            rows[pid]["warm"] = measure(pid, tmp / "warm")
            show(f"{pid} warm", rows[pid]["warm"])
        t0 = time.time()                          # the precompiled column: `btjit precompile`, then each program
        pre = subprocess.run([sys.executable, "-m", "btjit", "precompile"], env=child_env(tmp / "pre"),
                             capture_output=True, text=True, timeout=1800)
        pre_s = time.time() - t0
        progress(f"  {'precompile':<18s} {pre_s:6.2f} s" + ("" if pre.returncode == 0 else f" (rc {pre.returncode})"))
        for pid in pids:
            rows[pid]["pre"] = measure(pid, tmp / "pre")
            show(f"{pid} precompiled", rows[pid]["pre"])
        cli = dict(program="CLI", title="btjit train gpt3_tiny, 1 step", settings=dict(config=str(CLI_CONFIG)),
                   precompile_s=pre_s)
        cli["cold"] = measure_cli(tmp / "cli", tmp / "cli-run-cold")
        cli["cached"] = measure_cli(tmp / "cli", tmp / "cli-run-cached")
        cli["warm"], cli["jax"] = None, None
        cli["pre"] = measure_cli(tmp / "pre", tmp / "cli-run-pre")
        for k in ("cold", "cached", "pre"):
            progress(f"  {'CLI ' + k:<18s} " + (f"{cli[k]['wall_s']:6.2f} s" if cli[k]["status"] == "ok"
                                                  else cli[k]["status"]))
    out = [rows[p] for p in pids] + [cli]
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    return out


def _cell(m):
    if not m:
        return "-"
    if m.get("status") != "ok":
        st = m.get("status", "-")
        return st if len(st) <= 40 else st[:37] + "..."
    if "wall_s" in m:                            # the CLI row
        return f"{m['wall_s']:.2f} (compile {m['compile_s']:.2f})" if m.get("compile_s") is not None \
            else f"{m['wall_s']:.2f}"
    if "jit_s" in m:
        return f"{m['jit_s']:.2f}"
    return f"{m['ready_s']:.2f} ({len(m['compiled'])})"


def _breakdown(m):
    if not m or m.get("status") != "ok" or "ready_s" not in m:
        return ""
    return (f"import {m['import_s']:.2f} + data {m['data_s']:.2f} + trace {m['trace_wall_s']:.2f} (compile "
            f"{m['compile_s']:.2f}) + step {m['first_step_s']:.3f}; {m['entries']} entries; loss {m['loss']:.4f}")


def format_table(rows, machine=None, markdown=False, command=None):
    """The suite's table (btjit.bench.report.render). machine=None: this machine, False: no heading."""
    from btjit.bench.report import Table, render
    head = ("program", "cold s (n)", "cached s (n)", "warm lib s (n)", "precompiled s (n)", "jax jit s",
            "cold: breakdown")
    body = [(f"{r['program']} {r.get('title', '')}".strip(), _cell(r.get("cold")), _cell(r.get("cached")),
             _cell(r.get("warm")), _cell(r.get("pre")), _cell(r.get("jax")), _breakdown(r.get("cold"))) for r in rows]
    notes = ["s = wall seconds of a fresh process, from just before Popen to its first step returned; "
             "(n) = kernel library entries compiled in that process.",
             "cold = empty BTJIT_CACHE_DIR; cached = the same program again on it; warm lib = its first run in one "
             "dir where the main job (the CLI row's command) ran first, then the programs above it; precompiled = "
             "its first run after `btjit precompile` in an empty dir"
             + "".join(f" (precompile took {r['precompile_s']:.1f} s)" for r in rows if r.get("precompile_s")) + ".",
             "jax jit s = first call of jax.jit(value_and_grad + update), blocking, fresh process; CLI = `btjit "
             "train` to exit, with the compile seconds of its banner."]
    return render(Table(head, body, notes, "compile: process start to first step"), markdown, machine, command)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", metavar="PID", help="run one program in this process and print its JSON line")
    ap.add_argument("--jax", action="store_true", help="with --child: JAX's jit instead of btjit")
    ap.add_argument("--only", default=None, help="P1,P6,...")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child, "jax" if a.jax else "btjit")
    rows = run(a.json, progress=lambda s: print(s, file=sys.stderr, flush=True), only=a.only)
    print(format_table(rows))


if __name__ == "__main__":
    main()
