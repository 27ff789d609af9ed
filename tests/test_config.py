# tests/test_config.py -- the TOML run config (btjit/config.py): the shipped configs hold the paper's
# E5/E6 settings; every kind of bad input gives a ConfigError naming the problem; overrides; round trips.
from pathlib import Path

import pytest

from btjit import config as C
from btjit.config import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def err(text, overrides=(), tmp_path=None):
    if tmp_path is None:
        with pytest.raises(ConfigError) as e:
            C.loads(text)
        return str(e.value)
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        C.load(p, overrides)
    return str(e.value)


def test_gpt3_tiny_is_paper_e6():
    c = C.load(CONFIGS / "gpt3_tiny.toml")
    m, t, o = c.model, c.train, c.optim
    assert (m.kind, m.n_layer, m.n_head, m.n_embd, m.block_size, m.activation) == ("gpt", 6, 6, 24, 8, "relu")
    assert (t.batch_size, t.steps, t.seed, t.dtype) == (64, 3000, 1337, "float32")
    assert (o.name, o.lr, o.momentum, o.weight_decay, o.clip_norm) == ("sgd", 3e-4, 0.0, 0.0, 0.0)
    assert c.data.val_fraction == 0.1 and c.data.format == "text" and c.data.path is None
    assert c == C.Config()          # the dataclass defaults are the paper's E6 too


def test_makemore_mlp_is_paper_e5():
    c = C.load(CONFIGS / "makemore_mlp.toml")
    m = c.model
    assert (m.kind, m.context, m.n_emb, m.n_hidden) == ("mlp", 16, 64, 1024)
    assert (c.train.batch_size, c.optim.name, c.optim.lr, c.data.format) == (64, "sgd", 0.1, "lines")


@pytest.mark.parametrize("name", ["gpt3_tiny.toml", "makemore_mlp.toml"])
def test_every_key_has_a_comment(name):
    for line in (CONFIGS / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"{name}: no comment on {line!r}"


def test_malformed_toml_names_line_and_column(tmp_path):
    msg = err("[model]\nn_layer = 2\nn_head = = 3\n", tmp_path=tmp_path)
    assert "malformed TOML" in msg and "line 3" in msg and "column" in msg and "c.toml" in msg


def test_unknown_key_lists_allowed():
    msg = err("[train]\nstep = 5\n")
    assert "unknown key train.step" in msg
    assert "steps" in msg and "batch_size" in msg and "keep_checkpoints" in msg


def test_unknown_section():
    msg = err("[optimizer]\nlr = 1.0\n")
    assert "[optimizer]" in msg and "model, data, train, optim" in msg


@pytest.mark.parametrize("text,key,expected,got", [
    ('[model]\nn_layer = "6"', "model.n_layer", "integer", "'6'"),
    ("[model]\nn_layer = 6.0", "model.n_layer", "integer", "6.0"),
    ("[train]\nsteps = true", "train.steps", "integer", "True"),
    ('[optim]\nlr = "fast"', "optim.lr", "number", "'fast'"),
    ("[model]\nkind = 3", "model.kind", "string", "3"),
    ("[data]\npath = 1", "data.path", "string", "1"),
    ("[optim]\nbetas = [0.9]", "optim.betas", "list of 2 numbers", "[0.9]"),
])
def test_wrong_type_names_key_type_and_value(text, key, expected, got):
    msg = err(text)
    assert key in msg and expected in msg and got in msg


def test_int_accepted_for_float():
    c = C.loads("[optim]\nlr = 1\n")
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float)


@pytest.mark.parametrize("key", ["model.n_layer", "model.n_head", "model.n_embd", "model.block_size",
                                 "train.steps", "train.batch_size", "train.log_interval", "model.n_hidden"])
@pytest.mark.parametrize("value", [0, -3])
def test_zero_or_negative_sizes_rejected(key, value):
    sec, k = key.split(".")
    msg = err(f"[{sec}]\n{k} = {value}\n")
    assert key in msg and ">= 1" in msg and str(value) in msg


def test_n_embd_not_divisible_by_n_head():
    msg = err("[model]\nn_embd = 25\nn_head = 6\n")
    assert "n_embd (25)" in msg and "n_head (6)" in msg and "divisible" in msg


@pytest.mark.parametrize("text,needle", [
    ('[model]\nkind = "rnn"', "model.kind = 'rnn' is not one of: gpt, mlp"),
    ('[model]\nactivation = "tanh"', "relu, gelu"),
    ('[train]\non_nonfinite = "ignore"', "stop, skip"),
    ('[train]\ndtype = "float16"', "float32, float64"),
    ("[data]\nval_fraction = 1.0", "val_fraction"),
    ("[data]\nval_fraction = 0", "val_fraction"),
    ("[optim]\nlr = -0.1", "optim.lr"),
    ("[optim]\nmomentum = 1.5", "optim.momentum"),
    ("[train]\nseed = -1", "train.seed must be >= 0"),
    ('[model]\nkind = "mlp"', 'needs data.format = "lines"'),
])
def test_bad_values(text, needle):
    assert needle in err(text)


def test_overrides_are_toml_values(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nsteps = 10\n")
    c = C.load(p, ["train.steps=20", "optim.lr=1e-2", "optim.betas=[0.8, 0.9]", 'model.activation="gelu"',
                   "data.path=some file.txt", "train.on_nonfinite=skip"])
    assert c.train.steps == 20 and c.optim.lr == 0.01 and c.optim.betas == (0.8, 0.9)
    assert c.model.activation == "gelu" and c.data.path == "some file.txt"
    assert c.train.on_nonfinite == "skip"


@pytest.mark.parametrize("item,needle", [
    ("train.steps", "expected section.key=value"),
    ("steps=3", "must be section.key"),
    ("training.steps=3", "unknown section [training]"),
    ("train.stepz=3", "unknown key train.stepz"),
    ("train.steps=abc", "train.steps: expected integer, got 'abc'"),
    ("train.steps=0", "train.steps must be >= 1"),
])
def test_bad_overrides(tmp_path, item, needle):
    assert needle in err("", [item], tmp_path)


def test_missing_and_non_utf8_config(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        C.load(tmp_path / "nope.toml")
    (tmp_path / "b.toml").write_bytes(b"\xff\xfe[model]")
    with pytest.raises(ConfigError, match="not a UTF-8"):
        C.load(tmp_path / "b.toml")


def test_dict_and_toml_round_trip():
    c = C.loads('[model]\nn_layer = 2\n[data]\npath = "x.txt"\n[optim]\nname = "adamw"\nbetas = [0.8, 0.95]\n')
    assert C.Config.from_dict(c.to_dict()) == c
    assert C.loads(c.to_toml()) == c
    d = C.Config().to_dict()
    assert "path" not in d["data"] and C.loads(C.Config().to_toml()) == C.Config()
