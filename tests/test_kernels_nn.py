# Tests for btjit/kernels/nn.py and the elementwise helpers of btjit/kernels/common.py: fexp / ftanh / cvt,
# LayerNorm, cross-entropy, GELU and the embedding gather / scatter-add, forward and backward, on float32 and
# float64 arenas against float64 numpy references (written here), backward kernels also against central finite
# differences of the numpy forward.
# Each test also checks that a kernel writes nothing outside its declared outputs.
import numpy as np
import pytest
from numba import njit

from btjit.kernels.common import FM, cvt, fexp, ftanh
from btjit.kernels import nn as K
from kernel_harness import DTS, Arena, check, fd_grad, gelu_ref, rnd, row


# ---------------------------------------------------------------- common helpers
@njit(**FM)
def _map(x, y, which):
    for i in range(x.shape[0]):
        y[i] = fexp(x[i]) if which == 0 else ftanh(x[i])


@njit(**FM)
def _cvt(a):
    return cvt(a, 0.1)


@pytest.mark.parametrize("dt", DTS)
def test_fexp_ftanh_cvt(dt):
    x = np.linspace(-80, 80, 20001).astype(dt)
    y = np.empty_like(x)
    _map(x, y, 0)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - ref) / ref) < (3e-7 if dt == np.float32 else 1e-15)
    x = np.linspace(-12, 12, 20001).astype(dt)
    _map(x, y, 1)
    assert np.max(np.abs(y - np.tanh(x.astype(np.float64)))) < (5e-7 if dt == np.float32 else 1e-15)
    # saturated where tanh rounds to +-1 in the dtype (a tanh gradient 1 - t^2 is then exactly 0), NaN kept
    x = np.array([9.5, 12.0, 36.0, np.inf, -9.5, -40.0, -np.inf, np.nan], dt)
    y = np.empty_like(x)
    _map(x, y, 1)
    ref = np.tanh(x.astype(np.float64)).astype(dt)
    np.testing.assert_allclose(y, ref, rtol=0, atol=0 if dt == np.float32 else 1e-15)
    c = _cvt(np.zeros(1, dt))
    assert type(c) in (float, np.float32, np.float64) and c == dt(0.1)


# ---------------------------------------------------------------- LayerNorm
def ln_ref(x, g, b, eps):
    mu = x.mean(-1)
    rs = 1.0 / np.sqrt(x.var(-1) + eps)
    return (x - mu[:, None]) * rs[:, None] * g + b, mu, rs


def ln_bwd_ref(x, g, dy, eps):
    _, mu, rs = ln_ref(x, g, 0.0, eps)
    xh = (x - mu[:, None]) * rs[:, None]
    gy = dy * g
    dx = rs[:, None] * (gy - gy.mean(-1, keepdims=True) - xh * (gy * xh).mean(-1, keepdims=True))
    return dx, (dy * xh).sum(0), dy.sum(0)


def run_ln(dt, x, g, b, dy, eps):
    M, C = x.shape
    ar = Arena(dt)
    oe = ar.put("eps", np.array([eps]))
    ox, og, ob, ody = ar.put("x", x), ar.put("g", g), ar.put("b", b), ar.put("dy", dy)
    oy, om, orr = ar.put("y", size=M * C), ar.put("mean", size=M), ar.put("rstd", size=M)
    odx, odg, odb = ar.put("dx", size=M * C), ar.put("dg", size=C), ar.put("db", size=C)
    a = ar.build()
    ia = np.zeros(1, np.int32)
    K.k_layernorm_fwd(a, ia, row(ox, og, ob, oy, om, orr, M, C, oe))
    K.k_layernorm_bwd(a, ia, row(ox, og, om, orr, ody, odx, odg, odb, M, C))
    ar.only_wrote("y", "mean", "rstd", "dx", "dg", "db")
    return ar


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("M,C", [(8, 24), (32, 24), (5, 7), (1, 3)])
def test_layernorm(dt, M, C):
    rng = np.random.default_rng(M + C)
    x = rnd(rng, (M, C), dt, 2.0) + 0.5
    g, b, dy = rnd(rng, C, dt) + 1.0, rnd(rng, C, dt), rnd(rng, (M, C), dt)
    eps = float(dt(1e-5))
    ar = run_ln(dt, x, g, b, dy, eps)
    y, mu, rs = ln_ref(x, g, b, eps)
    check(ar.get("y", (M, C)), y, dt)
    check(ar.get("mean"), mu, dt)
    check(ar.get("rstd") / rs, np.ones(M), dt)
    dx, dg, db = ln_bwd_ref(x, g, dy, eps)
    check(ar.get("dx", (M, C)), dx, dt)
    check(ar.get("dg"), dg, dt)
    check(ar.get("db"), db, dt)


def test_layernorm_bwd_finite_diff():
    rng = np.random.default_rng(11)
    M, C, eps = 3, 5, 1e-5
    x, g, b, dy = (rnd(rng, (M, C), np.float64), rnd(rng, C, np.float64), rnd(rng, C, np.float64),
                   rnd(rng, (M, C), np.float64))
    ar = run_ln(np.float64, x, g, b, dy, eps)
    dx_fd = fd_grad(lambda v: (ln_ref(v, g, b, eps)[0] * dy).sum(), x)
    dg_fd = fd_grad(lambda v: (ln_ref(x, v, b, eps)[0] * dy).sum(), g)
    db_fd = fd_grad(lambda v: (ln_ref(x, g, v, eps)[0] * dy).sum(), b)
    for name, fd, refv in zip(("dx", "dg", "db"), (dx_fd, dg_fd, db_fd), ln_bwd_ref(x, g, dy, eps)):
        check(ar.get(name).reshape(fd.shape), fd, np.float64, 1e-7)
        check(refv, fd, np.float64, 1e-7)


# ---------------------------------------------------------------- cross-entropy
def ce_ref(l, t):
    mx = l.max(-1, keepdims=True)
    e = np.exp(l - mx)
    s = e.sum(-1, keepdims=True)
    loss = (np.log(s[:, 0]) + mx[:, 0] - l[np.arange(len(t)), t]).mean()
    return loss, e / s


def run_ce(dt, l, t, g):
    M, V = l.shape
    ar = Arena(dt)
    ol, og = ar.put("logits", l), ar.put("g", np.array([g]))
    oloss, op, od = ar.put("loss", size=1), ar.put("probs", size=M * V), ar.put("dlogits", size=M * V)
    a = ar.build()
    ia = np.full(M + 8, -1, np.int32)
    ia[3:3 + M] = t
    from btjit.graph.ops import IGNORE_NONE
    K.k_ce_fwd(a, ia, row(ol, 3, oloss, op, M, V, IGNORE_NONE, 0))      # ign: none; red 0: mean
    K.k_ce_bwd(a, ia, row(op, 3, og, od, M, V, IGNORE_NONE, 0))
    ar.only_wrote("loss", "probs", "dlogits")
    return ar


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("M,V", [(8, 65), (32, 65), (5, 13), (3, 1), (4, 2)])
def test_cross_entropy(dt, M, V):
    rng = np.random.default_rng(M * V)
    l = rnd(rng, (M, V), dt, 3.0) + 20.0                      # offset: max subtraction matters
    t = rng.integers(0, V, M).astype(np.int32)
    g = 0.75
    ar = run_ce(dt, l, t, g)
    loss, probs = ce_ref(l, t)
    check(ar.get("loss"), [loss], dt)
    check(ar.get("probs", (M, V)), probs, dt)
    oh = np.zeros((M, V))
    oh[np.arange(M), t] = 1
    check(ar.get("dlogits", (M, V)), (probs - oh) * g / M, dt)


def test_cross_entropy_finite_diff_and_extreme():
    rng = np.random.default_rng(9)
    M, V = 4, 7
    l, t = rnd(rng, (M, V), np.float64, 2.0), np.array([0, 6, 3, 3], np.int32)
    ar = run_ce(np.float64, l, t, 1.0)
    check(ar.get("dlogits", (M, V)), fd_grad(lambda v: ce_ref(v, t)[0], l), np.float64, 1e-7)
    for dt in DTS:                                            # huge spread: no overflow / NaN
        l = np.array([[1000.0, -1000.0, 0.0], [-50.0, -50.0, -50.0]])
        ar = run_ce(dt, l, np.array([1, 2], np.int32), 1.0)
        check(ar.get("loss"), [(2000.0 + np.log(3.0)) / 2], dt)
        assert np.all(np.isfinite(ar.get("probs")))


# ---------------------------------------------------------------- GELU
def gelu_grad_ref(x):
    k = np.sqrt(2 / np.pi)
    th = np.tanh(k * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * k * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("n", [1, 13, 8 * 96, 1001])
@pytest.mark.parametrize("scale", [1.0, 3.0, 30.0])
def test_gelu(dt, n, scale):
    rng = np.random.default_rng(n)
    x, dy = rnd(rng, n, dt, scale), rnd(rng, n, dt)
    ar = Arena(dt)
    ox, ody, oy, odx = ar.put("x", x), ar.put("dy", dy), ar.put("y", size=n), ar.put("dx", size=n)
    a = ar.build()
    ia = np.zeros(1, np.int32)
    K.k_gelu_fwd(a, ia, row(ox, oy, n))
    K.k_gelu_bwd(a, ia, row(ox, ody, odx, n))
    ar.only_wrote("y", "dx")
    check(ar.get("y"), gelu_ref(x), dt)
    check(ar.get("dx"), gelu_grad_ref(x) * dy, dt)
    eps = 1e-6                                                # analytic reference vs elementwise central FD
    check(gelu_grad_ref(x), (gelu_ref(x + eps) - gelu_ref(x - eps)) / (2 * eps), np.float64, 1e-7)


# ---------------------------------------------------------------- embedding gather / scatter-add
@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("V,C,n", [(65, 24, 8), (65, 24, 32), (13, 7, 5), (3, 5, 11)])
def test_gather_scatter(dt, V, C, n):
    rng = np.random.default_rng(V + C + n)
    table, g = rnd(rng, (V, C), dt), rnd(rng, (n, C), dt)
    idx = rng.integers(0, V, n).astype(np.int32)
    idx[-1] = idx[0]                                          # guaranteed repeat
    ar = Arena(dt)
    ot, og, oo, odt = ar.put("table", table), ar.put("g", g), ar.put("out", size=n * C), ar.put("dtable", size=V * C)
    a = ar.build()
    ia = np.full(n + 6, 99999, np.int32)
    ia[2:2 + n] = idx
    K.k_gather_rows(a, ia, row(ot, 2, oo, n, C))
    K.k_scatter_add_rows(a, ia, row(og, 2, odt, n, V, C))
    ar.only_wrote("out", "dtable")
    check(ar.get("out", (n, C)), table[idx], dt)
    ref = np.zeros((V, C))
    np.add.at(ref, idx, g)
    check(ar.get("dtable", (V, C)), ref, dt)
