"""Integer values inside the trace: slicing and indexing (by slices, index arrays and constant masks),
reshape/transpose, concatenate and stack, roll, assignment (x[:, 0] = v), integer arithmetic, comparisons
giving masks for where, arange constants -- each against numpy inside programs that also train (AdamW steps
against a float64 numpy reference where it matters); float stack / setitem / expand with their gradients
against finite differences; makemore's MLP context and nanoGPT's positions written as their sources write
them; a computed index out of range."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

V, T, E = 11, 5, 4


def _emb(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, size=(3, T)).astype(np.int32), rng.normal(size=(V + 1, E))


def _program(int_fn, np_fn):
    """sum(take(wte, int_fn(idx)) ** 2): forward and gradient against numpy, then 3 training steps."""
    idx, wte = _emb()
    f = lambda p, idx: btjit.sum(btjit.take(p["wte"], int_fn(idx)) ** 2)  # noqa: E731
    prog = btjit.trace(f, {"wte": wte}, idx, dtype="float64", grad=True)
    j = np_fn(idx)
    assert prog.value_and_grad(idx) == pytest.approx(float((wte[j] ** 2).sum()), rel=1e-12)
    want = np.zeros_like(wte)
    np.add.at(want, j, 2 * wte[j])
    np.testing.assert_allclose(prog.grads["wte"], want, rtol=1e-12)
    train = btjit.trace(f, {"wte": wte}, idx, dtype="float64", optimizer=btjit.optim.SGD(lr=0.1))
    w = wte.copy()
    for _ in range(3):
        train.step(idx)
        g = np.zeros_like(w)
        np.add.at(g, j, 2 * w[j])
        w -= 0.1 * g
    np.testing.assert_allclose(train.params["wte"], w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,int_fn,np_fn", [
    ("slice", lambda i: i[:, 1:4], lambda i: i[:, 1:4]),
    ("index", lambda i: i[1], lambda i: i[1]),
    ("step slice", lambda i: i[::2, ::2], lambda i: i[::2, ::2]),
    ("transpose", lambda i: i.T, lambda i: i.T),
    ("reshape", lambda i: i.reshape(T, 3), lambda i: i.reshape(T, 3)),
    ("concatenate", lambda i: btjit.concatenate([i, i[:, :2]], 1), lambda i: np.concatenate([i, i[:, :2]], 1)),
    ("stack", lambda i: btjit.stack([i[0], i[2]], 1), lambda i: np.stack([i[0], i[2]], 1)),
    ("roll", lambda i: btjit.roll(i, 2, 1), lambda i: np.roll(i, 2, 1)),
    ("np.roll", lambda i: np.roll(i, -1, 0), lambda i: np.roll(i, -1, 0)),
    ("broadcast_to", lambda i: btjit.broadcast_to(i[:1], (4, T)), lambda i: np.broadcast_to(i[:1], (4, T))),
    ("arithmetic", lambda i: btjit.minimum(i * 2 + 3 - i, V - 1), lambda i: np.minimum(i * 2 + 3 - i, V - 1)),
    ("maximum", lambda i: btjit.maximum(i - 3, 0), lambda i: np.maximum(i - 3, 0)),
    ("arange", lambda i: i[0] * 0 + btjit.arange(T), lambda i: np.arange(T)),
    ("boolean mask", lambda i: i[np.array([True, False, True])], lambda i: i[[0, 2]]),     # labels[train_mask]
    ("index array", lambda i: i[:, [4, 0, 4]], lambda i: i[:, [4, 0, 4]]),
    ("take rows", lambda i: btjit.take(i, np.array([2, 0, 2])), lambda i: i[[2, 0, 2]]),
])
def test_integer_op_inside_a_training_program(name, int_fn, np_fn):
    _program(int_fn, np_fn)


def _assign(i):
    i = btjit.roll(i, 1, 1)
    i[:, 0] = V
    return i


def _np_assign(i):
    i = np.roll(i, 1, 1)
    i[:, 0] = V
    return i


def test_assignment_makemore_mlp_context():
    """makemore's MLP: the context rolled by one and its first column set to the blank token, block times."""
    _program(_assign, _np_assign)

    def ctx(i, roll, setcol):
        out = []
        for _ in range(3):
            out.append(i)
            i = roll(i)
            setcol(i)
        return out
    idx, wte = _emb(1)
    want = np.concatenate([wte[j] for j in ctx(idx, lambda i: np.roll(i, 1, 1), lambda i: i.__setitem__(
        (slice(None), 0), V))], -1)

    def f(p, idx):
        embs = ctx(idx, lambda i: btjit.roll(i, 1, 1), lambda i: i.__setitem__((slice(None), 0), V))
        return btjit.sum(btjit.concatenate([btjit.take(p["wte"], j) for j in embs], -1) ** 2)
    prog = btjit.trace(f, {"wte": wte}, idx, dtype="float64", grad=True)
    assert prog.value_and_grad(idx) == pytest.approx(float((want ** 2).sum()), rel=1e-12)


def test_comparisons_give_masks_for_where():
    idx, wte = _emb(2)
    x = np.random.default_rng(3).normal(size=(3, T))

    def f(p, idx):
        keep = idx != 0
        big = idx >= 5
        return btjit.sum(btjit.where(keep, p["x"], 0.0) * btjit.where(big, 2.0, 1.0) + (idx == 3) * p["x"]), \
            {"mask": (idx < 4).astype(float)}
    prog = btjit.trace(f, {"x": x}, idx, dtype="float64", grad=True)
    want = (np.where(idx != 0, x, 0) * np.where(idx >= 5, 2, 1) + (idx == 3) * x).sum()
    assert prog.value_and_grad(idx) == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose(prog.grads["x"], (idx != 0) * np.where(idx >= 5, 2, 1) + (idx == 3), rtol=1e-12)
    np.testing.assert_array_equal(prog.outputs["mask"], (idx < 4).astype(float))


def test_nanogpt_positions_from_arange():
    """pos = arange(t); tok_emb + pos_emb as nanoGPT writes it."""
    rng = np.random.default_rng(4)
    idx = rng.integers(0, V, size=(2, T)).astype(np.int32)
    p = {"wte": rng.normal(size=(V, E)), "wpe": rng.normal(size=(T, E))}

    def f(p, idx):
        b, t = idx.shape
        pos = btjit.arange(0, t)
        return btjit.sum(btjit.tanh(btjit.take(p["wte"], idx) + btjit.take(p["wpe"], pos)))
    check_grads(f, p, idx)
    prog = btjit.trace(f, p, idx, dtype="float64", grad=True)
    assert prog.value_and_grad(idx) == pytest.approx(np.tanh(p["wte"][idx] + p["wpe"][np.arange(T)]).sum(), rel=1e-12)


def test_float_stack_setitem_expand_gradients():
    rng = np.random.default_rng(5)
    p = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(3, 4)), "s": rng.normal(size=(1, 4)),
         "v": rng.normal(size=(2,))}

    def f(p):
        h = btjit.stack([p["a"], btjit.tanh(p["b"])], 1)          # (3, 2, 4)
        h[:, 1, 1:3] = p["v"] * 2.0                                 # assignment with a broadcast value
        return btjit.sum(btjit.tanh(h) * np.arange(24).reshape(3, 2, 4)) + btjit.sum(p["s"].expand(3, -1) @ p["a"].T)
    check_grads(f, p)
    h = np.stack([p["a"], np.tanh(p["b"])], 1)
    h[:, 1, 1:3] = p["v"] * 2.0
    want = (np.tanh(h) * np.arange(24).reshape(3, 2, 4)).sum() + (np.broadcast_to(p["s"], (3, 4)) @ p["a"].T).sum()
    prog = btjit.trace(f, p, dtype="float64", grad=True)
    assert prog.value_and_grad() == pytest.approx(want, rel=1e-12)


def test_computed_index_out_of_range_is_an_error_naming_the_op():
    idx, wte = _emb(6)
    prog = btjit.trace(lambda p, i: btjit.sum(btjit.take(p["wte"], i[:, 1:] + 1)), {"wte": wte[:V]}, idx,
                       dtype="float64", grad=True)
    ok = np.minimum(idx, V - 2)
    assert prog.value_and_grad(ok) == pytest.approx(wte[:V][ok[:, 1:] + 1].sum(), rel=1e-12)
    with pytest.raises(ValueError, match=r"computed in the traced function is out of range: take at "
                                         r"test_ints.py:\d+ needs indices in \[0, 11\)"):
        prog.value_and_grad(np.full_like(idx, V - 1))
    assert prog.value_and_grad(ok) == pytest.approx(wte[:V][ok[:, 1:] + 1].sum(), rel=1e-12)   # the flag was reset


def test_shape_errors_name_the_problem():
    idx, wte = _emb(7)
    with pytest.raises(btjit.TraceError, match=r"cannot broadcast \(3, 5\) to \(4, 5\)"):
        btjit.trace(lambda p, i: btjit.sum(btjit.take(p["w"], btjit.broadcast_to(i, (4, 5)))), {"w": wte}, idx)
    with pytest.raises(btjit.TraceError, match="cannot concatenate integer and float"):
        btjit.trace(lambda p, i: btjit.sum(btjit.concatenate([i, p["w"][:3, :5]], 0)), {"w": wte}, idx)
    with pytest.raises(btjit.TraceError, match=r"a value of shape \(2,\) cannot be assigned to a region of shape "
                                               r"\(3, 1\)"):
        btjit.trace(lambda p, i: btjit.sum(btjit.take(p["w"], btjit.setitem(i, (slice(None), 0), np.array([1, 2]))
                                                      )), {"w": wte}, idx)
