# tests/test_probe_cli.py -- `btjit train` and `btjit bench` as a user runs them, on ground the other CLI tests
# leave: a resumed run prints the samples an uninterrupted one prints (the samples' RNG is in the checkpoint); an
# .npz whose integer targets hold an id far beyond its samples (a stray label) is one error naming the key, not a
# model of a billion outputs; `btjit bench` refuses --reps 0, negative --threads and an unknown --only before it
# measures anything.
import shutil

from click.testing import CliRunner

from btjit.cli import cli
from test_cli import assert_error
from textdata import words


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


BIGRAM = ('[model]\nkind = "bigram"\nblock_size = 8\n[train]\nsteps = 4\nbatch_size = 16\nseed = 5\n'
          "eval_interval = 2\neval_batches = 2\nlog_interval = 1\nsample_interval = 2\nsample_chars = 60\n"
          'checkpoint_interval = 2\nkeep_checkpoints = 5\n[optim]\nname = "adamw"\nlr = 0.05\n')


def samples(output: str) -> dict:
    """step -> the text of its sample block in a run's output."""
    out, lines = {}, output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("--- sample at step "):
            end = lines.index("---", i + 1)
            out[int(line.split()[-2])] = "\n".join(lines[i + 1:end])
    return out


def test_a_resumed_run_prints_the_samples_of_an_uninterrupted_one(tmp_path):
    (tmp_path / "c.toml").write_text(BIGRAM)
    (tmp_path / "w.txt").write_text(words())
    args = ("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--threads", "1")
    whole = run(*args, "--out", tmp_path / "a")
    assert whole.exit_code == 0, whole.output
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "ckpt_00000004.npz").unlink()               # as if stopped after the step-2 checkpoint
    resumed = run(*args, "--out", tmp_path / "b", "--resume")
    assert resumed.exit_code == 0 and "resumed from ckpt_00000002.npz at step 2" in resumed.output, resumed.output
    a, b = samples(whole.output), samples(resumed.output)
    assert sorted(a) == [2, 4] and sorted(b) == [4] and a[2] != a[4]
    assert b[4] == a[4]
