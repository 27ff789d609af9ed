"""sort / argsort / topk, floor / ceil / round / trunc, x % y (remainder) / fmod / x // y, cumsum / cumprod and diff
as numpy and torch code writes them: values and gradients against torch (float64 and float32), ties (btjit's order
is stable: the lower position first among equal values), finite differences away from the jumps, and the errors."""
import math

import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

torch = pytest.importorskip("torch")


def _run(fn, xs, dtype="float64", w=None):
    """(value, {name: gradient of sum(value * w)}) of fn(*xs) compiled by btjit, xs the params p0, p1, ..."""
    names = [f"p{i}" for i in range(len(xs))]

    def loss(p):
        y = fn(*(p[n] for n in names))
        return btjit.sum(y * (1.0 if w is None else w)), {"y": y}
    prog = btjit.trace(loss, {n: np.asarray(x, dtype) for n, x in zip(names, xs)}, dtype=dtype, grad=True)
    prog.value_and_grad()
    return prog.outputs["y"].copy(), [prog.grads[n].copy() for n in names]


def _torch(fn, xs, dtype="float64", w=None):
    ts = [torch.tensor(np.asarray(x, dtype), requires_grad=True) for x in xs]
    y = fn(*ts)
    (y * (1.0 if w is None else torch.tensor(w, dtype=y.dtype))).sum().backward()
    return y.detach().numpy(), [t.grad.numpy() if t.grad is not None else np.zeros(t.shape, dtype) for t in ts]


def _x(shape, seed=0, scale=2.0):
    return np.random.default_rng(seed).normal(size=shape) * scale


def assert_like_torch(bt, th, xs, dtype="float64"):
    want, _ = _torch(th, xs, dtype)
    w = np.random.default_rng(7).normal(size=want.shape)
    want, want_g = _torch(th, xs, dtype, w)
    got, got_g = _run(bt, xs, dtype, w)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=2e-6, atol=2e-6)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **tol)
    for g, h in zip(got_g, want_g):
        np.testing.assert_allclose(g, h, **tol)


def _v(r):
    return r[0]


# id -> (btjit fn, torch fn, input shapes): no ties in the inputs (normal draws)
CASES = {
    "topk_last": (lambda x: x.topk(3)[0], lambda x: x.topk(3)[0], [(4, 7)]),
    "topk_k1": (lambda x: btjit.topk(x, 1).values, lambda x: torch.topk(x, 1).values, [(5, 13)]),
    "topk_kn": (lambda x: x.topk(6, dim=0)[0], lambda x: x.topk(6, dim=0)[0], [(6, 5)]),
    "topk_dim1_3d": (lambda x: x.topk(2, dim=1, largest=False)[0], lambda x: x.topk(2, dim=1, largest=False)[0],
                     [(3, 5, 4)]),
    "topk_dim0_3d": (lambda x: btjit.topk(x, 2, 0)[0], lambda x: torch.topk(x, 2, 0)[0], [(3, 5, 4)]),
    "topk_batch1": (lambda x: x.topk(4, -1)[0], lambda x: x.topk(4, -1)[0], [(1, 9)]),
    "topk_1d": (lambda x: x.topk(2)[0], lambda x: x.topk(2)[0], [(11,)]),
    "sort_last": (lambda x: _v(x.sort(-1)), lambda x: x.sort(-1)[0], [(4, 7)]),
    "sort_dim0_desc": (lambda x: btjit.sort(x, 0, descending=True)[0], lambda x: torch.sort(x, 0, True)[0],
                       [(5, 3)]),
    "sort_dim1_3d": (lambda x: btjit.sort(x, dim=1).values, lambda x: torch.sort(x, dim=1).values, [(2, 7, 3)]),
    "np.sort": (lambda x: np.sort(x, axis=0), lambda x: torch.sort(x, 0)[0], [(5, 4)]),
    "np.sort_flat": (lambda x: np.sort(x, axis=None), lambda x: torch.sort(x.flatten())[0], [(3, 4)]),
    "np.sort_batch1": (lambda x: np.sort(x), lambda x: torch.sort(x)[0], [(1, 6)]),
    "sort_values_times_indices": (lambda x: x.sort(1)[0] * x.sort(1)[1],
                                  lambda x: x.sort(1)[0] * x.sort(1)[1], [(3, 5)]),
    "gather_topk": (lambda x: x.gather(1, x.topk(2, dim=1)[1]) * 2.0,
                    lambda x: x.gather(1, x.topk(2, dim=1)[1]) * 2.0, [(4, 6)]),
    "take_along_argsort": (lambda x: np.take_along_axis(x * x, np.argsort(x, axis=0), axis=0),
                           lambda x: torch.take_along_dim(x * x, torch.argsort(x, 0), 0), [(5, 3)]),
    "index_by_argsort": (lambda x: x[np.argsort(x[0])], lambda x: x[torch.argsort(x[0])], [(4, 4)]),
    "remainder": (lambda x, y: x % y, lambda x, y: x % y, [(3, 5), (3, 5)]),
    "remainder_scalar": (lambda x: x % 1.5, lambda x: x % 1.5, [(4, 5)]),
    "rmod": (lambda x: 5.0 % x, lambda x: torch.full_like(x, 5.0) % x, [(4, 5)]),
    "np.mod_bcast": (lambda x, y: np.mod(x, y), lambda x, y: torch.remainder(x, y), [(3, 1), (1, 4)]),
    "x.remainder_row": (lambda x, y: x.remainder(y), lambda x, y: x.remainder(y), [(3, 4), (4,)]),
    "fmod": (lambda x, y: np.fmod(x, y), lambda x, y: torch.fmod(x, y), [(3, 5), (3, 5)]),
    "x.fmod_scalar_y": (lambda x, y: x.fmod(y), lambda x, y: x.fmod(y), [(2, 3, 4), ()]),
    "btjit.fmod_bcast": (lambda x, y: btjit.fmod(x, y), lambda x, y: torch.fmod(x, y), [(5,), (2, 1)]),
    "floor": (lambda x: np.floor(x) * x, lambda x: torch.floor(x) * x, [(4, 5)]),
    "ceil": (lambda x: x.ceil() + x, lambda x: x.ceil() + x, [(4, 5)]),
    "round": (lambda x: np.round(x) * x, lambda x: torch.round(x) * x, [(4, 5)]),
    "round_decimals": (lambda x: x.round(decimals=1) + x, lambda x: x.round(decimals=1) + x, [(4, 5)]),
    "trunc": (lambda x: btjit.trunc(x) * x, lambda x: torch.trunc(x) * x, [(4, 5)]),
    "frac": (lambda x: x.frac(), lambda x: x.frac(), [(4, 5)]),
    "floor_divide": (lambda x, y: (x // y) * x, lambda x, y: torch.floor_divide(x.detach(), y.detach()) * x,
                     [(3, 5), (3, 5)]),
    "cumsum": (lambda x: x.cumsum(dim=1), lambda x: x.cumsum(dim=1), [(3, 6)]),
    "np.cumsum_axis0": (lambda x: np.cumsum(x, axis=0), lambda x: torch.cumsum(x, 0), [(5, 2, 3)]),
    "cumsum_long": (lambda x: np.cumsum(x, axis=0), lambda x: torch.cumsum(x, 0), [(300, 2)]),   # the scan
    "cumprod": (lambda x: x.cumprod(dim=1), lambda x: x.cumprod(dim=1), [(3, 7)]),
    "np.cumprod_axis0": (lambda x: np.cumprod(x, axis=0), lambda x: torch.cumprod(x, 0), [(5, 2, 3)]),
    "btjit.cumprod_flat": (lambda x: btjit.cumprod(x), lambda x: torch.cumprod(x.flatten(), 0), [(2, 3)]),
    "diff": (lambda x: np.diff(x, axis=1), lambda x: torch.diff(x, dim=1), [(3, 6)]),
    "diff_n2_dim0": (lambda x: x.diff(n=2, dim=0), lambda x: x.diff(n=2, dim=0), [(5, 4)]),
    "diff_prepend": (lambda x: np.diff(x, prepend=0.5), lambda x: torch.diff(
        x, prepend=torch.full((3, 1), 0.5, dtype=x.dtype)), [(3, 4)]),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(CASES))
def test_against_torch(name, dtype):
    bt, th, shapes = CASES[name]
    xs = [_x(s, seed=i) + (3.0 if i else 0.0) * np.sign(_x(s, seed=i)) for i, s in enumerate(shapes)]
    assert_like_torch(bt, th, xs, dtype)


def test_cumprod_through_zeros():
    x = _x((2, 9))
    x[0, 3] = 0.0
    x[1, [2, 6]] = 0.0
    assert_like_torch(lambda x: x.cumprod(1), lambda x: x.cumprod(1), [x])
    assert_like_torch(lambda x: np.cumprod(x, 1)[:, -1] + 0.0, lambda x: x.prod(1), [x])


TIES = np.array([[1.0, 3.0, 3.0, 2.0, 3.0, 1.0, 0.0, 3.0],
                 [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                 [0.0, -1.0, 5.0, -1.0, 5.0, 0.0, 0.0, 4.0]])


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_at_ties_is_stable(k, largest):
    """Among equal values the lower position comes first: torch.sort(stable=True)'s order (torch's topk leaves it
    unspecified: its values are the same, its positions may differ). The gradient goes to the positions taken."""
    want_i = torch.sort(torch.tensor(TIES), dim=1, descending=largest, stable=True)[1][:, :k]
    th = lambda x: x.gather(1, want_i) * 1.0                                  # noqa: E731
    assert_like_torch(lambda x: x.topk(k, largest=largest)[0], th, [TIES])
    np.testing.assert_array_equal(_run(lambda x: x.topk(k, largest=largest)[1], [TIES])[0], want_i.numpy())
    np.testing.assert_array_equal(_run(lambda x: x.topk(k, largest=largest)[0], [TIES])[0],
                                  torch.topk(torch.tensor(TIES), k, largest=largest)[0].numpy())


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dim", [0, 1])
def test_sort_and_argsort_at_ties_and_nan(descending, dim):
    x = TIES.copy()
    x[2, 3], x[0, 0] = np.nan, np.inf
    x = x if dim == 1 else x.T.copy()
    want_v, want_i = torch.sort(torch.tensor(x), dim=dim, descending=descending, stable=True)
    v, i = _run(lambda t: btjit.sort(t, dim, descending)[0], [x])[0], _run(lambda t: t.argsort(dim, descending), [x])[0]
    np.testing.assert_array_equal(v, want_v.numpy())
    np.testing.assert_array_equal(i, want_i.numpy())
    np.testing.assert_array_equal(_run(lambda t: btjit.argsort(t, dim, descending=descending), [x])[0], i)
    if not descending:
        np.testing.assert_array_equal(_run(lambda t: np.argsort(t, axis=dim, kind="stable"), [x])[0],
                                      np.argsort(x, axis=dim, kind="stable"))


def test_indices_are_floats_that_index():
    """topk's indices are floats (argmax's convention), compare with integer labels, one_hot them, and index."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 5)), rng.integers(0, 5, size=6).astype(np.int32)

    def loss(p, y):
        v, i = p["x"].topk(2)
        hit = btjit.sum((i[:, 0] == y) * 1.0)
        return btjit.sum(btjit.one_hot(i[:, 1], 5) * p["x"]) + hit, {"i": i, "hit": hit}
    prog = btjit.trace(loss, {"x": x}, y, dtype="float64", grad=True)
    prog.value_and_grad(y)
    i = np.argsort(-x, 1, kind="stable")[:, :2]
    assert prog.outputs["i"].dtype == np.float64
    np.testing.assert_array_equal(prog.outputs["i"], i)
    assert prog.outputs["hit"] == (i[:, 0] == y).sum()
    g = np.zeros_like(x)
    g[np.arange(6), i[:, 1]] = 1.0
    np.testing.assert_array_equal(prog.grads["x"], g)


def test_rounding_values_as_numpy_and_python():
    """Halves round to even (numpy's, torch's), x % y has y's sign, fmod x's, x // y is Python's for floats."""
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -3.7, 3.7, 7.0, -7.0, 1.0, 1e300])
    y = np.array([1.5, -1.5, 2.0, -2.0, 0.3, 0.1, 2.0, -2.0, 3.0, 3.0, 0.1, 7.0])
    fns = {"floor": (np.floor, np.floor), "ceil": (np.ceil, np.ceil), "round": (np.round, np.round),
           "trunc": (np.trunc, np.trunc), "rint": (np.rint, np.rint), "math.floor": (math.floor, np.floor),
           "round()": (round, np.round), "math.trunc": (math.trunc, np.trunc), "math.ceil": (math.ceil, np.ceil)}
    for name, (f, ref) in fns.items():
        for dtype in ("float64", "float32"):
            got = _run(lambda t: f(t) + 0.0, [x], dtype)[0]
            np.testing.assert_array_equal(got, ref(x.astype(dtype)), err_msg=f"{name} {dtype}")
    for name, f, ref in [("%", lambda a, b: a % b, np.mod), ("fmod", np.fmod, np.fmod),
                         ("//", lambda a, b: a // b, lambda a, b: np.array([p // q for p, q in zip(a, b)]))]:
        np.testing.assert_array_equal(_run(f, [x, y])[0], ref(x, y), err_msg=name)


@pytest.mark.parametrize("name", ["topk", "sort", "sort_desc_dim0", "remainder", "fmod", "cumprod", "diff"])
def test_gradient_finite_differences(name):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 7)) * 2.0
    y = np.sign(rng.normal(size=(4, 7))) * rng.uniform(0.7, 2.0, size=(4, 7))
    x = np.where(np.abs(np.round(x / y) - x / y) < 0.05, x + 0.2 * y, x)     # off the jumps of x % y
    w = rng.normal(size=(4, 7))
    fns = {"topk": lambda p: btjit.sum(p["x"].topk(3)[0] * w[:, :3]),
           "sort": lambda p: btjit.sum(np.sort(p["x"]) * w),
           "sort_desc_dim0": lambda p: btjit.sum(btjit.sort(p["x"], 0, descending=True)[0] * w),
           "remainder": lambda p: btjit.sum((p["x"] % p["y"]) * w),
           "fmod": lambda p: btjit.sum(btjit.fmod(p["x"], p["y"]) * w),
           "cumprod": lambda p: btjit.sum(btjit.cumprod(p["x"] * 0.5, 1) * w),
           "diff": lambda p: btjit.sum(np.diff(p["x"], n=2, axis=1, append=p["y"][:, :1]) * w[:, :6])}
    check_grads(fns[name], {"x": x, "y": y} if name in ("remainder", "fmod", "diff") else {"x": x})


@pytest.mark.parametrize("fn,match", [
    (lambda x: x.topk(8), r"topk: k=8 out of range: dim -1 of shape \(3, 7\) has size 7, k must be in \[1, 7\]"),
    (lambda x: btjit.topk(x, 0, dim=0), r"topk: k=0 out of range: dim 0 of shape \(3, 7\) has size 3"),
    (lambda x: x.topk(2, dim=2), r"topk: axis 2 out of range for 2-d input"),
    (lambda x: btjit.sort(x, dim=-3), r"sort: axis -3 out of range for 2-d input"),
    (lambda x: np.argsort(x, axis=(0, 1)), r"argsort: dim must be one int, got \(0, 1\)"),
    (lambda x: np.sort(x, order="a"), r"np.sort: order= \(structured arrays\) is not supported"),
    (lambda x: btjit.sum(x[0, 0]).topk(1), r"topk: needs at least 1 dim, got a 0-d value"),
    (lambda x: x % np.ones((2, 7)), r"remainder: shapes \(3, 7\) and \(2, 7\) do not broadcast"),
    (lambda x: btjit.arange(3) % 2, r"remainder: input 0 is an integer array where floats are needed"),
    (lambda x: np.cumprod(x, axis=2), r"cumprod: axis 2 out of range for 2-d input"),
])
def test_errors_name_the_problem(fn, match):
    with pytest.raises(btjit.TraceError, match=match + r".*test_sort_topk_mod.py:\d+"):
        btjit.trace(lambda p: btjit.sum(fn(p["x"])[0] * 1.0), {"x": np.zeros((3, 7))})


def _topk_mod_loss(p, x):
    h = x @ p["w"]
    v, i = h.topk(3)
    return btjit.mean((v % 1.5) * np.floor(v) + h.sort(0)[0][:2].sum()) + btjit.sum(i) * 0.0


def test_exported_program_steps_as_in_process(tmp_path):
    """An exported program (btjit.runtime: no numba) steps as the program does, bit for bit."""
    import btjit.runtime
    rng = np.random.default_rng(0)
    p, xs = {"w": rng.normal(size=(8, 16))}, [rng.normal(size=(40, 8)) for _ in range(3)]
    prog = btjit.trace(_topk_mod_loss, p, xs[0], optimizer=btjit.optim.SGD(lr=0.1), dtype="float64")
    prog.export(tmp_path / "e")
    want = [prog.step(x) for x in xs]
    exported = btjit.runtime.load(tmp_path / "e")
    assert [exported.step(x) for x in xs] == want


def test_argsort_split_over_threads_as_one_thread():
    """k_argsort's rows split over two threads (from 64K elements) compute what one thread does."""
    from btjit.testing import split_kernels
    rng = np.random.default_rng(1)
    p, x = {"w": rng.normal(size=(8, 160)).astype(np.float32)}, rng.normal(size=(512, 8)).astype(np.float32)
    runs = []
    for threads in (1, 2):
        prog = btjit.trace(_topk_mod_loss, p, x, optimizer=btjit.optim.SGD(lr=0.1), threads=threads)
        assert split_kernels(prog).get("k_argsort", 1) == min(threads, prog.threads)
        runs.append(([prog.step(x) for _ in range(2)], prog.params["w"].copy()))
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])
