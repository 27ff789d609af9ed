"""Every op of the op table: native forward vs its numpy reference (float64 and float32), and the compiled
gradient vs central finite differences in float64. Parametrized over TABLE: a new op is tested by adding
cases to its entry."""
import numpy as np
import pytest

import btjit
from btjit.graph import trace as T
from btjit.graph.ops import TABLE
from btjit.testing import check_grads

CASES = [(name, i) for name, d in TABLE.items() for i in range(len(d.cases))]


def _make(name, case, seed=0):
    rng = np.random.default_rng(seed)
    params, consts, ints = {}, {}, []
    spec = []
    for j, arg in enumerate(case.args):
        kind, shape = arg[0], arg[1]
        if kind == "f":
            dom = arg[2]
            x = rng.normal(size=shape)
            if dom == "pos":
                x = rng.uniform(0.5, 2.0, size=shape)
            elif dom == "away":
                x = np.sign(x) * (0.3 + np.abs(x))
            params[f"p{j}"] = x
            spec.append(("p", f"p{j}"))
        elif kind == "mask":
            consts[j] = rng.random(shape) < 0.5
            spec.append(("c", j))
        else:
            ints.append(rng.integers(0, arg[2], size=shape).astype(np.int32))
            spec.append(("i", len(ints) - 1))
    return params, consts, ints, spec


def _fn(name, case, consts, spec, weights):
    def fn(p, *ints):
        args = []
        for kind, k in spec:
            args.append(p[k] if kind == "p" else T.lift(consts[k]) if kind == "c" else ints[k])
        out = T.emit(name, args, **case.attrs)
        out = out[0] if isinstance(out, tuple) else out
        out = out.astype(float) if out.node.dtype == "i32" else out       # positions (argsort): compared as floats
        return btjit.sum(out * weights), {"y": out}
    return fn


def _ref_inputs(params, consts, ints, spec):
    return [params[k] if kind == "p" else consts[k].astype(np.float64) if kind == "c" else ints[k]
            for kind, k in spec]


@pytest.mark.parametrize("name,i", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_forward_matches_reference(name, i, dtype):
    d = TABLE[name]
    case = d.cases[i]
    params, consts, ints, spec = _make(name, case)
    want = d.ref(_ref_inputs(params, consts, ints, spec), case.attrs)[0]
    w = np.random.default_rng(1).normal(size=np.shape(want))
    fn = _fn(name, case, consts, spec, w)
    prog = btjit.trace(fn, {k: v.astype(dtype) for k, v in params.items()}, *ints, dtype=dtype, grad=False)
    loss = prog.forward(*ints)
    got = prog.outputs["y"]
    tol = 1e-12 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(got, want, rtol=tol * 10, atol=tol * 10)
    assert abs(loss - float(np.sum(want * w))) <= 1e-4 * max(1.0, abs(loss)) if dtype == "float32" else \
        abs(loss - float(np.sum(want * w))) <= 1e-10 * max(1.0, abs(loss))


GRAD_CASES = [(n, i) for n, i in CASES if not TABLE[n].internal and not TABLE[n].nondiff]


@pytest.mark.parametrize("name,i", GRAD_CASES)
def test_gradient_matches_finite_differences(name, i):
    case = TABLE[name].cases[i]
    params, consts, ints, spec = _make(name, case, seed=i)
    out = TABLE[name].ref(_ref_inputs(params, consts, ints, spec), case.attrs)[0]
    w = np.random.default_rng(2).normal(size=np.shape(out))
    fn = _fn(name, case, consts, spec, w)
    check_grads(lambda p, *b: fn(p, *b)[0], params, *ints, rtol=max(case.tol, 1e-6))


def test_every_op_has_reference_lowering_and_cases():
    for name, d in TABLE.items():
        assert callable(d.ref) and callable(d.lower) and callable(d.infer), name
        if not d.internal:
            assert d.cases, f"op {name} has no test cases"
            assert d.nondiff or d.vjp is not None, f"op {name} has no VJP rule"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_lone_op_with_one_number_runs_its_loop_and_matches_numpy(dtype):
    # between two products nothing fuses with it: k_binary's loops of one number (both operand orders)
    from btjit.kernels.library import LIBRARY
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(6, 5)).astype(dtype), rng.normal(size=(5, 7)).astype(dtype)
    s = dtype(0.37)
    cases = {"x*s": (lambda h: h * s, lambda h: h * s), "s*x": (lambda h: s * h, lambda h: s * h),
             "x/s": (lambda h: h / s, lambda h: h / s), "s/x": (lambda h: s / h, lambda h: s / h),
             "x+s": (lambda h: h + s, lambda h: h + s), "s+x": (lambda h: s + h, lambda h: s + h),
             "x-s": (lambda h: h - s, lambda h: h - s), "s-x": (lambda h: s - h, lambda h: s - h)}
    for name, (f, ref) in cases.items():
        prog = btjit.trace(lambda p, x: f(x @ p["b"]) @ p["c"], {"b": b, "c": b.T.copy()}, a, dtype=dtype.__name__)
        entries = {LIBRARY.entry_of(o)[0] for o in prog.tape[:, 0]}
        assert "k_binary" in entries, (name, entries)
        want = ref((a.astype(np.float64) @ b).astype(dtype)).astype(dtype) @ b.T
        tol = 1e-5 if dtype == np.float32 else 1e-13
        np.testing.assert_allclose(prog(a), want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=name)
        at = lambda v: prog.a[prog.plan.off[v.id]:][:v.size].reshape(v.shape)   # noqa: E731 -- a value's arena view
        e = prog.graph.eqns[1]                                    # the op, exactly numpy's on the product it read
        np.testing.assert_array_equal(at(e.outs[0]), ref(at(prog.graph.eqns[0].outs[0])), name)
