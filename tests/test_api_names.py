"""numpy's and torch's functions under btjit's own names (btjit.min, btjit.argmax, btjit.tril, ...): the values
numpy gives, torch's dim= / keepdim= / diagonal= spellings beside numpy's (btjit.max / min with dim=: torch's
(values, indices), as x.max(dim=)), and gradients against finite differences in float64; np.einsum /
np.pad / np.tril / np.logaddexp on traced values as before; and the spellings llama2.c's model.py needed
(torch.outer of integers, arange's keywords, view_as, reshape_as) against torch."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

X = np.random.default_rng(7).normal(size=(3, 5))

CASES = [  # btjit's call, numpy's
    (lambda x: btjit.min(x, 1), lambda x: x.min(1)),
    (lambda x: btjit.min(x, 0, keepdims=True), lambda x: x.min(0, keepdims=True)),
    (lambda x: btjit.max(x, axis=1) + btjit.min(x, 1).indices, lambda x: x.max(1) + x.argmin(1)),
    (lambda x: btjit.argmax(x, axis=1), lambda x: x.argmax(1)),
    (lambda x: btjit.argmin(x, dim=0), lambda x: x.argmin(0)),
    (lambda x: btjit.prod(x, 1, keepdims=True), lambda x: x.prod(1, keepdims=True)),
    (lambda x: btjit.tril(x, 1), lambda x: np.tril(x, 1)),
    (lambda x: btjit.triu(x, diagonal=-1), lambda x: np.triu(x, -1)),
    (lambda x: btjit.zeros_like(x) - 2 * btjit.ones_like(x) + btjit.full_like(x, 0.5), lambda x: np.full_like(x, -1.5)),
    (lambda x: btjit.squeeze(btjit.expand_dims(x, (0, 2)), 0), lambda x: x[:, None]),
    (lambda x: btjit.moveaxis(btjit.expand_dims(x, 0), 0, -1), lambda x: x[:, :, None]),
    (lambda x: btjit.take_along_axis(x, np.argsort(X, 1), 1), lambda x: np.take_along_axis(x, np.argsort(X, 1), 1)),
    (lambda x: btjit.sign(x) * x, lambda x: np.sign(x) * x),
    (lambda x: btjit.logaddexp(x, x[::-1]), lambda x: np.logaddexp(x, x[::-1])),
    (lambda x: btjit.tile(x, (2, 1)), lambda x: np.tile(x, (2, 1))),
    (lambda x: np.einsum("ij,kj->ik", x, x), lambda x: np.einsum("ij,kj->ik", x, x)),
    (lambda x: np.pad(x, 2, mode="reflect"), lambda x: np.pad(x, 2, mode="reflect")),
    (lambda x: np.tril(x) + x.triu(2), lambda x: np.tril(x) + np.triu(x, 2)),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_names_give_numpys_values(i):
    fn, ref = CASES[i]
    prog = btjit.trace(lambda p: fn(p["x"]), {"x": X}, dtype="float64", grad=False)
    np.testing.assert_allclose(prog(), ref(X), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("i", [0, 1, 2, 5, 6, 7, 9, 13, 15, 16])
def test_gradients_match_finite_differences(i):
    fn = CASES[i][0]
    r = np.random.default_rng(i).normal(size=np.shape(CASES[i][1](X)))
    check_grads(lambda p: btjit.sum(fn(p["x"]) * r), {"x": X.copy()})


def test_torchs_dim_names_as_torch():
    torch = pytest.importorskip("torch")
    t = torch.tensor(X)
    for fn, want in [(lambda x: btjit.min(x, dim=1).values, t.min(dim=1).values),
                     (lambda x: btjit.max(x, dim=0, keepdim=True)[1], t.max(dim=0, keepdim=True)[1].double()),
                     (lambda x: btjit.prod(x, dim=0), t.prod(0)),
                     (lambda x: btjit.argmax(x, dim=1, keepdim=True), t.argmax(1, keepdim=True).double()),
                     (lambda x: btjit.tril(x, diagonal=-1), torch.tril(t, diagonal=-1))]:
        prog = btjit.trace(lambda p: fn(p["x"]), {"x": X}, dtype="float64", grad=False)
        np.testing.assert_allclose(prog(), want.numpy(), rtol=1e-12)


def _value_and_grad(fn, x, dtype="float64"):
    prog = btjit.trace(lambda p: fn(p["x"]), {"x": x}, dtype=dtype, grad=True)
    return prog.value_and_grad(), prog.grads["x"]


def test_outer_of_integers_and_floats_and_arange_keywords_as_torch():
    """torch.outer(t, freqs) with t = torch.arange(end, device=...) integers: floats (before: `mul: input 0 is an
    integer array`); torch.arange(..., dtype=torch.float32) gives floats; x.outer(y) and np.outer alike."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=5)
    w = np.random.default_rng(1).normal(size=(7, 5))
    for spell in (lambda x: btjit.outer(btjit.arange(7, device=x.device), x), lambda x: btjit.arange(7).outer(x),
                  lambda x: np.outer(btjit.arange(7), x),
                  lambda x: btjit.outer(btjit.arange(7, dtype=torch.float32), x)):
        got, grad = _value_and_grad(lambda x: (btjit.cos(spell(x)) * w).sum(), x)
        xt = torch.tensor(x, requires_grad=True)
        want = (torch.cos(torch.outer(torch.arange(7), xt)) * torch.tensor(w)).sum()
        want.backward()
        assert abs(got - want.item()) < 1e-12
        np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    f = btjit.trace(lambda p: (btjit.arange(0.5, 3, 0.5, dtype="float64") * p["x"][:5]).sum(), {"x": x}, grad=True,
                    dtype="float64")
    assert f.value_and_grad() == pytest.approx(float((torch.arange(0.5, 3, 0.5) * torch.tensor(x)).sum()), abs=1e-12)
    np.testing.assert_array_equal(f.grads["x"], torch.arange(0.5, 3, 0.5).numpy())
    with pytest.raises(btjit.TraceError, match="arange: dtype must be an integer or float one"):
        btjit.trace(lambda p: btjit.arange(3, dtype=torch.bool).sum() * p["x"], {"x": x}, grad=True)
    with pytest.raises(btjit.TraceError, match=r"integer array where floats are needed \(x.float\(\) converts it"):
        btjit.trace(lambda p: (btjit.arange(5) * p["x"]).sum(), {"x": x}, grad=True)


def test_view_as_and_reshape_as_as_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).normal(size=(4, 6))
    w = np.random.default_rng(3).normal(size=(2, 12))
    for name in ("view_as", "reshape_as"):
        got, grad = _value_and_grad(lambda x: (getattr(x, name)(x.reshape(2, 12) * 0) * w).sum(), x)
        xt = torch.tensor(x, requires_grad=True)
        want = (getattr(xt, name)(torch.zeros(2, 12)) * torch.tensor(w)).sum()
        want.backward()
        assert abs(got - want.item()) < 1e-12
        np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize("args", [(1, 3, 2), (2, 4, 5), (-1, 9, 1), (0, 1, 1)])
def test_tensor_unfold_windows_as_torch(args):
    """torch's x.unfold(dimension, size, step) (sliding windows as a new last axis), and the patch idiom of ViT
    code, x.unfold(2, p, p).unfold(3, p, p), with gradients."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).normal(size=(2, 7, 9))
    for fn in (lambda t: t.unfold(*args), lambda t: t.reshape(1, 2, 7, 9).unfold(2, 3, 3).unfold(3, 3, 3)):
        r = np.random.default_rng(6).normal(size=fn(torch.tensor(x)).shape)
        got, grad = _value_and_grad(lambda v: (fn(v) * r).sum(), x)
        xt = torch.tensor(x, requires_grad=True)
        want = (fn(xt) * torch.tensor(r)).sum()
        want.backward()
        assert got == pytest.approx(want.item(), rel=1e-12)
        np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-14)
    with pytest.raises(btjit.TraceError, match="unfold: size 10 and step 1"):
        btjit.trace(lambda p: p["x"].unfold(2, 10, 1).sum(), {"x": x}, grad=True)


def test_public_submodules_are_attributes_after_import_btjit():
    # the README's btjit.testing.check_grads(loss_fn, params, *batch) with only `import btjit` (a fresh interpreter)
    import subprocess
    import sys
    code = ("import btjit, numpy as np; print(btjit.testing.check_grads(lambda p: (p['w'] ** 2).sum(), "
            "{'w': np.ones(3)}) < 1e-6, btjit.runtime.load.__name__, btjit.micrograd.Value.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "load", "Value"], out.stderr[-2000:]
