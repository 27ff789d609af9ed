"""Update rules with per-param statistics, written against btjit.optim.Optimizer as a user writes them: LARS and
LAMB (trust ratios from norms) against numpy transcriptions, Adafactor (factored second moments: states of
other shapes than the param's) against torch.optim.Adafactor, Muon (Newton-Schulz on 2-D params, AdamW on the
others, by `p.ndim`) against torch.optim.Muon and AdamW. A small MLP, two param groups, 12 steps, a
hyper-parameter changed mid-run, float64 (1e-10) and float32 (1e-5); clip_norm, clip_value and skip_nonfinite
with a per-param rule; state_dict mid-run, an export run by btjit.runtime and the C host, bit for bit. Each rule
is checked on btjit's own gradients (prog.grads after each step), so the update is what is compared."""
import numpy as np
import pytest

import btjit
import btjit.runtime
import btjit.train.checkpoint as K
from btjit.optim import Optimizer
from test_export import CC, c_host_train

SHAPES = {"w1": (6, 12), "b1": (12,), "w2": (12, 3), "b2": (3,)}     # w2 is tall: Muon transposes it
STEPS, CHANGE = 12, 6                   # hyper-parameters change before step CHANGE + 1
GROUPS = [{"params": lambda name, shape: len(shape) == 2, "weight_decay": 0.01},
          {"params": lambda name, shape: len(shape) == 1, "weight_decay": 0.0, "lr_scale": 0.5}]
GROUP_OF = {"w1": 0, "b1": 1, "w2": 0, "b2": 1}
TOL = {np.float64: 1e-10, np.float32: 1e-5}


def params0(dtype):
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(dtype) for k, s in SHAPES.items()}


def data(dtype, steps=STEPS):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((8, 6)).astype(dtype), rng.standard_normal((8, 3)).astype(dtype))
            for _ in range(steps)]


def loss(p, x, y):
    h = np.tanh(x @ p["w1"] + p["b1"])
    return btjit.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def norm(x):
    return np.sqrt(np.sum(x * x))


class LARS(Optimizer):
    """Momentum SGD with a layer-wise trust ratio eta * |p| / (|g| + wd |p|) (You et al. 2017)."""

    def __init__(self, lr=0.1, momentum=0.9, eta=0.01, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, momentum=momentum, eta=eta, weight_decay=weight_decay, groups=groups)

    def init(self, name, p):
        return {"momentum_buffer": np.zeros_like(p)}

    def update(self, p, g, s, hp, step):
        wn, gn = norm(p), np.linalg.norm(g)
        trust = np.where((wn > 0) & (gn > 0), hp["eta"] * wn / (gn + hp["weight_decay"] * wn), 1.0)
        buf = hp["momentum"] * s["momentum_buffer"] + hp["lr"] * trust * (g + hp["weight_decay"] * p)
        return p - buf, {"momentum_buffer": buf}


class LAMB(Optimizer):
    """Adam's direction plus decoupled decay, scaled per param by |p| / |direction| (You et al. 2019)."""

    def __init__(self, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=groups)

    def init(self, name, p):
        return {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}

    def update(self, p, g, s, hp, step):
        b1, b2 = hp["betas"]
        m, v = b1 * s["exp_avg"] + (1 - b1) * g, b2 * s["exp_avg_sq"] + (1 - b2) * g * g
        u = m / (1 - b1 ** step) / (np.sqrt(v / (1 - b2 ** step)) + hp["eps"]) + hp["weight_decay"] * p
        wn, un = norm(p), (u ** 2).sum() ** 0.5
        trust = np.where((wn > 0) & (un > 0), wn / un, 1.0)
        return p - hp["lr"] * trust * u, {"exp_avg": m, "exp_avg_sq": v}


def lars_np(p, g, s, hp, t):
    wn, gn = np.linalg.norm(p), np.linalg.norm(g)
    trust = hp["eta"] * wn / (gn + hp["weight_decay"] * wn) if wn > 0 and gn > 0 else 1.0
    buf = hp["momentum"] * s["momentum_buffer"] + hp["lr"] * trust * (g + hp["weight_decay"] * p)
    return p - buf, {"momentum_buffer": buf}


def lamb_np(p, g, s, hp, t):
    b1, b2 = hp["betas"]
    m, v = b1 * s["exp_avg"] + (1 - b1) * g, b2 * s["exp_avg_sq"] + (1 - b2) * g * g
    u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + hp["eps"]) + hp["weight_decay"] * p
    wn, un = np.linalg.norm(p), np.linalg.norm(u)
    return p - hp["lr"] * (wn / un if wn > 0 and un > 0 else 1.0) * u, {"exp_avg": m, "exp_avg_sq": v}


class Adafactor(Optimizer):
    """torch.optim.Adafactor: row and column mean squares for a matrix ((r, 1) and (1, c)), a full second moment
    for a vector; relative step size, update clipping by its RMS."""

    def __init__(self, lr=1e-2, beta2_decay=-0.8, eps2=1e-3, d=1.0, weight_decay=0.0, groups=None):
        super().__init__(lr=lr, beta2_decay=beta2_decay, eps2=eps2, d=d, weight_decay=weight_decay, groups=groups)

    def init(self, name, p):
        if p.ndim > 1:
            return {"row_var": np.zeros(p.shape[:-1] + (1,)), "col_var": np.zeros(p.shape[:-2] + (1,) + p.shape[-1:])}
        return {"variance": np.zeros_like(p)}

    def update(self, p, g, s, hp, step):
        eps1 = np.finfo(p.dtype).eps                              # torch's eps=(None, ...)
        w = step ** hp["beta2_decay"]
        alpha = np.maximum(hp["eps2"], np.linalg.norm(p) / p.size ** 0.5) * np.minimum(hp["lr"], 1 / np.sqrt(step))
        p = p * (1 - hp["lr"] * hp["weight_decay"])
        if g.ndim > 1:
            row = s["row_var"] + w * ((g * g).mean(axis=-1, keepdims=True) - s["row_var"])
            col = s["col_var"] + w * ((g * g).mean(axis=-2, keepdims=True) - s["col_var"])
            var, new = row @ col / np.maximum(row.mean(axis=-2, keepdims=True), eps1), {"row_var": row, "col_var": col}
        else:
            var = s["variance"] + w * (g * g - s["variance"])
            new = {"variance": var}
        u = g / np.sqrt(np.maximum(var, eps1 * eps1))
        return p - alpha / np.maximum(1.0, np.linalg.norm(u) / (u.size ** 0.5 * hp["d"])) * u, new


class Muon(Optimizer):
    """torch.optim.Muon on 2-D params (nesterov momentum, 5 Newton-Schulz steps, lr * sqrt(max(1, rows / cols)));
    torch.optim.AdamW on the others."""
    ns = (3.4445, -4.7750, 2.0315)

    def __init__(self, lr=0.02, momentum=0.95, weight_decay=0.1, eps=1e-7, betas=(0.9, 0.999), adam_eps=1e-8,
                 groups=None):
        super().__init__(lr=lr, momentum=momentum, weight_decay=weight_decay, eps=eps, betas=betas,
                         adam_eps=adam_eps, groups=groups)

    def init(self, name, p):
        if p.ndim == 2:
            return {"momentum_buffer": np.zeros_like(p)}
        return {"exp_avg": np.zeros_like(p), "exp_avg_sq": np.zeros_like(p)}

    def update(self, p, g, s, hp, step):
        p = p * (1 - hp["lr"] * hp["weight_decay"])
        if p.ndim != 2:
            (b1, b2), m, v = hp["betas"], s["exp_avg"], s["exp_avg_sq"]
            m, v = m + (1 - b1) * (g - m), b2 * v + (1 - b2) * g * g
            denom = np.sqrt(v) / np.sqrt(1 - b2 ** step) + hp["adam_eps"]
            return p - hp["lr"] / (1 - b1 ** step) * m / denom, {"exp_avg": m, "exp_avg_sq": v}
        buf = s["momentum_buffer"] + (1 - hp["momentum"]) * (g - s["momentum_buffer"])
        x = buf - (buf - g) * (1 - hp["momentum"])               # torch's g.lerp(buf, momentum)
        tall = p.shape[0] > p.shape[1]
        x = x.T if tall else x
        x = x / np.maximum(np.linalg.norm(x), hp["eps"])
        a, b, c = self.ns
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if tall else x
        return p - hp["lr"] * max(1, p.shape[0] / p.shape[1]) ** 0.5 * x, {"momentum_buffer": buf}


def run(opt, dtype, steps=STEPS, change=None, prog=None, start=0, **kw):
    """btjit's steps [start, steps); change(prog) before step CHANGE + 1; -> (prog, [grads of each step])."""
    prog = prog or btjit.trace(loss, params0(dtype), *data(dtype)[0], optimizer=opt, dtype=dtype, **kw)
    grads = []
    for t, b in enumerate(data(dtype, steps)[start:], start):
        if t == CHANGE and change:
            change(prog)
        prog.step(*b)
        grads.append({k: v.copy() for k, v in prog.grads.items()})
    return prog, grads


def set_hp(**kw):
    def change(prog):
        for k, v in kw.items():
            prog.hp[k] = v
    return change


def numpy_run(rule, opt, grads, dtype, change=None, clip=lambda g: g):
    """rule's steps on btjit's gradients, each param with its group's hyper-parameters (lr * lr_scale)."""
    p, s = params0(dtype), {k: opt.init(k, v) for k, v in params0(dtype).items()}
    groups = [dict(opt.hp, **{k: v for k, v in g.items() if k != "params"}) for g in GROUPS]
    for t, g in enumerate(grads, 1):
        for grp in groups if t == CHANGE + 1 and change else ():
            grp.update(change)
        g = clip(g)
        for k in p:
            hp = dict(groups[GROUP_OF[k]])
            hp["lr"] = opt.hp["lr"] * hp.get("lr_scale", 1.0)
            p[k], s[k] = rule(p[k], g[k], s[k], hp, t)
    return p, s


def close(got, want, dtype, err_msg=""):
    scale = max(np.abs(want).max(), 1e-3)
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale, err_msg=err_msg)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("make,rule", [(lambda: LARS(lr=0.5, groups=GROUPS), lars_np),
                                       (lambda: LAMB(lr=0.02, groups=GROUPS), lamb_np)], ids=["lars", "lamb"])
def test_trust_ratio_rules_match_numpy(make, rule, dtype):
    prog, grads = run(make(), dtype, change=set_hp(weight_decay=0.05))
    assert prog.hp.groups[0]["weight_decay"] == dtype(0.05) and prog.step_count == STEPS
    want, state = numpy_run(rule, make(), grads, dtype, {"weight_decay": 0.05})
    for k in SHAPES:
        close(prog.params[k], want[k], dtype, k)
        for n, v in state[k].items():
            close(prog.opt_state[n][k], v, dtype, f"{n} {k}")


def torch_run(make_opts, grads, dtype, change=None):
    """torch's optimizers (make_opts(params) -> list) stepped on btjit's gradients; change(opts) before CHANGE + 1:
    ({name: torch's param}, the optimizers)."""
    torch = pytest.importorskip("torch")
    p = {k: torch.tensor(v) for k, v in params0(dtype).items()}
    opts = make_opts(p)
    for t, g in enumerate(grads):
        if t == CHANGE and change:
            change(opts)
        for k, v in g.items():
            p[k].grad = torch.tensor(v)
        for o in opts:
            o.step()
    return p, opts


def check_torch(prog, p, opts, dtype):
    """prog's params and optimizer state against torch's."""
    for k, tp in p.items():
        close(prog.params[k], tp.numpy(), dtype, k)
        for n, v in next(o.state[tp] for o in opts if tp in o.state).items():
            if n != "step":
                close(prog.opt_state[n][k], v.numpy(), dtype, f"{n} {k}")


def torch_groups(p, names, lr):
    """GROUPS as torch's param groups of the params `names` (each group's lr = lr * lr_scale)."""
    return [{"params": [p[k] for k in names if GROUP_OF[k] == i], "lr": lr * g.get("lr_scale", 1.0),
             **{k: v for k, v in g.items() if k not in ("params", "lr_scale")}}
            for i, g in enumerate(GROUPS) if any(GROUP_OF[k] == i for k in names)]


def lr_to(lr):
    def change(opts):
        for o in opts:
            for grp in o.param_groups:
                grp["lr"] = lr * grp["lr"] / o.defaults["lr"]
    return change


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adafactor_matches_torch(dtype):
    torch = pytest.importorskip("torch")
    prog, grads = run(Adafactor(groups=GROUPS), dtype, change=lambda pr: setattr(pr, "lr", 0.005))
    assert {k: v.shape for k, v in prog.opt_state["row_var"].items()} == {"w1": (6, 1), "w2": (12, 1)}
    assert set(prog.opt_state["variance"]) == {"b1", "b2"}
    check_torch(prog, *torch_run(lambda p: [torch.optim.Adafactor(torch_groups(p, SHAPES, 0.01), lr=0.01,
                                                                  foreach=False)], grads, dtype, lr_to(0.005)), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_muon_matches_torch_muon_and_adamw(dtype, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())    # torch's Newton-Schulz in dtype
    prog, grads = run(Muon(groups=GROUPS), dtype, change=lambda pr: setattr(pr, "lr", 0.01))
    check_torch(prog, *torch_run(lambda p: [
        torch.optim.Muon(torch_groups(p, ["w1", "w2"], 0.02), lr=0.02),
        torch.optim.AdamW(torch_groups(p, ["b1", "b2"], 0.02), lr=0.02, foreach=False)], grads, dtype, lr_to(0.01)),
        dtype)


def clip_by_norm(max_norm):
    def clip(g):
        total = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in g.values()))
        return {k: v * min(1.0, max_norm / (total + 1e-6)) for k, v in g.items()}
    return clip


@pytest.mark.parametrize("make,rule,kw,clip", [
    (lambda: LAMB(lr=0.02, groups=GROUPS), lamb_np, {"clip_norm": 0.05}, clip_by_norm(0.05)),
    (lambda: LARS(lr=0.5, groups=GROUPS), lars_np, {"clip_value": 0.02},
     lambda g: {k: np.clip(v, -0.02, 0.02) for k, v in g.items()}),
], ids=["clip_norm", "clip_value"])
def test_clipping_applies_to_a_per_param_rule(make, rule, kw, clip):
    prog, grads = run(make(), np.float64, **kw)
    assert any(not np.array_equal(clip(g)[k], g[k]) for g in grads for k in g)          # it clips something
    want, _ = numpy_run(rule, make(), grads, np.float64, clip=clip)
    for k in SHAPES:
        close(prog.params[k], want[k], np.float64, k)


def test_a_non_finite_step_is_skipped_by_a_per_param_rule():
    prog = btjit.trace(loss, params0(np.float64), *data(np.float64)[0], optimizer=Adafactor(groups=GROUPS),
                       dtype="float64", skip_nonfinite=True)
    ref, _ = run(Adafactor(groups=GROUPS), np.float64, steps=4, skip_nonfinite=True)
    (x0, y0), *rest = data(np.float64, 4)
    prog.step(x0, y0)
    before = prog.state_dict()
    prog.step(np.full_like(x0, np.nan), y0)
    assert prog.last_step_skipped and prog.step_count == 1
    for k, v in prog.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    for b in rest:
        prog.step(*b)
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(prog.state_dict()[k], v, err_msg=k)


@pytest.mark.parametrize("make", [lambda: Adafactor(groups=GROUPS), lambda: Muon(groups=GROUPS)],
                         ids=["adafactor", "muon"])
def test_state_dict_and_checkpoint_mid_run_continue_bit_exact(make, tmp_path):
    whole, _ = run(make(), np.float32, change=set_hp(weight_decay=0.02))
    first, _ = run(make(), np.float32, steps=CHANGE + 2, change=set_hp(weight_decay=0.02))
    ck = K.load(K.save(tmp_path, CHANGE + 2, first.state_dict(), {"rng_state": None}))
    resumed = btjit.trace(loss, params0(np.float32), *data(np.float32)[0], optimizer=make(), dtype="float32")
    K.check_compatible(ck, resumed.state_dict())
    resumed.load_state_dict(ck.state)
    assert resumed.step_count == CHANGE + 2 and resumed.hp.groups[1]["weight_decay"] == np.float32(0.02)
    run(None, np.float32, prog=resumed, start=CHANGE + 2)
    ref, got = whole.state_dict(), resumed.state_dict()
    assert ref.keys() == got.keys() and {"opt/row_var", "opt/momentum_buffer"} & set(ref)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def same_in_runtime(prog, rt, batches, at, lr):
    """rt (prog's export) steps as prog does, prog.lr = rt.lr = lr before step `at`: the same losses, state_dict
    and optimizer state, bit for bit."""
    for t, b in enumerate(batches):
        if t == at:
            prog.lr = rt.lr = lr
        assert rt.step(*b) == prog.step(*b)
    ref, got = prog.state_dict(), rt.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    for n, views in prog.opt_state.items():
        assert {k: v.shape for k, v in rt.opt_state[n].items()} == {k: v.shape for k, v in views.items()}
        for k, v in views.items():
            np.testing.assert_array_equal(rt.opt_state[n][k], v, err_msg=f"{n} {k}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_per_param_rule_exports_and_runs_in_the_runtime_bitwise(dtype, tmp_path):
    prog = btjit.trace(loss, params0(dtype), *data(dtype)[0], optimizer=Adafactor(groups=GROUPS), dtype=dtype)
    prog.export(tmp_path / "e")
    same_in_runtime(prog, btjit.runtime.load(tmp_path / "e"), data(dtype, 6), 3, 0.003)
    if CC is None:
        pytest.skip("no C compiler (cc/gcc) on this machine")
    fresh = btjit.trace(loss, params0(dtype), *data(dtype)[0], optimizer=Adafactor(groups=GROUPS), dtype=dtype)
    r = c_host_train(tmp_path, data(dtype, 6), 6)
    assert r.returncode == 0, r.stderr
    as_dtype = np.dtype(dtype).type                                # the C host prints the loss in its dtype
    losses = [as_dtype(fresh.step(*b)) for b in data(dtype, 6)]
    assert [as_dtype(ln.split()[-1]) for ln in r.stdout.splitlines()] == losses


def test_init_and_update_shape_errors_name_the_param():
    class Bad(Adafactor):
        def update(self, p, g, s, hp, step):
            new_p, new = super().update(p, g, s, hp, step)
            return new_p, {k: (v.T if k == "row_var" else v) for k, v in new.items()}
    with pytest.raises(btjit.optim.OptimizerError, match=r"Bad.update for param 'w1': state 'row_var' has shape "
                                                         r"\(1, 6\), not \(6, 1\) \(init's\)"):
        run(Bad(), np.float64, steps=0)
    big = type("Big", (Adafactor,), {"init": lambda self, n, p: {"variance": np.zeros((p.size + 1,))}})
    with pytest.raises(btjit.optim.OptimizerError, match=r"Big.init\('w1'\): state 'variance' has shape \(73,\), "
                                                         r"the param \(6, 12\); a state has at most"):
        run(big(), np.float64, steps=0)
    with pytest.raises(btjit.optim.OptimizerError, match=r"Muon.update reads state\['momentum_buffer'\]; init gave "
                                                         r"param 'w1' \['exp_avg', 'exp_avg_sq'\]"):
        run(type("Muon", (Muon,), {"init": lambda self, n, p: Muon.init(self, n, p[0])})(), np.float64, steps=0)
    with pytest.raises(btjit.TraceError, match=r"np.svd is not supported on traced values — test_optim_perparam.py"):
        run(type("Svd", (LARS,), {"update": lambda self, p, g, s, hp, t: (np.linalg.svd(g)[0], s)})(), np.float64,
            steps=0)
