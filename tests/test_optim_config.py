"""The [optim] section for btjit.optim: every built-in by name, [optim.hp], decay = "matrices", [[optim.groups]]
(round trip through the run dir's TOML, errors), and the user's own optimizer file ([optim] file) through
`btjit train`: copied into the run dir, --resume bit-exact from the copy, `btjit export` of the run."""
import inspect

import numpy as np
import pytest

import btjit
from btjit.train import config as C
from btjit import runtime
from btjit.train.trainer import make_optimizer
from test_cli import assert_error, assert_same_state, final_state
from test_optim_user import TupleAdam
from test_usermodel import EXAMPLE, config, run
from textdata import words

PARAMS = {"wte": np.zeros((5, 3)), "w": np.zeros((3, 4)), "b": np.zeros(4), "ln": np.zeros(3)}

LION = '''
import numpy as np
import btjit


class MyLion(btjit.optim.Optimizer):
    def __init__(self, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, groups=groups)

    def init(self, name, param):
        return {"exp_avg": np.zeros_like(param)}

    def update(self, p, g, state, hp, step):
        m = state["exp_avg"]
        c = hp["beta1"] * m + (1 - hp["beta1"]) * g
        p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * ((c > 0) - (c < 0))
        return p, {"exp_avg": hp["beta2"] * m + (1 - hp["beta2"]) * g}
'''


def groups_of(opt):
    return [(names, {k: hp[k] for k in ("weight_decay", "lr_scale")})
            for names, hp in btjit.optim.resolve_groups(opt, PARAMS)]


def test_old_configs_build_the_same_optimizers():
    sgd = make_optimizer(C.loads('[optim]\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.01').optim)
    assert type(sgd) is btjit.optim.SGD and sgd.hp == {"lr": 0.1, "momentum": 0.9, "dampening": 0.0,
                                                       "weight_decay": 0.01} and not sgd.nesterov
    adamw = make_optimizer(C.loads('[optim]\nname = "adamw"\nbetas = [0.8, 0.9]\neps = 1e-6').optim)
    assert type(adamw) is btjit.optim.AdamW and adamw.hp == {"lr": 3e-4, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6,
                                                             "weight_decay": 0.0}


@pytest.mark.parametrize("name", sorted(btjit.optim.BUILTIN))
def test_every_builtin_by_name_with_its_own_arguments(name):
    hp = {"rmsprop": "centered = true\nalpha = 0.9", "sgd": "nesterov = true", "adagrad": "lr_decay = 0.1",
          "adadelta": "rho = 0.8", "lion": "betas = [0.95, 0.98]"}.get(name, "")
    cfg = C.loads(f'[optim]\nname = "{name}"\nlr = 0.01\nmomentum = 0.5\n[optim.hp]\n{hp}')
    opt = make_optimizer(cfg.optim)
    assert type(opt) is btjit.optim.BUILTIN[name] and opt.hp["lr"] == 0.01
    assert (getattr(opt, "centered", None), getattr(opt, "nesterov", None)) == \
        ((True, None) if name == "rmsprop" else (None, True) if name == "sgd" else (None, None))
    assert C.loads(cfg.to_toml()) == cfg


def test_decay_matrices_and_groups_round_trip():
    cfg = C.loads('[optim]\nname = "adamw"\nweight_decay = 0.1\ndecay = "matrices"')
    assert groups_of(make_optimizer(cfg.optim)) == [(["wte", "w"], {"weight_decay": 0.1, "lr_scale": 1.0}),
                                                    (["b", "ln"], {"weight_decay": 0.0, "lr_scale": 1.0})]
    text = ('[optim]\nname = "adamw"\nweight_decay = 0.1\n[[optim.groups]]\nparams = "w.*"\n'
            '[[optim.groups]]\nparams = ["b", "ln"]\nweight_decay = 0.0\nlr_scale = 2.0\n')
    cfg = C.loads(text)
    assert C.loads(cfg.to_toml()) == cfg and cfg.optim.groups[1] == {"params": ["b", "ln"], "weight_decay": 0.0,
                                                                      "lr_scale": 2.0}
    assert groups_of(make_optimizer(cfg.optim)) == [(["wte", "w"], {"weight_decay": 0.1, "lr_scale": 1.0}),
                                                    (["b", "ln"], {"weight_decay": 0.0, "lr_scale": 2.0})]
    named = C.loads('[optim]\n[optim.groups.mats]\nparams = "w.*"\n[optim.groups.rest]\nparams = "b|ln"\n')
    assert [g["params"] for g in named.optim.groups] == ["w.*", "b|ln"]


@pytest.mark.parametrize("text,msg", [
    ('[optim]\ndecay = "2d"', "optim.decay = '2d' is not one of: all, matrices"),
    ('[optim]\nname = "adafactor"', "optim.name = 'adafactor' is not one of: sgd, adam"),
    ('[optim]\ndecay = "matrices"\n[[optim.groups]]\nparams = "w"', "use one of them"),
    ('[optim]\n[[optim.groups]]\nweight_decay = 0.1', r"optim.groups\[0\] needs params = a regex"),
    ('[optim]\n[[optim.groups]]\nparams = "w"\nweight_decay = "x"', r"optim.groups\[0\].weight_decay = 'x'"),
    ('[optim]\n[optim.hp]\nnesterov = "yes"', "optim.hp.nesterov = 'yes': takes a number"),
    ("[optim]\nclip_value = -1", "optim.clip_value must be >= 0"),
])
def test_bad_optim_tables_are_named(text, msg):
    with pytest.raises(C.ConfigError, match=msg):
        C.loads(text)


def test_an_argument_the_optimizer_does_not_take_is_a_config_error():
    with pytest.raises(C.ConfigError,
                       match=r"\[optim\]: optim.hp.rho: SGD takes no argument 'rho' \(its arguments: lr, momentum"):
        make_optimizer(C.loads('[optim]\n[optim.hp]\nrho = 0.5').optim)


@pytest.fixture
def lion_setup(tmp_path):
    (tmp_path / "mymodel.py").write_text(EXAMPLE)
    (tmp_path / "mylion.py").write_text(LION)
    (tmp_path / "c.toml").write_text(config() + 'file = "mylion.py"\nweight_decay = 0.1\n'
                                     '[[optim.groups]]\nparams = ".*"\nlr_scale = 0.5\n[optim.hp]\nbeta2 = 0.98\n')
    (tmp_path / "words.txt").write_text(words())
    return tmp_path / "c.toml", tmp_path / "words.txt", tmp_path


def test_a_user_optimizer_file_trains_resumes_bit_exact_and_exports(lion_setup):
    cfg, data, tmp = lion_setup
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    res = run("train", cfg, "--data", data, "--out", tmp / "b", "--set", "train.steps=13")
    assert res.exit_code == 0, res.output
    assert (tmp / "b" / "mylion.py").read_text() == LION
    (tmp / "mylion.py").write_text(LION.replace("(c > 0) - (c < 0)", "c"))      # edited: the run's copy is used
    assert run("train", cfg, "--data", data, "--out", tmp / "b", "--resume").exit_code == 0
    a, b = final_state(tmp / "a"), final_state(tmp / "b")
    assert_same_state(a, b)
    assert b.meta["optimizer_file"]["source"] == LION and "opt/exp_avg" in b.state
    res = run("export", tmp / "b", tmp / "e", "--data", data)
    assert res.exit_code == 0, res.output
    rt = runtime.load(tmp / "e")
    assert rt.optimizer["type"] == "MyLion" and rt.hp["beta2"] == np.float32(0.98) and rt.step_count == 30
    assert rt.hp["lr_scale"] == 0.5
    (tmp / "b" / "mylion.py").unlink()
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "b", "--resume", "--set", "train.steps=40"),
                 "the run's copy of the optimizer file", "mylion.py", "is missing")


def test_an_optimizer_file_without_one_optimizer_is_named(lion_setup):
    cfg, data, tmp = lion_setup
    (tmp / "mylion.py").write_text("import btjit\n")
    assert_error(run("train", cfg, "--data", data, "--out", tmp / "x"),
                 "mylion.py must define one btjit.optim.Optimizer subclass, found 0")


def test_a_tuple_hyper_parameter_from_the_config(tmp_path):
    """[optim.hp] betas = [0.9, 0.95] reaches a user's torch-style Adam (test_optim_user's TupleAdam) as a tuple:
    the banner shows it, the checkpoint holds its two slots."""
    (tmp_path / "mymodel.py").write_text(EXAMPLE)
    (tmp_path / "myadam.py").write_text("import numpy as np\nimport btjit\n\n\n" + inspect.getsource(TupleAdam))
    (tmp_path / "c.toml").write_text(config() + 'file = "myadam.py"\n[optim.hp]\nbetas = [0.9, 0.95]\n')
    (tmp_path / "words.txt").write_text(words())
    res = run("train", tmp_path / "c.toml", "--data", tmp_path / "words.txt", "--out", tmp_path / "a")
    assert res.exit_code == 0, res.output
    assert "TupleAdam (myadam.py)" in res.output and "betas (0.9, 0.95)" in res.output
    st = final_state(tmp_path / "a").state
    assert {"opt/m", "opt/v"} <= set(st) and np.isclose(st["opt/hyper"], 0.95).any()
