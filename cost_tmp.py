"""Rough cost of dropout in the nanoGPT shakespeare-char config (6 layers, 6 heads, 384 wide, block 256), at
a smaller batch; CPU time of the process (less sensitive to the shared machine's load than wall time)."""
import sys, time
import numpy as np
import btjit
from btjit.models import gpt
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
progs = {}
rng = np.random.default_rng(0)
x, y = rng.integers(0, 65, (B, 256)), rng.integers(0, 65, (B, 256))
for p in (0.0, 0.2):
    cfg = gpt.GPTConfig(vocab_size=65, n_layer=6, n_head=6, n_embd=384, block_size=256, activation="gelu", dropout=p)
    t = time.perf_counter()
    progs[p] = btjit.trace(gpt.loss_fn(cfg), gpt.init_params(cfg, 0), x, y, optimizer=btjit.optim.AdamW(lr=1e-3), seed=1)
    print(f"dropout {p}: trace+compile {time.perf_counter() - t:.1f} s, compile {progs[p].compile_seconds:.2f} s", flush=True)
    progs[p].step(x, y)
cpu = {0.0: [], 0.2: []}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    for p, prog in progs.items():
        t = time.process_time()
        prog.step(x, y)
        cpu[p].append(time.process_time() - t)
for p in cpu:
    print(f"dropout {p}: step CPU s {np.round(cpu[p], 3)} median {np.median(cpu[p]):.3f}", flush=True)
print(f"cost of dropout: {100 * (np.median(cpu[0.2]) / np.median(cpu[0.0]) - 1):.1f}% of the step")
for p, prog in progs.items():
    rows = prog.profile(x, y, reps=1, print_table=False)
    print(p, [(r["op"], round(r["total_us"] / 1e3, 1)) for r in rows[:8]], flush=True)
