"""torch.nn.functional's unfold, fold, pixel_unshuffle, channel_shuffle and local_response_norm (AlexNet's,
GoogLeNet's) against torch: outputs and input gradients in float64 and float32, a ShuffleNet-style unit trained
a few steps beside torch, the argument errors naming the function and the line; and a text CNN whose embedding
has torch's padding_idx."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
from torch_models import sgd_steps_as_torch  # noqa: E402
F = torch.nn.functional

CASES = [  # name, btjit fn, torch fn (of one array)
    ("unfold", lambda x: btjit.unfold(x, 3, padding=1, stride=2), lambda x: F.unfold(x, 3, padding=1, stride=2)),
    ("unfold dilated, not square", lambda x: btjit.unfold(x, (2, 3), dilation=(2, 1), stride=(1, 2)),
     lambda x: F.unfold(x, (2, 3), dilation=(2, 1), stride=(1, 2))),
    ("fold of unfold", lambda x: btjit.fold(btjit.unfold(x, 3, padding=1), (8, 9), 3, padding=1),
     lambda x: F.fold(F.unfold(x, 3, padding=1), (8, 9), 3, padding=1)),
    ("fold", lambda x: btjit.fold(x.reshape(2, 6, 72)[:, :, :25], (5, 6), (3, 2), padding=(1, 0)),
     lambda x: F.fold(x.reshape(2, 6, 72)[:, :, :25], (5, 6), (3, 2), padding=(1, 0))),
    ("pixel_unshuffle", lambda x: btjit.pixel_unshuffle(x[:, :, :, :8], 2),
     lambda x: F.pixel_unshuffle(x[:, :, :, :8], 2)),
    ("channel_shuffle", lambda x: btjit.channel_shuffle(x, 3), lambda x: F.channel_shuffle(x, 3)),
    ("channel_shuffle (N, C, L)", lambda x: btjit.channel_shuffle(x[:, :, 0], 2),
     lambda x: F.channel_shuffle(x[:, :, 0], 2)),
    ("local_response_norm 2", lambda x: btjit.local_response_norm(x, 2), lambda x: F.local_response_norm(x, 2)),
    ("local_response_norm AlexNet", lambda x: btjit.local_response_norm(x, 5, alpha=1e-3, beta=0.75, k=2.0),
     lambda x: F.local_response_norm(x, 5, alpha=1e-3, beta=0.75, k=2.0)),
    ("local_response_norm (N, C, L)", lambda x: btjit.local_response_norm(x[:, :, 0], 3, alpha=0.5),
     lambda x: F.local_response_norm(x[:, :, 0], 3, alpha=0.5)),
    ("lp_pool2d", lambda x: btjit.lp_pool2d(x, 2, 3, stride=2), lambda x: F.lp_pool2d(x, 2, 3, stride=2)),
    ("lp_pool2d p 3, ceil_mode", lambda x: btjit.lp_pool2d(x * x + 0.1, 3, (2, 3), ceil_mode=True),
     lambda x: F.lp_pool2d(x * x + 0.1, 3, (2, 3), ceil_mode=True)),
    ("lp_pool1d", lambda x: btjit.lp_pool1d(x[:, :, 0], 2, 3), lambda x: F.lp_pool1d(x[:, :, 0], 2, 3)),
]


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-5)])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_matches_torch(i, dtype, tol):
    _, f, tf = CASES[i]
    x = np.random.default_rng(i).normal(size=(2, 6, 8, 9))
    tx = torch.tensor(x, requires_grad=True)
    want = tf(tx)
    r = np.random.default_rng(9).normal(size=tuple(want.shape))
    (want * torch.tensor(r)).sum().backward()

    def loss(p):
        y = f(p["x"])
        return btjit.sum(y * r), {"y": y}
    prog = btjit.trace(loss, {"x": x.astype(dtype)}, dtype=dtype, grad=True)
    prog.value_and_grad()
    np.testing.assert_allclose(prog.outputs["y"], want.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(prog.grads["x"], tx.grad.numpy(), rtol=tol, atol=tol)


def test_a_shufflenet_unit_with_lrn_trains_as_torch():
    torch.manual_seed(0)
    c1, c2 = torch.nn.Conv2d(6, 6, 1, groups=3), torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
    fc = torch.nn.Linear(6 * 4 * 4, 3)
    mods = torch.nn.ModuleDict({"c1": c1, "c2": c2, "fc": fc}).double()

    def tnet(x):
        h = F.local_response_norm(F.channel_shuffle(F.relu(c1(x)), 3), 3)
        return fc(F.pixel_unshuffle(c2(h), 2).reshape(len(x), 6, 4, 4, 4).mean(2).flatten(1))
    params = {k: v.detach().numpy().copy() for k, v in mods.named_parameters()}

    def loss(p, x, y):
        h = btjit.relu(btjit.conv2d(x, p["c1.weight"], p["c1.bias"], groups=3))
        h = btjit.local_response_norm(btjit.channel_shuffle(h, 3), 3)
        h = btjit.pixel_unshuffle(btjit.conv2d(h, p["c2.weight"], p["c2.bias"], padding=1, groups=6), 2)
        h = h.reshape(len(x), 6, 4, 4, 4).mean(2).flatten(1)
        return btjit.cross_entropy(h @ p["fc.weight"].T + p["fc.bias"], y)
    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(4, 6, 8, 8)), rng.integers(0, 3, 4).astype(np.int32)) for _ in range(3)]
    prog = btjit.trace(loss, params, *data[0], optimizer=btjit.optim.SGD(0.1, momentum=0.9), dtype="float64")
    sgd_steps_as_torch(prog, mods, data, lambda x, y: F.cross_entropy(tnet(torch.tensor(x)), torch.tensor(y).long()))


@pytest.mark.parametrize("call,message", [
    (lambda x: btjit.unfold(x[0], 3), "unfold: needs x (N, C, H, W)"),
    (lambda x: btjit.unfold(x, 3, stride=0), "unfold: stride must be >= 1, got 0"),
    (lambda x: btjit.fold(btjit.unfold(x, 3), (8, 8), 3), "holds 6 x 6 = 36 blocks, but x has L = 42"),
    (lambda x: btjit.fold(x[:, :, 0], (8, 8), 2), "fold: needs x (N, C*2*2, L)"),
    (lambda x: btjit.pixel_unshuffle(x, 2), "pixel_unshuffle: needs (N, C, H*2, W*2)"),
    (lambda x: btjit.channel_shuffle(x, 4), "divisible by groups=4"),
    (lambda x: btjit.local_response_norm(x, 0), "size >= 1"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(lambda p: btjit.sum(call(p["x"])), {"x": np.zeros((2, 6, 8, 9))}, grad=False)
    assert message in str(e.value) and "test_probe_vision_fns.py:" in str(e.value)


def test_a_text_cnn_with_a_padding_row_trains_as_torch():
    """nn.Embedding(V, D, padding_idx=0) -> conv1d over (N, D, L) -> max over time -> linear, 3 SGD steps: the
    padding row gets no gradient (it stays as initialised), the rest as torch's; negative padding_idx too."""
    torch.manual_seed(0)
    for pad in (0, -1):
        emb, conv, fc = torch.nn.Embedding(12, 6, padding_idx=pad), torch.nn.Conv1d(6, 8, 3), torch.nn.Linear(8, 2)
        mods = torch.nn.ModuleDict({"emb": emb, "conv": conv, "fc": fc}).double()
        params = {k: v.detach().numpy().copy() for k, v in mods.named_parameters()}

        def loss(p, ids, y):
            h = btjit.embedding(ids, p["emb.weight"], padding_idx=pad).transpose(1, 2)
            h = btjit.relu(btjit.conv1d(h, p["conv.weight"], p["conv.bias"])).max(2)
            return btjit.cross_entropy(h @ p["fc.weight"].T + p["fc.bias"], y)
        rng = np.random.default_rng(2)
        data = [(rng.integers(0, 12, (4, 9)).astype(np.int32), rng.integers(0, 2, 4).astype(np.int32))
                for _ in range(3)]
        for ids, _ in data:
            ids[:, -3:] = pad % 12                                       # padded sequences
        prog = btjit.trace(loss, params, *data[0], optimizer=btjit.optim.SGD(0.5), dtype="float64")
        opt = torch.optim.SGD(mods.parameters(), lr=0.5)
        for ids, y in data:
            opt.zero_grad()
            h = F.relu(conv(emb(torch.tensor(ids).long()).transpose(1, 2))).max(2).values
            want = F.cross_entropy(fc(h), torch.tensor(y).long())
            want.backward()
            opt.step()
            assert prog.step(ids, y) == pytest.approx(want.item(), rel=1e-10)
        for k, v in mods.named_parameters():
            np.testing.assert_allclose(prog.params[k], v.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=k)
        assert np.array_equal(prog.params["emb.weight"][pad], params["emb.weight"][pad])
