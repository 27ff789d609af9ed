"""makemore's six models: btjit's training step against torch's, on one thread.

    python scripts/makemore_vs_torch.py [--steps 200] [--reps 5] [--only transformer,gru]

Each model at makemore's default sizes (btjit/models/makemore.py) from the same weights, on the same
makemore-format batches of the bundled names.txt (batch 32, block 16): btjit's `prog.step(x, y)` (forward,
backward and AdamW in one native call) against torch eager's zero_grad + forward + cross_entropy(ignore_index=-1)
+ backward + AdamW step (makemore's settings: lr 5e-4, betas 0.9/0.99, weight decay 0.01), with the torch modules
of tests/test_makemore.py (makemore.py's architecture). NUMBA_NUM_THREADS=1 and torch.set_num_threads(1). Prints
the median ms/step over `reps` timed runs of `steps` steps each, after a warm-up, and the speed-up. Needs torch.
"""
import argparse
import os
import platform
import sys
from pathlib import Path

os.environ["NUMBA_NUM_THREADS"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

import btjit  # noqa: E402
from btjit.train import data as D  # noqa: E402
from btjit.models import makemore as M  # noqa: E402

try:
    import torch
except ImportError:
    sys.exit("scripts/makemore_vs_torch.py needs torch (pip install torch)")
import test_makemore as ref  # noqa: E402  (the torch modules and the parameter loading)
from timing import cycled, timed  # noqa: E402

B, LR, BETAS, WD = 32, 5e-4, (0.9, 0.99), 0.01


def measure(kind, batches, steps, reps):
    params, model = ref.build(kind, np.float32, seed=0)
    prog = btjit.trace(M.model(kind).loss, params, *batches[0],
                       optimizer=btjit.optim.AdamW(lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD)
    tb = [(torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)) for x, y in batches]
    def torch_step(x, y):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
        loss.backward()
        opt.step()
    btjit_step, torch_step = cycled(prog.step, batches), cycled(torch_step, tb)
    return timed(btjit_step, steps, reps), timed(torch_step, steps, reps), prog.n_params


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default=",".join(M.KINDS))
    args = ap.parse_args()
    btjit.set_num_threads(1)
    torch.set_num_threads(1)
    ds = D.load_words(None, M.MakemoreConfig().block_size, corpus="names")
    rng = np.random.default_rng(0)
    batches = [ds.batch("train", B, rng) for _ in range(64)]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} | numpy {np.__version__} | torch {torch.__version__} | batch {B}, block 16, "
          f"one thread | median of {args.reps} x {args.steps} steps")
    print("| model | params | btjit ms/step | torch ms/step | btjit speed-up |\n|---|---|---|---|---|")
    for kind in args.only.split(","):
        b, t, n = measure(kind, batches, args.steps, args.reps)
        print(f"| {kind} | {n:,} | {b:.3f} | {t:.3f} | {t / b:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
