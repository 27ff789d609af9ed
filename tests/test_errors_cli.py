"""Bad input at the command line gets one line naming the problem (the gaps test_cli.py and test_config.py leave):
an error in a real process is one line on stderr (a traceback only with --debug), an unexpected exception too,
with a hint; a checkpoint from a newer format or another model is refused by name."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "btjit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cli_error_in_a_real_process_is_one_line_on_stderr_and_traceback_only_with_debug(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_layer = = 2\n")
    r = _cli("train", bad)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "line 2, column" in lines[0], r.stderr
    r = _cli("train", bad, "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "line 2, column" in r.stderr


def test_unexpected_exception_is_one_line_with_a_debug_hint(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from btjit.train import config as config_mod
    from btjit.cli import cli

    def boom(*a, **k):
        raise RuntimeError("something odd\non two lines")
    monkeypatch.setattr(config_mod, "load", boom)
    res = CliRunner().invoke(cli, ["train", str(tmp_path / "x.toml")], catch_exceptions=False)
    assert res.exit_code != 0
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert lines == ["error: RuntimeError: something odd on two lines (run with --debug for the traceback)"]


def _tiny_run(tmp_path, steps=4):
    """A finished tiny GPT run in tmp_path/run (via the API, no CLI parsing)."""
    from btjit.train import config as C
    from btjit.train import train
    data = tmp_path / "text.txt"
    data.write_text("the cat sees the dog. a bird eats seeds.\n" * 40)
    cfg = C.loads("[model]\nn_layer = 1\nn_head = 2\nn_embd = 8\nblock_size = 4\n"
                  f"[train]\nsteps = {steps}\nbatch_size = 2\neval_interval = 0\neval_batches = 1\n"
                  "sample_interval = 0\nlog_interval = 2\ncheckpoint_interval = 2\n")
    train(cfg, tmp_path / "run", data_path=data, echo=lambda s="": None)
    return cfg, data


def test_cli_checkpoint_from_a_newer_format_or_another_model(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from btjit.train import checkpoint as K
    from btjit.cli import cli
    _tiny_run(tmp_path)
    run = tmp_path / "run"
    ck = K.load(K.path_for(run, 4))

    def invoke(*args):
        res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert res.exit_code != 0, res.output
        lines = [l for l in res.output.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
        return lines[0]
    # another model: the params do not match the model its config describes
    other = tmp_path / "other"
    other.mkdir()
    state = dict(ck.state)
    state["param/wte"] = np.zeros((3, 3), np.float32)
    K.save(other, 4, state, ck.meta)
    msg = invoke("sample", other)
    assert "is from another model" in msg and "param/wte has shape (3, 3)" in msg
    # a newer format version: refused by sample and by --resume (never silently skipped)
    monkeypatch.setattr(K, "FORMAT_VERSION", K.FORMAT_VERSION + 1)
    K.save(run, 6, ck.state, ck.meta)
    K.save_best(run, 6, ck.state, ck.meta)
    monkeypatch.undo()
    assert "best.npz has format version 2, newer than this btjit reads" in invoke("sample", run)   # its best.npz
    (run / K.BEST).unlink()
    assert "ckpt_00000006.npz has format version 2, newer than this btjit reads" in invoke("sample", run)
    cfg = tmp_path / "c.toml"
    cfg.write_text((run / "config.toml").read_text())
    msg = invoke("train", cfg, "--data", tmp_path / "text.txt", "--out", run, "--resume")
    assert "ckpt_00000006.npz has format version 2, newer than this btjit reads (1)" in msg
