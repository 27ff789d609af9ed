"""Models as their authors wrote them: btjit's training step against torch eager's, on one thread.

    python scripts/as_written_vs_torch.py [--steps 100] [--reps 5] [--only part3,wavenet,lstm] [--vocab 10000]

- part3: makemore part 3 (nn-zero-to-hero, "Activations & Gradients, BatchNorm"): embedding 27 x 10, block 3,
  six Linear(bias=False) + BatchNorm1d (+ tanh) layers of 100, the last to 27 with its batch norm; SGD lr 0.1.
- wavenet: makemore part 5's final net: embedding 27 x 24, block 8, FlattenConsecutive(2) + Linear(bias=False)
  + BatchNorm1d + tanh three times (128 hidden), Linear(128, 27); SGD lr 0.1.
- lstm: pytorch/examples word_language_model's RNNModel('LSTM', tied): emsize = nhid = 128, 2 layers, bptt 35,
  batch 20, the hidden state carried from batch to batch (detached), vocab --vocab (65: Tiny Shakespeare's
  characters); SGD lr 20 with gradient clipping 0.25 as its main.py.
Batch 32 for makemore's two, random token ids, the same initial weights on both
sides, float32, NUMBA_NUM_THREADS=1 and torch.set_num_threads(1). Prints the median ms/step over `reps` timed
runs of `steps` steps after a warm-up, and the speed-up. Needs torch.
"""
import argparse
import os
import platform
import sys

os.environ["NUMBA_NUM_THREADS"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import btjit  # noqa: E402
from btjit.models.rnn_cells import lstm  # noqa: E402

try:
    import torch
except ImportError:
    sys.exit("scripts/as_written_vs_torch.py needs torch (pip install torch)")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cycled, timed  # noqa: E402
F = torch.nn.functional
B, V = 32, 27


def bn(h, p, i):
    return btjit.batch_norm(h, p[f"g{i}"], p[f"b{i}"], p[f"rm{i}"], p[f"rv{i}"], momentum=0.1, axis=-1)


def mlp_bn(sizes, fan_ins, rng, emb):
    """Params and buffers of an embedding then Linear(bias=False) + BatchNorm layers (the lectures' init)."""
    p, bufs = {"C": rng.normal(size=emb).astype(np.float32)}, {}
    for i, (fi, fo) in enumerate(zip(fan_ins, sizes)):
        p[f"W{i}"] = (rng.normal(size=(fi, fo)) * (5 / 3) / fi ** 0.5).astype(np.float32)
        p[f"g{i}"], p[f"b{i}"] = np.ones(fo, np.float32), np.zeros(fo, np.float32)
        bufs[f"rm{i}"], bufs[f"rv{i}"] = np.zeros(fo, np.float32), np.ones(fo, np.float32)
    return p, bufs


def part3():
    rng = np.random.default_rng(0)
    sizes = [100] * 5 + [V]
    p, bufs = mlp_bn(sizes, [30] + [100] * 5, rng, (V, 10))

    def loss(p, x, y):
        h = btjit.take(p["C"], x).reshape(x.shape[0], -1)
        for i in range(6):
            h = bn(h @ p[f"W{i}"], p, i)
            h = btjit.tanh(h) if i < 5 else h
        return btjit.cross_entropy(h, y)

    def torch_loss(P, Bf, x, y):
        h = P["C"][x].view(x.shape[0], -1)
        for i in range(6):
            h = F.batch_norm(h @ P[f"W{i}"], Bf[f"rm{i}"], Bf[f"rv{i}"], P[f"g{i}"], P[f"b{i}"], training=True)
            h = torch.tanh(h) if i < 5 else h
        return F.cross_entropy(h, y)
    data = lambda r: (r.integers(0, V, (B, 3)).astype(np.int32), r.integers(0, V, B).astype(np.int32))  # noqa: E731
    return p, bufs, loss, torch_loss, data, btjit.optim.SGD(lr=0.1), None


def wavenet():
    rng = np.random.default_rng(0)
    p, bufs = mlp_bn([128] * 3, [48, 256, 256], rng, (V, 24))
    p["Wout"] = (rng.normal(size=(128, V)) * 0.1 / 128 ** 0.5).astype(np.float32)
    p["bout"] = np.zeros(V, np.float32)

    def loss(p, x, y):
        h = btjit.take(p["C"], x)                                  # (B, 8, 24)
        for i in range(3):
            Bn, T, C = h.shape
            h = h.reshape(Bn, T // 2, C * 2)
            h = h.reshape(Bn, C * 2) if T // 2 == 1 else h
            h = btjit.tanh(bn(h @ p[f"W{i}"], p, i))
        return btjit.cross_entropy(h @ p["Wout"] + p["bout"], y)

    def torch_loss(P, Bf, x, y):
        h = P["C"][x]
        for i in range(3):
            Bn, T, C = h.shape
            h = h.reshape(Bn, T // 2, C * 2)
            h = h.squeeze(1) if T // 2 == 1 else h
            h = h @ P[f"W{i}"]
            ht = h.transpose(1, 2) if h.ndim == 3 else h
            ht = F.batch_norm(ht, Bf[f"rm{i}"], Bf[f"rv{i}"], P[f"g{i}"], P[f"b{i}"], training=True)
            h = torch.tanh(ht.transpose(1, 2) if h.ndim == 3 else ht)
        return F.cross_entropy(h @ P["Wout"] + P["bout"], y)
    data = lambda r: (r.integers(0, V, (B, 8)).astype(np.int32), r.integers(0, V, B).astype(np.int32))  # noqa: E731
    return p, bufs, loss, torch_loss, data, btjit.optim.SGD(lr=0.1), None


def lstm_lm(vocab, H=128, layers=2, bptt=35, B=20):
    rng = np.random.default_rng(0)
    u = lambda *s, a=0.1: rng.uniform(-a, a, size=s).astype(np.float32)  # noqa: E731
    p = {"encoder": u(vocab, H), "decoder_bias": np.zeros(vocab, np.float32)}
    for l in range(layers):
        k = 1 / H ** 0.5
        p.update({f"weight_ih_l{l}": u(4 * H, H, a=k), f"weight_hh_l{l}": u(4 * H, H, a=k),
                  f"bias_ih_l{l}": u(4 * H, a=k), f"bias_hh_l{l}": u(4 * H, a=k)})
    bufs = {f"{s}{l}": np.zeros((B, H), np.float32) for l in range(layers) for s in "hc"}

    def loss(p, x, y):
        out = btjit.take(p["encoder"], x)                          # (T, B, H)
        for l in range(layers):
            out, (h, c) = lstm(out, (p[f"h{l}"], p[f"c{l}"]), p[f"weight_ih_l{l}"], p[f"weight_hh_l{l}"],
                               p[f"bias_ih_l{l}"], p[f"bias_hh_l{l}"])
            btjit.assign(p[f"h{l}"], h)                            # carried to the next batch, no gradient
            btjit.assign(p[f"c{l}"], c)
        return btjit.cross_entropy((out @ p["encoder"].T + p["decoder_bias"]).reshape(-1, vocab), y.reshape(-1))

    rnn = torch.nn.LSTM(H, H, layers)
    with torch.no_grad():
        for l in range(layers):
            for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(rnn, f"{k}_l{l}").copy_(torch.from_numpy(p[f"{k}_l{l}"]))
    state = {}

    def torch_loss(P, Bf, x, y):
        h = state.get("h") or (torch.zeros(layers, B, H), torch.zeros(layers, B, H))
        out, (h1, c1) = rnn(P["encoder"][x], h)
        state["h"] = (h1.detach(), c1.detach())                    # repackage_hidden
        return F.cross_entropy((out @ P["encoder"].T + P["decoder_bias"]).view(-1, vocab), y.reshape(-1))
    torch_loss.extra = list(rnn.parameters())
    data = lambda r: (r.integers(0, vocab, (bptt, B)).astype(np.int32),  # noqa: E731
                      r.integers(0, vocab, (bptt, B)).astype(np.int32))
    return p, bufs, loss, torch_loss, data, btjit.optim.SGD(lr=20.0), 0.25


def measure(build, steps, reps):
    p, bufs, loss, torch_loss, data, opt, clip = build()
    r = np.random.default_rng(1)
    batches = [data(r) for _ in range(8)]
    prog = btjit.trace(loss, p, *batches[0], buffers=bufs, optimizer=opt, clip_norm=clip, threads=1)
    P = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    Bf = {k: torch.tensor(v) for k, v in bufs.items() if k.startswith("r")}    # batch norms' running statistics
    params = list(P.values()) + getattr(torch_loss, "extra", [])
    topt = torch.optim.SGD(params, lr=opt.hp["lr"])
    tb = [(torch.from_numpy(x).long(), torch.from_numpy(y).long()) for x, y in batches]
    def torch_step(x, y):
        topt.zero_grad(set_to_none=True)
        loss_ = torch_loss(P, Bf, x, y)
        loss_.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        topt.step()
        return loss_.item()
    btjit_step, torch_step = cycled(prog.step, batches), cycled(torch_step, tb)
    return timed(btjit_step, steps, reps), timed(torch_step, steps, reps), prog.compile_seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="part3,wavenet,lstm")
    ap.add_argument("--vocab", type=int, default=65, help="the LSTM's vocabulary (word_language_model: its corpus')")
    a = ap.parse_args()
    torch.set_num_threads(1)
    import llvmlite.binding as llvm
    print(f"{platform.processor() or platform.machine()} (LLVM {llvm.get_host_cpu_name()}), one thread, "
          f"torch {torch.__version__}, LSTM vocab {a.vocab}")
    builds = {"part3": part3, "wavenet": wavenet, "lstm": lambda: lstm_lm(a.vocab)}
    print(f"{'model':<8} {'btjit ms':>9} {'torch ms':>9} {'speed-up':>9} {'compile s':>10}")
    for name in a.only.split(","):
        b, t, c = measure(builds[name], a.steps, a.reps)
        print(f"{name:<8} {b:9.3f} {t:9.3f} {t / b:8.2f}x {c:10.2f}")


if __name__ == "__main__":
    main()
