"""micrograd's own test/test_engine.py (karpathy/micrograd), its two test bodies verbatim with only the import
changed: `from micrograd.engine import Value` -> `from btjit.micrograd import Value` (gradients by
btjit.trace_scalar, compared against torch as the original does). Below them, btjit's additions: every node's
grad, the other methods, graphs of one structure sharing one compiled function, and the same bodies written
for btjit.trace_scalar itself with the tensor methods (x.relu())."""
import pytest

torch = pytest.importorskip("torch")

from btjit.micrograd import Value  # noqa: E402  (micrograd: from micrograd.engine import Value)


def test_sanity_check():

    x = Value(-4.0)
    z = 2 * x + 2 + x
    q = z.relu() + z * x
    h = (z * z).relu()
    y = h + q + q * x
    y.backward()
    xmg, ymg = x, y

    x = torch.Tensor([-4.0]).double()
    x.requires_grad = True
    z = 2 * x + 2 + x
    q = z.relu() + z * x
    h = (z * z).relu()
    y = h + q + q * x
    y.backward()
    xpt, ypt = x, y

    # forward pass went well
    assert ymg.data == ypt.data.item()
    # backward pass went well
    assert xmg.grad == xpt.grad.item()


def test_more_ops():

    a = Value(-4.0)
    b = Value(2.0)
    c = a + b
    d = a * b + b**3
    c += c + 1
    c += 1 + c + (-a)
    d += d * 2 + (b + a).relu()
    d += 3 * d + (b - a).relu()
    e = c - d
    f = e**2
    g = f / 2.0
    g += 10.0 / f
    g.backward()
    amg, bmg, gmg = a, b, g

    a = torch.Tensor([-4.0]).double()
    b = torch.Tensor([2.0]).double()
    a.requires_grad = True
    b.requires_grad = True
    c = a + b
    d = a * b + b**3
    c = c + c + 1
    c = c + 1 + c + (-a)
    d = d + d * 2 + (b + a).relu()
    d = d + 3 * d + (b - a).relu()
    e = c - d
    f = e**2
    g = f / 2.0
    g = g + 10.0 / f
    g.backward()
    apt, bpt, gpt = a, b, g

    tol = 1e-6
    # forward pass went well
    assert abs(gmg.data - gpt.data.item()) < tol
    # backward pass went well
    assert abs(amg.grad - apt.grad.item()) < tol
    assert abs(bmg.grad - bpt.grad.item()) < tol


# ----------------------------------------------------------------------------- btjit's additions
import math  # noqa: E402

import numpy as np  # noqa: E402

import btjit  # noqa: E402
import btjit.micrograd as M  # noqa: E402


def _expr(x, y):
    """Every Value operation; the same code runs on torch tensors."""
    u = (x * y + 3.0).tanh() + (x / 4.0).exp() - (y * y + 1.0).log()
    w = (u - x).sigmoid() * (y.abs() + 0.5).sqrt() + (x - y).relu() ** 2 - 1.5 / (u * u + 1.0)
    return w, u


@pytest.mark.parametrize("xy", [(-0.7, 1.3), (1.1, -0.4)])
def test_every_op_and_every_node_grad_against_torch(xy):
    x, y = Value(xy[0]), Value(xy[1])
    w, u = _expr(x, y)
    w.backward()
    tx, ty = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in xy)
    tw, tu = _expr(tx, ty)
    tu.retain_grad()
    tw.backward()
    assert w.data == pytest.approx(tw.item(), rel=1e-14)
    for v, t in [(x, tx), (y, ty), (u, tu)]:
        assert v.grad == pytest.approx(t.grad.item(), rel=1e-12, abs=1e-14)
    assert w.grad == 1


def test_grads_accumulate_as_micrograd():
    a = Value(3.0)
    b = a * a
    c = b * 2.0
    c.backward()
    c.backward()                              # micrograd: the root's grad is set to 1, the others accumulate
    assert (a.grad, b.grad, c.grad) == (24.0, 4.0, 1)


def test_one_structure_one_compiled_function():
    def step(p, xs):
        loss = sum(((p[0] * xi + p[1]).relu() - xi * 0.5) ** 2 for xi in xs)
        loss.backward()
        return loss
    M._CACHE.clear()
    for seed in range(3):
        rng = np.random.default_rng(seed)
        p, xs = [Value(float(v)) for v in rng.normal(size=2)], rng.uniform(-2, 2, 5).tolist()
        loss = step(p, xs)
        tp = torch.tensor([v.data for v in p], dtype=torch.float64, requires_grad=True)
        tl = sum(((tp[0] * xi + tp[1]).relu() - xi * 0.5) ** 2 for xi in xs)
        tl.backward()
        assert loss.data == pytest.approx(tl.item(), rel=1e-14)
        np.testing.assert_allclose([v.grad for v in p], tp.grad.numpy(), rtol=1e-12)
    assert len(M._CACHE) == 1


def test_deep_graph_beyond_the_recursion_limit():
    x = Value(0.5)
    y = x
    for _ in range(3000):
        y = y * 1.0001 + 0.0
    y.backward()
    assert x.grad == pytest.approx(1.0001 ** 3000, rel=1e-12)


def test_pow_needs_a_number():
    with pytest.raises(TypeError, match="only int/float powers"):
        Value(2.0) ** Value(3.0)


@pytest.mark.parametrize("lowering", ["straight", "tape"])
def test_the_bodies_under_trace_scalar_with_methods(lowering):
    def sanity(x):
        z = 2 * x + 2 + x
        q = z.relu() + z * x
        h = (z * z).relu()
        return h + q + q * x
    y, (dx,) = btjit.trace_scalar(sanity, lowering=lowering)(-4.0)
    x = torch.tensor([-4.0], dtype=torch.float64, requires_grad=True)
    ypt = sanity(x)
    ypt.backward()
    assert y == ypt.item() and dx == x.grad.item()
    f = btjit.trace_scalar(lambda a: a.tanh() + a.exp() * a.sigmoid() - a.abs().sqrt() + (a * a).log(),
                           lowering=lowering)
    v, (da,) = f(0.7)
    assert v == pytest.approx(math.tanh(0.7) + math.exp(0.7) / (1 + math.exp(-0.7)) - math.sqrt(0.7)
                              + math.log(0.49), rel=1e-14)
    t = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    (t.tanh() + t.exp() * t.sigmoid() - t.abs().sqrt() + (t * t).log()).backward()
    assert da == pytest.approx(t.grad.item(), rel=1e-13)
