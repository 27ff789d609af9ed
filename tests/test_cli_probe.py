# tests/test_cli_probe.py -- `btjit train` as a new user runs it on their own files: a model file (an MLP classifier
# with batch norm and dropout) on an .npz of their own, a user optimizer with [optim.hp] and [[optim.groups]],
# gradient accumulation; the val accuracy of metrics.jsonl recomputed with numpy from the checkpoint; a run killed
# after a checkpoint that does not fall on a progress line resumes to the same params and the same metrics; the
# errors of bad input (data.path relative to the config, x/y of different lengths, 0-d arrays, class ids beyond
# the model's outputs, an argument the optimizer does not take, another optimizer on --resume).
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from btjit.cli import cli
from btjit.train import arrays as A
from btjit.train import checkpoint as K
from btjit.train import config as C
from btjit.train.data import DataError
from btjit.train.runparts import make_optimizer

MODEL = '''import numpy as np
import btjit

def init_params(cfg, rng):
    D, H, V = cfg.n_in, cfg.hidden, cfg.outputs or cfg.vocab_size
    return {"w1": (rng.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32), "b1": np.zeros(H, np.float32),
            "g": np.ones(H, np.float32), "beta": np.zeros(H, np.float32),
            "w2": (rng.standard_normal((H, V)) / np.sqrt(H)).astype(np.float32), "b2": np.zeros(V, np.float32)}

def init_buffers(cfg):
    return {"rm": np.zeros(cfg.hidden, np.float32), "rv": np.ones(cfg.hidden, np.float32)}

def logits(p, x):
    h = btjit.batch_norm(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"], p["g"], p["beta"], p["rm"], p["rv"])
    return btjit.dropout(btjit.relu(h), 0.1) @ p["w2"] + p["b2"]

def loss(p, x, y):
    return btjit.cross_entropy(logits(p, x), y)
'''

OPTIM = '''import numpy as np
import btjit

class MySGD(btjit.optim.Optimizer):
    def __init__(self, lr=0.1, mom=0.9, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, mom=mom, weight_decay=weight_decay, groups=groups)

    def init(self, name, param):
        return {"buf": np.zeros_like(param)}

    def update(self, p, g, state, hp, step):
        b = hp["mom"] * state["buf"] + g + hp["weight_decay"] * p
        return p - hp["lr"] * b, {"buf": b}
'''

CONFIG = '''[model]
kind = "python"
file = "mlp.py"
n_in = 10
hidden = 16
outputs = 0
[data]
format = "arrays"
path = "feat.npz"
[train]
steps = 40
batch_size = 32
grad_accum = 2
eval_interval = 20
log_interval = 10
checkpoint_interval = 15
sample_interval = 0
[optim]
file = "myopt.py"
lr = 0.05
weight_decay = 0.01
schedule = "linear"
[optim.hp]
mom = 0.8
[[optim.groups]]
params = "w.*"
[[optim.groups]]
params = ["b1", "b2", "g", "beta"]
weight_decay = 0.0
'''


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def error_line(res):
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output
    return [line for line in res.output.splitlines() if line.strip()][-1]


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def no_time(events):
    return [{k: v for k, v in e.items() if k not in ("time", "ms_per_step", "tokens_per_s")} for e in events]


@pytest.fixture
def user(tmp_path):
    """A user's dir: the model, the optimizer, the config and feat.npz (10 features, 3 classes)."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "mlp.py").write_text(MODEL)
    (d / "myopt.py").write_text(OPTIM)
    (d / "c.toml").write_text(CONFIG)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 10)).astype(np.float32)
    y = (x @ rng.standard_normal((10, 3))).argmax(1)
    np.savez(d / "feat.npz", x_train=x[:240], y_train=y[:240], x_val=x[240:], y_val=y[240:])
    return d


def test_data_path_is_relative_to_the_config_file(user, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                              # the config is proj/c.toml, the data proj/feat.npz
    assert C.load(user / "c.toml").data.path == str(user / "feat.npz")
    (tmp_path / "here.npz").write_bytes(b"")                 # --set: the current dir's, as --data FILE
    assert C.load(user / "c.toml", ["data.path=here.npz"]).data.path == "here.npz"
    (user / "c.toml").write_text(CONFIG.replace('"feat.npz"', '"here.npz"'))
    assert C.load(user / "c.toml").data.path == "here.npz"   # found only in the current dir: still found there
    (user / "c.toml").write_text(CONFIG.replace('"feat.npz"', '"gone.npz"'))
    res = run("train", user / "c.toml", "--out", tmp_path / "r")
    assert error_line(res) == f"error: data file not found: {user / 'gone.npz'}"


def test_user_model_and_optimizer_train_resume_and_report_accuracy(user, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    res = run("train", user / "c.toml", "--out", a)
    assert res.exit_code == 0, res.output
    assert "optim: MySGD (myopt.py) linear lr 0.05 -> 0 by step 40 mom 0.8 weight_decay 0.01 groups 2" in res.output
    assert "batch 32 x 2 micro-batches = 64" in res.output
    ck = K.load(a / "ckpt_00000040.npz")
    p, buf = ck.params, ck.buffers
    assert not np.all(buf["rm"] == 0)                        # batch norm's running statistics were updated
    with np.load(user / "feat.npz") as z:                    # the last val event, recomputed in float64
        x, y = z["x_val"].astype(np.float64), z["y_val"]
    h = (x @ p["w1"] + p["b1"] - buf["rm"]) / np.sqrt(buf["rv"] + 1e-5) * p["g"] + p["beta"]
    lg = np.maximum(h, 0) @ p["w2"] + p["b2"]                # eval mode: no dropout, running statistics
    lse = lg.max(1) + np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1))
    last = [e for e in metrics(a) if e["event"] == "val"][-1]
    assert last["step"] == 40 and last["val_acc"] == np.mean(lg.argmax(1) == y)
    assert last["val_loss"] == pytest.approx(np.mean(lse - lg[np.arange(len(y)), y]), rel=1e-5)
    assert f"val acc {100 * last['val_acc']:.2f}%" in res.output

    # killed right after the checkpoint of step 15 (no progress line there: log_interval 10) -> --resume
    shutil.copytree(a, b)
    for f in ("ckpt_00000030.npz", "ckpt_00000040.npz", "best.npz"):
        (b / f).unlink()
    res = run("train", user / "c.toml", "--out", b, "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000015.npz at step 15" in res.output, res.output
    done = K.load(b / "ckpt_00000040.npz")
    assert sorted(done.state) == sorted(ck.state)
    for k in ck.state:
        np.testing.assert_array_equal(done.state[k], ck.state[k], err_msg=k)
    assert no_time(metrics(b)) == no_time(metrics(a))        # step 20's loss: the mean of steps 11-20 again


def test_another_optimizer_on_resume_is_named(user, tmp_path):
    out = tmp_path / "r"
    cfg = CONFIG.replace('file = "myopt.py"', 'name = "adamw"').replace("[optim.hp]\nmom = 0.8\n", "")
    (user / "c.toml").write_text(cfg.replace("steps = 40", "steps = 2").replace("grad_accum = 2", "grad_accum = 1"))
    assert run("train", user / "c.toml", "--out", out).exit_code == 0
    res = run("train", user / "c.toml", "--out", out, "--resume", "--set", "train.steps=4", "--set", "optim.name=sgd")
    line = error_line(res)
    assert "--resume: ckpt_00000002.npz was trained with optim.name = 'adamw', the config says 'sgd'" in line
    assert not (out / "ckpt_00000004.npz").exists() and K.load(out / "ckpt_00000002.npz").step == 2


def test_another_dtype_on_resume_is_noted(user, tmp_path):
    out = tmp_path / "r"
    (user / "c.toml").write_text(CONFIG.replace("steps = 40", "steps = 2").replace("grad_accum = 2", "grad_accum = 1"))
    assert run("train", user / "c.toml", "--out", out).exit_code == 0
    res = run("train", user / "c.toml", "--out", out, "--resume", "--set", "train.steps=4",
              "--set", "train.dtype=float64")
    assert res.exit_code == 0, res.output
    assert ("note: ckpt_00000002.npz was trained with train.dtype = 'float32', this run continues in 'float64'"
            in res.output)
    assert K.load(out / "ckpt_00000004.npz").params["w1"].dtype == np.float64


def test_class_ids_beyond_the_models_outputs(user, tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((60, 10)).astype(np.float32), rng.integers(0, 6, 60)
    np.savez(user / "six.npz", x=x, y=y)
    res = run("train", user / "c.toml", "--out", tmp_path / "r", "--data", user / "six.npz",
              "--set", "model.outputs=3", "--set", "train.steps=2", "--set", "train.grad_accum=1")
    assert error_line(res) == (f"error: {user / 'six.npz'}: its class ids go up to 5, but logits(p, x) gives 3 "
                               f"class scores per sample (shape (32, 3)): the model needs cfg.vocab_size = 6 outputs")
    assert not list((tmp_path / "r").glob("ckpt_*"))


@pytest.mark.parametrize("arrays,needle", [
    ({"x": np.zeros((5, 2), np.float32), "y": np.zeros(4, int)}, "y has 4 samples but x has 5"),
    ({"x": np.float32(1.0), "y": np.int64(0)}, "x is a single value (shape ()); it must hold one sample per row"),
    ({"x_train": np.zeros((3, 2)), "y_train": np.int64(1), "x_val": np.zeros((2, 2)), "y_val": np.zeros(2, int)},
     "y_train is a single value"),
])
def test_array_files_of_mismatched_or_scalar_arrays(tmp_path, arrays, needle):
    f = tmp_path / "d.npz"
    np.savez(f, **arrays)
    cfg = C.loads(f'[model]\nkind = "python"\nfile = "m.py"\n[data]\nformat = "arrays"\npath = "{f}"\n')
    with pytest.raises(DataError) as e:
        A.load(cfg)
    assert str(f) in str(e.value) and needle in str(e.value)


def test_an_hp_the_optimizer_does_not_take_is_named():
    with pytest.raises(C.ConfigError, match=r"optim.hp.nesterov: AdamW takes no argument 'nesterov' \(its arguments: "
                                            r"lr, betas, eps, weight_decay, amsgrad, maximize\)"):
        make_optimizer(C.loads('[optim]\nname = "adamw"\n[optim.hp]\nnesterov = true\n').optim)
