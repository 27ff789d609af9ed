"""Update rules a user writes against btjit.optim.Optimizer (tests/optim_zoo.py: torch.optim's NAdam, RAdam,
Adamax, Rprop, ASGD; Signum, AdaBelief, Adan, SGDW, an error-feedback SGD, Lion) against torch.optim and numpy
transcriptions over 20 steps with two param groups (weight decay, lr_scale) and a hyper-parameter changed
mid-run, in float64 (1e-12) and float32 (1e-6); the built-in NAdam, RAdam and Adamax against torch.optim;
state_dict / checkpoint round trips mid-run and an export run by btjit.runtime, bit for bit; the idioms
update rules are written with (& | ~ on masks, np.isfinite, hp ** step in float32) and the errors for those
btjit cannot trace (Python's max() and if, math.*, %), naming the line."""
import contextlib
import math

import numpy as np
import pytest

import btjit
import btjit.optim as O
import btjit.runtime
import btjit.train.checkpoint as K
import optim_zoo as Z
from test_optim import SHAPES, batches, close, loss, params0

STEPS, CHANGE = 20, 10          # hyper-parameters change before step CHANGE + 1
GROUPS = [{"params": lambda name, shape: len(shape) >= 2, "weight_decay": 0.1},
          {"params": ["b", "g"], "weight_decay": 0.0, "lr_scale": 0.5}]
GROUP_NAMES = [["w", "e"], ["b", "g"]]
NO_WD = [{k: v for k, v in g.items() if k != "weight_decay"} for g in GROUPS]
TOL = {np.float64: 1e-12, np.float32: 1e-6}


def run(opt, dtype, change=None, steps=STEPS, prog=None, start=0):
    """btjit over batches [start, steps), prog.hp updated by `change` before step CHANGE + 1."""
    if prog is None:
        p0 = {k: v.astype(dtype) for k, v in params0().items()}
        prog = btjit.trace(loss, p0, *[b.astype(dtype) for b in batches(1)[0]], optimizer=opt, dtype=dtype)
    for t, b in enumerate(batches(steps)[start:], start):
        if t == CHANGE and change:
            for k, v in change.items():
                prog.hp[k] = v
        prog.step(*[x.astype(dtype) for x in b])
    return prog


@contextlib.contextmanager
def torch_dtype(torch, dtype):
    """torch keeps NAdam's mu_product and ASGD's eta, mu in the default dtype: float64 for a float64 run."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if dtype == np.float64 else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def torch_run(cls, kw, lr, groups, dtype, change=None):
    torch = pytest.importorskip("torch")
    with torch_dtype(torch, dtype):
        p = {k: torch.tensor(v.astype(dtype)) for k, v in params0().items()}
        tg = [{"params": [p[n] for n in names], "lr": lr * g.get("lr_scale", 1.0),
               **({"weight_decay": g["weight_decay"]} if "weight_decay" in g else {})}
              for names, g in zip(GROUP_NAMES, groups)]
        opt = getattr(torch.optim, cls)(tg, lr=lr, foreach=False, **kw)
        for t, b in enumerate(batches(STEPS)):
            if t == CHANGE and change:
                for pg in opt.param_groups:
                    pg.update(change)
            for k, a in zip(SHAPES, b):                  # test_optim's loss: grad_k = a_k + p_k
                p[k].grad = torch.tensor(a.astype(dtype)) + p[k]
            opt.step()
    return {k: v.numpy() for k, v in p.items()}, {k: {s: np.asarray(v) for s, v in opt.state[p[k]].items()}
                                                   for k in p}


def check(prog, want, state, dtype):
    for k in SHAPES:
        close(prog.params[k], want[k], TOL[dtype], k)
        for s, views in prog.opt_state.items():        # torch's per-param numbers (mu_product) broadcast
            close(views[k], np.broadcast_to(state[k][s], SHAPES[k]), TOL[dtype], f"{s} of {k}")


# (user rule, its kwargs, torch's class and kwargs, groups, (btjit's, torch's) hyper-parameters changed mid-run)
USER_VS_TORCH = [
    (Z.NAdam, dict(lr=0.01, betas=(0.8, 0.99)), ("NAdam", dict(betas=(0.8, 0.99))), GROUPS,
     ({"betas": (0.9, 0.95)}, {"betas": (0.9, 0.95)})),
    (Z.RAdam, dict(lr=0.01), ("RAdam", {}), GROUPS, ({"betas": (0.8, 0.99)}, {"betas": (0.8, 0.99)})),
    (Z.Adamax, dict(lr=0.01), ("Adamax", {}), GROUPS, ({"eps": 1e-3}, {"eps": 1e-3})),
    (Z.Rprop, dict(lr=0.01, step_sizes=(1e-6, 0.05)), ("Rprop", dict(step_sizes=(1e-6, 0.05))), NO_WD,
     ({"etas": (0.3, 1.5)}, {"etas": (0.3, 1.5)})),
    (Z.ASGD, dict(lr=0.05, lambd=0.01, t0=5), ("ASGD", dict(lambd=0.01, t0=5)), GROUPS,
     ({"alpha": 0.5}, {"alpha": 0.5})),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", USER_VS_TORCH, ids=[c[0].__name__ for c in USER_VS_TORCH])
def test_user_rule_matches_torch(case, dtype):
    cls, kw, (tcls, tkw), groups, (change, tchange) = case
    prog = run(cls(**kw, groups=groups), dtype, change)
    want, state = torch_run(tcls, tkw, kw["lr"], groups, dtype, tchange)
    check(prog, want, state, dtype)
    assert prog.hp["lr"] == dtype(kw["lr"]) and prog.step_count == STEPS


BUILTIN_VS_TORCH = [
    ("NAdam", dict(lr=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, betas=(0.8, 0.99), momentum_decay=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    ("NAdam", dict(lr=0.01, maximize=True)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1)),
    ("RAdam", dict(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True)),
    ("RAdam", dict(lr=0.01, maximize=True)),
    ("Adamax", dict(lr=0.01, weight_decay=0.1)),
    ("Adamax", dict(lr=0.01, betas=(0.5, 0.9), eps=1e-3, maximize=True)),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("cls,kw", BUILTIN_VS_TORCH, ids=[f"{c}{i}" for i, (c, _) in enumerate(BUILTIN_VS_TORCH)])
def test_builtin_matches_torch(cls, kw, dtype):
    groups = [{**g, "weight_decay": g["weight_decay"] * kw.get("weight_decay", 0.0) * 10} for g in GROUPS]
    prog = run(getattr(O, cls)(**kw, groups=groups), dtype, {"beta1": 0.7})
    betas = kw.get("betas", (0.9, 0.999))
    want, state = torch_run(cls, {k: v for k, v in kw.items() if k not in ("lr", "weight_decay")}, kw["lr"], groups,
                            dtype, {"betas": (0.7, betas[1])})
    check(prog, want, state, dtype)
    assert prog.hp.groups[0]["weight_decay"] == dtype(groups[0]["weight_decay"]) and prog.hp["beta1"] == dtype(0.7)


def test_builtins_are_exported_named_and_checked():
    assert {"NAdam", "RAdam", "Adamax"} <= set(O.__all__)
    assert {O.BUILTIN[k] for k in ("nadam", "radam", "adamax")} == {O.NAdam, O.RAdam, O.Adamax}
    with pytest.raises(O.OptimizerError, match="NAdam: Invalid momentum_decay value: -0.1"):
        O.NAdam(momentum_decay=-0.1)
    with pytest.raises(O.OptimizerError, match=r"RAdam: betas must be a pair of numbers"):
        O.RAdam(betas=0.9)
    with pytest.raises(O.OptimizerError, match="Adamax: Invalid epsilon value"):
        O.Adamax(eps=-1.0)


# (user rule, its kwargs, numpy transcription, groups)
USER_VS_NUMPY = [
    (Z.Signum, dict(lr=0.01), Z.signum, GROUPS),
    (Z.Signum, dict(lr=0.01, momentum=0.0), Z.signum, GROUPS),          # signSGD
    (Z.AdaBelief, dict(lr=0.01, eps=1e-12), Z.adabelief, GROUPS),
    (Z.Adan, dict(lr=0.01), Z.adan, GROUPS),
    (Z.SGDW, dict(lr=0.01), Z.sgdw, GROUPS),
    (Z.ErrorFeedbackSGD, dict(lr=0.01, threshold=1.0), Z.error_feedback_sgd, NO_WD),
    (Z.HandLion, dict(lr=0.01), Z.lion, GROUPS),
    (Z.LookaheadSGD, dict(lr=0.1, k=3), Z.lookahead_sgd, NO_WD),
    (Z.Yogi, dict(lr=0.01), Z.yogi, NO_WD),
]


def numpy_run(fn, opt, dtype):
    """fn's steps in dtype (hyper-parameters Python floats, as torch's), opt's groups, the hp change at CHANGE."""
    groups = [(names, {**hp, "lr": hp["lr"] * hp["lr_scale"]}) for names, hp in O.resolve_groups(opt, params0())]
    p = {k: v.astype(dtype) for k, v in params0().items()}
    st = {k: {s: np.asarray(a, dtype) for s, a in opt.init(k, v).items()} for k, v in p.items()}
    for t, b in enumerate(batches(STEPS), 1):
        for names, hp in groups:
            hp["lr"] = hp["lr"] * (0.5 if t == CHANGE + 1 else 1.0)
            for k, a in zip(SHAPES, b):
                if k in names:
                    p[k] = fn(p[k], a.astype(dtype) + p[k], st[k], hp, t).astype(dtype)
    return p, st


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", USER_VS_NUMPY, ids=[f"{c[0].__name__}{i}" for i, c in enumerate(USER_VS_NUMPY)])
def test_user_rule_matches_numpy(case, dtype):
    cls, kw, fn, groups = case
    prog = run(cls(**kw, groups=groups), dtype, {"lr": kw["lr"] * 0.5})    # prog.lr halved mid-run
    want, state = numpy_run(fn, cls(**kw, groups=groups), dtype)
    check(prog, want, state, dtype)


@pytest.mark.parametrize("make", [lambda: Z.NAdam(lr=0.01, weight_decay=0.1, groups=GROUPS),
                                  lambda: O.RAdam(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1),
                                  lambda: Z.Rprop(lr=0.01, groups=NO_WD)], ids=["user_nadam", "radam", "user_rprop"])
def test_state_dict_and_checkpoint_mid_run_continue_bit_exact(make, tmp_path):
    whole = run(make(), np.float32, {"lr": 0.005})
    first = run(make(), np.float32, {"lr": 0.005}, steps=CHANGE + 3)
    path = K.save(tmp_path, CHANGE + 3, first.state_dict(), {"rng_state": None})
    from_checkpoint, from_state_dict = run(make(), np.float32, steps=0), run(make(), np.float32, steps=0)
    from_checkpoint.load_state_dict(K.load(path).state)
    from_state_dict.load_state_dict(first.state_dict())
    first.load_state_dict(first.state_dict())                   # a round trip onto itself
    for resumed in (from_checkpoint, from_state_dict, first):
        assert resumed.step_count == CHANGE + 3 and resumed.lr == np.float32(0.005)
        run(None, np.float32, prog=resumed, start=CHANGE + 3)
        for k in SHAPES:
            np.testing.assert_array_equal(resumed.params[k], whole.params[k], err_msg=k)
        ref, got = whole.state_dict(), resumed.state_dict()
        assert ref.keys() == got.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_user_rule_exports_and_runs_in_the_runtime(tmp_path):
    bs = batches(6)
    prog = run(Z.ASGD(lr=0.05, lambd=0.01, t0=2, weight_decay=0.01, groups=GROUPS), np.float64, steps=0)
    prog.export(tmp_path / "e")
    rt = btjit.runtime.load(tmp_path / "e")
    assert rt.optimizer["type"] == "ASGD" and rt.hp["t0"] == 2.0
    for i, b in enumerate(bs):
        if i == 3:
            prog.hp["alpha"] = rt.hp["alpha"] = 0.5
        assert rt.step(*b) == prog.step(*b)
    ref, mine = prog.state_dict(), rt.state_dict()
    assert ref.keys() == mine.keys() and "opt/ax" in ref
    for k in ref:
        np.testing.assert_array_equal(mine[k], ref[k], err_msg=k)


class Rule(O.Optimizer):
    """new param = rule(p, g, hp, step) (no state): the idioms below, one per rule."""

    def __init__(self, rule, lr=0.1, beta=0.999):
        super().__init__(lr=lr, beta=beta)
        self.rule = rule

    def update(self, p, g, state, hp, step):
        return self.rule(p, g, hp, step), {}


def one_step(rule, dtype="float64", **kw):
    prog = btjit.trace(loss, params0(), *batches(1)[0], optimizer=Rule(rule, **kw), dtype=dtype)
    prog.step(*batches(1)[0])
    return prog, {k: a + p for (k, p), a in zip(params0().items(), batches(1)[0])}      # the gradients


@pytest.mark.parametrize("rule,want", [
    (lambda p, g, hp, t: np.where((g > 0) & (p > 0), 1.0, 0.0), lambda p, g: (g > 0) & (p > 0)),
    (lambda p, g, hp, t: np.where((g > 0) | ~(p > 0), 1.0, 0.0), lambda p, g: (g > 0) | ~(p > 0)),
    (lambda p, g, hp, t: np.where((g > 0) ^ (p > 0), 1.0, 0.0), lambda p, g: (g > 0) ^ (p > 0)),
    (lambda p, g, hp, t: 1.0 * np.logical_and(g > 0, np.logical_not(p > 0)), lambda p, g: (g > 0) & (p <= 0)),
    (lambda p, g, hp, t: np.logical_or(g > 1, p > 1) + np.logical_xor(g > 0, True), lambda p, g: (
        (g > 1) | (p > 1)) + (g <= 0)),
    (lambda p, g, hp, t: np.isfinite(g / (p > 0)) + 2 * np.isinf(g / (p > 0)) + 4 * np.isnan(p / (p > 0) * 0),
     lambda p, g: (p > 0) + 2 * (p <= 0) + 4 * (p <= 0)),
])
def test_masks_combine_as_numpys_bools(rule, want):
    with np.errstate(all="ignore"):
        prog, g = one_step(rule)
        for k, p in params0().items():
            np.testing.assert_array_equal(prog.params[k], want(p, g[k]).astype(np.float64), err_msg=k)


def test_hp_to_the_step_and_one_minus_it_are_accurate_in_float32():
    """float32(0.999) ** t is 1.3e-5 * t off relatively, and 1 - it kept only its rounding's digits (RAdam's rho_t
    and Adam's bias correction were 1e-5 off torch's); built from the exact 1 - beta slot they are an ulp or two."""
    rules = [(lambda p, g, hp, step: 1 - hp["beta"] ** step, lambda t, b: 1 - np.float64(b) ** t, 3e-7),
             (lambda p, g, hp, step: hp["beta"] ** (step * 100.0), lambda t, b: np.float64(b) ** (100 * t),
              2e-6)]                                # exp(y) of a y up to 20: y's rounding
    for (rule, want, rtol), beta in [(r, b) for r in rules for b in (0.999, 0.5, 0.0, 1.0, 1.5, -0.5)]:
        x = [a.astype(np.float32) for a in batches(1)[0]]
        prog = btjit.trace(loss, {k: v.astype(np.float32) for k, v in params0().items()}, *x, dtype="float32",
                           optimizer=Rule(rule, beta=beta))
        for t in (1, 2, 3, 201):                    # 0.5 ** 201 underflows, 1.5 ** 201 overflows
            prog.step_count = t - 1
            prog.step(*x)
            with np.errstate(all="ignore"):
                np.testing.assert_allclose(prog.params["w"], np.float32(want(t, beta)), rtol=rtol,
                                           err_msg=f"{beta} {t}")
    adam = run(O.Adam(lr=0.01, groups=GROUPS), np.float32)       # the one-pass kernel's corrections too
    want, _ = torch_run("Adam", {}, 0.01, GROUPS, np.float32)
    for k in SHAPES:                                             # elementwise (was 1.2e-4)
        np.testing.assert_allclose(adam.params[k], want[k], rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("rule,what,instead", [
    (lambda p, g, hp, t: p - hp["lr"] * g / max(1, t - 2), r"Python's max\(\) / min\(\)", "np.maximum"),
    (lambda p, g, hp, t: p - (hp["lr"] if t > 2 else 0.0) * g, r"bool\(\) \(an if", r"np.where\(cond, a, b\)"),
    (lambda p, g, hp, t: p - hp["lr"] * g / math.sqrt(t), r"float\(\) \(or a math.\* function", r"np.sqrt"),
])
def test_untraceable_idioms_name_the_line_and_what_to_write(rule, what, instead):
    with pytest.raises(btjit.TraceError, match=rf"{what}.*{instead}.*test_optim_zoo.py:"
                                               rf"{rule.__code__.co_firstlineno}"):
        one_step(rule)


@pytest.mark.parametrize("rule,scale", [
    (lambda p, g, hp, t: p - hp["lr"] * np.where(t % 2 == 0, g, 0.0), lambda t: float(t % 2 == 0)),
    (lambda p, g, hp, t: p - hp["lr"] * 0.5 ** (t // 2) * g, lambda t: 0.5 ** (t // 2)),
    (lambda p, g, hp, t: p - hp["lr"] * np.floor(t / 2) * g, lambda t: float(t // 2)),
])
def test_a_rule_may_take_the_step_modulo_or_floor_divided(rule, scale):
    """`step % k`, `step // k`, np.floor(step / k): a schedule on the step count, against numpy over 5 steps."""
    x = batches(1)[0]
    prog = btjit.trace(loss, params0(), *x, optimizer=Rule(rule), dtype="float64")
    want = params0()
    for t in range(1, 6):
        prog.step(*x)
        want = {k: p - 0.1 * scale(t) * (a + p) for (k, p), a in zip(want.items(), x)}
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], want[k], rtol=1e-13, atol=1e-15, err_msg=k)


class TorchStateNAdam(Z.NAdam):
    def init(self, name, p):                   # torch's: mu_product one number per param
        return {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p), "mu_product": 1.0}


def test_a_state_of_one_number_per_param_stays_one_number():
    prog = run(TorchStateNAdam(lr=0.01, groups=GROUPS), np.float64)
    want = run(Z.NAdam(lr=0.01, groups=GROUPS), np.float64)
    for k in SHAPES:
        np.testing.assert_array_equal(prog.params[k], want.params[k], err_msg=k)
        assert prog.opt_state["mu_product"][k].shape == ()             # torch's: one number per param
    bad = type("Bad", (Z.NAdam,), {"init": lambda self, name, p: {"a": np.zeros(p.size + 1), "b": 0, "c": 0}})
    with pytest.raises(O.OptimizerError, match=r"Bad.init\('w'\): state 'a' has shape \(31,\), the param \(6, 5\); "
                                               r"a state has at most its param's elements"):
        run(bad(), np.float64, steps=0)


@pytest.mark.parametrize("name", ["step", "hyper"])
def test_a_state_named_as_state_dicts_own_keys_is_an_error(name):
    bad = type("Named", (Z.SGDW,), {"init": lambda self, n, p: {name: np.zeros_like(p)}})
    with pytest.raises(O.OptimizerError, match=rf"Named.init: a state named '{name}' would be state_dict's opt/step "
                                               r"or opt/hyper .*name it otherwise"):
        run(bad(), np.float64, steps=0)
