"""Train the paper's GPT with the paper's E6 settings (configs/paper_e6.toml: SGD lr 3e-4, the bundled Tiny
Shakespeare) with btjit and with an independent PyTorch implementation (tests/torch_models.py) from the same
initial weights on the same batches, and report both losses. Both sides use plain SGD at the config's lr.

    python scripts/compare_torch.py [--data FILE] [--steps 3000]

Batches and init come from btjit's own data pipeline and model init (as `btjit train` uses them); val loss is
the mean over the same fixed val batches for both. This is the check behind issue 3's "3000 steps end within
0.05 of the PyTorch reference".
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch_models as TM  # noqa: E402

import btjit  # noqa: E402
from btjit.train import data as D  # noqa: E402
from btjit.train.config import load as load_config  # noqa: E402
from btjit.models import gpt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "paper_e6.toml"))
    ap.add_argument("--data", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-batches", type=int, default=50)
    a = ap.parse_args()
    cfg = load_config(a.config)
    m, t = cfg.model, cfg.train
    steps = a.steps or t.steps
    ds = D.load(cfg, a.data)
    mcfg = gpt.GPTConfig(vocab_size=len(ds.vocab), n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                         block_size=m.block_size, activation=m.activation)
    params = gpt.init_params(mcfg, np.random.default_rng(t.seed))
    rng = np.random.default_rng(t.seed + 1)
    x, y = ds.batch("train", t.batch_size, rng)
    prog = btjit.trace(gpt.loss_fn(mcfg), params, x, y, optimizer=btjit.optim.SGD(lr=cfg.optim.lr))
    val = [ds.batch("val", t.batch_size, np.random.default_rng(10_000 + i)) for i in range(a.eval_batches)]
    torch.set_num_threads(1)
    P = TM.tensors(params)
    opt = torch.optim.SGD(P.values(), lr=cfg.optim.lr)

    def torch_val():
        with torch.no_grad():
            return float(np.mean([TM.gpt_loss(P, torch.tensor(vx), torch.tensor(vy), m.n_layer, m.n_head,
                                              m.activation).item() for vx, vy in val]))

    def btjit_val():
        return float(np.mean([prog.forward(vx, vy) for vx, vy in val]))

    print(f"data: {ds.describe()}; {steps} steps of batch {t.batch_size}, SGD lr {cfg.optim.lr}")
    print(f"step 0: val btjit {btjit_val():.4f}  torch {torch_val():.4f}")
    tb = tt = 0.0
    lb, lt = [], []
    for step in range(1, steps + 1):
        x, y = ds.batch("train", t.batch_size, rng)
        t0 = time.perf_counter()
        lb.append(prog.step(x, y))
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = TM.gpt_loss(P, torch.tensor(x), torch.tensor(y), m.n_layer, m.n_head, m.activation)
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        lt.append(loss.item())
        tb, tt = tb + t1 - t0, tt + t2 - t1
        if step % max(1, steps // 10) == 0 or step == steps:
            print(f"step {step}: train btjit {np.mean(lb[-100:]):.4f}  torch {np.mean(lt[-100:]):.4f}")
    vb, vt = btjit_val(), torch_val()
    print(f"final val loss: btjit {vb:.4f}  torch {vt:.4f}  |diff| {abs(vb - vt):.4f}")
    print(f"time per step: btjit {1e3 * tb / steps:.2f} ms, torch eager {1e3 * tt / steps:.2f} ms")
    return 0 if abs(vb - vt) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
