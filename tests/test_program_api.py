"""A Program as a user meets it, on a small MLP: trace-time warnings and errors (an unused parameter, a shape
mismatch naming the line, data-dependent control flow, an unsupported numpy function, an int where floats are
needed), value_and_grad without gradients, step()'s checks of its batch; training drives the loss down, a
forward-only program returns its outputs, state_dict round trips exactly, skip_nonfinite leaves everything
untouched, and assigning a param copies it into the arena."""
import numpy as np
import pytest

import btjit


def _mlp(seed=0, n_in=4, n_h=16, n_out=3):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(0, 0.5, (n_in, n_h)), "b1": np.zeros(n_h),
            "w2": rng.normal(0, 0.5, (n_h, n_out)), "b2": np.zeros(n_out)}


def mlp_loss(p, x, y):
    h = btjit.tanh(x @ p["w1"] + p["b1"])
    return btjit.cross_entropy(h @ p["w2"] + p["b2"], y)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] * x[:, 2] > 0)).astype(np.int32)
    return x, y


# ----------------------------------------------------------------------------- trace-time warnings and errors
def test_unused_param_gets_zero_grad_and_a_warning():
    x, y = _data()
    params = {**_mlp(), "unused": np.ones(3)}
    with pytest.warns(UserWarning, match="'unused' does not reach the loss"):
        prog = btjit.trace(mlp_loss, params, x, y, optimizer=btjit.optim.SGD(lr=0.1, weight_decay=0.0), dtype="float64")
    prog.step(x, y)
    assert np.all(prog.grads["unused"] == 0) and np.all(prog.params["unused"] == 1)


def test_shape_error_names_op_shapes_and_line():
    def bad(p, x):
        return btjit.sum(x @ p["w"])
    with pytest.raises(btjit.TraceError, match=r"matmul: .*\(64, 16\) and \(32, 8\).*test_program_api.py:\d+"):
        btjit.trace(bad, {"w": np.zeros((32, 8))}, np.zeros((64, 16)), grad=False)


def test_data_dependent_control_flow_is_a_clear_error():
    def bad(p, x):
        y = btjit.sum(x * p["w"])
        if y > 0:
            return y
        return -y
    with pytest.raises(btjit.TraceError, match=r"data-dependent control flow.*test_program_api.py"):
        btjit.trace(bad, {"w": np.zeros(3)}, np.zeros(3))


def test_unsupported_numpy_function_and_int_as_float():
    with pytest.raises(btjit.TraceError, match="np.nanmedian is not supported"):
        btjit.trace(lambda p: btjit.sum(np.nanmedian(p["w"])), {"w": np.zeros(3)}, grad=True)
    with pytest.raises(btjit.TraceError, match="integer array where floats are needed"):
        btjit.trace(lambda p, i: btjit.sum(p["w"] * i), {"w": np.zeros(3)}, np.zeros(3, np.int32), grad=True)
    with pytest.raises(TypeError, match="parameter 'w' has dtype int64"):
        btjit.trace(lambda p: btjit.sum(p["w"]), {"w": np.zeros(3, np.int64)})


def test_value_and_grad_of_a_program_without_gradients_says_how():
    x, y = _data()
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y)
    with pytest.raises(RuntimeError, match=r"computes no gradients: trace it with btjit.trace\(..., grad=True\)"):
        prog.value_and_grad(x.astype(np.float32), y)
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y, grad=True)
    assert prog.value_and_grad(x.astype(np.float32), y) == prog.forward(x.astype(np.float32), y)


def test_step_rejects_wrong_batches():
    x, y = _data()
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y, optimizer=btjit.optim.SGD(lr=0.1))
    with pytest.raises(ValueError,
                       match=r"argument 0 \(x\): expected float32 array of shape \(64, 4\), got float32 \(32, 4\)"):
        prog.step(x[:32].astype(np.float32), y)
    with pytest.raises(ValueError, match=r"argument 0 \(x\): expected float32"):
        prog.step(x, y)     # float64
    with pytest.raises(ValueError, match=r"argument 1 \(y\): index values must be in \[0, 3\)"):
        prog.step(x.astype(np.float32), np.full(64, 7, np.int32))
    with pytest.raises(TypeError, match="expected 2 batch arguments"):
        prog.step(x.astype(np.float32))


# ----------------------------------------------------------------------------- training
def test_mlp_training_drives_the_loss_far_down():
    x, y = _data(256)
    prog = btjit.trace(mlp_loss, _mlp(), x.astype(np.float32), y, optimizer=btjit.optim.SGD(lr=0.5, momentum=0.9))
    first = prog.forward(x.astype(np.float32), y)
    for _ in range(300):
        last = prog.step(x.astype(np.float32), y)
    assert first > 0.8 and last < 0.1 * first


def test_forward_only_program_returns_outputs():
    p = _mlp()
    x, _ = _data(5)
    prog = btjit.trace(lambda p, x: btjit.tanh(x @ p["w1"] + p["b1"]), p, x, dtype="float64")
    np.testing.assert_allclose(prog(x), np.tanh(x @ p["w1"] + p["b1"]), rtol=1e-12)
    with pytest.raises(RuntimeError, match="without an optimizer"):
        prog.step(x)


def test_state_dict_round_trip_is_exact():
    x, y = _data()
    x = x.astype(np.float32)
    prog = btjit.trace(mlp_loss, _mlp(), x, y, optimizer=btjit.optim.AdamW(lr=0.01))
    for _ in range(3):
        prog.step(x, y)
    sd = prog.state_dict()
    other = btjit.trace(mlp_loss, _mlp(seed=9), x, y, optimizer=btjit.optim.AdamW(lr=0.01))
    other.load_state_dict(sd)
    assert other.step(x, y) == prog.step(x, y)
    for k in prog.params:
        np.testing.assert_array_equal(other.params[k], prog.params[k])


def test_skip_nonfinite_leaves_params_and_state_untouched():
    x, y = _data()
    x = x.astype(np.float32)
    prog = btjit.trace(lambda p, x, y: mlp_loss(p, x, y) * btjit.sqrt(p["s"]), {**_mlp(), "s": np.ones(())}, x, y,
                       optimizer=btjit.optim.AdamW(lr=0.01), skip_nonfinite=True)
    prog.step(x, y)
    assert not prog.last_step_skipped and prog.step_count == 1
    prog.params["s"][...] = -1.0                       # sqrt(-1) = NaN: loss and every gradient non-finite
    before = prog.state_dict()
    loss = prog.step(x, y)
    assert np.isnan(loss) and prog.last_step_skipped
    after = prog.state_dict()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    prog.params["s"][...] = 1.0
    prog.step(x, y)
    assert not prog.last_step_skipped and prog.step_count == 2


def test_assigning_a_param_copies_it_into_the_arena():
    """prog.params[name] = array loads the values (the program then computes with them, and state_dict saves
    what it computes with); an unknown name or another shape is an error naming it."""
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(5, 3)), "b": np.zeros(3)}
    x, y = rng.normal(size=(4, 5)), np.array([0, 1, 2, 1])
    prog = btjit.trace(lambda p, x, y: btjit.cross_entropy(x @ p["w"] + p["b"], y), p, x, y, dtype="float64",
                       optimizer=btjit.optim.SGD(lr=0.1))
    prog.params["w"] = np.zeros((5, 3))
    assert prog.forward(x, y) == pytest.approx(np.log(3.0), rel=1e-14)
    assert np.all(prog.state_dict()["param/w"] == 0.0)
    with pytest.raises(ValueError, match=r"prog.params\['w'\].*\(2, 2\).*\(5, 3\)"):
        prog.params["w"] = np.zeros((2, 2))
    with pytest.raises(KeyError, match="no such param"):
        prog.params["q"] = 1.0
