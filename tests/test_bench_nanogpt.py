"""`btjit bench --suite nanogpt` (btjit/bench/nanogpt_suite.py) at a tiny size: the btjit row comes from the real
`btjit train` in a child process and the torch row from nanoGPT's loop (btjit/bench/peers/nanogpt_torch.py), both
on one shrunken copy of configs/nanogpt_cpu.toml; the rows have their fields, finite losses that fall, and the
CLI's argument errors. No timing assertions."""
import math
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from btjit.bench import nanogpt_suite, report
from btjit.cli import cli

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "nanogpt_cpu.toml"
SMALL = {"n_layer": "1", "n_embd": "32", "block_size": "16", "batch_size": "8", "warmup_steps": "0", "lr": "1e-2",
         "eval_interval": "6", "eval_batches": "4", "log_interval": "3", "decay_steps": "12"}


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    text = RECIPE.read_text()
    for key, value in SMALL.items():
        text, n = re.subn(rf"^{key} = \S+", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    path = tmp_path_factory.mktemp("nanogpt") / "small.toml"
    path.write_text(text)
    return path


def _check(row, steps):
    assert row["status"] == "ok", row["status"]
    assert row["steps"] == steps and row["wall_s"] > 0 and row["ms_per_step"] > 0 and row["n_params"] > 0
    steps_seen = [s for s, _ in row["val_losses"]]
    assert steps_seen == [0, 6, 12], steps_seen
    vals = [v for _, v in row["val_losses"]]
    assert all(math.isfinite(v) for v in vals) and vals[-1] < vals[0] - 0.2, vals   # ln 65 = 4.17 -> clearly less
    assert row["val_loss"] == vals[-1]


def test_btjit_and_torch_rows_from_one_config(small_config):
    pytest.importorskip("torch")
    rows = nanogpt_suite.run(steps=12, config=small_config)
    assert [r["impl"] for r in rows] == ["btjit", "btjit-bf16", "torch", "torch-bf16"]
    for r in rows:
        _check(r, 12)
    assert len({r["n_params"] for r in rows}) == 1                  # the same model on every side
    assert "train.precision=bf16" in rows[1]["command"] and "precision" not in rows[0]["command"]
    assert rows[0]["val_loss"] != rows[1]["val_loss"]            # the bf16 products round
    assert rows[2]["val_loss"] != rows[3]["val_loss"]            # so do torch's under autocast
    assert rows[0]["threads"] >= 1 and rows[2]["threads"] >= 1
    head, cells = report.parse_markdown(nanogpt_suite.format_table(rows, markdown=True, command="btjit bench"))
    assert [c[0] for c in cells] == ["btjit", "btjit-bf16", "torch", "torch-bf16"] and head[4] == "val loss"
    assert cells[0][4] == f"{rows[0]['val_loss']:.4f}"


def test_shortened_recipe_overrides_and_unknown_impls():
    assert nanogpt_suite.overrides(RECIPE, None) == []
    assert nanogpt_suite.overrides(RECIPE, 500) == ["train.steps=500"]
    assert nanogpt_suite.overrides(RECIPE, 3) == ["train.steps=3", "optim.warmup_steps=2"]   # warm-up 100 cut to fit
    with pytest.raises(ValueError, match="unknown implementation"):
        nanogpt_suite.run(only="btjit,jax")


def test_cli_argument_errors():
    r = CliRunner().invoke(cli, ["bench", "--suite", "nanogpt", "--steps", "0"])
    assert r.exit_code != 0 and "--steps must be >= 1" in r.output
    r = CliRunner().invoke(cli, ["bench", "--suite", "nanogtp"])
    assert r.exit_code != 0 and "'nanogtp' is not one of" in r.output and "nanogpt" in r.output
