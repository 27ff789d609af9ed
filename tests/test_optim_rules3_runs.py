"""Update rules of tests/optim_rules3.py in runs: SGLD's noise (btjit.randn_like) seeded and bit-exact across a
state_dict round trip; three rules through `btjit train` ([optim] file), interrupted and resumed bit for bit; a
per-param rule exported and run by btjit.runtime bitwise; a per-param rule in precision="bf16"; states of one
number per param (0-d: reductions see one number); float32 schedules near 1 (AdEMAMix's beta3) against float64;
numpy's functions in a rule against numpy; and the errors a rule's author hits, each naming the line."""
import inspect
import math

import numpy as np
import pytest

import btjit
import btjit.runtime
import optim_rules3 as R
from btjit.optim import Optimizer, OptimizerError
from optim_rules3 import NO_WD, SHAPES, close, run, trace
from test_cli import assert_error, assert_same_state, final_state
from test_optim_perparam import same_in_runtime
from test_usermodel import EXAMPLE, config, run as cli
from textdata import words


class Rule(Optimizer):
    """update = rule(p, g, s, hp, step) with init's state `init(p)`: one idiom a test."""

    def __init__(self, rule, init=None, lr=0.01, **hp):
        super().__init__(lr=lr, **{"beta": 0.999, **hp})
        self.rule, self._init = rule, init or (lambda p: {})

    def init(self, name, p):
        return self._init(p)

    def update(self, p, g, s, hp, step):
        return self.rule(p, g, s, hp, step)


def same_code_in_numpy(opt, grads, dtype):
    """opt's own update run on numpy arrays (numpy's meaning of the code is the reference) from init's state."""
    p = R.params0(dtype)
    s = {k: {n: np.asarray(v, dtype) for n, v in opt.init(k, v).items()} for k, v in p.items()}
    for t, g in enumerate(grads, 1):
        hp = {"lr": opt.hp["lr"] / (2 if t > R.CHANGE else 1), "beta": 0.999}
        for k in p:
            p[k], s[k] = opt.update(p[k], g[k], s[k], hp, t)
    return p, s


IDIOMS = {   # numpy functions a rule uses: matrix norms, all / any, fmax, copysign, median, vdot, trace, a 0-d state
    "norms": (lambda p, g, s, hp, t: (p - hp["lr"] * g / (np.linalg.norm(g, np.inf) if g.ndim == 2 else np.linalg.norm(
        g.ravel(), 3)), {}), None),
    "masks": (lambda p, g, s, hp, t: (p - hp["lr"] * np.where(np.all(np.isfinite(g)) & ~np.any(g > 50), np.fmax(
        g, -0.01) + np.copysign(0.001, g), 0.0), {}), None),
    "median": (lambda p, g, s, hp, t: (p - hp["lr"] * np.where(np.abs(g) >= np.median(np.abs(g)), g, 0.0), {}), None),
    "vdot_trace": (lambda p, g, s, hp, t: (p - hp["lr"] * g / (1 + np.vdot(g, g) + (np.trace(g @ g.T) if g.ndim == 2
                                                                                      else 0.0)), {}), None),
    "sum_of_0d_state": (lambda p, g, s, hp, t: (p - hp["lr"] * g / np.sqrt(s["n"].sum()),
                                                {"n": s["n"] + (g * g).sum()}), lambda p: {"n": 1.0}),
    "0d_state_widened": (lambda p, g, s, hp, t: (p - hp["lr"] * s["m"], {"m": 0.9 * s["m"] + g}), lambda p: {"m": 0.0}),
}


@pytest.mark.parametrize("name", list(IDIOMS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_numpy_idioms_in_a_rule_are_numpys(name, dtype):
    prog, grads, _ = run(Rule(*IDIOMS[name]), dtype)
    want, state = same_code_in_numpy(Rule(*IDIOMS[name]), grads, dtype)
    for k in SHAPES:
        close(prog.params[k], want[k], dtype, k)
        for n, v in state[k].items():
            assert prog.opt_state[n][k].shape == np.shape(v)          # a 0-d state is one number; widened: p's shape
            close(prog.opt_state[n][k], v, dtype, f"{n} of {k}")


class ClippedSGLD(R.SGLD):
    """SGLD with the gradient clipped to norm 1 per param: a per-param rule that draws noise."""

    def update(self, p, g, s, hp, step):
        noise = btjit.randn_like(p) * np.sqrt(hp["lr"] * hp["temperature"])
        return p - hp["lr"] / 2 * g / np.maximum(np.linalg.norm(g), 1.0) + noise, {}


@pytest.mark.parametrize("cls", [R.SGLD, ClippedSGLD])
def test_sgld_noise_is_seeded_and_bit_exact_across_a_state_dict(cls):
    opt = lambda: cls(lr=0.01, temperature=0.5, groups=NO_WD)                     # noqa: E731
    a, grads, _ = run(opt(), np.float32, prog=trace(opt(), np.float32, seed=3))
    b, _, _ = run(opt(), np.float32, prog=trace(opt(), np.float32, seed=3))
    c, _, _ = run(opt(), np.float32, prog=trace(opt(), np.float32, seed=4))
    half, _, _ = run(opt(), np.float32, steps=9, prog=trace(opt(), np.float32, seed=3))
    resumed = trace(opt(), np.float32, seed=3)
    resumed.load_state_dict(half.state_dict())
    run(None, np.float32, prog=resumed, start=9)
    for k in SHAPES:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)
        np.testing.assert_array_equal(resumed.params[k], a.params[k], err_msg=k)
        assert not np.array_equal(c.params[k], a.params[k]), k
    # the noise: what the step added beyond the gradient's part, N(0, lr * temperature) per element
    one = trace(opt(), np.float64, seed=5)
    one.step(*R.data(np.float64, 1)[0])
    g = {k: v / (np.maximum(np.linalg.norm(v), 1.0) if cls is ClippedSGLD else 1.0) for k, v in one.grads.items()}
    lr = {k: 0.01 * (0.5 if len(s) < 2 else 1.0) for k, s in SHAPES.items()}
    z = np.concatenate([((one.params[k] - R.params0(np.float64)[k] + lr[k] / 2 * g[k]) / np.sqrt(lr[k] * 0.5)).ravel()
                        for k in SHAPES])
    assert abs(z.mean()) < 0.3 and 0.8 < z.std() < 1.2, (z.mean(), z.std())


def rule_file(cls):
    """An optimizer file: the imports, the rule class and the helper it uses."""
    return ("import numpy as np\n\nimport btjit\nfrom btjit.optim import Optimizer\n\n\n" + inspect.getsource(R.zeros)
            + "\n\n" + inspect.getsource(cls) + ("\n\n" + inspect.getsource(R.adam) if "adam(" in
                                                 inspect.getsource(cls) else ""))


@pytest.mark.parametrize("cls,section", [
    (R.ScheduleFreeAdamW, 'weight_decay = 0.01\n[optim.hp]\nwarmup_steps = 4\nbetas = [0.9, 0.99]\n'),
    (R.CentralizedAdam, '[[optim.groups]]\nparams = "w.*|head"\n[[optim.groups]]\nparams = ["b", "h0"]\n'
                        'lr_scale = 0.5\n'),
    (R.LARS, 'weight_decay = 0.01\n[[optim.groups]]\nparams = "b|h0"\nadapt = 0.0\nweight_decay = 0.0\n'
             '[[optim.groups]]\nparams = "w.*|head"\n'),
], ids=["schedule_free", "centralized", "lars"])
def test_a_rule_file_trains_and_resumes_bit_exact(cls, section, tmp_path):
    (tmp_path / "mymodel.py").write_text(EXAMPLE)
    (tmp_path / "rule.py").write_text(rule_file(cls))
    (tmp_path / "c.toml").write_text(config() + 'file = "rule.py"\n' + section)
    (tmp_path / "words.txt").write_text(words())
    args = ("train", tmp_path / "c.toml", "--data", tmp_path / "words.txt", "--out")
    res = cli(*args, tmp_path / "a")
    assert res.exit_code == 0, res.output
    assert cli(*args, tmp_path / "b", "--set", "train.steps=13").exit_code == 0
    assert cli(*args, tmp_path / "b", "--resume").exit_code == 0
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert_same_state(a, b)
    assert a.step == 30 and f"{cls.__name__} (rule.py)" in res.output
    assert set(cls().init("w", np.zeros((2, 2)))) <= {k[len("opt/"):] for k in a.state}


def test_a_rule_files_errors_name_the_file_and_line(tmp_path):
    src = rule_file(R.CentralizedAdam).replace('hp["eps"]', 'hp["epsilon"]')
    (tmp_path / "mymodel.py").write_text(EXAMPLE)
    (tmp_path / "rule.py").write_text(src)
    (tmp_path / "c.toml").write_text(config() + 'file = "rule.py"\n')
    (tmp_path / "words.txt").write_text(words())
    line = next(i for i, text in enumerate(src.splitlines(), 1) if "epsilon" in text)
    assert_error(cli("train", tmp_path / "c.toml", "--data", tmp_path / "words.txt", "--out", tmp_path / "a"),
                 f"error: rule.py:{line}: tracing its init and update raised UnknownHyperParameter: CentralizedAdam"
                 f".update reads hp['epsilon']", f"— rule.py:{line}")


@pytest.mark.parametrize("make", [lambda: R.CentralizedAdam(0.01, groups=NO_WD), lambda: R.AdaGradNorm(0.1)],
                         ids=["centralized", "adagrad_norm"])
def test_a_per_param_rule_exports_and_runs_in_the_runtime_bitwise(make, tmp_path):
    prog = trace(make(), np.float32)
    prog.export(tmp_path / "e")
    same_in_runtime(prog, btjit.runtime.load(tmp_path / "e"), R.data(np.float32, 8), 4, prog.lr / 2)


def test_a_per_param_rule_trains_in_bf16():
    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(16, 32)) * 0.3, "b1": np.zeros(32), "w2": rng.normal(size=(32, 16)) * 0.3}
    x = rng.normal(size=(32, 16)).astype(np.float32)
    y = np.sin(x)

    def loss(p, x, y):
        return btjit.mean((np.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)
    opts = [R.LAMB(0.01, weight_decay=0.01, groups=R.GROUPS), R.CentralizedAdam(0.01)]
    for opt in opts:
        prog = btjit.trace(loss, {k: v.astype(np.float32) for k, v in p.items()}, x, y, optimizer=opt,
                           precision="bf16")
        assert prog.precision.startswith("bf16")
        losses = [float(prog.step(x, y)) for _ in range(40)]
        assert losses[-1] < 0.5 * losses[0] and np.all(np.isfinite(losses))


SCHEDULES = [  # 1 - a schedule near 1 made of a hyper-parameter (beta 0.9999), in float32 against float64
    (lambda b, t: 1 - np.minimum(np.exp(np.log(0.9) * np.log(b) / ((1 - t / 8) * np.log(b) + t / 8 * np.log(0.9))), b),
     lambda b, t: 1 - min(math.exp(math.log(0.9) * math.log(b) / ((1 - t / 8) * math.log(b) + t / 8 * math.log(0.9))),
                          b)),                                          # AdEMAMix's beta3 warm-up, the paper's
    (lambda b, t: 1 - np.where(t < 8, 0.5 ** (1 / (np.log(0.5) / np.log(b + 1e-8) + 1)), b),
     lambda b, t: 1 - (0.5 ** (1 / (math.log(0.5) / math.log(b + 1e-8) + 1)) if t < 8 else b)),   # by half-life
    (lambda b, t: 1 - b * np.maximum(b, 0.5) ** t, lambda b, t: 1 - b ** (t + 1)),
    (lambda b, t: 1 - (b + 1e-8) ** 2, lambda b, t: 1 - (b + 1e-8) ** 2),
]


@pytest.mark.parametrize("i", range(len(SCHEDULES)))
def test_one_minus_a_schedule_near_one_is_accurate_in_float32(i):
    """float32's 0.9999 is 0.99989998: 1 - it is 1.7e-4 off, and an EMA started at zero (AdEMAMix's slow one) with
    it; each value near 1 that a schedule makes of a hyper-parameter keeps its complement exactly enough."""
    rule, want = SCHEDULES[i]
    prog = trace(Rule(lambda p, g, s, hp, t: (p * 0 + rule(hp["beta"], t), {}), beta=0.9999), np.float32)
    for t in (1, 3, 7, 8, 12):
        prog.step_count = t - 1
        prog.step(*R.data(np.float32, 1)[0])
        np.testing.assert_allclose(prog.params["b2"], want(0.9999, t), rtol=2e-6, err_msg=str(t))


ERRORS = [  # (rule, init, the error's text): each names the line (the rule's; init's def or update's where named)
    (lambda p, g, s, hp, t: (p - g, {"P": s["P"] + np.outer(g, g)}), lambda p: {"P": np.eye(p.size) if p.ndim == 1
                                                                                else np.zeros_like(p)},
     r"Rule.init\('b1'\): state 'P' has shape \(12, 12\), the param \(12,\); a state has at most its param's"),
    (lambda p, g, s, hp, t: ((p - hp["lr"] * g).T, {}), None,
     r"Rule.update for param 'w1': the new param has shape \(4, 3, 6\), not \(6, 3, 4\)"),
    (lambda p, g, s, hp, t: (p - hp["lr"] * hp["momentum"] * g, {}), None,
     r"reads hp\['momentum'\], which is not a hyper-parameter .* super\(\).__init__\(momentum=...\)"),
    (lambda p, g, s, hp, t: (p - hp["lr"] * g if g.sum() > 0 else p, {}), None, r"bool\(\) \(an if.*np.where"),
    (lambda p, g, s, hp, t: (p - hp["lr"] * g / float(g.max()), {}), None, r"float\(\) \(or a math"),
    (lambda p, g, s, hp, t: (p - s["m"], {}), None, r"Rule.update reads state\['m'\]; init gave param 'w1' no state"),
    (lambda p, g, s, hp, t: p - hp["lr"] * g, None,
     r"must return \(new_param, \{state name: new value\}\), got a traced value of shape \(6, 3, 4\)"),
    (lambda p, g, s, hp, t: (p, {"m": g}), lambda p: {"m": None},
     r"Rule.init\('w1'\): state 'm' is None, not a number"),
    (lambda p, g, s, hp, t: (p - hp["lr"] * g + 0.01 * np.random.randn(*p.shape), {}), None,
     r"Rule.update calls np.random.randn, which draws its numbers once, .* Use btjit.randn_like\(p\)"),
]


@pytest.mark.parametrize("rule,init,msg", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_a_rules_errors_name_its_line(rule, init, msg):
    at = (Rule.init if msg.startswith(r"Rule.init") else Rule.update if "must return" in msg else
          rule).__code__.co_firstlineno
    with pytest.raises((OptimizerError, btjit.TraceError), match=rf"{msg}.* — test_optim_rules3_runs.py:{at}$"):
        trace(Rule(rule, init), np.float64)
