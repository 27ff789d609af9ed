import dataclasses
# tests/test_config.py -- the TOML run config (btjit/config.py): the shipped configs hold the paper's
# E5/E6 settings (gpt3_tiny: the E6 model with the AdamW + cosine recipe) and makemore.py's defaults
# (makemore_<kind>.toml); every kind of bad input, the impossible LR schedules included, gives a ConfigError
# naming the key and the allowed values; overrides; round trips; makemore's sizes for keys left out; the
# python kind's model file path and the user's own [model] keys.
from pathlib import Path

import pytest

from btjit.train import config as C
from btjit.train.config import ConfigError

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


def test_paper_e6_is_the_papers_run():
    c = C.load(CONFIGS / "paper_e6.toml")
    m, t, o = c.model, c.train, c.optim
    assert (m.kind, m.n_layer, m.n_head, m.n_embd, m.block_size, m.activation) == ("gpt", 6, 6, 24, 8, "relu")
    assert (t.batch_size, t.grad_accum, t.steps, t.seed, t.dtype) == (64, 1, 3000, 1337, "float32")
    assert (o.name, o.lr, o.momentum, o.weight_decay, o.clip_norm) == ("sgd", 3e-4, 0.0, 0.0, 0.0)
    assert (o.schedule, o.warmup_steps) == ("constant", 0)
    assert c.data.val_fraction == 0.1 and c.data.format == "text" and c.data.path is None
    assert c.data.corpus == "tinyshakespeare"
    d = C.Config()                  # the dataclass defaults are the paper's E6 too (corpus left out: by format),
    assert t.threads == 1 and d.train.threads == 0      # but on every core unless told: the paper ran one thread
    assert (d.model, dataclasses.replace(d.train, threads=1), d.optim) == (m, t, o) and d.data.corpus is None


def test_gpt3_tiny_is_the_paper_model_with_a_recipe_that_learns():
    c, paper = C.load(CONFIGS / "gpt3_tiny.toml"), C.load(CONFIGS / "paper_e6.toml")
    assert (c.model, c.data, c.distributed) == (paper.model, paper.data, paper.distributed)
    assert c.train == dataclasses.replace(paper.train, threads=0)     # every core; the paper's run on one
    o = c.optim
    assert (o.name, o.lr, o.betas, o.eps, o.weight_decay, o.clip_norm) == ("adamw", 3e-3, (0.9, 0.999), 1e-8, 0.0, 0.0)
    assert (o.schedule, o.warmup_steps, o.decay_steps, o.lr_min) == ("cosine", 100, 0, 3e-4)


def test_makemore_mlp_is_paper_e5():
    c = C.load(CONFIGS / "makemore_mlp.toml")
    m = c.model
    assert (m.kind, m.context, m.n_emb, m.n_hidden) == ("mlp", 16, 64, 1024)
    assert (c.train.batch_size, c.optim.name, c.optim.lr, c.data.format) == (64, "sgd", 0.1, "lines")
    assert c.data.corpus == "names" and c.optim.schedule == "constant" and c.train.grad_accum == 1


MAKEMORE_CONFIGS = {"bigram": "makemore_bigram.toml", "makemore_mlp": "makemore_mlp_words.toml",
                    "rnn": "makemore_rnn.toml", "gru": "makemore_gru.toml", "bow": "makemore_bow.toml",
                    "transformer": "makemore_transformer.toml"}


@pytest.mark.parametrize("kind", list(MAKEMORE_CONFIGS))
def test_makemore_configs_are_makemores_defaults(kind):
    c = C.load(CONFIGS / MAKEMORE_CONFIGS[kind])
    m, o, t = c.model, c.optim, c.train
    assert m.kind == kind and (m.n_layer, m.n_head, m.n_embd, m.n_embd2, m.block_size) == (4, 4, 64, 64, 16)
    assert (c.data.format, c.data.corpus, c.data.path) == ("words", "names", None)
    assert (o.name, o.lr, o.betas, o.eps, o.weight_decay, o.schedule, o.clip_norm) == \
        ("adamw", 5e-4, (0.9, 0.99), 1e-8, 0.01, "constant", 0.0)
    assert (t.batch_size, t.grad_accum, t.seed) == (32, 1, 3407)


def test_makemore_kinds_agree_with_the_models():
    from btjit.models import makemore
    assert C.MAKEMORE_KINDS == makemore.KINDS == tuple(MAKEMORE_CONFIGS)


def test_makemore_kind_takes_makemores_sizes_for_keys_left_out():
    c = C.loads('[model]\nkind = "gru"\nn_embd2 = 32\n')
    m = c.model
    assert (m.n_layer, m.n_head, m.n_embd, m.n_embd2, m.block_size, c.data.format) == (4, 4, 64, 32, 16, "words")
    assert C.loads(c.to_toml()) == c
    assert 'needs data.format = "words"' in err('[model]\nkind = "bow"\n[data]\nformat = "lines"\n')
    assert "n_embd (64) must be divisible by model.n_head (5)" in err('[model]\nkind = "transformer"\nn_head = 5\n')
    assert "model.n_embd2 must be >= 1, got 0" in err('[model]\nkind = "rnn"\nn_embd2 = 0\n')


def test_python_kind_keeps_the_users_keys_and_resolves_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "c.toml"
    p.write_text('[model]\nkind = "python"\nfile = "mine.py"\nwidth = 48\nacts = ["tanh", "relu"]\nextra = 1.5\n'
                 '[data]\nformat = "words"\n')
    c = C.load(p, ["model.depth=3"])
    assert c.model.file == str(tmp_path / "sub" / "mine.py")
    assert c.model.extra == {"width": 48, "acts": ["tanh", "relu"], "extra": 1.5, "depth": 3}
    d = c.to_dict()["model"]
    assert d["width"] == 48 and d["depth"] == 3 and "extra" in d and d["extra"] == 1.5
    assert C.Config.from_dict(c.to_dict()) == c and C.loads(c.to_toml()) == c
    assert C.load(p, [f"model.file={tmp_path}/abs.py"]).model.file == f"{tmp_path}/abs.py"
    assert "model.file" not in C.Config().to_toml() and "extra" not in C.Config().to_toml()


@pytest.mark.parametrize("text,needle", [
    ('[model]\nkind = "python"\n', 'model.kind = "python" needs model.file'),
    ('[model]\nkind = "python"\nfile = ""\n', 'model.kind = "python" needs model.file'),
    ('[model]\nfile = "m.py"\n', 'model.file is only used with model.kind = "python" (this config has kind = "gpt")'),
    ('[model]\nwidth = 3\n', 'unknown key model.width; allowed in [model]: kind, n_layer'),
    ('[model]\nwidth = 3\n', 'your own keys need model.kind = "python"'),
    ('[model]\nkind = "python"\nfile = "m.py"\n[model.sub]\na = 1\n', "model.sub = {'a': 1}: your own [model] keys "
                                                                       "take numbers, strings, booleans or lists"),
    ('[model]\nkind = "python"\nfile = "m.py"\nn_embd = "wide"\n', "model.n_embd: expected integer, got 'wide'"),
])
def test_python_kind_errors(text, needle):
    assert needle in err(text)


@pytest.mark.parametrize("name", ["gpt3_tiny.toml", "paper_e6.toml", "makemore_mlp.toml", *MAKEMORE_CONFIGS.values()])
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
    ('[model]\nkind = "lstm"', "model.kind = 'lstm' is not one of: gpt, nanogpt, mlp, bigram, makemore_mlp, rnn, "
                               "gru, bow, transformer, python"),
    ('[data]\nformat = "csv"', "data.format = 'csv' is not one of: text, lines, words"),
    ('[model]\nactivation = "tanh"', "relu, gelu"),
    ('[train]\non_nonfinite = "ignore"', "stop, skip"),
    ('[train]\ndtype = "float16"', "float32, float64"),
    ("[data]\nval_fraction = 1.0", "val_fraction"),
    ("[data]\nval_fraction = 0", "val_fraction"),
    ("[optim]\nlr = -0.1", "optim.lr"),
    ("[optim]\nmomentum = 1.5", "optim.momentum"),
    ("[train]\nseed = -1", "train.seed must be >= 0"),
    ('[model]\nkind = "mlp"', 'needs data.format = "lines"'),
    ('[data]\ncorpus = "shakespeare"', "data.corpus = 'shakespeare' is not one of: tinyshakespeare, names, pydoc"),
    ("[train]\ngrad_accum = 0", "train.grad_accum must be >= 1, got 0"),
    ('[optim]\nschedule = "cos"', "optim.schedule = 'cos' is not one of: constant, cosine, linear"),
    ("[optim]\nwarmup_steps = -5", "optim.warmup_steps must be >= 0, got -5"),
    ("[optim]\ndecay_steps = -1", "optim.decay_steps must be >= 0, got -1"),
    ("[optim]\nlr_min = -1e-4", "optim.lr_min must be >= 0, got -0.0001"),
    ("[optim]\nlr = 1e-3\nlr_min = 2e-3", "optim.lr_min = 0.002 must be <= optim.lr (0.001)"),
    ('[optim]\nschedule = "linear"\nwarmup_steps = 50\ndecay_steps = 50',
     "optim.decay_steps = 50 must be greater than optim.warmup_steps (50) (or 0 = train.steps)"),
])
def test_bad_values(text, needle):
    assert needle in err(text)


def test_schedule_errors_name_the_override(tmp_path):
    msg = err((CONFIGS / "gpt3_tiny.toml").read_text(), ["optim.lr_min=0.01"], tmp_path)
    assert "c.toml" in msg and "optim.lr_min = 0.01 must be <= optim.lr (0.003)" in msg


def test_a_short_run_of_a_config_ends_within_its_warm_up():
    """--set train.steps=20 on a config with 100 warm-up steps: allowed, the learning rates are the warm-up's."""
    from btjit.train.schedule import for_config
    cfg = C.load(CONFIGS / "gpt3_tiny.toml", ["train.steps=20"])
    lr = for_config(cfg)
    assert [lr(i) for i in (0, 19)] == [0.003 * 1 / 101, 0.003 * 20 / 101]


def test_overrides_are_toml_values(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nsteps = 10\n")
    c = C.load(p, ["train.steps=20", "optim.lr=1e-2", "optim.betas=[0.8, 0.9]", 'model.activation="gelu"',
                   "data.path=some file.txt", "train.on_nonfinite=skip"])
    assert c.train.steps == 20 and c.optim.lr == 0.01 and c.optim.betas == (0.8, 0.9)
    assert c.model.activation == "gelu" and c.data.path == "some file.txt"
    assert c.train.on_nonfinite == "skip"


def test_an_override_reaches_a_key_of_a_table_in_a_section(tmp_path):
    """--set optim.hp.beta2=0.95 sets one key of [optim.hp], keeping the table's others."""
    p = tmp_path / "c.toml"
    p.write_text('[optim]\nname = "lion"\n[optim.hp]\nbeta1 = 0.8\n')
    c = C.load(p, ["optim.hp.beta2=0.95"])
    assert c.optim.hp == {"beta1": 0.8, "beta2": 0.95}
    assert C.load(tmp_path / "c.toml", ["optim.hp.beta1=0.7"]).optim.hp == {"beta1": 0.7}
    with pytest.raises(ConfigError, match=r"optim.name is not a table"):
        C.load(p, ["optim.name.x=1"])


@pytest.mark.parametrize("item,needle", [
    ("train.steps", "expected section.key=value"),
    ("steps=3", "must be section.key"),
    ("training.steps=3", "unknown section [training]"),
    ("train.stepz=3", "unknown key train.stepz"),
    ("train.steps=abc", "train.steps: expected integer, got 'abc'"),
    ("train.steps=0", "train.steps must be >= 1"),
    ("train.steps.x=1", "train.steps: expected integer"),
    ("train.foo.x=1", "unknown key train.foo"),
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
    c = C.loads('[model]\nn_layer = 2\n[data]\npath = "x.txt"\ncorpus = "pydoc"\n[optim]\nname = "adamw"\n'
                'betas = [0.8, 0.95]\nschedule = "linear"\nwarmup_steps = 10\nlr_min = 1e-5\n[train]\ngrad_accum = 3\n')
    assert C.Config.from_dict(c.to_dict()) == c
    assert C.loads(c.to_toml()) == c
    assert (c.data.corpus, c.optim.schedule, c.optim.warmup_steps, c.train.grad_accum) == ("pydoc", "linear", 10, 3)
    d = C.Config().to_dict()
    assert "path" not in d["data"] and "corpus" not in d["data"] and C.loads(C.Config().to_toml()) == C.Config()
