"""numpy's and torch's functions under btjit's own names (btjit.min, btjit.argmax, btjit.tril, ...): the values
numpy gives, torch's dim= / keepdim= / diagonal= spellings beside numpy's, and gradients against finite
differences in float64; and np.einsum / np.pad / np.tril / np.logaddexp on traced values as before."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

X = np.random.default_rng(7).normal(size=(3, 5))

CASES = [  # btjit's call, numpy's
    (lambda x: btjit.min(x, 1), lambda x: x.min(1)),
    (lambda x: btjit.min(x, dim=0, keepdim=True), lambda x: x.min(0, keepdims=True)),
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


@pytest.mark.parametrize("i", [0, 1, 4, 5, 6, 8, 12, 14, 15])
def test_gradients_match_finite_differences(i):
    fn = CASES[i][0]
    r = np.random.default_rng(i).normal(size=np.shape(CASES[i][1](X)))
    check_grads(lambda p: btjit.sum(fn(p["x"]) * r), {"x": X.copy()})


def test_torchs_dim_names_as_torch():
    torch = pytest.importorskip("torch")
    t = torch.tensor(X)
    for fn, want in [(lambda x: btjit.min(x, dim=1), t.min(dim=1).values), (lambda x: btjit.prod(x, dim=0), t.prod(0)),
                     (lambda x: btjit.argmax(x, dim=1, keepdim=True), t.argmax(1, keepdim=True).double()),
                     (lambda x: btjit.tril(x, diagonal=-1), torch.tril(t, diagonal=-1))]:
        prog = btjit.trace(lambda p: fn(p["x"]), {"x": X}, dtype="float64", grad=False)
        np.testing.assert_allclose(prog(), want.numpy(), rtol=1e-12)
