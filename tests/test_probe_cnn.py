"""Gradient accumulation (`train.grad_accum`, btjit.train.schedule.Accumulator) as torch users accumulate: each
micro-batch draws its own dropout masks -- those one step on the k-times batch draws -- and every micro-batch's
forward moves batch norm's running statistics, as k forwards of a torch model in train mode do."""
import numpy as np
import pytest

import btjit
from btjit.train.schedule import Accumulator


def _dropout_net(p, x, y):
    h = btjit.dropout(btjit.relu(btjit.conv2d(x, p["w"], p["b"], padding=1)), 0.5)       # (B, 4, 5, 5)
    return btjit.cross_entropy(btjit.flatten(h) @ p["fc"], y)


def _params(rng):
    return {"w": rng.normal(size=(4, 2, 3, 3)) * 0.4, "b": rng.normal(size=4) * 0.1,
            "fc": rng.normal(size=(100, 3)) * 0.1}


def test_accumulated_micro_batches_draw_the_big_batchs_dropout_masks():
    """k micro-batches of B, accumulated, give one step on the k B batch bit for bit in the masks (the same
    params to float64 rounding), every update; before, every micro-batch of an update reused one mask."""
    rng = np.random.default_rng(0)
    k, B = 3, 2
    p = _params(rng)
    x = rng.normal(size=(k * B, 2, 5, 5))
    y = rng.integers(0, 3, k * B).astype(np.int32)
    small = btjit.trace(_dropout_net, p, x[:B], y[:B], optimizer=btjit.optim.SGD(0.1), dtype="float64", seed=7)
    big = btjit.trace(_dropout_net, p, x, y, optimizer=btjit.optim.SGD(0.1), dtype="float64", seed=7)
    acc = Accumulator(small)
    for _ in range(3):
        parts = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(k)]
        assert acc.step(parts) == pytest.approx(big.step(x, y), rel=1e-12)
        for n in p:
            np.testing.assert_allclose(small.params[n], big.params[n], rtol=1e-10, atol=1e-13, err_msg=n)
        x = x + 0.1
    # the program's own numbering is back: a plain step draws what a fresh program at this step draws
    fresh = btjit.trace(_dropout_net, p, x[:B], y[:B], optimizer=btjit.optim.SGD(0.1), dtype="float64", seed=7)
    fresh.load_state_dict(small.state_dict())
    assert small.value_and_grad(x[:B], y[:B]) == fresh.value_and_grad(x[:B], y[:B])


def test_accumulated_micro_batches_move_batch_norms_running_statistics_as_torch():
    """A conv + BatchNorm2d net trained with grad_accum = 3 (torch: three forwards, each loss / 3 backward, one
    optimizer step): loss, params and the running statistics as torch's after every update (float64)."""
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 3)).double()
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    bufs = {k: v.numpy().copy() for k, v in net.named_buffers() if not k.endswith("num_batches_tracked")}

    def loss(p, x, y):
        h = btjit.conv2d(x, p["0.weight"], p["0.bias"], padding=1)
        h = btjit.batch_norm(h, p["1.weight"], p["1.bias"], p["1.running_mean"], p["1.running_var"])
        h = btjit.flatten(btjit.adaptive_avg_pool2d(btjit.relu(h), 1))
        return btjit.cross_entropy(h @ p["5.weight"].T + p["5.bias"], y)
    rng = np.random.default_rng(1)
    k, B = 3, 4
    batches = [[(rng.normal(size=(B, 2, 6, 5)) + 2, rng.integers(0, 3, B).astype(np.int32)) for _ in range(k)]
               for _ in range(3)]
    prog = btjit.trace(loss, params, *batches[0][0], optimizer=btjit.optim.SGD(0.1, momentum=0.9),
                       dtype="float64", buffers=bufs)
    acc, opt = Accumulator(prog), torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for parts in batches:
        opt.zero_grad()
        want = 0.0
        for x, y in parts:
            t = F.cross_entropy(net(torch.tensor(x)), torch.tensor(y).long()) / k
            t.backward()
            want += t.item()
        opt.step()
        assert acc.step(parts) == pytest.approx(want, rel=1e-10)
        for n, v in list(net.named_parameters()) + list(net.named_buffers()):
            if n in prog.params or n in prog.buffers:
                got = prog.params[n] if n in prog.params else prog.buffers[n]
                np.testing.assert_allclose(got, v.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=n)


@pytest.mark.parametrize("k", [1, 2])
def test_data_parallel_ranks_draw_their_own_dropout_masks(k, monkeypatch):
    """N ranks (here 2, each a DataParallel with a stand-in communicator) of k micro-batches: rank r's micro-batch
    i draws part i N + r of one k N B batch, so the mean of the ranks' losses and gradients is the big batch's
    (before, every rank drew rank 0's masks)."""
    import types

    from btjit.train import distributed
    N, B = 2, 2

    class Rank:
        def __init__(self, r):
            self.Get_rank, self.Get_size = (lambda: r), (lambda: N)
    monkeypatch.setattr(distributed, "require_mpi", lambda: types.SimpleNamespace(COMM_WORLD=None))
    rng = np.random.default_rng(3)
    p = _params(rng)
    x = rng.normal(size=(k * N * B, 2, 5, 5))
    y = rng.integers(0, 3, k * N * B).astype(np.int32)
    big = btjit.trace(_dropout_net, p, x, y, optimizer=btjit.optim.SGD(0.1), dtype="float64", seed=11)
    want = big.value_and_grad(x, y)
    got, grads = 0.0, {n: 0.0 for n in p}
    for r in range(N):
        prog = btjit.trace(_dropout_net, p, x[:B], y[:B], optimizer=btjit.optim.SGD(0.1), dtype="float64", seed=11)
        dp = distributed.DataParallel(prog, comm=Rank(r), broadcast=False)
        rows = [slice((i * N + r) * B, (i * N + r + 1) * B) for i in range(k)]
        got += dp.accum.grad([(x[s], y[s]) for s in rows]) / N
        for n in p:
            grads[n] = grads[n] + prog.grads[n] / N
    assert got == pytest.approx(want, rel=1e-12)
    for n in p:
        np.testing.assert_allclose(grads[n], big.grads[n], rtol=1e-10, atol=1e-13, err_msg=n)
