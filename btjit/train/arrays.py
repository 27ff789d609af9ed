# btjit/train/arrays.py -- array data for `btjit train` ([data] format = "arrays"): an .npz holding x_train,
# y_train, x_val, y_val (or x, y, split by val_fraction after a shuffle with the run's seed), or the bundled
# corpus "digits" (scikit-learn's 8x8 handwritten digits, btjit/corpora/digits.u8.gz, sha256-checked). x is
# float or uint8 (uint8 scaled to [0, 1]); the sample shape is the file's. y holds integer class ids
# (classification: the run reports accuracy) or floats. Batches are drawn like the other formats' (one rng);
# `sweep` walks a whole split in order for evaluation, and `Classifier` scores one with the model's logits.
# Errors are DataError naming the file and the key.
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from btjit.train import data, files
from btjit.train.data import Corpus, DataError, Split, Vocab, split_point

DIGITS = Corpus("digits.u8.gz", "68aea062d35a127749050fa0e52dca09d6569ac08092c925610e0954e172dde2",
                "scikit-learn's 8x8 digits")
KEYS = ("x_train", "y_train", "x_val", "y_val")
MAX_CLASSES = 65536     # class ids beyond both this and the sample count are an error (an out-of-range label)


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits: x (1797, 1, 8, 8) float32 in [0, 1] (pixel / 16), y (1797,) int32 in 0..9."""
    raw = data.bundled(DIGITS, "digits", "--data FILE.npz")
    rec = np.frombuffer(raw, np.uint8).reshape(-1, 65)
    return (rec[:, :64].astype(np.float32) / np.float32(16)).reshape(-1, 1, 8, 8), rec[:, 64].astype(np.int32)


def _read_npz(p: Path) -> dict:
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    try:
        return files.npz_arrays(p)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{p}: not a readable .npz file ({type(e).__name__}: {e})") from None


def _x(name, key, a):
    if a.dtype == np.uint8:
        return a.astype(np.float32) / np.float32(255)
    if a.dtype.kind != "f":
        raise DataError(f"{name}: {key} has dtype {a.dtype}; inputs must be float or uint8 (scaled to [0, 1])")
    if a.ndim < 1 or not np.all(np.isfinite(a)):
        raise DataError(f"{name}: {key} must be an array of samples with finite values")
    return a


def _y(name, key, a, n):
    if a.dtype.kind not in "iuf" or a.dtype == np.float16:
        raise DataError(f"{name}: {key} has dtype {a.dtype}; targets must be integer class ids or floats")
    if len(a) != n:
        raise DataError(f"{name}: {key} has {len(a)} samples but its inputs have {n}")
    if a.dtype.kind in "iu":
        if a.ndim != 1 or (a.size and a.min() < 0):
            raise DataError(f"{name}: {key}: integer class ids must be a 1-d array of values >= 0")
        if a.size and int(a.max()) > np.iinfo(np.int32).max:
            raise DataError(f"{name}: {key} holds class id {int(a.max()):,}: integer targets are class ids 0..K-1 "
                            f"(float targets for regression)")
        return a.astype(np.int32)
    if not np.all(np.isfinite(a)):
        first = int(np.argwhere(~np.isfinite(a))[0][0])
        raise DataError(f"{name}: {key} holds non-finite targets (first at sample {first})")
    return a


def _check_class_ids(name, ys, n):
    """Integer targets are class ids 0..K-1, K = the largest + 1 (the model's cfg.vocab_size outputs): an id far
    beyond both the samples and MAX_CLASSES is an error naming its key, not a model of K outputs."""
    ids = [(int(y.max()), k) for k, y in ys if y.dtype.kind == "i" and y.size]
    if not ids:
        return
    top, key = max(ids)
    if top + 1 > max(n, MAX_CLASSES):
        raise DataError(f"{name}: {key} holds class id {top:,}, which would make a model of {top + 1:,} outputs for "
                        f"{n:,} samples; integer targets are class ids 0..K-1 (float targets for regression)")


def read_arrays(path, corpus, val_fraction, seed):
    """(train Split, val Split, name) of an .npz (path) or the bundled corpus."""
    if path is None:
        if corpus != "digits":
            raise DataError(f'data.format = "arrays" reads an .npz (--data FILE.npz) or corpus = "digits", '
                            f'not corpus {corpus!r}')
        x, y = digits()
        name, d = "<bundled corpus: scikit-learn's 8x8 digits>", {"x": x, "y": y}
    else:
        p = Path(path)
        name, d = str(p), _read_npz(p)
    for k in (*KEYS, "x", "y"):
        if k in d and d[k].ndim == 0:
            raise DataError(f"{name}: {k} is a single value (shape ()); it must hold one sample per row")
    if all(k in d for k in KEYS):
        parts = [(d["x_train"], d["y_train"], "train"), (d["x_val"], d["y_val"], "val")]
    elif "x" in d and "y" in d:
        if len(d["y"]) != len(d["x"]):
            raise DataError(f"{name}: y has {len(d['y'])} samples but x has {len(d['x'])}")
        order = np.random.default_rng(seed).permutation(len(d["x"]))
        n = split_point(len(order), val_fraction)
        parts = [(d["x"][order[:n]], d["y"][order[:n]], "train"), (d["x"][order[n:]], d["y"][order[n:]], "val")]
    else:
        missing = [k for k in KEYS if k not in d]
        raise DataError(f"{name}: missing key {missing[0]}: an arrays file holds {', '.join(KEYS)} (or x and y, "
                        f"split by data.val_fraction); it has {', '.join(sorted(d)) or 'nothing'}")
    splits, ykeys = [], []
    for x, y, what in parts:
        kx, ky = ("x", "y") if "x" in d and "x_train" not in d else (f"x_{what}", f"y_{what}")
        x = _x(name, kx, x)
        splits.append(Split(x, _y(name, ky, y, len(x))))
        ykeys.append(ky)
        if not len(x):
            raise DataError(f"{name}: the {what} split is empty ({kx})")
    tr, va = splits
    _check_class_ids(name, [(ky, s.y) for (ky, s) in zip(ykeys, splits)], len(tr) + len(va))
    if tr.x.shape[1:] != va.x.shape[1:] or tr.y.shape[1:] != va.y.shape[1:] or tr.y.dtype.kind != va.y.dtype.kind:
        raise DataError(f"{name}: x_val, y_val must hold samples like x_train, y_train: shapes {va.x.shape[1:]}, "
                        f"{va.y.shape[1:]} ({va.y.dtype}) against {tr.x.shape[1:]}, {tr.y.shape[1:]} ({tr.y.dtype})")
    return tr, va, name


class ArrayDataset:
    """The train/val splits of array samples; the interface of btjit.train.data.Dataset. vocab: the class labels
    "0".."K-1" (len = the number of classes, the model's cfg.vocab_size), or one label for float targets."""
    format = "arrays"

    def __init__(self, train, val, name, dtype, vocab=None):
        self.train = Split(train.x.astype(dtype), train.y if train.y.dtype.kind == "i" else train.y.astype(dtype))
        self.val = Split(val.x.astype(dtype), val.y if val.y.dtype.kind == "i" else val.y.astype(dtype))
        self.name, self.block = name, 0
        self.classes = int(max(self.train.y.max(), self.val.y.max())) + 1 if self.train.y.dtype.kind == "i" else 0
        self.vocab = Vocab([str(i) for i in range(max(self.classes, 1))])
        if vocab is not None and len(vocab) > len(self.vocab):      # a resumed run keeps its class count
            self.vocab = vocab
            self.classes = len(vocab) if self.classes else 0
        elif vocab is not None and vocab != self.vocab:
            raise DataError(f"{name}: {self.classes} classes, but the checkpoint's model was trained on {len(vocab)}")

    def batch(self, split: str, batch_size: int, rng: np.random.Generator):
        s = self.train if split == "train" else self.val
        ix = rng.integers(0, len(s), size=batch_size)
        return np.ascontiguousarray(s.x[ix]), np.ascontiguousarray(s.y[ix])

    def sweep(self, split: str, batch_size: int):
        """(x, y, n) batches over the whole split in order; the last one is filled up with its first samples
        and only its first n count."""
        s = self.train if split == "train" else self.val
        for i in range(0, len(s), batch_size):
            ix = np.arange(i, i + batch_size) % len(s)
            yield s.x[ix], s.y[ix], min(batch_size, len(s) - i)

    def describe(self) -> str:
        what = f"{self.classes} classes" if self.classes else f"targets {self.train.y.shape[1:]}"
        return (f"data: {self.name}: samples {self.train.x.shape[1:]}, {what}, train {len(self.train):,} / "
                f"val {len(self.val):,} samples")


def load(cfg, data_path=None, vocab: Vocab | None = None):
    """The dataset of a config, any format: "arrays" here (the file `data_path`, else cfg.data.path, else the
    corpus), the text formats by btjit.train.data.load."""
    if cfg.data.format != "arrays":
        return data.load(cfg, data_path, vocab)
    path = data_path if data_path is not None else cfg.data.path
    corpus = cfg.data.corpus or data.DEFAULT_CORPUS["arrays"]
    tr, va, name = read_arrays(path, corpus, cfg.data.val_fraction, cfg.train.seed)
    return ArrayDataset(tr, va, name, np.dtype(cfg.train.dtype), vocab)


class Classifier:
    """Val loss (the mean cross-entropy of logits(p, x)) and accuracy over a whole split, by a forward-only
    program of the model's logits in eval mode (no dropout, batch norm on its running statistics) at the run's
    batch size, its params and buffers copied from the training program."""

    def __init__(self, model, batch_size, dtype):
        self.model, self.batch_size, self.dtype, self.prog = model, batch_size, dtype, None

    def evaluate(self, ds, params, buffers=None) -> tuple[float, float]:
        buffers = buffers or {}
        nll, correct, n = 0.0, 0, 0
        for x, y, k in ds.sweep("val", self.batch_size):
            if self.prog is None:
                import btjit
                with self.model.guard("tracing logits(p, x)"):
                    self.prog = btjit.trace(self.model.logits, dict(params), x, dtype=self.dtype, grad=False,
                                            training=False, buffers=dict(buffers))
            for name, v in params.items():
                self.prog.params[name][...] = v
            for name, v in buffers.items():
                self.prog.buffers[name][...] = v
            out = np.asarray(self.prog.forward(x), np.float64)
            lg = out[:k].reshape(k, -1)
            if lg.shape[1] < ds.classes:
                raise DataError(f"{ds.name}: its class ids go up to {ds.classes - 1}, but logits(p, x) gives "
                                f"{lg.shape[1]} class scores per sample (shape {out.shape}): the model needs "
                                f"cfg.vocab_size = {ds.classes} outputs")
            lse = lg.max(1) + np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1))
            nll += float((lse - lg[np.arange(k), y[:k]]).sum())
            correct += int((lg.argmax(1) == y[:k]).sum())
            n += k
        return nll / n, correct / n
