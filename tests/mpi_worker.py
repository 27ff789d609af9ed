# tests/mpi_worker.py -- run by tests/test_distributed.py under `mpiexec -n 2 python tests/mpi_worker.py MODE`
# (not a test module itself). Rank 0 prints one JSON line with what the test checks.
#   equiv:    k data-parallel steps of a tiny GPT (per-rank batch B/N, each rank its own shard generator);
#             rank 0 then replays the same k steps in ONE process on the concatenated global batches and
#             compares parameters and losses; every rank's parameters are gathered and compared bitwise.
#   compress: the same model trained with a compressor; reports the losses and bytes per step.
import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

import btjit
from btjit.train.distributed import DataParallel, rank_rng
from btjit.models import gpt

V, B, T = 13, 8, 4


def data(rng, n):
    """A learnable toy stream: token t+1 = (3 * token t + 1) mod V, with random starts."""
    x = rng.integers(0, V, size=(n, 1))
    seq = [x]
    for _ in range(T):
        seq.append((3 * seq[-1] + 1) % V)
    s = np.concatenate(seq, axis=1).astype(np.int32)
    return np.ascontiguousarray(s[:, :T]), np.ascontiguousarray(s[:, 1:])


def optimizer(name, lr):
    return btjit.optim.AdamW(lr=lr, weight_decay=0.01) if name == "adamw" else btjit.optim.SGD(lr=lr, momentum=0.9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["equiv", "compress"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--opt", default="adamw")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--compressor", default="none")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=0.0)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cfg = gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2, n_embd=8)
    # different init on each rank on purpose: DataParallel must broadcast rank 0's parameters
    params = gpt.init_params(cfg, np.random.default_rng(100 + rank))
    rng = rank_rng(11, rank, size)
    x0, y0 = data(rng, B // size)
    prog = btjit.trace(gpt.loss_fn(cfg), params, x0, y0, optimizer=optimizer(a.opt, a.lr),
                       clip_norm=a.clip or None)
    dp = DataParallel(prog, comm, compressor=a.compressor, ratio=a.ratio, seed=5)
    init = {k: v.copy() for k, v in prog.params.items()}
    shards, losses, sent = [], [], []
    for _ in range(a.steps):
        x, y = data(rng, B // size)
        shards.append((x, y))
        losses.append(dp.step(x, y))
        sent.append(dp.bytes_last)
    mine = prog.param_slice.copy()
    everyone = comm.gather(mine, root=0)
    all_shards = comm.gather(shards, root=0)
    in_sync = dp.in_sync()
    if rank != 0:
        return
    out = {"size": size, "losses": losses, "bytes": sent, "dense_bytes": dp.dense_bytes, "in_sync": in_sync,
           "identical": all(np.array_equal(everyone[0], e) for e in everyone),
           "init_differs": bool(not np.array_equal(gpt.init_params(cfg, np.random.default_rng(100))["wte"],
                                                    gpt.init_params(cfg, np.random.default_rng(101))["wte"]))}
    if a.mode == "equiv":
        xg0 = np.concatenate([all_shards[r][0][0] for r in range(size)])
        yg0 = np.concatenate([all_shards[r][0][1] for r in range(size)])
        ref = btjit.trace(gpt.loss_fn(cfg), init, xg0, yg0, optimizer=optimizer(a.opt, a.lr),
                          clip_norm=a.clip or None)
        ref_losses = []
        for s in range(a.steps):
            xg = np.concatenate([all_shards[r][s][0] for r in range(size)])
            yg = np.concatenate([all_shards[r][s][1] for r in range(size)])
            ref_losses.append(ref.step(xg, yg))
        out["ref_losses"] = ref_losses
        out["max_abs_diff"] = float(max(np.abs(prog.params[k] - ref.params[k]).max() for k in ref.params))
        out["max_abs_param"] = float(max(np.abs(ref.params[k]).max() for k in ref.params))
        out["moved"] = float(max(np.abs(ref.params[k] - init[k]).max() for k in ref.params))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
