"""Property-based fuzzing of the whole compiler (hypothesis): random graphs built from the op table's
user-facing ops — random shapes, broadcasting, fan-out, reductions with keepdims, reshapes, transposes,
slices, concatenate/split, matmul, softmax, where, take, layer_norm, cross_entropy, attention, long
elementwise chains (fused into one row), take with an index computed from integers (roll, slice, assignment,
stack, transpose) — each
checked three ways in float64:

  1. the compiled forward (loss and every intermediate value) against a direct numpy evaluation of the
     same random program (an independent numpy implementation of each op, tests/fuzz_builder.py);
  2. the compiled gradient against central finite differences of the compiled forward, element by element;
  3. the native forward+backward against the numpy interpretation of the planned IR (btjit.graph.interp).

Plus a float32 compile of the same program against the float64 result (loose tolerance).

Inputs stay in safe domains: log/sqrt/pow/div get positive (or away-from-zero) operands; relu/abs/max/
maximum/where conditions are used only where every element is at least GAP from a kink or a tie (checked on
the numpy values while the graph is drawn), so finite differences are valid.

CI runs a bounded, derandomized set of examples. To fuzz longer (random seeds, hypothesis's database in
.hypothesis/ replays failures):   BTJIT_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py
Failures found by the fuzzer are kept as explicit regression tests at the end of this file.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings

import btjit
from btjit.graph import interp
from fuzz_builder import NP
from fuzz_programs import programs

_N_LONG = int(os.environ.get("BTJIT_FUZZ_EXAMPLES", "0") or 0)
FUZZ = settings(max_examples=_N_LONG or 100, deadline=None, derandomize=not _N_LONG, print_blob=True,
                suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- the checks
def _trace(fn, params, batch, dtype):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="btjit: parameter")
        return btjit.trace(fn, {k: v.astype(dtype) for k, v in params.items()}, *batch, dtype=dtype, grad=True)


def _fd_grads(prog, params, batch, eps=1e-5):
    """Central finite differences of the compiled float64 forward, element by element."""
    out = {}
    for name, p0 in params.items():
        view = prog.params[name]
        g = np.zeros(p0.shape)
        for i in np.ndindex(*p0.shape):
            view[...] = p0
            view[i] = p0[i] + eps
            fp = prog.forward(*batch)
            view[i] = p0[i] - eps
            fm = prog.forward(*batch)
            g[i] = (fp - fm) / (2 * eps)
        view[...] = p0
        out[name] = g
    return out


@FUZZ
@given(programs())
def test_random_program_forward_gradient_and_interpretation(prog_spec):
    fn, replay, params, batch, expose = prog_spec
    want_loss, want_env = replay(NP, params, batch)
    prog = _trace(fn, params, batch, "float64")
    note(str(prog.graph))

    # 1. forward vs direct numpy
    loss = prog.value_and_grad(*batch)
    scale = max(1.0, abs(float(want_loss)))
    assert abs(loss - float(want_loss)) <= 1e-9 * scale, (loss, float(want_loss))
    if expose:
        for k, v in enumerate(want_env):
            if f"v{k}" in prog.outputs:
                np.testing.assert_allclose(prog.outputs[f"v{k}"], v, rtol=1e-9, atol=1e-9, err_msg=f"v{k}")

    # 2. gradient vs finite differences
    grads = {k: v.copy() for k, v in prog.grads.items()}
    fd = _fd_grads(prog, params, batch)
    for name in params:
        g, f = grads[name], fd[name]
        tol = 1e-7 * scale + 1e-5 * np.abs(f)
        bad = np.abs(g - f) > tol
        assert not bad.any(), f"gradient of {name}: compiled {g[bad][:4]} vs finite differences {f[bad][:4]}"

    # 3. native forward+backward vs the numpy interpretation of the planned IR
    a_ref, _ = interp.run(prog, *batch, upto="backward")
    prog.value_and_grad(*batch)
    g0, n = prog.plan.grads_start, prog.plan.params_span[1]
    np.testing.assert_allclose(prog.a[g0:g0 + n], a_ref[g0:g0 + n], rtol=1e-9, atol=1e-10 * scale)
    assert abs(a_ref[prog.plan.off[prog.graph.loss.id]] - loss) <= 1e-10 * scale


@FUZZ
@given(programs(max_ops=12))
def test_random_program_float32_matches_float64(prog_spec):
    fn, replay, params, batch, _ = prog_spec
    p64, p32 = _trace(fn, params, batch, "float64"), _trace(fn, params, batch, "float32")
    l64, l32 = p64.value_and_grad(*batch), p32.value_and_grad(*batch)
    assert abs(l32 - l64) <= 1e-3 * max(1.0, abs(l64)), (l32, l64)
    for name in params:
        g64 = p64.grads[name]
        np.testing.assert_allclose(p32.grads[name], g64, rtol=0, atol=2e-3 * max(1.0, np.abs(g64).max()),
                                   err_msg=name)


# ----------------------------------------------------------------------------- regressions found by the fuzzer
def test_regression_ellipsis_with_newaxis():
    """x[..., :, None] inserted the new axis in the wrong place: Ellipsis counted None as an input axis."""
    x = np.arange(6.0).reshape(2, 3)
    for idx in [(Ellipsis, slice(None), None), (None, Ellipsis, 0), (Ellipsis, None), (0, None, Ellipsis)]:
        prog = btjit.trace(lambda p: p["x"][idx] * 1.0, {"x": x}, dtype="float64")
        np.testing.assert_array_equal(prog(), x[idx], err_msg=str(idx))


def test_regression_aliased_registers_are_freed_once():
    """A fused chain reading x and broadcast_to(x) (one register) for the last time in one instruction freed
    that register twice; two later values then shared it (found by the fuzzer: log(y*y + 0.5) of
    y = broadcast_to(x) + x, with y kept for the backward, gave a loss of 0)."""
    from btjit.testing import check_grads
    x = np.array([[0.12573022, -0.13210486], [0.64042265, 0.10490012]])
    w = np.random.default_rng(1).normal(size=(2, 1, 2, 2))

    def f(p):
        v = p["x"][..., :, None, :, None]
        y = btjit.broadcast_to(v, (2, 1, 2, 2)) + v
        return btjit.sum(btjit.log(y * y + 0.5) * w)
    v = x[..., :, None, :, None]
    y = np.broadcast_to(v, (2, 1, 2, 2)) + v
    prog = btjit.trace(f, {"x": x}, dtype="float64", grad=True)
    assert prog.value_and_grad() == pytest.approx(float(np.sum(np.log(y * y + 0.5) * w)), rel=1e-12)
    check_grads(f, {"x": x})


def test_regression_np_take_without_axis_flattens():
    """np.take(x, idx) (axis=None) gathered rows instead of indexing the flattened array, as numpy does."""
    x = np.arange(6.0).reshape(2, 3)
    idx = np.array([[5, 0], [1, 4]])
    prog = btjit.trace(lambda p: np.take(p["x"], idx) * 1.0, {"x": x}, dtype="float64")
    np.testing.assert_array_equal(prog(), np.take(x, idx))
    prog = btjit.trace(lambda p: np.take(p["x"], [1, 0], axis=0) * 1.0, {"x": x}, dtype="float64")
    np.testing.assert_array_equal(prog(), np.take(x, [1, 0], axis=0))
    with pytest.raises(btjit.TraceError, match=r"np.take: only axis=0 or axis=None .*axis=1.*test_fuzz.py:\d+"):
        btjit.trace(lambda p: np.take(p["x"], [1], axis=1), {"x": x}, dtype="float64")


def test_regression_array_exponent():
    """x ** ndarray raised 'exponent must be a number or a traced value'; numpy allows an array exponent."""
    rng = np.random.default_rng(0)
    params = {"x": rng.uniform(0.5, 2.0, (3, 4))}
    e = rng.normal(size=(4,))
    prog = btjit.trace(lambda p: p["x"] ** e, params, dtype="float64")
    np.testing.assert_allclose(prog(), params["x"] ** e, rtol=1e-12)
    from btjit.testing import check_grads
    check_grads(lambda p: btjit.sum(p["x"] ** e + p["x"] ** np.float64(3.0)), params)


def test_regression_constant_index_through_reshape_is_range_checked():
    """An int constant reaching take through a reshape skipped take()'s range check: -1 read the word before
    the table (the forward gave 0.0). Now every constant index is checked once, naming the op and line."""
    w = np.arange(6.0).reshape(3, 2)
    for bad in (np.array([[0, -1]]), np.array([[3, 0]])):
        with pytest.raises(btjit.TraceError, match=r"take: constant index values must be in \[0, 3\).*"
                                                   r"test_fuzz.py:\d+"):
            btjit.trace(lambda p: btjit.sum(btjit.take(p["w"], btjit.reshape(bad, (-1,)))), {"w": w},
                        dtype="float64", grad=True)
    ok = np.array([[2, 0]])
    prog = btjit.trace(lambda p: btjit.sum(btjit.take(p["w"], btjit.reshape(ok, (-1,)))), {"w": w},
                       dtype="float64", grad=True)
    assert prog.value_and_grad() == w[[2, 0]].sum()
