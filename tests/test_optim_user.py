"""A user-written optimizer (Lion, written here against btjit.optim.Optimizer) end to end: it matches its numpy
transcription, compiles no kernel AdamW does not use, and its state goes through state_dict, a checkpoint and
--resume bit for bit, an export run by btjit.runtime in a fresh interpreter and by the C host; an update
that reads an old value after writing the new one, and one that returns a param as state; rules that reduce
over a param or read its shape, traced per param, against numpy."""

import numpy as np
import pytest

import btjit
import btjit.train.checkpoint as K
import optim_numpy as R
from test_export import CC, batches, c_host_train, gpt_program, run_fresh
from test_optim import SHAPES, loss, params0
from test_optim import batches as quad_batches


class MyLion(btjit.optim.Optimizer):
    def __init__(self, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, groups=groups)

    def init(self, name, param):
        return {"exp_avg": np.zeros_like(param)}

    def update(self, p, g, state, hp, step):
        m = state["exp_avg"]
        c = hp["beta1"] * m + (1 - hp["beta1"]) * g
        sign = (c > 0) - (c < 0)
        p = p * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * sign
        return p, {"exp_avg": hp["beta2"] * m + (1 - hp["beta2"]) * g}


def test_user_lion_matches_numpy_and_compiles_no_new_kernel():
    bs = quad_batches()
    opt = MyLion(lr=0.01, weight_decay=0.1, groups=[{"params": "w|e"}, {"params": ["b", "g"], "weight_decay": 0.0}])
    prog = btjit.trace(loss, params0(), *bs[0], optimizer=opt, dtype="float64")
    for b in bs:
        prog.step(*b)
    groups = btjit.optim.resolve_groups(opt, params0())
    grads = lambda t, p: {k: a + p[k] for k, a in zip(SHAPES, bs[t - 1])}  # noqa: E731
    want, state = R.run(R.lion, params0(), grads, groups, len(bs), lambda n, v: {"exp_avg": np.zeros_like(v)})
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], want[k], rtol=1e-12, atol=1e-13, err_msg=k)
        np.testing.assert_allclose(prog.opt_state["exp_avg"][k], state[k]["exp_avg"], rtol=1e-12, atol=1e-13)
    adamw = btjit.trace(loss, params0(), *bs[0], optimizer=btjit.optim.AdamW(), dtype="float64")
    assert set(prog.kernels.entries) <= set(adamw.kernels.entries)


def test_user_optimizer_state_survives_a_checkpoint_and_resumes_bit_exact(tmp_path):
    data = batches(6)
    whole = gpt_program(MyLion(lr=1e-3, weight_decay=0.1))
    first = gpt_program(MyLion(lr=1e-3, weight_decay=0.1))
    for x, y in data[:3]:
        whole.step(x, y)
        first.step(x, y)
    first.hp["beta1"] = whole.hp["beta1"] = 0.8            # a hyper-parameter changed before the checkpoint
    path = K.save(tmp_path, 3, first.state_dict(), {"rng_state": None})
    ck = K.load(path)
    assert ck.state["opt/step"] == 3 and set(ck.state) >= {"opt/exp_avg", "opt/hyper"}
    resumed = gpt_program(MyLion(lr=1e-3, weight_decay=0.1))
    K.check_compatible(ck, resumed.state_dict())
    resumed.load_state_dict(ck.state)
    assert resumed.hp["beta1"] == np.float32(0.8) and resumed.step_count == 3
    for x, y in data[3:]:
        assert resumed.step(x, y) == whole.step(x, y)
    for k in whole.params:
        np.testing.assert_array_equal(resumed.params[k], whole.params[k], err_msg=k)
    np.testing.assert_array_equal(resumed.state_dict()["opt/exp_avg"], whole.state_dict()["opt/exp_avg"])


def test_user_optimizer_exports_and_runs_in_the_runtime_and_the_c_host(tmp_path):
    data = batches(5)
    prog = gpt_program(MyLion(lr=1e-3, weight_decay=0.1))
    prog.export(tmp_path / "e")
    np.savez(tmp_path / "b.npz", **{f"x{i}": x for i, (x, _) in enumerate(data)},
             **{f"y{i}": y for i, (_, y) in enumerate(data)})
    got = run_fresh({"lion": {"kind": "tensor", "dir": str(tmp_path / "e"), "batches": str(tmp_path / "b.npz"),
                              "steps": len(data)}})
    rt = btjit.runtime.load(tmp_path / "e")
    assert rt.optimizer["type"] == "MyLion" and rt.hp["beta2"] == np.float32(0.99)
    losses = [prog.step(x, y) for x, y in data]
    assert got.pop("imported") == [] and got["lion"]["losses"] == losses
    assert got["lion"]["params"] == {k: v.tolist() for k, v in prog.params.items()}
    for x, y in data:
        rt.step(x, y)
    ref, mine = prog.state_dict(), rt.state_dict()
    assert ref.keys() == mine.keys()
    for k in ref:
        np.testing.assert_array_equal(mine[k], ref[k], err_msg=k)
    if CC is None:
        pytest.skip("no C compiler (cc/gcc) on this machine")
    r = c_host_train(tmp_path, data, 5)
    assert r.returncode == 0, r.stderr
    assert [np.float32(ln.split()[-1]) for ln in r.stdout.splitlines()] == [np.float32(v) for v in losses]


class Lookahead(btjit.optim.Optimizer):
    """Keeps the param before the step ("prev", the old param itself) and a momentum read after the new
    param: both need the assigns' copies rather than writing in place."""

    def __init__(self, lr=0.1):
        super().__init__(lr=lr)

    def init(self, name, param):
        return {"prev": np.array(param), "mom": np.zeros_like(param)}

    def update(self, p, g, state, hp, step):
        new_p = p - hp["lr"] * (g + state["mom"])
        return new_p, {"prev": p, "mom": new_p * 0.0 + 0.5 * state["mom"] + g + 0.0 * p}


def test_an_update_reading_old_values_after_new_ones_is_copied_at_the_end():
    bs = quad_batches(3)
    prog = btjit.trace(loss, params0(), *bs[0], optimizer=Lookahead(), dtype="float64")
    p, mom = params0(), {k: np.zeros(s) for k, s in SHAPES.items()}
    for b in bs:
        before = {k: v.copy() for k, v in prog.params.items()}
        prog.step(*b)
        g = {k: a + p[k] for k, a in zip(SHAPES, b)}
        p = {k: p[k] - 0.1 * (g[k] + mom[k]) for k in p}
        mom = {k: 0.5 * mom[k] + g[k] for k in p}
        for k in SHAPES:
            np.testing.assert_array_equal(prog.opt_state["prev"][k], before[k], err_msg=k)
    assert any(not a.in_place for a in prog.graph.assigns)
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], p[k], rtol=1e-13, err_msg=k)
        np.testing.assert_allclose(prog.opt_state["mom"][k], mom[k], rtol=1e-13, err_msg=k)


class TupleAdam(btjit.optim.Optimizer):
    """torch.optim.Adam as a user writes it: betas one tuple hyper-parameter, bias correction by the traced step."""

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, groups=groups)

    def init(self, name, param):
        return {"m": np.zeros_like(param), "v": np.zeros_like(param)}

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        m, v = b1 * s["m"] + (1 - b1) * g, b2 * s["v"] + (1 - b2) * g * g
        return p - hp["lr"] * (m / (1 - b1 ** step)) / (np.sqrt(v / (1 - b2 ** step)) + hp["eps"]), {"m": m, "v": v}


def test_a_tuple_hyper_parameter_is_slots_and_matches_torch():
    torch = pytest.importorskip("torch")
    bs = quad_batches()
    opt = TupleAdam(lr=0.01, groups=[{"params": "w|e"}, {"params": ["b", "g"], "betas": (0.8, 0.95)}])
    prog = btjit.trace(loss, params0(), *bs[0], optimizer=opt, dtype="float64")
    assert prog.hp.groups[1]["betas"] == (0.8, 0.95) and "betas[1]" in prog.hp
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params0().items()}
    topt = torch.optim.Adam([{"params": [tp["w"], tp["e"]]}, {"params": [tp["b"], tp["g"]], "betas": (0.8, 0.95)}],
                            lr=0.01)
    for t, b in enumerate(bs):
        if t == 2:                                         # both groups' betas changed between steps
            prog.hp["betas"] = (0.7, 0.9)
            for grp in topt.param_groups:
                grp["betas"] = (0.7, 0.9)
        prog.step(*b)
        topt.zero_grad()
        for k, a in zip(SHAPES, b):                        # test_optim's loss: grad_k = a_k + p_k
            tp[k].grad = torch.tensor(a) + tp[k].detach()
        topt.step()
    assert prog.hp["betas"] == (0.7, 0.9)
    for k in SHAPES:
        np.testing.assert_allclose(prog.params[k], tp[k].detach().numpy(), rtol=1e-12, atol=1e-13, err_msg=k)


@pytest.mark.parametrize("kw,needle", [
    (dict(betas=("a", 0.9)), r"TupleAdam: betas=\('a', 0.9\) must be a number or a tuple of numbers"),
    (dict(lr=(0.1, 0.2)), "lr must be one number"),
    (dict(groups=[{"params": "w", "betas": (0.8,)}, {"params": "b|g|e"}]),
     r"group 0: betas=\(0.8,\) must be of the form of the optimizer's betas=\(0.9, 0.999\)"),
])
def test_tuple_hyper_parameter_errors(kw, needle):
    with pytest.raises(btjit.optim.OptimizerError, match=needle):
        TupleAdam(**kw)


class Probe(btjit.optim.Optimizer):
    """An update given as a function of (p, g, hp), traced at each param's shape when it is not elementwise."""

    def __init__(self, rule, lr=0.1):
        super().__init__(lr=lr)
        self.rule = rule

    def update(self, p, g, state, hp, step):
        return self.rule(p, g, hp), {}


@pytest.mark.parametrize("rule", [
    lambda p, g, hp: p - hp["lr"] * g / (g * g).mean(),
    lambda p, g, hp: p - hp["lr"] * p.min() * g,
    lambda p, g, hp: p - hp["lr"] * g / np.sqrt(np.sum(g * g)),
    lambda p, g, hp: p - hp["lr"] * g.var() * g,
    lambda p, g, hp: (p - hp["lr"] * g).sum(),                  # one number: every element of the param takes it
    lambda p, g, hp: p - hp["lr"] * g * np.arange(3.0)[0],       # elementwise: the group's one pass
    lambda p, g, hp: p - hp["lr"] * g * (2.0 if p.ndim == 2 else 1.0),   # elementwise, but at the param's shape
    lambda p, g, hp: p - hp["lr"] * g / p.size,
])
def test_an_update_with_per_param_statistics_matches_numpy_per_param(rule):
    bs = quad_batches(1)
    prog = btjit.trace(loss, params0(), *bs[0], optimizer=Probe(rule), dtype="float64")
    prog.step(*bs[0])
    for (k, p), a in zip(params0().items(), bs[0]):                 # the loss's gradient is a + p
        want = np.broadcast_to(rule(p, a + p, {"lr": 0.1}), p.shape)
        np.testing.assert_allclose(prog.params[k], want, rtol=1e-13, atol=1e-15, err_msg=k)


@pytest.mark.parametrize("rule", [
    lambda p, g, hp: p - hp["lr"] * g.reshape(-1, 1)[:, 0],
    lambda p, g, hp: (p - hp["lr"] * g * np.ones((2, 1)))[0],
])
def test_an_update_wrong_at_a_params_shape_is_an_error_naming_the_line(rule):
    with pytest.raises(btjit.TraceError, match=rf"input shapes \(6, 5\) and .*test_optim_user.py:"
                                               rf"{rule.__code__.co_firstlineno}"):
        btjit.trace(loss, params0(), *quad_batches(1)[0], optimizer=Probe(rule), dtype="float64")


def test_a_returned_value_of_another_shape_names_the_param_and_its_shape():
    with pytest.raises(btjit.optim.OptimizerError, match=r"Probe.update for param 'w': the new param has shape "
                                                         r"\(3,\), not \(6, 5\) \(the param's\)"):
        btjit.trace(loss, params0(), *quad_batches(1)[0], optimizer=Probe(lambda p, g, hp: np.ones(3)))
    prog = btjit.trace(loss, params0(), *quad_batches(1)[0], optimizer=Probe(lambda p, g, hp: hp["lr"] * 1.0),
                       dtype="float64")
    prog.step(*quad_batches(1)[0])              # a 0-d new param is broadcast (as numpy would)
    assert (prog.params["w"] == 0.1).all() and (prog.params["g"] == 0.1).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_user_update_over_a_param_larger_than_the_cache_matches_numpy(threads):
    # 1.5M float64s: the update's chain streams ~36 MB, so it prefetches each next block whole (btjit/kernels/
    # fused.py); 1.5M + 5 is not a multiple of the block, so the last block is partial
    n = 3 * 2 ** 19 + 5
    rng = np.random.default_rng(1)
    w0, xs = rng.standard_normal(n), [rng.standard_normal(n) for _ in range(3)]
    prog = btjit.trace(lambda p, x: btjit.sum(p["w"] * x), {"w": w0}, xs[0], optimizer=MyLion(lr=0.01, weight_decay=0.1),
                       threads=threads, dtype="float64")
    w, m = w0.copy(), np.zeros(n)
    for x in xs:
        prog.step(x)
        c = 0.9 * m + 0.1 * x
        w = w * (1 - 0.01 * 0.1) - 0.01 * np.sign(c)
        m = 0.99 * m + 0.01 * x
    np.testing.assert_allclose(prog.params["w"], w, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(prog.opt_state["exp_avg"]["w"], m, rtol=1e-12, atol=1e-13)
