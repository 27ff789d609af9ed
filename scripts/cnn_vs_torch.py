"""The CNNs of examples/ against torch eager: the training step's time, side by side in one run.

    python scripts/cnn_vs_torch.py [--threads 1] [--steps 20] [--reps 5] [--only mnist,beautiful]

- mnist: pytorch/examples' MNIST net (examples/mnist_cnn.py: conv 1->32, conv 32->64, max_pool 2, dropout 0.25,
  linear 9216->128, dropout 0.5, linear 128->10, log_softmax + nll_loss), batch 64, Adadelta lr 1.0 as its main.py.
- beautiful: tinygrad's beautiful_mnist net (examples/beautiful_mnist.py, its two batch norms in train mode),
  batch 512, Adam.
The same initial weights and random 28x28 batches on both sides; threads 0 = each side's default (every core).
Prints the median ms/step over `reps` timed runs of `steps` steps after a warm-up, and the speed-up. Needs torch.
"""
import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--only", default="mnist,beautiful")
ARGS = ap.parse_args()
if ARGS.threads:
    os.environ["NUMBA_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402

import btjit  # noqa: E402
from btjit.train import usermodel  # noqa: E402

try:
    import torch
except ImportError:
    sys.exit("scripts/cnn_vs_torch.py needs torch (pip install torch)")
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from timing import cycled, timed  # noqa: E402
from test_cnn_models import BeautifulNetBN, MnistNet  # noqa: E402
nn, TF = torch.nn, torch.nn.functional


class MnistNetDropout(MnistNet):     # as main.py: the two dropouts in train mode
    def __init__(self):
        super().__init__()
        self.d1, self.d2 = nn.Dropout(0.25), nn.Dropout(0.5)

    def forward(self, x):
        x = TF.max_pool2d(TF.relu(self.conv2(TF.relu(self.conv1((x - 0.1307) / 0.3081)))), 2)
        x = TF.relu(self.fc1(torch.flatten(self.d1(x), 1)))
        return TF.log_softmax(self.fc2(self.d2(x)), dim=1)


def load(net, p, linear_names):
    """Copy btjit's params into the torch module (linear weights stored (in, out) in btjit: transposed)."""
    with torch.no_grad():
        for k, v in net.state_dict().items():
            if k in p:
                a = p[k].T if k.split(".")[0] in linear_names and k.endswith("weight") else p[k]
                v.copy_(torch.from_numpy(np.ascontiguousarray(a)))


def case(name):
    rng = np.random.default_rng(0)
    if name == "mnist":
        mod, B = usermodel.read(ROOT / "examples" / "mnist_cnn.py").module, 64
        cfg = SimpleNamespace(dropout1=0.25, dropout2=0.5)
        net, opt = MnistNetDropout(), btjit.optim.Adadelta(lr=1.0)
        topt = lambda ps: torch.optim.Adadelta(ps, lr=1.0)  # noqa: E731
        lin = ("fc1", "fc2")
    else:
        mod, B = usermodel.read(ROOT / "examples" / "beautiful_mnist.py").module, 512
        cfg = SimpleNamespace(batch_norm=True)
        net, opt = BeautifulNetBN(), btjit.optim.Adam(lr=1e-3)
        topt = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
        lin = ("fc",)
    p = mod.init_params(cfg, rng)
    bufs = mod.init_buffers(cfg) if hasattr(mod, "init_buffers") else None
    load(net, p, lin)
    batches = [(rng.random((B, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, B).astype(np.int32))
               for _ in range(4)]
    prog = btjit.trace(lambda p, x, y: mod.loss(p, x, y, cfg), p, *batches[0], optimizer=opt, buffers=bufs,
                       threads=ARGS.threads or None)
    topt = topt(net.parameters())
    tb = [(torch.from_numpy(x), torch.from_numpy(y).long()) for x, y in batches]
    def torch_step(x, y):
        topt.zero_grad(set_to_none=True)
        out = net(x)
        loss = TF.nll_loss(out, y) if name == "mnist" else TF.cross_entropy(out, y)
        loss.backward()
        topt.step()
        return loss.item()
    btjit_step, torch_step = cycled(prog.step, batches), cycled(torch_step, tb)
    return btjit_step, torch_step, prog


def main():
    if ARGS.threads:
        torch.set_num_threads(ARGS.threads)
    import llvmlite.binding as llvm
    print(f"LLVM {llvm.get_host_cpu_name()}, threads {ARGS.threads or 'default'} (torch {torch.get_num_threads()}), "
          f"torch {torch.__version__}")
    print(f"{'model':<10} {'btjit ms':>9} {'torch ms':>9} {'speed-up':>9} {'btjit threads':>14}")
    for name in ARGS.only.split(","):
        b, t, prog = case(name)
        tb, tt = timed(b, ARGS.steps, ARGS.reps), timed(t, ARGS.steps, ARGS.reps)
        print(f"{name:<10} {tb:9.2f} {tt:9.2f} {tt / tb:8.2f}x {prog.threads:>14}")


if __name__ == "__main__":
    main()
