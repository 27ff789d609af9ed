# tests/test_cli_makemore.py -- makemore.py's six models through `btjit train` and `btjit sample`: each kind
# trains on a tiny corpus of name-like words (data.format "words") with its val loss falling, and samples names
# one per line from the vocabulary, at most block_size - 1 characters, starting with the prompt; each shipped
# configs/makemore_<kind>.toml runs (a few steps on the bundled names.txt) at makemore's default sizes.
from pathlib import Path

import pytest
from click.testing import CliRunner

from btjit.train import checkpoint as K
from btjit.cli import cli
from btjit.models import makemore
from test_cli import assert_error, final_state, metrics
from textdata import words

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"bigram": "makemore_bigram.toml", "makemore_mlp": "makemore_mlp_words.toml", "rnn": "makemore_rnn.toml",
           "gru": "makemore_gru.toml", "bow": "makemore_bow.toml", "transformer": "makemore_transformer.toml"}
LETTERS = set("aeioulmnrst")


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def tiny(kind: str) -> str:
    return (f'[model]\nkind = "{kind}"\nn_layer = 1\nn_head = 2\nn_embd = 8\nn_embd2 = 16\nblock_size = 8\n'
            "[train]\nsteps = 40\nbatch_size = 16\nseed = 3\neval_interval = 20\neval_batches = 8\nlog_interval = 10\n"
            'sample_interval = 20\nsample_chars = 40\n[optim]\nname = "adamw"\nlr = 0.03\n')


@pytest.mark.parametrize("kind", makemore.KINDS)
def test_each_kind_trains_and_samples_names(tmp_path, kind):
    (tmp_path / "c.toml").write_text(tiny(kind))
    (tmp_path / "w.txt").write_text(words())
    res = run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    assert f"model: makemore {kind.replace('makemore_', '')}" in res.output
    assert "--- sample at step 20 ---" in res.output
    assert "train 270 / val 30 words" in res.output
    val = [e["val_loss"] for e in metrics(tmp_path / "r") if e["event"] == "val"]
    assert val[-1] < val[0] - 0.3, val
    ck = final_state(tmp_path / "r")
    assert ck.meta["vocab"] == ["."] + sorted(LETTERS) and ck.meta["config"]["data"]["format"] == "words"
    out = run("sample", tmp_path / "r", "--n", 80, "--prompt", "a", "--seed", 1)
    assert out.exit_code == 0, out.output
    names = out.stdout.splitlines()
    assert len(names) >= 5 and all(n.startswith("a") and set(n) <= LETTERS and len(n) <= 7 for n in names), names
    seeded = [run("sample", K.path_for(tmp_path / "r", 40), "--n", 80, "--seed", 2).stdout for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0].strip()
    assert_error(run("sample", tmp_path / "r", "--prompt", "a.e"), "prompt character '.'")


@pytest.mark.parametrize("kind", makemore.KINDS)
def test_shipped_config_runs_on_the_bundled_names(tmp_path, kind):
    res = run("train", ROOT / "configs" / CONFIGS[kind], "--out", tmp_path / "r", "--set", "train.steps=3",
              "--set", "train.eval_batches=2", "--set", "train.sample_interval=0", "--set", "train.log_interval=1")
    assert res.exit_code == 0, res.output
    n = sum(v.size for v in makemore.model(kind).init_params(0).values())
    assert f"| {n:,} params |" in res.output and "<bundled corpus: names.txt>" in res.output
    assert "batch 32 | 3 steps | seed 3407" in res.output and "adamw constant lr 0.0005 betas (0.9, 0.99)" in res.output
    names = run("sample", tmp_path / "r", "--n", 30, "--seed", 0).stdout.splitlines()
    assert names and all(set(n) <= set("abcdefghijklmnopqrstuvwxyz") and len(n) <= 15 for n in names)


def test_words_longer_than_the_block_are_an_error(tmp_path):
    (tmp_path / "c.toml").write_text(tiny("rnn"))
    (tmp_path / "w.txt").write_text(words() + "abcdefghijk\n")
    assert_error(run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--out", tmp_path / "r"),
                 "the word 'abcdefghijk' has 11 characters", "model.block_size >= the longest word + 1 = 12, got 8")
