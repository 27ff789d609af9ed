# tests/test_cli.py -- the `btjit` command line end to end: bad configs, data, options and checkpoints
# give one readable error line and a non-zero exit; a short training on generated text (tiny GPT) where
# the loss falls; resume bit-exact against an uninterrupted run (also past a corrupt checkpoint);
# Ctrl+C (a real SIGINT to a child process) saves and exits 0; NaN stop/skip; a failed checkpoint
# write; `sample` and `plot`.
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from btjit.train import checkpoint as K
from btjit.models import gpt as gpt_model
from btjit.cli import cli
from textdata import corpus, tiny_config, write_run_files

ROOT = Path(__file__).resolve().parent.parent

TINY = tiny_config()




@pytest.fixture
def setup(tmp_path):
    return write_run_files(tmp_path, TINY, corpus())


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_error(res, *needles):
    assert res.exit_code != 0, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.output     # one line, the last one
    assert "Traceback" not in res.output
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def metrics(run_dir):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ---- errors that need no model -------------------------------------------------------------------------
def test_missing_config(tmp_path):
    assert_error(run("train", tmp_path / "nope.toml"), "config file not found", "nope.toml")


@pytest.mark.parametrize("text,needles", [
    ("[model]\nn_layer = = 1\n", ["malformed TOML", "line 2, column"]),
    ("[model]\nlayers = 2\n", ["unknown key model.layers", "n_layer, n_head"]),
    ('[train]\nsteps = "many"\n', ["train.steps", "expected integer", "'many'"]),
    ("[train]\nbatch_size = -4\n", ["train.batch_size must be >= 1"]),
    ("[model]\nn_embd = 10\nn_head = 4\n", ["n_embd (10)", "n_head (4)"]),
])
def test_bad_config(tmp_path, text, needles):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    assert_error(run("train", p), "bad.toml", *needles)


def test_bad_set_option(setup):
    cfg, data, tmp = setup
    assert_error(run("train", cfg, "--set", "train.stepz=3"), "unknown key train.stepz")
    assert_error(run("train", cfg, "--set", "nonsense"), "expected section.key=value")


@pytest.mark.parametrize("content,needles", [
    (None, ["data file not found", "missing.txt"]),
    (b"", ["data file is empty", "missing.txt"]),
    (bytes(range(256)) * 10, ["binary", "missing.txt"]),
    ("\u00e9t\u00e9 ".encode("latin-1") * 50, ["not valid UTF-8", "missing.txt"]),
    (b"abcdefgh", ["too short", "block_size + 1 = 5", "missing.txt"]),
], ids=["missing", "empty", "binary", "latin1", "short"])
def test_bad_data(setup, content, needles):
    cfg, _, tmp = setup
    p = tmp / "missing.txt"
    if content is not None:
        p.write_bytes(content)
    assert_error(run("train", cfg, "--data", p, "--out", tmp / "run"), *needles)


def test_out_is_a_file(setup):
    cfg, data, tmp = setup
    (tmp / "afile").write_text("x")
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "afile"), "is a file, not a directory")


def test_usage_errors_are_one_line(setup):
    cfg, _, _ = setup
    assert_error(run("train", cfg, "--threads", "x"), "--threads", "btjit train --help")
    assert_error(run("train", cfg, "--threads", "-2"), "--threads must be >= 0")
    assert_error(run("frobnicate"), "No such command")


def test_sample_and_plot_errors(tmp_path):
    assert_error(run("sample", tmp_path / "ckpt_00000001.npz"), "checkpoint not found")
    bad = tmp_path / "ckpt_00000001.npz"
    bad.write_bytes(b"PK\x03\x04 not really")
    assert_error(run("sample", bad), "truncated or damaged")
    assert_error(run("sample", tmp_path), "no valid checkpoint", "1 corrupt: ckpt_00000001.npz")
    (tmp_path / "empty").mkdir()
    assert_error(run("sample", tmp_path / "empty"), "no valid checkpoint")
    assert_error(run("plot", tmp_path / "nowhere"), "run dir not found")
    assert_error(run("plot", tmp_path), "no metrics.jsonl")


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"event": "train", "step": 5, "loss": 3.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_error(run("plot", tmp_path), "needs matplotlib", "pip install 'btjit[plot]'")


def test_debug_shows_traceback(tmp_path):
    with pytest.raises(Exception):
        run("train", tmp_path / "nope.toml", "--debug")


# ---- training: needs the models ---------------------------------------------------------------------
@pytest.fixture
def gpt():
    return gpt_model


def final_state(run_dir):
    ck, skipped = K.latest_valid(run_dir)
    assert not skipped
    return ck


def assert_same_state(a, b):
    assert a.step == b.step and set(a.state) == set(b.state)
    for k in a.state:
        assert a.state[k].dtype == b.state[k].dtype
        assert np.array_equal(a.state[k], b.state[k]), f"{k} differs"
    assert a.meta["rng_state"] == b.meta["rng_state"]


def test_short_training_loss_falls(setup, gpt):
    cfg, data, tmp = setup
    res = run("train", cfg, "--data", data, "--out", tmp / "a")
    assert res.exit_code == 0, res.output
    out = res.output
    for needle in ("btjit ", "numba ", "threads 1", "params", "arena", "compile", "ms/step", "tok/s",
                   "val loss", "done: 30 steps"):
        assert needle in out, needle
    ev = metrics(tmp / "a")
    val = [e["val_loss"] for e in ev if e["event"] == "val"]
    train = [e for e in ev if e["event"] == "train"]
    assert [e["step"] for e in train] == [5, 10, 15, 20, 25, 30]
    assert all(e["ms_per_step"] > 0 and e["tokens_per_s"] > 0 for e in train)
    assert len(val) == 4 and val[-1] < val[0] - 0.3, val          # steps 0, 10, 20, 30
    assert train[-1]["loss"] < train[0]["loss"]
    assert [p.name for p in K.list_checkpoints(tmp / "a")] == \
        ["ckpt_00000010.npz", "ckpt_00000020.npz", "ckpt_00000030.npz"]
    from btjit.train import config
    saved = config.load(tmp / "a" / "config.toml")
    assert saved == config.load(cfg)
    ck = final_state(tmp / "a")
    assert config.Config.from_dict(ck.meta["config"]) == saved
    assert "".join(ck.meta["vocab"]) == "".join(sorted(set(corpus())))
    n_params = sum(v.size for v in ck.params.values())
    assert f"{n_params:,} params" in out


def test_resume_is_bit_exact(setup, gpt):
    cfg, data, tmp = setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    # stopped early at step 13 (its end checkpoint), resumed to 30
    assert run("train", cfg, "--data", data, "--out", tmp / "b", "--set", "train.steps=13").exit_code == 0
    res = run("train", cfg, "--data", data, "--out", tmp / "b", "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000013.npz at step 13" in res.output, res.output
    assert_same_state(final_state(tmp / "a"), final_state(tmp / "b"))
    # the metrics log of the resumed run has no duplicated steps
    steps = [e["step"] for e in metrics(tmp / "b") if e["event"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 30


def test_two_thread_training_runs_replicas_and_resumes_bit_exact(setup, gpt):
    """--threads 2 with 64 sequences of 4 tokens: two data-parallel replicas (btjit.replicas_for), which end
    where one thread ends up to rounding, and resume bit-exact."""
    cfg, data, tmp = setup
    two = ("--data", data, "--threads", "2", "--set", "train.batch_size=64")
    res = run("train", cfg, *two, "--out", tmp / "a")
    assert res.exit_code == 0 and "threads 2 (2 data-parallel replicas)" in res.output, res.output
    assert run("train", cfg, *two, "--out", tmp / "b", "--set", "train.steps=13").exit_code == 0
    res = run("train", cfg, *two, "--out", tmp / "b", "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000013.npz at step 13" in res.output, res.output
    assert_same_state(final_state(tmp / "a"), final_state(tmp / "b"))
    res = run("train", cfg, "--data", data, "--threads", "1", "--set", "train.batch_size=64", "--out", tmp / "c")
    assert res.exit_code == 0 and "replicas" not in res.output
    a, c = final_state(tmp / "a"), final_state(tmp / "c")
    for k in a.params:
        np.testing.assert_allclose(a.params[k], c.params[k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_resume_falls_back_past_corrupt_checkpoint(setup, gpt):
    cfg, data, tmp = setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    assert run("train", cfg, "--data", data, "--out", tmp / "c", "--set", "train.steps=25").exit_code == 0
    newest = K.path_for(tmp / "c", 25)
    newest.write_bytes(newest.read_bytes()[:-40])                  # truncated
    res = run("train", cfg, "--data", data, "--out", tmp / "c", "--resume")
    assert res.exit_code == 0, res.output
    assert "skipped checkpoint" in res.output and "ckpt_00000025.npz" in res.output
    assert "resuming from the newest valid checkpoint ckpt_00000020.npz (step 20)" in res.output
    assert_same_state(final_state(tmp / "a"), final_state(tmp / "c"))


def test_resume_refusals(setup, gpt):
    cfg, data, tmp = setup
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "e", "--resume"), "does not exist")
    (tmp / "e").mkdir()
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "e", "--resume"), "no valid checkpoint")
    assert run("train", cfg, "--data", data, "--out", tmp / "a", "--set", "train.steps=10").exit_code == 0
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "a"), "already holds checkpoints", "--resume")
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "a", "--resume", "--set", "model.n_embd=12"),
                 "model.n_embd = 8", "12")
    other = tmp / "other.txt"
    other.write_text(corpus().upper())
    assert_error(run("train", cfg, "--data", other, "--out", tmp / "a", "--resume"),
                 "not in the checkpoint's vocabulary")


def test_nonfinite_loss_stops_or_skips(setup, gpt, monkeypatch):
    import btjit.core.program
    cfg, data, tmp = setup
    real_step = btjit.core.program.Program.step
    calls = {"n": 0}

    def step(self, *batch):
        loss = real_step(self, *batch)
        calls["n"] += 1
        return float("nan") if calls["n"] == 17 else loss
    monkeypatch.setattr(btjit.core.program.Program, "step", step)
    line = assert_error(run("train", cfg, "--data", data, "--out", tmp / "s"), "loss is nan at step 17",
                        "Last good checkpoint", "ckpt_00000010.npz")
    assert "stopped" in line
    calls["n"] = 0
    res = run("train", cfg, "--data", data, "--out", tmp / "k", "--set", "train.on_nonfinite=skip")
    assert res.exit_code == 0 and "step 17: non-finite loss" in res.output, res.output
    assert [e["step"] for e in metrics(tmp / "k") if e["event"] == "skip"] == [17]
    assert all(np.isfinite(v).all() for v in final_state(tmp / "k").state.values())


def test_failed_checkpoint_write_stops_with_last_good(setup, gpt, monkeypatch):
    cfg, data, tmp = setup
    real = K.write_atomic

    def flaky(path, arrays):                  # the second checkpoint (best.npz writes go through too)
        if path.name == "ckpt_00000020.npz":
            raise K.CheckpointError(f"cannot write checkpoint {path}: no space left on device")
        return real(path, arrays)
    monkeypatch.setattr(K, "write_atomic", flaky)
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "f"), "stopped at step 20",
                 "no space left on device", "Last good checkpoint", "ckpt_00000010.npz")
    assert K.load(K.path_for(tmp / "f", 10)).step == 10


def test_sample(setup, gpt):
    cfg, data, tmp = setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    a = run("sample", tmp / "a", "--n", 40, "--seed", 1, "--prompt", "the ")    # the run dir: its best.npz
    b = run("sample", tmp / "a" / "best.npz", "--n", 40, "--seed", 1, "--prompt", "the ")
    best = K.load(tmp / "a" / "best.npz")
    vals = {e["step"]: e["val_loss"] for e in metrics(tmp / "a") if e["event"] == "val" and e["step"] > 0}
    assert best.meta["best"] == {"step": min(vals, key=vals.get), "val_loss": min(vals.values())}
    assert a.exit_code == 0 and a.stdout == b.stdout and a.stdout, a.output
    assert f"using {tmp / 'a' / 'best.npz'} (step {best.step}, val loss" in a.stderr and not b.stderr
    (tmp / "a" / "best.npz").write_bytes(b"PK\x03\x04 damaged")                 # falls back to the newest
    c = run("sample", tmp / "a", "--n", 40, "--seed", 1, "--prompt", "the ")
    d = run("sample", K.path_for(tmp / "a", 30), "--n", 40, "--seed", 1, "--prompt", "the ")
    assert c.exit_code == 0 and c.stdout == d.stdout and "using the newest checkpoint instead" in c.stderr
    text = a.stdout[:-1]                                         # echo adds "\n"
    assert len(text) == 44 and text.startswith("the ") and set(text) <= set(corpus())
    g1 = run("sample", tmp / "a", "--n", 20, "--temperature", 0, "--seed", 1)
    g2 = run("sample", tmp / "a", "--n", 20, "--temperature", 0, "--seed", 2, "--top-k", 1)
    assert g1.stdout == g2.stdout                                # greedy ignores the seed
    assert_error(run("sample", tmp / "a", "--prompt", "the Zebra"), "prompt character 'Z'")
    assert_error(run("sample", tmp / "a", "--temperature", -1), "--temperature must be >= 0")


def test_plot(setup, gpt):
    pytest.importorskip("matplotlib")
    cfg, data, tmp = setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a", "--set", "train.steps=10").exit_code == 0
    res = run("plot", tmp / "a", "--out", tmp / "loss.png")
    assert res.exit_code == 0, res.output
    assert (tmp / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_finishes_step_saves_and_exits_zero(setup, gpt):
    cfg, data, tmp = setup
    out = tmp / "i"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-m", "btjit.cli", "train", str(cfg), "--data", str(data),
                              "--out", str(out), "--set", "train.steps=10000000", "--set",
                              "train.checkpoint_interval=0", "--set", "train.eval_interval=0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:             # wait until training is under way
            m = out / "metrics.jsonl"
            if m.exists() and '"train"' in m.read_text():
                break
            assert child.poll() is None, child.stdout.read()
            time.sleep(0.1)
        child.send_signal(signal.SIGINT)
        text, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, text
    assert "interrupt: finishing the current step" in text and "Traceback" not in text
    line = [l for l in text.splitlines() if l.startswith("interrupted at step ")][0]
    step = int(line.split()[3].rstrip(":"))
    assert step >= 5 and "--resume" in line
    ck = final_state(out)
    assert ck.step == step and K.path_for(out, step) == ck.path


def test_mlp_on_lines_trains_and_samples_names(tmp_path):
    rng = np.random.default_rng(0)
    names = ["".join(rng.choice(list("aeiou")) + rng.choice(list("lmnrst")) for _ in range(rng.integers(1, 4)))
             for _ in range(300)]
    (tmp_path / "names.txt").write_text("\n".join(names) + "\n")
    cfg = tmp_path / "mlp.toml"
    cfg.write_text('[model]\nkind = "mlp"\ncontext = 3\nn_emb = 4\nn_hidden = 16\n[data]\nformat = "lines"\n'
                   "[train]\nsteps = 40\nbatch_size = 16\neval_interval = 20\nlog_interval = 10\n"
                   'sample_interval = 0\n[optim]\nname = "adamw"\nlr = 0.03\n')
    res = run("train", cfg, "--data", tmp_path / "names.txt", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    val = [e["val_loss"] for e in metrics(tmp_path / "m") if e["event"] == "val"]
    assert val[-1] < val[0] - 0.3, val
    ck = final_state(tmp_path / "m")
    assert ck.meta["vocab"] == ["."] + sorted("aeioulmnrst")
    res = run("sample", tmp_path / "m", "--n", 60, "--prompt", "a", "--seed", 3)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines and all(l.startswith("a") and set(l) <= set("aeioulmnrst") for l in lines)
    assert_error(run("sample", tmp_path / "m", "--prompt", "a.b"), "prompt character '.'")
