"""Buffers and btjit.assign: state a step reads and writes without training it (issue 28 item 1), the eval
program sharing the arena (item 2), and buffers through state_dict, checkpoints and exports."""
import numpy as np
import pytest

import btjit
from btjit.graph.trace import TraceError


def _ema(p, x):
    btjit.assign(p["rm"], p["rm"] * 0.9 + x.mean(axis=0) * 0.1)
    btjit.assign(p["n"], p["n"] + 1.0)
    h = x @ p["w"] + p["rm"][:2] * 0.0
    return (h * h).mean() if btjit.is_training() else (h * h).mean() * 2.0


def _prog(dtype="float64", **kw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3))
    params = {"w": rng.standard_normal((3, 2))}
    bufs = {"rm": np.zeros(3), "n": np.zeros(())}
    return btjit.trace(_ema, params, x, buffers=bufs, optimizer=btjit.optim.SGD(lr=0.1), dtype=dtype, **kw), x, params


def test_assign_updates_buffer_at_step_end():
    prog, x, params = _prog()
    w = params["w"].copy()
    rm = np.zeros(3)
    for k in range(3):
        loss = prog.step(x + k)
        h = (x + k) @ w
        assert loss == pytest.approx((h * h).mean(), rel=1e-12)        # read the old buffer: no effect here
        w -= 0.1 * 2 * (x + k).T @ h / h.size
        rm = rm * 0.9 + (x + k).mean(0) * 0.1
        np.testing.assert_allclose(prog.buffers["rm"], rm, rtol=1e-13)
        assert prog.buffers["n"] == k + 1
    np.testing.assert_allclose(prog.params["w"], w, rtol=1e-12)
    # forward() and value_and_grad() do not end a step: no assign
    prog.forward(x), prog.value_and_grad(x)
    assert prog.buffers["n"] == 3


def test_eval_shares_params_and_buffers():
    prog, x, _ = _prog()
    prog.step(x)
    n, rm = prog.buffers["n"].copy(), prog.buffers["rm"].copy()
    h = x @ prog.params["w"]
    assert prog.eval(x) == pytest.approx(2 * (h * h).mean(), rel=1e-12)     # is_training() False
    assert prog.buffers["n"] == n and (prog.buffers["rm"] == rm).all()       # assigns not applied
    prog.params["w"][...] = 0.5                                               # an edit seen by both
    assert prog.eval(x) == pytest.approx(2 * ((x @ np.full((3, 2), 0.5)) ** 2).mean(), rel=1e-12)
    ev = next(iter(prog._evals.values()))
    assert np.shares_memory(ev.params["w"], prog.params["w"]) and np.shares_memory(ev.buffers["rm"],
                                                                                    prog.buffers["rm"])
    prog.step(x)                                         # the eval program leaves the train step's state alone
    assert prog.buffers["n"] == n + 1
    assert prog.eval(x[:2]) == pytest.approx(2 * ((x[:2] @ prog.params["w"]) ** 2).mean(), rel=1e-12)


def test_state_dict_round_trip():
    prog, x, _ = _prog()
    prog.step(x)
    d = prog.state_dict()
    assert set(d) >= {"param/w", "buffer/rm", "buffer/n"}
    prog2, _, _ = _prog()
    prog2.load_state_dict(d)
    assert prog.step(x) == prog2.step(x)
    assert (prog.buffers["rm"] == prog2.buffers["rm"]).all() and (prog.params["w"] == prog2.params["w"]).all()
    with pytest.raises(ValueError, match="buffer 'rm'"):
        prog2.load_state_dict({k: v for k, v in d.items() if k != "buffer/rm"})


def test_assign_errors_name_lines():
    x = np.ones((2, 3))

    def twice(p, x):
        btjit.assign(p["b"], x.sum(axis=0))
        btjit.assign(p["b"], x.sum(axis=0))
        return x.sum()
    with pytest.raises(TraceError, match=r"assigned twice: at test_buffers.py:\d+ and at test_buffers.py:\d+"):
        btjit.trace(twice, {}, x, buffers={"b": np.zeros(3)}, grad=False)

    def wrong_shape(p, x):
        btjit.assign(p["b"], x)
        return x.sum()
    with pytest.raises(TraceError, match=r"buffer 'b' is f64\[3\].*f64\[2,3\] — test_buffers.py:\d+"):
        btjit.trace(wrong_shape, {}, x, buffers={"b": np.zeros(3)}, grad=False, dtype="float64")

    def not_a_buffer(p, x):
        btjit.assign(p["w"], p["w"] * 2)
        return (x * p["w"]).sum()
    with pytest.raises(TraceError, match="must be a buffer"):
        btjit.trace(not_a_buffer, {"w": np.ones(3)}, x, buffers={"b": np.zeros(3)}, grad=False)
    with pytest.raises(ValueError, match="name of a parameter"):
        btjit.trace(not_a_buffer, {"w": np.ones(3)}, x, buffers={"w": np.zeros(3)}, grad=False)


def test_no_gradient_through_buffer():
    def f(p, x):
        btjit.assign(p["b"], p["w"] * 3.0)
        return (p["w"] * p["b"]).sum()
    prog = btjit.trace(f, {"w": np.ones(3)}, np.ones(1), buffers={"b": np.full(3, 2.0)}, grad=True, dtype="float64")
    prog.value_and_grad(np.ones(1))
    np.testing.assert_array_equal(prog.grads["w"], np.full(3, 2.0))    # d(w*b)/dw = b: b is a constant
