"""The scalar (micrograd-style) front end: btjit.trace_scalar, both lowerings, node-value files."""
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import btjit
from btjit.bench.workloads import e1   # the paper's E1, written once for every backend
from btjit.scalar.lower import STRAIGHT_LINE_MAX
from btjit.scalar.nodefile import NodeFileError, load_values, save_values

LOWERINGS = ["straight", "tape"]


def e2(a, b, relu=btjit.relu):
    c = a + b
    d = a * b + b ** 3
    c += c + 1
    c += 1 + c + (-a)
    d += d * 2 + relu(b + a)
    d += 3 * d + relu(b - a)
    e = c - d
    f = e ** 2
    g = f / 2
    g += 10.0 / f
    return g, dict(a=a, b=b, c=c, d=d, e=e, f=f, g=g)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_e1(lowering):
    f = btjit.trace_scalar(e1, dtype="float64", lowering=lowering)
    assert f.lowering == lowering and f.arg_names == ["a", "b"]
    value, (da, db) = f(-41.0, 2.0)
    assert value == pytest.approx(612.5, abs=1e-12)
    assert da == pytest.approx(-35.0, abs=1e-12) and db == pytest.approx(1050.0, abs=1e-10)
    assert f(-41, 2) == f(-41.0, 2.0)           # integers are converted, not a new specialization


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_e2_not_burtorch(lowering):
    f = btjit.trace_scalar(e2, lowering=lowering)
    g, (da, db) = f(-4.0, 2.0)
    assert round(g, 4) == 24.7041
    assert round(da, 4) == 138.8338 and round(db, 4) == 645.5773     # BurTorch's relu' bug: 104.125 / 680.286
    nodes = f.values(-4.0, 2.0)
    assert list(nodes) == list("abcdefg")
    assert nodes == pytest.approx(dict(a=-4.0, b=2.0, c=-1.0, d=6.0, e=-7.0, f=49.0, g=24.70408163265306))
    ref_val, ref_grads, ref_named = f.reference(-4.0, 2.0)
    assert g == pytest.approx(ref_val, rel=1e-14) and (da, db) == pytest.approx(ref_grads, rel=1e-13)
    assert nodes == pytest.approx(ref_named, rel=1e-14)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_shared_node_two_backwards(lowering):
    # PAPER.md: x=3, y=x*x, l1=2y, l2=3y; backward(l1); backward(l2) must leave x.grad = 12 + 18 = 30
    # (BurTorch gives 12). In btjit the gradient of several outputs is the gradient of their sum, i.e. the
    # accumulated result of one backward call per output; returning l1 + l2 is the same graph.
    def two_outputs(x):
        y = x * x
        return 2 * y, 3 * y

    def summed(x):
        y = x * x
        return 2 * y + 3 * y

    f2 = btjit.trace_scalar(two_outputs, lowering=lowering)
    (l1, l2), (dx,) = f2(3.0)
    assert (l1, l2) == (18.0, 27.0) and dx == 30.0
    fs = btjit.trace_scalar(summed, lowering=lowering)
    assert fs(3.0) == (45.0, (30.0,))
    vals, grads = f2.many(np.array([[3.0], [1.0]]))
    assert vals.shape == (2, 2) and vals.tolist() == [[18.0, 27.0], [2.0, 3.0]]
    assert grads.tolist() == [[30.0], [10.0]]


# every scalar op: (name, fn, input sampler) -- inputs drawn away from kinks and outside domains
_pos = lambda r: r.uniform(0.3, 2.0)                       # noqa: E731
_any = lambda r: r.uniform(-2.0, 2.0)                      # noqa: E731
_away = lambda r: r.choice([-1, 1]) * r.uniform(0.3, 2.0)  # noqa: E731
OPS = [
    ("add", lambda a, b: a + b, _any, _any),
    ("radd", lambda a, b: 1.5 + a, _any, _any),
    ("sub", lambda a, b: a - b, _any, _any),
    ("rsub", lambda a, b: 3.0 - b, _any, _any),
    ("mul", lambda a, b: a * b, _any, _any),
    ("square", lambda a, b: a * a, _any, _any),
    ("div", lambda a, b: a / b, _any, _away),
    ("rdiv", lambda a, b: 2.0 / b, _any, _away),
    ("neg", lambda a, b: -a + (+b), _any, _any),
    ("exp", lambda a, b: btjit.exp(a), _any, _any),
    ("log", lambda a, b: btjit.log(a), _pos, _any),
    ("tanh", lambda a, b: btjit.tanh(a), _any, _any),
    ("relu", lambda a, b: btjit.relu(a), _away, _any),
    ("sigmoid", lambda a, b: btjit.sigmoid(a), _any, _any),
    ("sqrt", lambda a, b: btjit.sqrt(a), _pos, _any),
    ("abs", lambda a, b: btjit.abs(a) + abs(b), _away, _away),
    ("pow3", lambda a, b: a ** 3, _any, _any),
    ("pow_frac", lambda a, b: a ** -1.5 + b ** 0.5, _pos, _pos),
    ("pow_traced", lambda a, b: a ** b, _pos, _any),
    ("rpow", lambda a, b: 2.0 ** b, _any, _any),
    ("maximum", lambda a, b: btjit.maximum(a, b), _any, _any),
    ("minimum", lambda a, b: btjit.minimum(a, b * 2.0), _any, _any),
    ("gelu", lambda a, b: btjit.gelu(a), _any, _any),
    ("gelu_tanh", lambda a, b: btjit.gelu(a, approximate="tanh"), _any, _any),
    ("silu", lambda a, b: btjit.silu(a) * b + a * btjit.sigmoid(b), _any, _any),
    ("erf", lambda a, b: btjit.erf(a) * b, _any, _any),
    ("log1p", lambda a, b: btjit.log1p(a), _pos, _any),
    ("sin_cos", lambda a, b: btjit.sin(a) * btjit.cos(b), _any, _any),
    ("methods", lambda a, b: a.relu() + b.tanh() * a.sigmoid() - b.exp() + a.abs().sqrt(), _away, _any),
    ("where_cmp", lambda a, b: btjit.where(a > b, a * b, a - b) + btjit.where(a <= b, 2.0 * a, b), _any, _any),
    ("where_const", lambda a, b: btjit.where(True, a * a, b) + btjit.where(0.0, a, b * b), _any, _any),
    ("rebind", lambda a, b: _rebind(a, b), _any, _any),
]


def _rebind(a, b):
    c = a * b
    c += a
    c *= b
    c -= 1.0
    c /= 2.0
    return c


def _ctx_ok(fn, a, b):
    # inputs not within 1e-3 of a tie (maximum/minimum/where kinks)
    return abs(a - b) > 1e-3 and abs(a - 2 * b) > 1e-3


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("name,fn,sa,sb", OPS, ids=[o[0] for o in OPS])
def test_gradcheck_every_op(name, fn, sa, sb, lowering):
    f = btjit.trace_scalar(fn, lowering=lowering)
    r = np.random.default_rng(abs(hash(name)) % 2 ** 32)
    h = 1e-6
    n_checked = 0
    while n_checked < 3:
        a, b = float(sa(r)), float(sb(r))
        if not _ctx_ok(fn, a, b):
            continue
        n_checked += 1
        v, (da, db) = f(a, b)
        ref_v, ref_g, _ = f.reference(a, b)     # the op table's numpy references, op by op
        assert v == pytest.approx(ref_v, rel=1e-12, abs=1e-12)
        assert (da, db) == pytest.approx(ref_g, rel=1e-10, abs=1e-12)
        nda = (f(a + h, b)[0] - f(a - h, b)[0]) / (2 * h)
        ndb = (f(a, b + h)[0] - f(a, b - h)[0]) / (2 * h)
        assert da == pytest.approx(nda, rel=1e-5, abs=1e-6), (name, a, b)
        assert db == pytest.approx(ndb, rel=1e-5, abs=1e-6), (name, a, b)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_nan_inf_semantics(lowering):
    f = btjit.trace_scalar(lambda a, b: (btjit.relu(a), btjit.maximum(a, b), btjit.minimum(b, a), btjit.log(b),
                                         1.0 / b, btjit.sqrt(b)), lowering=lowering)
    for a, b in [(math.nan, 1.0), (1.0, math.nan), (2.0, 0.0), (-1.0, -1.0), (math.inf, -math.inf)]:
        got = np.array(f(a, b)[0])
        want = np.array(f.reference(a, b)[0])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_many_equals_loop(lowering):
    f = btjit.trace_scalar(lambda a, b: e2(a, b)[0] + btjit.tanh(a * b) * btjit.exp(-b * b), lowering=lowering)
    X = np.random.default_rng(0).uniform(-3, 3, (257, 2))
    vals, grads = f.many(X)
    assert vals.shape == (257,) and grads.shape == (257, 2)
    loop = [f(a, b) for a, b in X]
    np.testing.assert_allclose(vals, [v for v, _ in loop], rtol=1e-12)
    np.testing.assert_allclose(grads, [g for _, g in loop], rtol=1e-12, atol=1e-12)
    vf, gf = f.many(np.asfortranarray(X))      # column layout: the vectorized kernel on the straight line
    np.testing.assert_allclose(vf, vals, rtol=1e-12)
    np.testing.assert_allclose(gf, grads, rtol=1e-12, atol=1e-12)
    out = (np.empty((257, 1)), np.empty((257, 2)))
    v2, g2 = f.many(X, out=out)
    assert g2 is out[1]
    np.testing.assert_array_equal(v2, vals)
    with pytest.raises(ValueError):
        f.many(np.zeros((3, 3)))


def test_straight_and_tape_agree():
    def fn(a, b, c):
        x = btjit.sigmoid(a * b - c) + btjit.relu(c - a) * btjit.log(b * b + 1.0)
        y = btjit.maximum(x, a) ** 2 + btjit.sqrt(btjit.abs(b) + 1.0) / (c * c + 0.5)
        return y - btjit.gelu(x) + btjit.where(a > c, x * c, y)
    fs = btjit.trace_scalar(fn, lowering="straight")
    ft = btjit.trace_scalar(fn, lowering="tape")
    assert fs.lowering == "straight" and ft.lowering == "tape" and ft.tape is not None and fs.source
    X = np.random.default_rng(1).uniform(-2, 2, (100, 3))
    vs, gs = fs.many(X)
    vt, gt = ft.many(X)
    np.testing.assert_allclose(vs, vt, rtol=1e-12)
    np.testing.assert_allclose(gs, gt, rtol=1e-11, atol=1e-13)
    (v1, g1), (v2, g2) = fs(*X[0]), ft(*X[0])
    assert v1 == pytest.approx(v2, rel=1e-12) and g1 == pytest.approx(g2, rel=1e-11)
    # auto picks the straight line for small graphs
    assert btjit.trace_scalar(fn).lowering == "straight"


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_float32(lowering):
    f = btjit.trace_scalar(e1, dtype="float32", lowering=lowering)
    v, (da, db) = f(-41.0, 2.0)
    assert (v, da, db) == (612.5, -35.0, 1050.0)     # exact in float32
    vals, grads = f.many(np.array([[-41.0, 2.0]]))
    assert vals.dtype == np.float32 and grads.dtype == np.float32 and vals[0] == 612.5


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_many_inputs_and_varargs(lowering):
    n = 20                                     # above ARGS_MAX: the straight-line one() takes an array

    def fn(*xs):
        acc = 0.0
        for i, x in enumerate(xs):
            acc = acc + (i + 1) * x * x
        return acc
    with pytest.raises(TypeError):
        btjit.trace_scalar(fn)
    f = btjit.trace_scalar(fn, n_args=n, lowering=lowering)
    xs = np.arange(n, dtype=float) / 10
    v, g = f(*xs)
    assert v == pytest.approx(sum((i + 1) * x * x for i, x in enumerate(xs)))
    assert g == pytest.approx([2 * (i + 1) * x for i, x in enumerate(xs)])
    vals, grads = f.many(np.stack([xs, -xs]))
    assert vals == pytest.approx([v, v]) and grads[1] == pytest.approx([-x for x in g])


def test_unused_input_and_constant_output():
    f = btjit.trace_scalar(lambda a, b: a * 2.0)
    assert f(1.0, 5.0) == (2.0, (2.0, 0.0))
    c = btjit.trace_scalar(lambda a: 7.0)
    assert c(1.0) == (7.0, (0.0,))
    assert c.many(np.ones(3))[0].tolist() == [7.0, 7.0, 7.0]


def test_tensor_ops_rejected():
    with pytest.raises(btjit.TraceError):
        btjit.trace_scalar(lambda a: btjit.sum(a * np.ones(3)))


def _big(a, b, c, d, tanh, steps):
    """~10 scalar ops per step forward; distinct constants at every step."""
    xs = [a, b, c, d]
    acc = a * 0.0
    for i in range(steps):
        x, y = xs[-1], xs[-2 - i % 3]
        v = tanh(0.9 * x + 0.3 * y * d + (i % 97) * 1e-3 + i * 1e-7)
        xs.append(v)
        acc = acc + v * (1.0 + (i % 5) * 0.1)
    return acc


def test_100k_node_graph():
    steps = 6000
    fn = lambda a, b, c, d: _big(a, b, c, d, btjit.tanh, steps)  # noqa: E731
    f = btjit.trace_scalar(fn)
    assert len(f.graph.eqns) >= 100_000 and f.n_instructions > STRAIGHT_LINE_MAX
    assert f.lowering == "tape"
    x = (0.3, -0.2, 0.5, 0.7)
    v, g = f(*x)
    assert v == pytest.approx(_big(*x, math.tanh, steps), rel=1e-10)
    ref_v, ref_g, _ = f.reference(*x)
    assert v == pytest.approx(ref_v, rel=1e-10) and g == pytest.approx(ref_g, rel=1e-9)
    h = 1e-6
    nd = (_big(x[0] + h, *x[1:], math.tanh, steps) - _big(x[0] - h, *x[1:], math.tanh, steps)) / (2 * h)
    assert g[0] == pytest.approx(nd, rel=1e-5)
    X = np.array([x, (0.1, 0.2, 0.3, 0.4)])
    vals, grads = f.many(X)
    assert vals[0] == pytest.approx(v, rel=1e-14) and grads[1] == pytest.approx(f(*X[1])[1], rel=1e-14)


# ----------------------------------------------------------------------------- node-value files
def test_save_load_roundtrip(tmp_path):
    f = btjit.trace_scalar(e2)
    vals = f.values(-4.0, 2.0)
    p = tmp_path / "nodes.btv"
    f.save_values(p, vals)
    back = load_values(p)
    assert back == vals and list(back) == list("abcdefg")
    assert all(type(x) is float for x in back.values())
    f.save_values(p, None, -4.0, 2.0)
    assert load_values(p) == vals
    save_values(p, {"x": 0.1, "ünïcode name": -2.5}, dtype="float32")
    back = load_values(p)
    assert back == {"x": float(np.float32(0.1)), "ünïcode name": -2.5}
    save_values(p, {})
    assert load_values(p) == {}
    with pytest.raises(ValueError):
        save_values(p, {"": 1.0})


def test_corrupted_files(tmp_path):
    p = tmp_path / "n.btv"
    save_values(p, dict(a=1.0, b=2.0, c=3.0))
    good = p.read_bytes()

    def load(data):
        q = tmp_path / "bad.btv"
        q.write_bytes(data)
        return load_values(q)

    assert load(good) == dict(a=1.0, b=2.0, c=3.0)
    with pytest.raises(NodeFileError, match="magic"):
        load(b"NOTBTJIT" + good[8:])
    with pytest.raises(NodeFileError, match="magic"):
        load(b"hello")
    with pytest.raises(NodeFileError, match="version 7"):
        load(good[:8] + struct.pack("<H", 7) + good[10:])
    with pytest.raises(NodeFileError, match="dtype"):
        load(good[:10] + b"\x09" + good[11:])
    for cut in (len(good) - 1, len(good) - 9, 22, 12):
        with pytest.raises(NodeFileError, match="truncated"):
            load(good[:cut])
    with pytest.raises(NodeFileError, match="trailing"):
        load(good + b"\0")
    flipped = bytearray(good)
    flipped[-6] ^= 0x40                       # a bit of the last value
    with pytest.raises(NodeFileError, match="checksum"):
        load(bytes(flipped))
    with pytest.raises(NodeFileError):
        load(good[:12] + struct.pack("<I", 4) + good[16:])   # count disagrees with the rest
    assert issubclass(NodeFileError, ValueError)


def test_cache_reload_in_new_process(tmp_path):
    """The generated straight-line code is compiled once and loaded from the cache by later processes."""
    code = ("import btjit, json\n"
            "from btjit.bench.workloads import e1\n"
            "f = btjit.trace_scalar(e1)\n"
            "f.many([[1.0, 2.0]])\n"
            "print(json.dumps([f(-41.0, 2.0)[0], f._straight.cache_hit('one'), f._straight.cache_hit('many')]))\n")
    env = dict(os.environ, BTJIT_CACHE_DIR=str(tmp_path))
    outs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0].strip() == "[612.5, false, false]"
    assert outs[1].strip() == "[612.5, true, true]"
