"""btjit.batch_norm against torch.nn.functional.batch_norm (values, gradients, running statistics over several
steps, eval mode) at float64 1e-10 and float32 1e-5, and makemore part 3's batch-norm MLP (nn-zero-to-hero:
embedding 27x10, block 3, Linear 30->200 without bias, BatchNorm1d(200), tanh, Linear 200->27) trained 10 SGD
steps beside the same model in torch."""
import numpy as np
import pytest

import btjit
from btjit.graph.trace import TraceError

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = {"float64": 1e-10, "float32": 1e-5}


def _bn_loss(axis, affine, momentum):
    def fn(p, x, t):
        w, b = (p["w"], p["b"]) if affine else (None, None)
        y = btjit.batch_norm(x * p["s"], w, b, p["rm"], p["rv"], momentum=momentum, axis=axis)
        return btjit.sum(btjit.tanh(y) * t)
    return fn


def _torch_bn(x, s, w, b, rm, rv, t, axis, momentum, training=True):
    xs = x * s
    xt = xs.movedim(axis, 1) if axis != 1 else xs
    y = F.batch_norm(xt, rm, rv, w, b, training=training, momentum=momentum, eps=1e-5)
    y = y.movedim(1, axis) if axis != 1 else y
    return (torch.tanh(y) * t).sum()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape,axis,affine", [((8, 5), 1, True), ((4, 3, 6), 1, True), ((3, 4, 2, 3), 1, False),
                                               ((4, 6, 5), -1, True)])
def test_batch_norm_matches_torch(shape, axis, affine, dtype):
    rng = np.random.default_rng(1)
    C = shape[axis]
    tdt = getattr(torch, dtype)
    params = {"s": rng.uniform(0.5, 2.0, shape)}
    if affine:
        params.update(w=rng.normal(size=C), b=rng.normal(size=C))
    bufs = {"rm": rng.normal(size=C) * 0.1, "rv": rng.uniform(0.5, 1.5, C)}
    xs = [(rng.normal(size=shape) * 2 + 1).astype(dtype) for _ in range(3)]
    t = rng.normal(size=shape).astype(dtype)
    prog = btjit.trace(_bn_loss(axis, affine, 0.2), params, xs[0], t, buffers=bufs, grad=True, dtype=dtype)
    T = {k: torch.tensor(v, dtype=tdt, requires_grad=True) for k, v in params.items()}
    rm, rv = (torch.tensor(bufs[k], dtype=tdt) for k in ("rm", "rv"))
    tol = TOL[dtype]
    for x in xs:                               # a step: value, grads, then the running statistics
        loss = _torch_bn(torch.tensor(x, dtype=tdt), T["s"], T.get("w"), T.get("b"), rm, rv, torch.tensor(t, dtype=tdt),
                         axis, 0.2)
        for v in T.values():
            v.grad = None
        loss.backward()
        got = prog.step(x, t)
        assert got == pytest.approx(loss.item(), rel=tol, abs=tol)
        for k, v in T.items():
            np.testing.assert_allclose(prog.grads[k], v.grad.numpy(), rtol=tol, atol=tol, err_msg=k)
        np.testing.assert_allclose(prog.buffers["rm"], rm.numpy(), rtol=tol, atol=tol)
        np.testing.assert_allclose(prog.buffers["rv"], rv.numpy(), rtol=tol, atol=tol)
    with torch.no_grad():                      # eval: the running statistics, nothing assigned
        want = _torch_bn(torch.tensor(xs[0], dtype=tdt), T["s"], T.get("w"), T.get("b"), rm, rv,
                         torch.tensor(t, dtype=tdt), axis, 0.2, training=False)
    assert prog.eval(xs[0], t) == pytest.approx(want.item(), rel=tol, abs=tol)
    np.testing.assert_allclose(prog.buffers["rm"], rm.numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape,axis", [((16, 24, 20, 20), 1), ((64, 16, 96), -1)], ids=["nchw", "channels_last"])
def test_large_batch_norm_is_bitwise_the_same_on_one_thread_and_two(shape, axis):
    """From 64K elements batch norm's rows split its channels over the threads: loss and every gradient bitwise
    equal on one thread and two, the running statistics too."""
    from btjit.testing import split_kernels
    rng = np.random.default_rng(2)
    C = shape[axis]
    p = {"s": rng.normal(size=shape).astype(np.float32), "w": rng.normal(size=C).astype(np.float32),
         "b": rng.normal(size=C).astype(np.float32)}
    x, t = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    out = []
    for threads in (1, 2):
        bufs = {"rm": np.zeros(C, np.float32), "rv": np.ones(C, np.float32)}
        prog = btjit.trace(_bn_loss(axis, True, 0.1), p, x, t, buffers=bufs, optimizer=btjit.optim.SGD(lr=0.1),
                           threads=threads)
        losses = [prog.step(x, t) for _ in range(2)]
        out.append((losses, {k: v.copy() for k, v in {**prog.params, **prog.buffers}.items()}, split_kernels(prog)))
    assert out[0][0] == out[1][0] and all(np.array_equal(out[0][1][k], out[1][1][k]) for k in out[0][1])
    assert not {"k_batchnorm_fwd", "k_batchnorm_bwd"} & set(out[0][2])
    assert out[1][2]["k_batchnorm_fwd"] == out[1][2]["k_batchnorm_bwd"] == 2


def test_batch_norm_finite_differences():
    from btjit.testing import check_grads
    rng = np.random.default_rng(2)

    def f(p, x):
        y = btjit.batch_norm(x * p["s"], p["w"], p["b"], None, None, training=True, axis=1)
        return btjit.sum(btjit.tanh(y) * x)
    params = {"s": rng.uniform(0.5, 2, (4, 3, 5)), "w": rng.normal(size=3), "b": rng.normal(size=3)}
    check_grads(f, params, rng.normal(size=(4, 3, 5)))


def test_batch_norm_errors():
    x = np.ones((4, 3))

    def bad_weight(p, x):
        return btjit.batch_norm(x, p["w"], None, None, None).sum()
    with pytest.raises(TraceError, match=r"weight has shape \(4,\).*3 channels along axis 1 — test_batchnorm.py:\d+"):
        btjit.trace(bad_weight, {"w": np.ones(4)}, x, grad=False)

    def one_value(p, x):
        return btjit.batch_norm(x[:1], None, None, None, None, training=True).sum()
    with pytest.raises(TraceError, match="more than one value per channel"):
        btjit.trace(one_value, {}, x, grad=False)


# ----------------------------------------------------------------------------- makemore part 3
def _mlp_bn(p, x, y):
    emb = p["C"][x].reshape(x.shape[0], -1)                  # (B, 30)
    h = btjit.batch_norm(emb @ p["W1"], p["bngain"], p["bnbias"], p["bnmean"], p["bnvar"])
    logits = btjit.tanh(h) @ p["W2"] + p["b2"]
    return btjit.cross_entropy(logits, y)


def _init(rng):
    return {"C": rng.normal(size=(27, 10)), "W1": rng.normal(size=(30, 200)) * (5 / 3) / 30 ** 0.5,
            "bngain": np.ones(200), "bnbias": np.zeros(200), "W2": rng.normal(size=(200, 27)) * 0.01,
            "b2": np.zeros(27)}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_makemore_part3_batchnorm_mlp_trajectory(dtype):
    rng = np.random.default_rng(3)
    params, tdt, tol = _init(rng), getattr(torch, dtype), TOL[dtype]
    bufs = {"bnmean": np.zeros(200), "bnvar": np.ones(200)}
    batches = [(rng.integers(0, 27, (32, 3)), rng.integers(0, 27, 32)) for _ in range(10)]
    prog = btjit.trace(_mlp_bn, params, *batches[0], buffers=bufs, optimizer=btjit.optim.SGD(lr=0.1), dtype=dtype)
    emb = torch.nn.Embedding(27, 10)
    l1, bn, l2 = torch.nn.Linear(30, 200, bias=False), torch.nn.BatchNorm1d(200), torch.nn.Linear(200, 27)
    model = torch.nn.Sequential(l1, bn, torch.nn.Tanh(), l2).to(tdt)
    emb = emb.to(tdt)
    with torch.no_grad():
        emb.weight.copy_(torch.tensor(params["C"]))
        l1.weight.copy_(torch.tensor(params["W1"].T))
        l2.weight.copy_(torch.tensor(params["W2"].T))
        l2.bias.zero_()
    opt = torch.optim.SGD(list(emb.parameters()) + list(model.parameters()), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(emb(torch.tensor(x)).view(32, -1)), torch.tensor(y))
        loss.backward()
        opt.step()
        assert prog.step(x, y) == pytest.approx(loss.item(), rel=tol)
    np.testing.assert_allclose(prog.buffers["bnmean"], bn.running_mean.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(prog.buffers["bnvar"], bn.running_var.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(prog.params["W1"], l1.weight.detach().numpy().T, rtol=tol, atol=tol)
    np.testing.assert_allclose(prog.params["bngain"], bn.weight.detach().numpy(), rtol=tol, atol=tol)
    model.eval()                                   # eval mode: the running statistics
    x, y = batches[0]
    with torch.no_grad():
        want = F.cross_entropy(model(emb(torch.tensor(x)).view(32, -1)), torch.tensor(y)).item()
    assert prog.eval(x, y) == pytest.approx(want, rel=tol)
