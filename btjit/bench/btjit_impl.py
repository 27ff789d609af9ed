# btjit/bench/btjit_impl.py -- btjit's side of `btjit bench`: the same work per iteration as the peers.
# E5/E6: the models of btjit/models traced once (trace + plan + compile reported as compile_seconds), then
# prog.step(x, y) on one pre-sampled batch: forward + backward + SGD update in one native call. With
# --threads N and a batch divisible by N, the step is data parallel over N replicas (trace(..., replicas=N)),
# as `btjit train` runs it; otherwise the kernels themselves use the threads.
# E1-E4: the scalar front end (btjit.trace_scalar) when present.
import math
import time


import btjit
from btjit.bench import workloads as W
from btjit.bench.peers import Runner
from btjit.models import gpt, mlp


class TrainRunner(Runner):
    def __init__(self, workload_id, seed=0, text=None, threads=1):
        w = W.WORKLOADS[workload_id]
        params, self.x, self.y, self.vocab, self.data = W.setup_batch(workload_id, seed, text)
        if w.kind == "mlp":
            loss = mlp.loss_fn(mlp.MLPConfig(vocab_size=self.vocab, context=self.x.shape[1]))
        else:
            loss = gpt.loss_fn(gpt.GPTConfig(vocab_size=self.vocab, block_size=self.x.shape[1]))
        replicas = btjit.replicas_for(len(self.y), self.y.size, threads)
        t0 = time.perf_counter()
        self.prog = btjit.trace(loss, params, self.x, self.y, optimizer=btjit.optim.SGD(lr=w.settings["lr"]),
                                replicas=replicas)
        self.compile_seconds = time.perf_counter() - t0
        m = self.prog.memory
        self.note = ((f"{replicas} replicas; " if replicas > 1 else "") +
                     f"arena {m['planned_bytes'] / 1e6:.2f} MB (naive {m['naive_bytes'] / 1e6:.2f}); "
                     f"kernels {'cached' if self.prog.kernels.cache_hit else 'compiled'} "
                     f"{self.prog.compile_seconds:.2f}s")

    def step(self):
        return self.prog.step(self.x, self.y)

    def check(self):
        return dict(loss=self.prog.forward(self.x, self.y), vocab=self.vocab, ln_vocab=math.log(self.vocab))

    def params(self):
        return {k: v.copy() for k, v in self.prog.params.items()}


def make(workload_id, threads=1, seed=0, text=None, **opts):
    kind = W.WORKLOADS[workload_id].kind
    if kind in ("mlp", "gpt"):
        return TrainRunner(workload_id, seed=seed, text=text, threads=threads)
    from btjit.bench import btjit_scalar          # E1-E4 (the scalar front end)
    return btjit_scalar.make(workload_id, **opts)


def profile(only, threads=1):
    """`btjit bench --profile`: prog.profile() of the E5/E6 training step, a table per workload."""
    from btjit.bench.run_one import pin_cpus
    btjit.set_num_threads(threads)        # numba is imported already: its env vars are read-only now
    pin_cpus(threads)
    for wid in [w.strip() for w in (only.split(",") if isinstance(only, str) else only)]:
        if W.WORKLOADS[wid].kind not in ("mlp", "gpt"):
            continue
        r = TrainRunner(wid, threads=threads)
        print(f"\n{wid}: {r.prog} ({r.data})")
        r.prog.profile(r.x, r.y, reps=20 if wid != "E6b1" else 200)
