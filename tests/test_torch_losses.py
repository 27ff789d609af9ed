"""torch.nn.functional's pairwise_distance, ranking / embedding / margin losses, Poisson and Gaussian NLL and the
shrink activations, and numpy's hyperbolic functions, against torch in float64 (the value and every input's
gradient, 1e-10) for each reduction; dropout with p = 1 zeroes everything, as torch's."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
F = torch.nn.functional
RNG = np.random.default_rng(11)
A, B, C = (RNG.normal(size=(5, 4)) for _ in range(3))
Y = np.sign(RNG.normal(size=5))                 # +1 / -1 labels
YM = np.sign(RNG.normal(size=(5, 4)))
POS = np.abs(RNG.normal(size=(5, 4))) + 0.1
COUNTS = RNG.integers(0, 5, size=(5, 4)).astype(np.float64)

CASES = {  # name -> (btjit fn of the params, torch fn of the same, params, takes reduction=)
    "pairwise_distance": (lambda p, r: btjit.pairwise_distance(p["a"], p["b"]),
                          lambda p, r: F.pairwise_distance(p["a"], p["b"]), {"a": A, "b": B}, False),
    "pairwise_distance_p1_keepdim": (lambda p, r: btjit.pairwise_distance(p["a"], p["b"], p=1.0, keepdim=True),
                                     lambda p, r: F.pairwise_distance(p["a"], p["b"], p=1.0, keepdim=True),
                                     {"a": A, "b": B}, False),
    "margin_ranking": (lambda p, r: btjit.margin_ranking_loss(p["a"][:, 0], p["b"][:, 0], Y, 0.3, reduction=r),
                       lambda p, r: F.margin_ranking_loss(p["a"][:, 0], p["b"][:, 0], torch.tensor(Y), 0.3,
                                                          reduction=r), {"a": A, "b": B}, True),
    "triplet": (lambda p, r: btjit.triplet_margin_loss(p["a"], p["b"], p["c"], margin=2.0, reduction=r),
                lambda p, r: F.triplet_margin_loss(p["a"], p["b"], p["c"], margin=2.0, reduction=r),
                {"a": A, "b": B, "c": C}, True),
    "triplet_swap_p3": (lambda p, r: btjit.triplet_margin_loss(p["a"], p["b"], p["c"], p=3, swap=True, reduction=r),
                        lambda p, r: F.triplet_margin_loss(p["a"], p["b"], p["c"], p=3, swap=True, reduction=r),
                        {"a": A, "b": B, "c": C}, True),
    "hinge_embedding": (lambda p, r: btjit.hinge_embedding_loss(p["a"], YM, margin=0.5, reduction=r),
                        lambda p, r: F.hinge_embedding_loss(p["a"], torch.tensor(YM), margin=0.5, reduction=r),
                        {"a": A}, True),
    "soft_margin": (lambda p, r: btjit.soft_margin_loss(p["a"] * 20, YM, reduction=r),
                    lambda p, r: F.soft_margin_loss(p["a"] * 20, torch.tensor(YM), reduction=r), {"a": A}, True),
    "cosine_embedding": (lambda p, r: btjit.cosine_embedding_loss(p["a"], p["b"], Y, margin=-0.2, reduction=r),
                         lambda p, r: F.cosine_embedding_loss(p["a"], p["b"], torch.tensor(Y), margin=-0.2,
                                                              reduction=r), {"a": A, "b": B}, True),
    "poisson_log": (lambda p, r: btjit.poisson_nll_loss(p["a"], COUNTS, reduction=r),
                    lambda p, r: F.poisson_nll_loss(p["a"], torch.tensor(COUNTS), reduction=r), {"a": A}, True),
    "poisson_full": (lambda p, r: btjit.poisson_nll_loss(p["a"], COUNTS, log_input=False, full=True, reduction=r),
                     lambda p, r: F.poisson_nll_loss(p["a"], torch.tensor(COUNTS), log_input=False, full=True,
                                                     reduction=r), {"a": POS}, True),
    "gaussian": (lambda p, r: btjit.gaussian_nll_loss(p["a"], p["b"], p["v"], reduction=r),
                 lambda p, r: F.gaussian_nll_loss(p["a"], p["b"], p["v"], reduction=r),
                 {"a": A, "b": B, "v": POS * np.where(POS > 0.5, 1.0, 1e-7)}, True),
    "gaussian_row_var_full": (lambda p, r: btjit.gaussian_nll_loss(p["a"], p["b"], p["v"], full=True, reduction=r),
                              lambda p, r: F.gaussian_nll_loss(p["a"], p["b"], p["v"], full=True, reduction=r),
                              {"a": A, "b": B, "v": POS[:, 0]}, True),
    "shrinks": (lambda p, r: btjit.tanhshrink(p["a"]) + btjit.softshrink(p["a"], 0.4) + btjit.hardshrink(p["a"], 0.7),
                lambda p, r: F.tanhshrink(p["a"]) + F.softshrink(p["a"], 0.4) + F.hardshrink(p["a"], 0.7),
                {"a": A}, False),
    "hyperbolic": (lambda p, r: np.sinh(p["a"]) + np.cosh(p["a"]) + np.arcsinh(p["a"] * 30) + np.arctanh(p["a"] * 0.2)
                   + np.arccosh(p["v"] + 1.0),
                   lambda p, r: torch.sinh(p["a"]) + torch.cosh(p["a"]) + torch.asinh(p["a"] * 30)
                   + torch.atanh(p["a"] * 0.2) + torch.acosh(p["v"] + 1.0), {"a": A, "v": POS}, False),
}


RUNS = [(n, r) for n, c in CASES.items() for r in (("mean", "sum", "none") if c[3] else ("mean",))]


@pytest.mark.parametrize("name,reduction", RUNS)
def test_against_torch_float64(name, reduction):
    fn, tfn, params, _ = CASES[name]
    r = RNG.normal(size=np.shape(tfn({k: torch.tensor(v) for k, v in params.items()}, reduction)))
    prog = btjit.trace(lambda p: btjit.sum(fn(p, reduction) * r), params, dtype="float64", grad=True)
    got = prog.value_and_grad()
    t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    want = (tfn(t, reduction) * torch.tensor(r)).sum()
    want.backward()
    assert got == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    for k in params:
        np.testing.assert_allclose(prog.grads[k], t[k].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


def test_dropout_of_one_zeroes_everything_and_eval_is_the_identity():
    x = RNG.normal(size=(3, 4))
    prog = btjit.trace(lambda p: btjit.dropout(p["x"], 1.0) * 1.0, {"x": x}, dtype="float64", grad=False)
    np.testing.assert_array_equal(prog(), np.zeros_like(x))
    np.testing.assert_array_equal(prog.eval(), x)
    with pytest.raises(btjit.TraceError, match=r"dropout probability must be a number in \[0, 1\], got 1.5"):
        btjit.trace(lambda p: btjit.dropout(p["x"], 1.5), {"x": x}, grad=False)


def test_labels_of_another_shape_are_named():
    with pytest.raises(btjit.TraceError, match=r"margin_ranking_loss: labels y \(3,\) must have the input's shape"):
        btjit.trace(lambda p: btjit.margin_ranking_loss(p["a"][:, 0], p["b"][:, 0], Y[:3]), {"a": A, "b": B},
                    grad=False)
