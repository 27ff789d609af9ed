"""[data] format = "arrays" (btjit/train/arrays.py): the .npz reader (the four keys or x, y split by val_fraction,
uint8 scaled to [0, 1], sample shapes from the file), its errors naming the file and the key, the bundled
digits and their checksum, and `btjit train` of a CNN on them reporting val accuracy in the progress lines
and metrics.jsonl."""
import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from btjit.cli import cli
from btjit.train import arrays as A
from btjit.train import config as C
from btjit.train import data as D
from btjit.train.data import DataError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def cfg(path=None, extra=""):
    return C.loads(f'[model]\nkind = "python"\nfile = "m.py"\n[data]\nformat = "arrays"\n'
                   + (f'path = "{path}"\n' if path else "") + extra)


def test_the_bundled_digits_hash_to_their_checksum():
    raw = gzip.decompress(resources.files("btjit").joinpath("corpora", "digits.u8.gz").read_bytes())
    assert hashlib.sha256(raw).hexdigest() == A.DIGITS.sha256 and len(raw) == 1797 * 65
    x, y = A.digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32 and x.min() == 0 and x.max() == 1
    assert np.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]   # scikit-learn's counts
    assert (resources.files("btjit") / "corpora" / "LICENSE.digits").read_text().startswith("BSD 3-Clause")


def test_digits_are_the_default_corpus_of_arrays_split_by_val_fraction():
    ds = A.load(cfg())
    assert ds.format == "arrays" and ds.classes == 10 and len(ds.vocab) == 10
    assert (len(ds.train), len(ds.val)) == (1617, 180)
    x, y = ds.batch("train", 7, np.random.default_rng(0))
    assert x.shape == (7, 1, 8, 8) and x.dtype == np.float32 and y.dtype == np.int32
    seen = np.concatenate([xv[:n].reshape(n, -1) for xv, _, n in ds.sweep("val", 64)])
    np.testing.assert_array_equal(seen, ds.val.x.reshape(180, -1))           # the sweep covers val once
    assert A.load(cfg(extra="[train]\ndtype = \"float64\"\n")).train.x.dtype == np.float64
    with pytest.raises(DataError, match='corpus = "digits" holds images: it needs data.format = "arrays"'):
        D.load(C.loads('[data]\ncorpus = "digits"\n'))


def test_an_npz_with_the_four_keys(tmp_path):
    rng = np.random.default_rng(0)
    f = tmp_path / "d.npz"
    np.savez(f, x_train=rng.integers(0, 256, (20, 5, 6), dtype=np.uint8), y_train=rng.integers(0, 3, 20),
             x_val=rng.integers(0, 256, (4, 5, 6), dtype=np.uint8), y_val=np.array([0, 1, 2, 3]))
    ds = A.load(cfg(f))
    with np.load(f) as z:
        np.testing.assert_array_equal(ds.train.x, z["x_train"].astype(np.float32) / 255)
        np.testing.assert_array_equal(ds.val.y, z["y_val"])
    assert ds.classes == 4 and ds.train.x.shape[1:] == (5, 6) and "4 classes" in ds.describe()


def test_float_targets_and_x_y_split(tmp_path):
    f = tmp_path / "r.npz"
    np.savez(f, x=np.arange(40.0).reshape(10, 4), y=np.arange(20.0).reshape(10, 2))
    ds = A.load(cfg(f, "val_fraction = 0.2\n"))
    assert (len(ds.train), len(ds.val), ds.classes) == (8, 2, 0)
    np.testing.assert_array_equal(ds.train.x[:, 0] / 2, ds.train.y[:, 0])      # rows stay paired
    assert sorted(np.concatenate([ds.train.y[:, 0], ds.val.y[:, 0]]).tolist()) == list(np.arange(0.0, 20.0, 2))


@pytest.mark.parametrize("arrays,needles", [
    ({"x_train": np.zeros((3, 2)), "y_train": np.zeros(3, int), "x_val": np.zeros((2, 2))}, ["missing key y_val"]),
    ({"x_train": np.zeros((3, 2)), "y_train": np.zeros(4, int), "x_val": np.zeros((2, 2)), "y_val": np.zeros(2, int)},
     ["y_train has 4 samples but its inputs have 3"]),
    ({"x_train": np.zeros((3, 2)), "y_train": np.zeros(3, int), "x_val": np.zeros((2, 5)), "y_val": np.zeros(2, int)},
     ["x_val, y_val must hold samples like x_train", "(5,)"]),
    ({"x": np.zeros((5, 2), np.int64), "y": np.zeros(5, int)}, ["x has dtype int64", "float or uint8"]),
    ({"x": np.zeros((5, 2)), "y": np.array(["a"] * 5)}, ["y has dtype <U1"]),
    ({"x": np.zeros((5, 2)), "y": -np.ones(5, int)}, ["y: integer class ids", ">= 0"]),
])
def test_npz_errors_name_the_file_and_the_key(tmp_path, arrays, needles):
    f = tmp_path / "bad.npz"
    np.savez(f, **arrays)
    with pytest.raises(DataError) as e:
        A.load(cfg(f))
    assert str(e.value).startswith(str(f)) and all(n in str(e.value) for n in needles), str(e.value)


def test_unreadable_files_and_config_errors(tmp_path):
    (tmp_path / "t.npz").write_text("not a zip")
    with pytest.raises(DataError, match="t.npz: not a readable .npz file"):
        A.load(cfg(tmp_path / "t.npz"))
    with pytest.raises(DataError, match="data file not found"):
        A.load(cfg(tmp_path / "none.npz"))
    with pytest.raises(C.ConfigError, match='data.format = "arrays" needs model.kind = "python"'):
        C.loads('[data]\nformat = "arrays"\n')


def test_btjit_train_reports_val_accuracy_and_samples_no_text(tmp_path):
    conf = tmp_path / "digits.toml"
    conf.write_text(Path(EXAMPLES.parent / "configs" / "digits_cnn.toml").read_text()
                    .replace('"../examples/digits_cnn.py"', json.dumps(str(EXAMPLES / "digits_cnn.py"))))
    res = CliRunner().invoke(cli, ["train", str(conf), "--out", str(tmp_path / "run"), "--set", "train.steps=150",
                                   "--set", "train.eval_interval=75", "--set", "model.channels1=8",
                                   "--set", "model.channels2=16", "--set", 'optim.schedule="constant"'], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    vals = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if json.loads(l)["event"] == "val"]
    assert [v["step"] for v in vals] == [0, 75, 150] and all(0 <= v["val_acc"] <= 1 for v in vals)
    assert vals[-1]["val_acc"] > vals[0]["val_acc"] + 0.2      # 150 steps learn something of the digits
    assert f"step 150: val loss {vals[-1]['val_loss']:.4f} | val acc {100 * vals[-1]['val_acc']:.2f}%" in res.output
    assert "samples (1, 8, 8), 10 classes, train 1,617 / val 180 samples" in res.output
    sample = CliRunner().invoke(cli, ["sample", str(tmp_path / "run")], catch_exceptions=False)
    assert sample.exit_code != 0 and 'data.format = "arrays"): it has no text to sample' in sample.output


def test_mnist_idx_files_become_the_npz_the_config_reads(tmp_path):
    """examples/mnist_npz.py (docs/guide.md) on small idx files of MNIST's layout, read back by the arrays reader."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mnist_npz", EXAMPLES / "mnist_npz.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = np.random.default_rng(0)
    want = {"x_train": rng.integers(0, 256, (6, 28, 28)), "y_train": rng.integers(0, 10, 6),
            "x_val": rng.integers(0, 256, (3, 28, 28)), "y_val": rng.integers(0, 10, 3)}
    for key, name in mod.FILES.items():
        a = want[key].astype(np.uint8)
        raw = bytes([0, 0, 8, a.ndim]) + np.array(a.shape, ">i4").tobytes() + a.tobytes()
        (tmp_path / (name + ".gz" if key.startswith("x") else name)).write_bytes(
            gzip.compress(raw) if key.startswith("x") else raw)
    out = mod.convert(tmp_path, tmp_path / "mnist.npz")
    ds = A.load(cfg(out))
    np.testing.assert_array_equal(ds.train.x, want["x_train"].astype(np.float32) / 255)
    np.testing.assert_array_equal(ds.val.y, want["y_val"])
    assert ds.train.x.shape[1:] == (28, 28) and ds.classes == max(want["y_train"].max(), want["y_val"].max()) + 1
