"""btjit.optim: every built-in against torch.optim and a numpy transcription (tests/optim_numpy.py) over 20
steps with param groups, weight decay and momentum (and Adam's amsgrad, maximize), in float64 (1e-12) and
float32 (1e-6 relative); the update as one fused pass per group; hyper-parameters changed between steps; the group rules and errors.
A user-written optimizer end to end is in test_optim_user.py."""
import numpy as np
import pytest

import btjit
import btjit.optim as O
import optim_numpy as R

SHAPES = {"w": (6, 5), "b": (5,), "e": (3, 4), "g": (4,)}
STEPS = 20


def params0():
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def batches(n=STEPS):
    rng = np.random.default_rng(1)
    return [[rng.standard_normal(s) for s in SHAPES.values()] for _ in range(n)]


def loss(p, *a):
    """sum(a * p) + 0.5 * sum(p * p) per param: the gradient is a + p, computed alike everywhere."""
    out = 0.0
    for k, ak in zip(SHAPES, a):
        out = out + btjit.sum(ak * p[k]) + 0.5 * btjit.sum(p[k] * p[k])
    return out


# nanoGPT's decay on matrices, and a group of its own lr for the biases
GROUPS = [{"params": lambda name, shape: len(shape) >= 2, "weight_decay": 0.1},
          {"params": ["b"], "weight_decay": 0.0, "lr_scale": 0.5},
          {"params": "g", "weight_decay": 0.02}]
GROUP_NAMES = [["w", "e"], ["b"], ["g"]]

# (name, btjit optimizer, torch class and kwargs, numpy step and its options)
CASES = [
    ("sgd", lambda gr: O.SGD(lr=0.05, groups=gr), ("SGD", {}), (R.sgd, {})),
    ("sgd_momentum", lambda gr: O.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, groups=gr),
     ("SGD", dict(momentum=0.9, dampening=0.1)), (R.sgd, {})),
    ("sgd_nesterov", lambda gr: O.SGD(lr=0.05, momentum=0.8, nesterov=True, groups=gr),
     ("SGD", dict(momentum=0.8, nesterov=True)), (R.sgd, {"nesterov": True})),
    ("adam", lambda gr: O.Adam(lr=0.01, betas=(0.8, 0.99), groups=gr), ("Adam", dict(betas=(0.8, 0.99))),
     (R.adam, {})),
    ("adamw", lambda gr: O.AdamW(lr=0.01, groups=gr), ("AdamW", {}), (R.adamw, {})),
    ("adam_amsgrad", lambda gr: O.Adam(lr=0.01, amsgrad=True, groups=gr), ("Adam", dict(amsgrad=True)),
     (R.adam, {"amsgrad": True})),
    ("adamw_amsgrad_maximize", lambda gr: O.AdamW(lr=0.01, amsgrad=True, maximize=True, groups=gr),
     ("AdamW", dict(amsgrad=True, maximize=True)), (R.adam, {"decoupled": True, "amsgrad": True, "maximize": True})),
    ("sgd_momentum_maximize", lambda gr: O.SGD(lr=0.05, momentum=0.9, maximize=True, groups=gr),
     ("SGD", dict(momentum=0.9, maximize=True)), (R.sgd, {"maximize": True})),
    ("adadelta_maximize", lambda gr: O.Adadelta(lr=0.5, maximize=True, groups=gr), ("Adadelta", dict(maximize=True)),
     (R.adadelta, {"maximize": True})),
    ("adagrad", lambda gr: O.Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, groups=gr),
     ("Adagrad", dict(lr_decay=0.01, initial_accumulator_value=0.1)), (R.adagrad, {})),
    ("adadelta", lambda gr: O.Adadelta(lr=0.5, rho=0.8, groups=gr), ("Adadelta", dict(rho=0.8)), (R.adadelta, {})),
    ("rmsprop", lambda gr: O.RMSprop(lr=0.01, groups=gr), ("RMSprop", {}), (R.rmsprop, {})),
    ("rmsprop_centered_momentum", lambda gr: O.RMSprop(lr=0.01, momentum=0.9, centered=True, groups=gr),
     ("RMSprop", dict(momentum=0.9, centered=True)), (R.rmsprop, {"centered": True})),
    ("lion", lambda gr: O.Lion(lr=0.01, weight_decay=0.1, groups=gr), None, (R.lion, {})),
]
IDS = [c[0] for c in CASES]


def btjit_run(make, dtype, steps=STEPS, groups=GROUPS):
    p0 = {k: v.astype(dtype) for k, v in params0().items()}
    bs = batches(steps)
    prog = btjit.trace(loss, p0, *[b.astype(dtype) for b in bs[0]], optimizer=make(groups), dtype=dtype)
    for b in bs:
        prog.step(*[x.astype(dtype) for x in b])
    return prog


def torch_run(cls, kw, lr, dtype, steps=STEPS):
    torch = pytest.importorskip("torch")
    p = {k: torch.tensor(v.astype(dtype)) for k, v in params0().items()}
    wd = [g.get("weight_decay", kw.get("weight_decay", 0.0)) for g in GROUPS]
    tg = [{"params": [p[n] for n in names], "weight_decay": w, "lr": lr * g.get("lr_scale", 1.0)}
          for names, w, g in zip(GROUP_NAMES, wd, GROUPS)]
    kw = {k: v for k, v in kw.items() if k != "weight_decay"}
    extra = {} if cls in ("Adadelta",) else {"foreach": False}
    opt = getattr(torch.optim, cls)(tg, lr=lr, **kw, **extra)
    for b in batches(steps):
        for k, a in zip(SHAPES, b):
            p[k].grad = torch.tensor(a.astype(dtype)) + p[k]
        opt.step()
    return {k: v.numpy() for k, v in p.items()}, {k: opt.state[p[k]] for k in p}


def numpy_run(fn, kw, opt):
    groups = O.resolve_groups(opt, params0())
    groups = [(names, {**hp, "lr": hp["lr"] * hp["lr_scale"]}) for names, hp in groups]
    init = lambda name, v: {k: np.asarray(a, np.float64) for k, a in opt.init(name, v).items()}  # noqa: E731
    grads = lambda t, p: {k: a + p[k] for k, a in zip(SHAPES, batches()[t - 1])}  # noqa: E731
    return R.run(fn, params0(), grads, groups, STEPS, init, **kw)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float64_matches_numpy(case):
    _, make, _, (fn, kw) = case
    prog = btjit_run(make, np.float64)
    want, state = numpy_run(fn, kw, make(GROUPS))
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], want[k], rtol=1e-12, atol=1e-13, err_msg=k)
        for s, views in prog.opt_state.items():
            np.testing.assert_allclose(views[k], state[k][s], rtol=1e-12, atol=1e-13, err_msg=f"{s} of {k}")
    assert prog.step_count == STEPS


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-6)])
@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]])
def test_matches_torch(case, dtype, rtol):
    _, make, (cls, kw), _ = case
    opt = make(GROUPS)
    prog = btjit_run(make, dtype)
    want, state = torch_run(cls, {**kw, "weight_decay": opt.hp.get("weight_decay", 0.0)}, opt.hp["lr"], dtype)
    for k in SHAPES:                    # relative to the array's scale (a difference of two values can be ~0)
        close(prog.params[k], want[k], rtol, k)
        for s, views in prog.opt_state.items():
            close(views[k], state[k][s].numpy(), rtol, f"{s} of {k}")


def close(got, want, rtol, what):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(), err_msg=what)


def traced(cls):
    """cls with its update traced as equations (a subclass overriding update), not its one-pass kernel."""
    return type("Traced" + cls.__name__, (cls,), {"update": lambda self, *a: cls.update(self, *a)})


@pytest.mark.parametrize("make,op", [(lambda gr: O.SGD(lr=0.1, momentum=0.9, groups=gr), "opt_update"),
                                     (lambda gr: O.AdamW(lr=1e-3, groups=gr), "opt_update"),
                                     (lambda gr: O.Adadelta(groups=gr), "opt_update"),
                                     (lambda gr: traced(O.AdamW)(lr=1e-3, groups=gr), "ew_fused")],
                         ids=["sgd", "adamw", "adadelta", "adamw_traced"])
def test_update_is_one_pass_per_group(make, op):
    """The built-in SGD, Adam(W) and Adadelta are one opt_update kernel per group; traced, AdamW is one fused
    chain."""
    prog = btjit_run(make, np.float32, steps=1)
    g = prog.graph
    big = [e for e in g.eqns[g.n_backward:] if e.outs[0].shape != ()]
    assert [e.op for e in big] == [op] * len(GROUPS)
    assert sorted(e.outs[0].shape[0] for e in big) == sorted(sum(-(-int(np.prod(SHAPES[n])) // 16) * 16
                                                                 for n in names) for names in GROUP_NAMES)
    assert all(e.op in ("ew_fused", "opt_update", "add", "sub", "mul", "div", "neg", "sqrt", "pow2")
               for e in g.eqns[g.n_backward:])


ONE_PASS = [(O.SGD, dict(lr=0.05)), (O.Adam, dict(lr=0.05)), (O.AdamW, dict(lr=0.05)),
            (O.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
            (O.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01)),
            (O.Adam, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)),
            (O.AdamW, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)),
            (O.Adadelta, dict(lr=1.0)), (O.Adadelta, dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.05))]


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-13), (np.float32, 2e-6)])
@pytest.mark.parametrize("cls,kw", ONE_PASS, ids=["sgd", "adam", "adamw", "sgd_damp", "sgd_nesterov", "adam_wd",
                                                  "adamw_wd", "adadelta", "adadelta_wd"])
def test_one_pass_kernel_matches_traced_equations(cls, kw, dtype, rtol):
    """The one-pass kernels against the same update traced, with clipping and a skipped non-finite step, on
    one thread and two (the kernel split over the threads: bitwise one thread's)."""
    bs = batches(8)
    bs[3] = [np.full_like(b, np.nan) for b in bs[3]]
    runs = []
    for c, threads in ((cls, 1), (traced(cls), 1), (cls, 2)):
        p0 = {k: v.astype(dtype) for k, v in params0().items()}
        prog = btjit.trace(loss, p0, *bs[0], optimizer=c(**kw, groups=GROUPS), dtype=dtype, clip_norm=3.0,
                           skip_nonfinite=True, threads=threads)
        for b in bs:
            prog.step(*[x.astype(dtype) for x in b])
        runs.append((prog.params, prog.opt_state, prog.step_count))
    (p1, s1, n1), (p2, s2, n2), (p3, s3, n3) = runs
    assert n1 == n2 == n3 == 7
    for k in SHAPES:
        close(p1[k], p2[k], rtol, k)
        np.testing.assert_array_equal(p1[k], p3[k], err_msg=k)
        for s in s1:
            close(s1[s][k], s2[s][k], rtol, f"{s} of {k}")
            np.testing.assert_array_equal(s1[s][k], s3[s][k])


def test_hyper_parameters_change_between_steps_without_recompiling():
    torch = pytest.importorskip("torch")
    bs = batches(6)
    prog = btjit.trace(loss, params0(), *bs[0], optimizer=O.Adam(lr=0.01, groups=GROUPS), dtype="float64")
    tape, kernels = prog.tape, prog.kernels
    p = {k: torch.tensor(v) for k, v in params0().items()}
    opt = torch.optim.Adam([{"params": [p[n] for n in names], "lr": 0.01 * g.get("lr_scale", 1.0),
                             "weight_decay": g["weight_decay"]} for names, g in zip(GROUP_NAMES, GROUPS)],
                           foreach=False)
    for i, b in enumerate(bs):
        if i == 3:
            prog.hp["beta1"] = 0.5
            prog.hp.groups[1]["lr_scale"] = 2.0
            prog.lr = 0.02
            for j, pg in enumerate(opt.param_groups):
                pg["betas"] = (0.5, 0.999)
                pg["lr"] = 0.02 * (2.0 if j == 1 else GROUPS[j].get("lr_scale", 1.0))
        prog.step(*b)
        for k, a in zip(SHAPES, b):
            p[k].grad = torch.tensor(a) + p[k]
        opt.step()
    assert prog.tape is tape and prog.kernels is kernels
    assert prog.hp["beta1"] == 0.5 and prog.hp.groups[1]["lr_scale"] == 2.0 and prog.lr == 0.02
    with pytest.raises(KeyError, match="differs between param groups"):
        prog.hp["weight_decay"]
    with pytest.raises(KeyError, match="no hyper-parameter 'beta'"):
        prog.hp["beta"] = 1.0
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], p[k].numpy(), rtol=1e-12, atol=1e-13, err_msg=k)


def test_clip_value_clips_each_gradient_element():
    bs = batches(3)
    prog = btjit.trace(loss, params0(), *bs[0], optimizer=O.SGD(lr=0.1), clip_value=0.5, dtype="float64")
    p, cv = params0(), 0.5
    for b in bs:                                # the clip changes between steps: 0.5, 0.25, 0.5
        prog.hp["clip_value"] = cv
        prog.step(*b)
        p = {k: p[k] - 0.1 * np.clip(a + p[k], -cv, cv) for k, a in zip(SHAPES, b)}
        cv = 0.25 if cv == 0.5 else 0.5
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], p[k], rtol=1e-13, err_msg=k)
    assert np.abs(p["w"] - params0()["w"]).max() <= 0.1 * (0.5 + 0.25 + 0.5) + 1e-12


def test_decay_matrices_is_nanogpts_rule():
    opt = O.AdamW(lr=1e-3, weight_decay=0.1, groups=O.decay_matrices())
    groups = O.resolve_groups(opt, params0())
    assert [(names, hp["weight_decay"]) for names, hp in groups] == [(["w", "e"], 0.1), (["b", "g"], 0.0)]


@pytest.mark.parametrize("groups,msg", [
    ([{"params": ["w", "e"]}], r"parameter 'b' \(shape \(5,\)\) is in no param group \(nor 1 more\)"),
    ([{"params": "w|b"}, {"params": lambda n, s: True}], r"parameter 'w' is in two param groups \(0 and 1\)"),
    ([{"params": ["w", "nope"]}, {"params": "b|e|g"}], "group 0 lists 'nope', which is not a parameter"),
    ([{"params": "w("}], r"group 0: params regex 'w\(' is invalid"),
    ([{"params": 3}], "group 0: params must be a predicate on"),
    ([{"params": "bias"}, {"params": ".*"}], r"group 0: params regex 'bias' matches no parameter"),
])
def test_group_errors_name_the_param(groups, msg):
    with pytest.raises(O.OptimizerError, match=msg):
        O.resolve_groups(O.SGD(lr=0.1, groups=groups), params0())


def test_bad_optimizer_arguments_are_named():
    with pytest.raises(O.OptimizerError, match="group 0 has unknown key 'betas'"):
        O.AdamW(groups=[{"params": "w", "betas": 0.5}])
    with pytest.raises(O.OptimizerError, match="group 0: weight_decay='x' must be a number"):
        O.AdamW(groups=[{"params": "w", "weight_decay": "x"}])
    with pytest.raises(O.OptimizerError, match="group 0 sets lr; a group scales the optimizer's: lr_scale"):
        O.AdamW(groups=[{"params": "w", "lr": 0.5}])
    with pytest.raises(O.OptimizerError, match="'step' is reserved"):
        O.Optimizer(lr=0.1, step=2)
    with pytest.raises(O.OptimizerError, match="nesterov needs momentum > 0"):
        O.SGD(lr=0.1, nesterov=True)
    with pytest.raises(O.OptimizerError, match=r"beta1 must be in \[0.0, 1.0\], got 1.5"):
        O.Adam(betas=(1.5, 0.9))
    with pytest.raises(TypeError, match="optimizer must be a btjit.optim.Optimizer"):
        btjit.trace(loss, params0(), *batches(1)[0], optimizer="adam")


def test_update_reading_an_unknown_hyper_parameter_names_it():
    class Mine(O.Optimizer):
        def __init__(self, lr=0.1):
            super().__init__(lr=lr)

        def update(self, param, grad, state, hp, step):
            return param - hp["lr"] * hp["beta"] * grad, state
    for kind in (KeyError, O.OptimizerError):
        with pytest.raises(kind, match=r"Mine.update reads hp\['beta'\].*\(it has lr\).*super\(\).__init__\(beta="):
            btjit.trace(loss, params0(), *batches(1)[0], optimizer=Mine())


@pytest.mark.parametrize("make", [lambda: O.AdamW(lr=1e-2, weight_decay=0.1), lambda: O.SGD(lr=0.1, momentum=0.9),
                                  lambda: O.Adadelta(weight_decay=0.01)], ids=["adamw", "sgd_momentum", "adadelta"])
def test_one_pass_kernel_split_over_threads_is_bitwise_one_threads(make):
    """A group of >= PAR_EW_ELEMENTS elements splits the kernel's row over two threads, with the same result."""
    from btjit.testing import split_kernels
    rng = np.random.default_rng(3)
    p0 = {"w": rng.standard_normal((300, 256)).astype(np.float32)}
    xs = [rng.standard_normal((4, 300)).astype(np.float32) for _ in range(3)]
    fn = lambda p, x: btjit.sum(btjit.tanh(x @ p["w"]))          # noqa: E731
    progs = [btjit.trace(fn, p0, xs[0], optimizer=make(), threads=t) for t in (1, 2)]
    par = [any(e.startswith("k_opt_") for e in split_kernels(pr)) for pr in progs]
    assert par == [False, True]
    for pr in progs:
        for x in xs:
            pr.step(x)
    np.testing.assert_array_equal(progs[0].params["w"], progs[1].params["w"])
    for s in progs[0].opt_state:
        np.testing.assert_array_equal(progs[0].opt_state[s]["w"], progs[1].opt_state[s]["w"])


def _prog(opt, **kw):
    return btjit.trace(loss, params0(), *batches(1)[0], optimizer=opt, dtype="float64", **kw)


@pytest.mark.parametrize("make,key", [(lambda: O.SGD(lr=0.1), "momentum"), (lambda: O.SGD(lr=0.1), "weight_decay"),
                                      (lambda: O.Adam(lr=0.1), "weight_decay"),
                                      (lambda: O.RMSprop(lr=0.1), "momentum"),
                                      (lambda: O.Adagrad(lr=0.1), "weight_decay")])
def test_a_hyper_parameter_traced_at_0_refuses_a_nonzero_value(make, key):
    prog = _prog(make())
    with pytest.raises(ValueError, match=rf"prog.hp\['{key}'\] = 0.5: the program was traced with {key} = 0 .*"
                                         rf"its term is not in the step.*nonzero {key} \(e.g. {key}=1e-12\)"):
        prog.hp[key] = 0.5
    with pytest.raises(ValueError, match=f"traced with {key} = 0"):
        prog.hp.groups[0][key] = 0.5
    prog.hp[key] = 0.0                          # 0 stays allowed
    prog.hp.groups[0][key] = 0
    assert prog.hp[key] == 0.0


@pytest.mark.parametrize("key", ["clip_norm", "clip_value"])
def test_clipping_not_traced_refuses_a_value_and_traced_stays_changeable(key):
    with pytest.raises(ValueError, match=rf"traced without {key}, so the step does no such clipping.*pass {key}= "
                                         rf"to btjit.trace"):
        _prog(O.SGD(lr=0.1)).hp[key] = 1e-3
    prog = _prog(O.SGD(lr=0.1), **{key: 10.0})
    prog.hp[key] = 1e-3
    assert prog.hp[key] == 1e-3


@pytest.mark.parametrize("clip", [{}, {"clip_value": 1e9}], ids=["one_pass", "traced"])
@pytest.mark.parametrize("make,key,value", [(lambda **k: O.AdamW(**{"lr": 0.01, "weight_decay": 0.0, **k}),
                                             "weight_decay", 0.5),
                                            (lambda **k: O.SGD(lr=0.05, momentum=0.9, **k), "dampening", 0.5),
                                            (lambda **k: O.SGD(**{"lr": 0.05, "weight_decay": 0.01, **k}),
                                             "weight_decay", 0.5)],
                         ids=["adamw_wd", "sgd_dampening", "sgd_wd"])
def test_hyper_parameters_whose_terms_are_traced_stay_changeable(make, key, value, clip):
    """AdamW's decoupled decay and SGD's dampening are traced at 0 too: set before the first step, the program
    equals one traced with the value (and differs from one left as traced)."""
    a, want, unchanged = _prog(make(), **clip), _prog(make(**{key: value}), **clip), _prog(make(), **clip)
    a.hp[key] = value
    for bt in batches(4):
        for prog in (a, want, unchanged):
            prog.step(*bt)
    for k in SHAPES:
        np.testing.assert_allclose(a.params[k], want.params[k], rtol=1e-13, atol=1e-15, err_msg=k)
    assert np.abs(a.params["w"] - unchanged.params["w"]).max() > 1e-4


def test_hp_groups_are_indexed_as_declared_with_empty_groups():
    groups = [{"params": lambda n, s: False, "weight_decay": 0.0}, {"params": ["w", "e"], "weight_decay": 0.1},
              {"params": ["b", "g"], "lr_scale": 2.0}]
    prog = _prog(O.SGD(lr=0.1, weight_decay=0.01, groups=groups))
    ref = _prog(O.SGD(lr=0.1, weight_decay=0.01, groups=groups[1:]))
    assert len(prog.hp.groups) == 3
    assert prog.hp.groups[1]["weight_decay"] == 0.1 and prog.hp.groups[1]["lr_scale"] == 1.0
    assert prog.hp.groups[2]["weight_decay"] == 0.01 and prog.hp.groups[2]["lr_scale"] == 2.0
    with pytest.raises(KeyError, match=r"hp.groups\[0\]\['weight_decay'\]: param group 0 matches no parameter"):
        prog.hp.groups[0]["weight_decay"] = 0.5
    with pytest.raises(KeyError, match="param group 0 matches no parameter"):
        prog.hp.groups[0]["weight_decay"]
    with pytest.raises(IndexError, match=r"hp.groups\[3\]: this program has 3 param groups \(indices 0 to 2\)"):
        prog.hp.groups[3]
    prog.hp.groups[1]["weight_decay"] = ref.hp.groups[0]["weight_decay"] = 0.3
    prog.hp["lr_scale"] = ref.hp["lr_scale"] = 0.5
    for bt in batches(3):
        prog.step(*bt)
        ref.step(*bt)
    for k in SHAPES:
        np.testing.assert_array_equal(prog.params[k], ref.params[k], err_msg=k)
    sd = prog.state_dict()
    prog.load_state_dict(sd)
    assert prog.hp.groups[1]["weight_decay"] == 0.3


def test_decay_matrices_without_1d_params_keeps_an_empty_second_group():
    p = {"w": np.random.default_rng(0).standard_normal((3, 4))}
    x = np.ones((2, 3))
    prog = btjit.trace(lambda p, x: btjit.sum((x @ p["w"]) ** 2), p, x, dtype="float64",
                       optimizer=O.AdamW(lr=0.1, weight_decay=0.1, groups=O.decay_matrices()))
    prog.step(x)
    assert prog.hp["weight_decay"] == 0.1 and prog.hp.groups[0]["weight_decay"] == 0.1
    assert "weight_decay" in prog.hp and len(prog.hp.groups) == 2
    with pytest.raises(KeyError, match="param group 1 matches no parameter"):
        prog.hp.groups[1]["weight_decay"] = 0.0


@pytest.mark.parametrize("make,msg", [
    (lambda: O.Adam(lr=0.1, betas=0.9), r"Adam: betas must be a pair of numbers \(beta1, beta2\), got 0.9"),
    (lambda: O.Lion(betas=(0.9,)), r"Lion: betas must be a pair of numbers"),
    (lambda: O.Adam(lr=-0.1), "Adam: Invalid learning rate: -0.1"),
    (lambda: O.SGD(lr=-1), "SGD: Invalid learning rate: -1"),
    (lambda: O.Lion(lr=-1e-4), "Lion: Invalid learning rate: -0.0001"),
    (lambda: O.AdamW(eps=-1e-8), "AdamW: Invalid epsilon value: -1e-08"),
    (lambda: O.RMSprop(weight_decay=-0.1), "RMSprop: Invalid weight_decay value: -0.1"),
    (lambda: O.Adagrad(lr_decay=-0.1), "Adagrad: Invalid lr_decay value: -0.1"),
    (lambda: O.SGD(lr=0.1, groups=[{"params": ".*", "weight_decay": -1.0}]),
     "SGD: Invalid weight_decay value: -1.0 in group 0"),
])
def test_bad_builtin_arguments_are_optimizer_errors_as_torchs(make, msg):
    with pytest.raises(O.OptimizerError, match=msg):
        make()
