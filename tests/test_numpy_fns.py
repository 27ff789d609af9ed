"""numpy's functions and the array methods on traced values (btjit/graph/numpy_fns.py): each numpy case runs the
SAME function on a numpy array and on a traced one (values to 1e-12, gradients against finite differences);
each torch-method case against torch in float64 (values and gradients, 1e-10)."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads
from test_functional import _np_x, assert_like_torch

X3 = (2, 3, 4)
# id -> (fn written once for numpy arrays and traced values, x shape)
NUMPY = {
    "np.min": (lambda x: np.min(x, axis=1), X3),
    "x.min": (lambda x: x.min(axis=(0, 2), keepdims=True), X3),
    "np.amin all": (lambda x: np.amin(x) * np.ones(2), X3),
    "np.square": (lambda x: np.square(x), X3),
    "np.sign": (lambda x: np.sign(x) * x, X3),
    "np.reciprocal": (lambda x: np.reciprocal(x * x + 1.0), X3),
    "np.expm1 log2 log10": (lambda x: np.expm1(x) + np.log2(x * x + 1.0) + np.log10(x * x + 2.0), X3),
    "np.zeros_like ones_like full_like": (lambda x: x * np.ones_like(x) + np.zeros_like(x) + np.full_like(x, 2.5), X3),
    "np.expand_dims": (lambda x: np.expand_dims(x, 1), X3),
    "np.expand_dims tuple": (lambda x: np.expand_dims(x, (0, -1)), X3),
    "x.squeeze": (lambda x: x[:, :1].squeeze(), X3),
    "np.squeeze axis": (lambda x: np.squeeze(x[:, :, :1], axis=2), X3),
    "x.flatten": (lambda x: x.flatten(), X3),
    "x.ravel": (lambda x: x.ravel(), X3),
    "np.ravel": (lambda x: np.ravel(x), X3),
    "np.dot 2d": (lambda x: np.dot(x[0], x[1].T), X3),
    "np.dot 1d": (lambda x: np.dot(x[0, 0], x[1, 1]) * np.ones(3), X3),
    "x.dot": (lambda x: x[0].dot(x[1, 0]), X3),
    "np.outer": (lambda x: np.outer(x[0, 0], x[1, :, 1]), X3),
    "np.linalg.norm": (lambda x: np.linalg.norm(x, axis=-1), X3),
    "np.linalg.norm all": (lambda x: np.linalg.norm(x) * np.ones(2), X3),
    "np.linalg.norm vector ords": (lambda x: np.linalg.norm(x, 3, axis=-1) + np.linalg.norm(x, -np.inf, axis=-1) +
                                   np.linalg.norm(x, -1.5, axis=-1) + np.linalg.norm(x[0, 0], 1), X3),
    "np.linalg.norm matrix ords": (lambda x: np.linalg.norm(x[0], 1) + np.linalg.norm(x[1], -np.inf) + np.linalg.norm(
        x, np.inf, axis=(2, 1)) + np.linalg.norm(x, -1, axis=(0, 2), keepdims=True)[0, :2, 0], X3),
    "np.linalg.vector_norm matrix_norm": (lambda x: np.linalg.vector_norm(x, ord=4, axis=(0, 2)) +
                                          np.linalg.matrix_norm(x, ord=-1).sum() + np.linalg.vector_norm(x), X3),
    "np.vdot trace diag": (lambda x: np.diag(x[0], 1) + np.trace(x[0]) + np.trace(x[1], -1) + np.vdot(x[0], x[1]) +
                           np.diagonal(x, 1, 1, 2)[1] + np.diag(x[0, 0], -1)[1:4, 0], X3),
    "np.all any": (lambda x: x * np.all(x > -1.5, axis=0) + x * np.any(x > 1, axis=(1, 2), keepdims=True) + x.any() +
                   (x > -3).all(axis=2, keepdims=True), X3),
    "np.median quantile percentile": (lambda x: np.median(x, axis=1) + np.quantile(x, 0.3, axis=1) + np.percentile(
        x, [25, 75], axis=1).sum(0) + np.median(x) + np.quantile(x[0], 0.5, axis=0, keepdims=True), X3),
    "np.partition": (lambda x: np.partition(x, 1, axis=1) + np.partition(x, 2)[..., 2:3], X3),
    "np.fmax fmin copysign signbit heaviside": (lambda x: np.fmax(x, 0.1) + np.fmin(x, x * x) + np.copysign(
        x, x - 0.3) + np.signbit(x - 0.2) + np.heaviside(x - 0.1, 0.5), X3),
    "np.hypot cbrt float_power nan_to_num": (lambda x: np.hypot(x, 2.0) + np.cbrt(x) + np.float_power(
        x * x, 1.5) + np.nan_to_num(x), X3),
    "np.pad": (lambda x: np.pad(x, ((0, 0), (1, 2), (0, 1)), constant_values=0.5), X3),
    "np.pad int": (lambda x: np.pad(x, 1), X3),
    "np.pad reflect": (lambda x: np.pad(x, ((1, 0), (2, 1), (0, 3)), "reflect"), X3),
    "np.pad edge": (lambda x: np.pad(x, 2, "edge"), X3),
    "np.pad wrap": (lambda x: np.pad(x, ((0, 1), (1, 3), (2, 2)), "wrap"), X3),
    "np.repeat": (lambda x: np.repeat(x, 3, axis=1), X3),
    "x.repeat flat": (lambda x: x.repeat(2), X3),
    "np.tile": (lambda x: np.tile(x, (2, 1, 3)), X3),
    "np.tile short": (lambda x: np.tile(x, 2), X3),
    "np.tile long": (lambda x: np.tile(x[0], (2, 1, 2)), X3),
    "index list on axis 1": (lambda x: x[:, [0, 2, 2]] * 1.0, X3),
    "index array, slices": (lambda x: x[1:, :, np.array([3, 0])] * 1.0, X3),
    "index after ellipsis": (lambda x: x[..., [1]] * 1.0, X3),
    "ints beside an index array": (lambda x: x[0, [1, 2]] * 1.0, X3),
    "index array between slice and int": (lambda x: x[:, [2, 0], 1] * 1.0, X3),
    "int, slice, index array": (lambda x: x[1, :, [3, 0]] * 1.0, X3),
    "np.cumsum": (lambda x: np.cumsum(x, axis=1), X3),
    "np.cumsum flat": (lambda x: np.cumsum(x), X3),
    "np.prod": (lambda x: np.prod(x, axis=2), X3),
    "np.prod keepdims": (lambda x: np.prod(x, axis=0, keepdims=True), X3),
    "np.flip": (lambda x: np.flip(x, 1) + np.flip(x, (0, 2)), X3),
    "negative steps": (lambda x: x[::-1, :, ::-2] * 1.0, X3),
    "negative step after ellipsis, None": (lambda x: x[..., None, 3:0:-1] * 1.0, X3),
    "np.argmax": (lambda x: np.argmax(x, axis=1)[:, None] + np.argmin(x, axis=-1, keepdims=True), X3),
    "np.argmax flat": (lambda x: np.argmax(x) * np.ones(2), X3),
    "two index arrays": (lambda x: x[[0, 1, 1], [2, 0, 1]] * 1.0, X3),
    "range and array": (lambda x: x[range(2), np.array([[2], [0]]), np.array([1, 3])] * 1.0, X3),
    "np.take_along_axis": (lambda x: np.take_along_axis(x, np.array([[[0], [2], [1]], [[3], [3], [0]]]), 2), X3),
    "np.take_along_axis 0": (lambda x: np.take_along_axis(x, np.array([[[1, 0, 0, 1]]]), 0), X3),
    "boolean mask": (lambda x: x[np.array([True, False])] * 1.0, X3),
    "boolean mask 2d": (lambda x: x[np.array([[True, False, True], [False, True, True]])] * 1.0, X3),
    "x.copy": (lambda x: x.copy() * np.copy(x), X3),
    "einsum bmm": (lambda x: np.einsum("bij,bkj->bik", x, x * 0.5), X3),
    "einsum heads": (lambda x: np.einsum("bhd,bhe->hde", x, x * x), X3),
    "einsum sum": (lambda x: np.einsum("ijk->ik", x), X3),
    "einsum permute": (lambda x: np.einsum("ijk->kji", x), X3),
    "einsum outer": (lambda x: np.einsum("i,j->ij", x[0, 0], x[1, 1]), X3),
    "einsum all": (lambda x: np.einsum("ijk,ijk->", x, x) * np.ones(2), X3),
    "einsum sums first": (lambda x: np.einsum("ij,jk->i", x[0], x[1].T), X3),
    "einsum ellipsis": (lambda x: np.einsum("...ij,...kj->...ik", x, x * 0.5), X3),
    "einsum ellipsis one side": (lambda x: np.einsum("...j,jk->...k", x, x[1].T), X3),
    "einsum implicit": (lambda x: np.einsum("ij,kj", x[0], x[1]) + np.einsum("ji", x[0]).sum(), X3),
    "einsum ellipsis sum": (lambda x: np.einsum("...j->...", x), X3),
}


def _run_btjit(fn, x):
    def loss(p):
        y = fn(p["x"])
        return btjit.sum(y * np.cos(np.arange(y.size)).reshape(y.shape)), {"y": y}
    prog = btjit.trace(loss, {"x": x}, dtype="float64", grad=True)
    prog.value_and_grad()
    return prog.outputs["y"], loss


@pytest.mark.parametrize("name", list(NUMPY))
def test_numpy_function_on_traced_values_is_numpys(name):
    fn, shape = NUMPY[name]
    x = _np_x(shape)
    got, loss = _run_btjit(fn, x)
    want = fn(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    check_grads(lambda p: loss(p)[0], {"x": _np_x(shape, seed=3)})


torch = pytest.importorskip("torch")

# id -> (btjit fn, torch fn): the same text where torch and btjit agree
TORCH = {
    "view": (lambda x: x.view(6, 4) * 1.0, lambda x: x.view(6, 4) * 1.0),
    "view tuple -1": (lambda x: x.view((-1, 2)), lambda x: x.view((-1, 2))),
    "permute": (lambda x: x.permute(2, 0, 1), lambda x: x.permute(2, 0, 1)),
    "unsqueeze": (lambda x: x.unsqueeze(-1), lambda x: x.unsqueeze(-1)),
    "contiguous t": (lambda x: x[0].t().contiguous(), lambda x: x[0].t().contiguous()),
    "masked_fill": (lambda x: x.masked_fill(np.tril(np.ones((3, 4))) == 0, -1.5),
                    lambda x: x.masked_fill(torch.tensor(np.tril(np.ones((3, 4)))) == 0, -1.5)),
    "pow square sign": (lambda x: x.pow(3) + x.square() + x.sign() * x, lambda x: x.pow(3) + x.square() + x.sign() * x),
    "clamp": (lambda x: x.clamp(min=-0.5) + x.clamp(max=0.2) + x.clamp(-0.1, 0.1),
              lambda x: x.clamp(min=-0.5) + x.clamp(max=0.2) + x.clamp(-0.1, 0.1)),
    # torch's chunk: 2 pieces of 2 along the last axis, then 2 and 1 along axis 1
    "chunk": (lambda x: x.chunk(3, dim=-1)[1] * 2.0 + x.chunk(2, dim=1)[1][..., :2],
              lambda x: x.chunk(3, dim=-1)[1] * 2.0 + x.chunk(2, dim=1)[1][..., :2]),
    "softmax dim": (lambda x: x.softmax(1) + x.log_softmax(dim=0), lambda x: x.softmax(1) + x.log_softmax(dim=0)),
    "sum mean dim": (lambda x: x.sum(dim=1, keepdim=True) + x.mean(dim=(0, 1), keepdim=True),
                     lambda x: x.sum(dim=1, keepdim=True) + x.mean(dim=(0, 1), keepdim=True)),
    "flatten start": (lambda x: x.flatten(1), lambda x: x.flatten(1)),
    "squeeze dim": (lambda x: x[:1].squeeze(0), lambda x: x[:1].squeeze(0)),
    "transpose two dims": (lambda x: x.transpose(1, 2) * 1.0, lambda x: x.transpose(1, 2) * 1.0),
    "split sizes": (lambda x: x.split(3, dim=-1)[1] + x.split([2, 1], dim=1)[1][..., :1],
                    lambda x: x.split(3, dim=-1)[1] + x.split([2, 1], dim=1)[1][..., :1]),
    "max(dim) min(dim)": (lambda x: x.max(dim=1).values + x.max(1, keepdim=True)[1][:, 0] + x.min(dim=1)[0] * 2,
                          lambda x: x.max(dim=1).values + x.max(1, keepdim=True)[1][:, 0] + x.min(dim=1)[0] * 2),
    "max(1).values .indices": (lambda x: x.max(1).values * 2 + x.min(1).indices + x.max(1).indices,
                               lambda x: x.max(1).values * 2 + x.min(1).indices + x.max(1).indices),
    "argmax argmin": (lambda x: x.argmax(dim=-1) + x.argmin(2, keepdim=True)[..., 0] * 3 + x.argmax() + x[..., 0],
                      lambda x: x.argmax(dim=-1) + x.argmin(2, keepdim=True)[..., 0] * 3 + x.argmax() + x[..., 0]),
    "amax amin norm": (lambda x: x.amax(dim=-1) + x.amin(1)[..., :1] + x.norm(dim=-1) + x.norm(),
                       lambda x: x.amax(dim=-1) + x.amin(1)[..., :1] + x.norm(dim=-1) + x.norm()),
    "flip cumsum prod": (lambda x: x.flip(0, 2) + x.cumsum(dim=1) + x.prod(dim=2, keepdim=True),
                         lambda x: x.flip(0, 2) + x.cumsum(dim=1) + x.prod(dim=2, keepdim=True)),
    "clone detach": (lambda x: x.clone() * x.detach() + x.detach().exp(), lambda x: x.clone() * x.detach() +
                     x.detach().exp()),
    "gather": (lambda x: x.gather(2, np.array([[[0, 0], [2, 1], [1, 3]], [[3, 2], [3, 3], [0, 1]]])),
               lambda x: x.gather(2, torch.tensor([[[0, 0], [2, 1], [1, 3]], [[3, 2], [3, 3], [0, 1]]]))),
    "size()": (lambda x: x.view(x.size(0), -1) * x.size(-1) + x.size()[1],
               lambda x: x.view(x.size(0), -1) * x.size(-1) + x.size()[1]),
}


@pytest.mark.parametrize("name", list(TORCH))
def test_torch_method_against_torch(name):
    assert_like_torch(*TORCH[name], _np_x(X3))


@pytest.mark.parametrize("bad,needle", [
    (lambda x: x.no_such_method(), "traced values have no attribute 'no_such_method'"),
    (lambda x: x.squeeze(1), r"squeeze: axis \[1\] of shape \(2, 3, 4\) is not of size 1"),
    (lambda x: np.linalg.norm(x, ord=3), "norm: ord=3 of a 3-d value without an axis"),
    (lambda x: np.linalg.norm(x[0], ord=2), "norm: ord=2 of a matrix needs its singular values"),
    (lambda x: np.pad(x, 1, mode="symmetric"), "pad: mode must be one of"),
    (lambda x: np.dot(x, x), r"dot: operands of at most 2 dims, got \(2, 3, 4\)"),
    (lambda x: x[[0, 1], :, [1, 2]], r"getitem: several integer index arrays must index the leading axes"),
    (lambda x: x[[0, 1], [1, 2, 0]], r"getitem: index arrays of shapes \[\(2,\), \(3,\)\] do not broadcast"),
    (lambda x: x[[0, 5], [1, 2]], r"getitem: index 0 out of range for axis 0 of size 2"),
    (lambda x: x[x > 0], r"getitem: a traced float index \(a mask like x\[x > 0\]\?\) .* use btjit.where"),
    (lambda x: x[np.array([True, False, True])], r"getitem: a boolean mask of shape \(3,\) for a value of shape"),
    (lambda x: x[[0, 1], None], r"getitem: an integer index array can stand with slices only"),
    (lambda x: np.einsum("i,i,i->", x[0, 0], x[1, 1], x[0, 1]), r"einsum: 'i,i,i->': one or two operands"),
    (lambda x: np.einsum("...j,...j->...", x, x[:, :1]), r"einsum: '...j,...j->...': a letter of two sizes"),
    (lambda x: np.einsum("ii->i", x[0, :, :3]), r"no letter twice in one term"),
    (lambda x: x.split([1, 1], dim=1), r"split: sizes \[1, 1\] must add up to 3"),
])
def test_unsupported_uses_are_named(bad, needle):
    with pytest.raises((btjit.TraceError, AttributeError), match=needle):
        btjit.trace(lambda p: btjit.sum(bad(p["x"])), {"x": _np_x(X3)})


def test_accuracy_by_argmax_against_integer_labels():
    """(logits.argmax(-1) == y).float().mean() with y the batch's integer labels: a comparison of the float
    indices with the integers (converted), no gradient through it; logprobs[range(n), y] picks each row's label."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5)), rng.integers(0, 5, 8)

    def loss(p, x, y):
        logits = x @ p["w"]
        acc = (logits.argmax(-1) == y).float().mean()
        return -btjit.log_softmax(logits)[range(8), y].mean(), {"acc": acc}
    w = rng.normal(size=(5, 5))
    prog = btjit.trace(loss, {"w": w}, x, y, dtype="float64", grad=True)
    got = prog.value_and_grad(x, y)
    logits = x @ w
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert got == pytest.approx(-logp[range(8), y].mean(), rel=1e-12)
    assert prog.outputs["acc"] == pytest.approx((logits.argmax(-1) == y).mean(), abs=0)
    check_grads(lambda p, x, y: loss(p, x, y)[0], {"w": w}, x, y)


def test_stop_gradient_and_detach_block_the_gradient():
    w = np.array([2.0, -3.0])

    def loss(p):
        a = p["w"] * 3.0
        return btjit.sum(a * btjit.stop_gradient(a)) + btjit.sum(p["w"].detach() * p["w"])
    prog = btjit.trace(loss, {"w": w}, dtype="float64", grad=True)
    assert prog.value_and_grad() == pytest.approx(9 * 13 + 13)
    np.testing.assert_allclose(prog.grads["w"], 3 * (3 * w) + w)          # only the un-stopped factors


def test_positional_max_indexed_by_0_or_1_warns_that_it_is_numpys_not_torchs_pair():
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
    w = {"w": np.ones(4)}
    with pytest.warns(UserWarning, match=r"x.max\(axis\)\[0\].*numpy's.*x.max\(dim=axis\)\[0\].*test_numpy_fns.py"):
        prog = btjit.trace(lambda p, x: (x * p["w"]).max(2)[0], w, x, dtype="float64")
    np.testing.assert_array_equal(prog(x), x.max(2)[0])                # numpy's meaning: the first maxima row
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                   # the unambiguous spellings are silent
        for f, want in ((lambda p, x: (x * p["w"]).max(2).values, x.max(2)),
                        (lambda p, x: (x * p["w"]).max(dim=2)[0], x.max(2)),
                        (lambda p, x: (x * p["w"]).min(2)[:, 2], x.min(2)[:, 2])):
            prog = btjit.trace(f, w, x, dtype="float64")
            np.testing.assert_array_equal(prog(x), want)
