"""MNIST's idx files -> the .npz that `btjit train configs/mnist_cnn.toml --data mnist.npz` reads ([data] format
= "arrays"): x_train (60000, 28, 28) uint8, y_train (60000,) uint8, x_val / y_val the 10,000 test images.

    python examples/mnist_npz.py DIR [OUT]    # DIR holds train-images-idx3-ubyte(.gz) & co.; OUT: mnist.npz

numpy only. An idx file is a big-endian header (two zero bytes, a type byte 0x08 = uint8, the number of
dimensions, then each size as an int32) followed by the values."""
import gzip
import sys
from pathlib import Path

import numpy as np

FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
         "x_val": "t10k-images-idx3-ubyte", "y_val": "t10k-labels-idx1-ubyte"}


def read_idx(path) -> np.ndarray:
    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path}: not an idx file of uint8 values")
    shape = tuple(np.frombuffer(raw, ">i4", count=raw[3], offset=4))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * raw[3]).reshape(shape)


def convert(src_dir, out="mnist.npz") -> Path:
    src = Path(src_dir)
    found = {k: next((p for p in (src / f, src / f"{f}.gz") if p.exists()), None) for k, f in FILES.items()}
    missing = [FILES[k] for k, p in found.items() if p is None]
    if missing:
        raise FileNotFoundError(f"{src}: no {', '.join(missing)} (.gz or not)")
    np.savez_compressed(out, **{k: read_idx(p) for k, p in found.items()})
    return Path(out)


if __name__ == "__main__":
    print(convert(*sys.argv[1:3]))
