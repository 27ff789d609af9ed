# tests/test_usermodel.py -- `btjit train` on the user's own model file ([model] kind = "python", btjit/usermodel.py)
# end to end through the CLI: the README's example (examples/mymodel.py, examples/mymodel.toml) trains and the
# loss falls; the file is copied into the run dir and --resume uses the copy (bit-exact against an uninterrupted
# run although the original was edited meanwhile); `btjit sample` reads the source kept in the checkpoint; the
# user's own [model] keys and cfg as a last argument of loss; a "text"-format model; and the errors: a missing
# file, a missing function, a syntax error, a loss that fails to trace or raises, a bad init_params, logits of
# the wrong shape, a deleted run-dir copy -- each one line naming the file (and line).
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from btjit.train import checkpoint as K
from btjit.cli import cli
from test_cli import assert_error, assert_same_state, final_state, metrics
from textdata import words

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "examples" / "mymodel.py").read_text()
SMALL = dict(n_embd=8, hidden=16, block_size=8)


def config(file="mymodel.py", fmt="words", model=None, **train):
    m = {**SMALL, **(model or {})}
    t = {**dict(steps=30, batch_size=8, seed=5, eval_interval=10, eval_batches=4, sample_interval=0, log_interval=10,
                checkpoint_interval=10), **train}
    lines = "".join(f"{k} = {v!r}\n" for k, v in m.items())
    return (f'[model]\nkind = "python"\nfile = "{file}"\n{lines}[data]\nformat = "{fmt}"\n[train]\n' +
            "".join(f"{k} = {v!r}\n" for k, v in t.items()) + '[optim]\nname = "adamw"\nlr = 0.02\n')


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def setup(tmp_path):
    """tmp/models/mymodel.py + tmp/models/c.toml (file relative to the config's dir) and tmp/words.txt."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mymodel.py").write_text(EXAMPLE)
    (tmp_path / "models" / "c.toml").write_text(config())
    (tmp_path / "words.txt").write_text(words())
    return tmp_path / "models" / "c.toml", tmp_path / "words.txt", tmp_path


def test_the_guide_shows_the_example():
    readme = (ROOT / "docs" / "guide.md").read_text()
    assert EXAMPLE.strip() in readme and (ROOT / "examples" / "mymodel.toml").read_text().strip() in readme


def test_the_example_config_trains_and_samples(tmp_path):
    (tmp_path / "w.txt").write_text(words())
    res = run("train", ROOT / "examples" / "mymodel.toml", "--data", tmp_path / "w.txt", "--out", tmp_path / "r",
              *(f"--set=train.{k}" for k in ("steps=40", "eval_interval=20", "sample_interval=20", "log_interval=20")))
    assert res.exit_code == 0, res.output
    assert "model: python mymodel.py, hidden 64 |" in res.output and "--- sample at step 20 ---" in res.output
    val = [e["val_loss"] for e in metrics(tmp_path / "r") if e["event"] == "val"]
    assert val[-1] < val[0] - 0.5, val
    assert (tmp_path / "r" / "mymodel.py").read_text() == EXAMPLE


def test_resume_uses_the_run_dirs_copy_bit_exact(setup):
    cfg, data, tmp = setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    assert run("train", cfg, "--data", data, "--out", tmp / "b", "--set", "train.steps=13").exit_code == 0
    assert (tmp / "b" / "mymodel.py").read_text() == EXAMPLE
    (tmp / "models" / "mymodel.py").write_text(EXAMPLE.replace("h = btjit.tanh(", "h = btjit.sigmoid("))   # edited
    res = run("train", cfg, "--data", data, "--out", tmp / "b", "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000013.npz at step 13" in res.output, res.output
    assert f"note: resuming with the run's copy of the model file, {tmp / 'b' / 'mymodel.py'}" in res.output
    assert_same_state(final_state(tmp / "a"), final_state(tmp / "b"))
    assert (tmp / "b" / "mymodel.py").read_text() == EXAMPLE              # the copy is not overwritten
    ck = final_state(tmp / "b")
    assert ck.meta["model_file"]["name"] == "mymodel.py" and ck.meta["model_file"]["source"] == EXAMPLE
    (tmp / "b" / "mymodel.py").unlink()
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "b", "--resume", "--set", "train.steps=40"),
                 "the run's copy of the model file", "mymodel.py", "is missing")


def test_sample_reads_the_model_kept_in_the_checkpoint(setup):
    cfg, data, tmp = setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    a = run("sample", tmp / "a", "--n", 50, "--seed", 3, "--prompt", "a")
    assert a.exit_code == 0, a.output
    names = a.stdout.splitlines()
    assert names and all(n.startswith("a") and set(n) <= set("aeioulmnrst") and len(n) <= 7 for n in names)
    shutil.copy(K.path_for(tmp / "a", 30), tmp / "elsewhere.npz")       # without the run dir (or the model file)
    shutil.rmtree(tmp / "models")
    b = run("sample", tmp / "elsewhere.npz", "--n", 50, "--seed", 3, "--prompt", "a")
    c = run("sample", K.path_for(tmp / "a", 30), "--n", 50, "--seed", 3, "--prompt", "a")
    assert b.exit_code == 0 and b.stdout == c.stdout, b.output
    assert_error(run("sample", tmp / "a", "--prompt", "aaaaaaa"), "at most block_size - 1 = 7", "a prompt at most 6")


OWN_KEYS = '''import numpy as np
import btjit


def init_params(cfg, rng):
    assert (cfg.width, cfg.tags, cfg.vocab_size) == (6, ["a", "b"], 3)
    return {"w": rng.normal(size=(cfg.vocab_size, cfg.vocab_size))}     # float64 is fine


def logits(p, x, cfg):
    return p["w"][x] * cfg.scale


def loss(p, x, y, cfg):
    return btjit.cross_entropy(logits(p, x, cfg), y)
'''


def test_own_keys_cfg_arguments_and_a_text_model(tmp_path):
    (tmp_path / "bigram.py").write_text(OWN_KEYS)
    (tmp_path / "c.toml").write_text(config("bigram.py", "text", model=dict(width=6, tags=["a", "b"], scale=0.5,
                                                                          block_size=4), steps=100))
    (tmp_path / "t.txt").write_text("abcabcabcab" * 30)
    res = run("train", tmp_path / "c.toml", "--data", tmp_path / "t.txt", "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    assert "model: python bigram.py, hidden 16, width 6, tags ['a', 'b'], scale 0.5 |" in res.output
    out = run("sample", tmp_path / "r", "--n", 12, "--temperature", 0, "--prompt", "ab").stdout
    assert out == "abcabcabcabcab\n"                 # greedy from the learned bigram table


@pytest.mark.parametrize("name,content,needles", [
    (None, None, ["model file not found", "nope.py", "relative to the config file's dir"]),
    ("dir", None, ["model.file is a directory"]),
    ("nologits.py", EXAMPLE.replace("def logits(", "def logit("), ["nologits.py does not define logits(p, x)",
                                                                  "a model file defines init_params(cfg, rng)"]),
    ("syntax.py", EXAMPLE.replace("def loss(p, x, y):", "def loss(p, x, y)"),
     ["syntax.py:26: syntax error in the model file", "expected ':'"]),
    ("notrace.py", EXAMPLE.replace("    lg = logits(p, x)\n", "    lg = logits(p, x) @ p['wx']\n"),
     ["notrace.py: tracing loss(p, x, y): matmul: shapes (8, 8, 12)", "notrace.py:27"]),
    ("raises.py", EXAMPLE.replace("    lg = logits(p, x)\n", "    lg = logits(p, x) + p['nope']\n"),
     ["raises.py:27: tracing loss(p, x, y) raised UnknownName: p['nope']: no such param or buffer"]),
    ("init.py", EXAMPLE.replace("cfg.hidden\n", "cfg.hiden\n"),
     ["init.py:9: init_params(cfg, rng) raised AttributeError: cfg has no key 'hiden'", "hidden, vocab_size"]),
    ("ints.py", EXAMPLE.replace('"b": np.zeros(H, np.float32)', '"b": np.zeros(H, np.int64)'),
     ["ints.py: init_params(cfg, rng) must return a dict of name -> numpy float array; 'b' is a ndarray of int64"]),
    ("nan.py", EXAMPLE.replace('"b": np.zeros(H, np.float32)', '"b": np.full(H, np.nan, np.float32)'),
     ["nan.py: init_params(cfg, rng) returned 'b' with non-finite values (first at index (0,))"]),
    ("imports.py", "import numpy\nx = 1 / 0\n", ["imports.py:2: executing the model file raised ZeroDivisionError"]),
    ("shape.py", EXAMPLE.replace('    return btjit.stack(hs, 1) @ p["head"]',
                                 '    return (btjit.stack(hs, 1) @ p["head"])[:, 0]')
     .replace("    lg = logits(p, x)\n", "    lg = btjit.stack([logits(p, x)] * x.shape[1], 1)\n"),
     ["shape.py: logits(p, x) of x (1, 8) must return shape (1, 8, 12)", 'data.format = "words", got (1, 12)']),
])
def test_model_file_errors_name_the_file_and_line(setup, name, content, needles):
    cfg, data, tmp = setup
    file = name or "nope.py"
    if name == "dir":
        (tmp / "models" / "dir").mkdir()
    elif content is not None:
        (tmp / "models" / name).write_text(content)
    cfg.write_text(config(file, sample_interval=10 if name == "shape.py" else 0))
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "r"), *needles)


def test_model_file_of_another_kind_and_its_own_keys_are_config_errors(setup):
    cfg, data, tmp = setup
    cfg.write_text(config().replace('kind = "python"', 'kind = "rnn"').replace("hidden = 16\n", ""))
    assert_error(run("train", cfg, "--data", data), 'model.file is only used with model.kind = "python"')
    cfg.write_text(config().replace('kind = "python"\nfile = "mymodel.py"\n', ""))
    assert_error(run("train", cfg, "--data", data), "unknown key model.hidden",
                 'your own keys need model.kind = "python"')
