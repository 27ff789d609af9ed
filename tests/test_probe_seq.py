"""A 2-layer bidirectional GRU language model as torch.nn.GRU(bidirectional=True) computes it, written with
btjit.models.rnn_cells.gru and btjit.flip (torch's flip(dims=)) for the reverse direction, its final states
carried from batch to batch in a buffer: a 6-step SGD (nesterov, weight decay) trajectory against torch in
float64 (loss, every param, the carried state), then prog.eval; btjit.flip against numpy's and torch's."""
import numpy as np
import pytest

import btjit
from btjit.models.rnn_cells import gru

torch = pytest.importorskip("torch")

T, B, I, H, V = 5, 3, 4, 6, 7


def _model():
    torch.manual_seed(0)
    m = torch.nn.GRU(I, H, num_layers=2, bidirectional=True).double()
    emb, head = torch.nn.Embedding(V, I).double(), torch.nn.Linear(2 * H, V).double()
    p = {"gru." + k: v.detach().numpy().copy() for k, v in m.named_parameters()}
    p.update(emb=emb.weight.detach().numpy().copy(), hw=head.weight.detach().numpy().copy(),
             hb=head.bias.detach().numpy().copy())
    return m, emb, head, p


def loss_fn(p, x, y):
    inp, finals = p["emb"][x], []
    for layer in range(2):
        outs = []
        for d, suffix in enumerate(("", "_reverse")):
            w = [p[f"gru.{n}_l{layer}{suffix}"] for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            o, h = gru(inp if d == 0 else btjit.flip(inp, dims=(0,)), p["h"][2 * layer + d], *w)
            outs.append(o if d == 0 else btjit.flip(o, 0))
            finals.append(h)
        inp = btjit.concatenate(outs, axis=2)
    btjit.assign(p["h"], btjit.stack(finals))
    return btjit.cross_entropy(inp.reshape(T * B, 2 * H) @ p["hw"].T + p["hb"], y.reshape(T * B))


def test_bidirectional_gru_lm_with_carried_state_trains_as_torch():
    m, emb, head, p = _model()
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, V, (T, B)).astype(np.int32), rng.integers(0, V, (T, B)).astype(np.int32))
               for _ in range(7)]
    opt = btjit.optim.SGD(lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01)
    prog = btjit.trace(loss_fn, p, *batches[0], buffers={"h": np.zeros((4, B, H))}, optimizer=opt, dtype="float64")
    tparams = [*m.parameters(), emb.weight, head.weight, head.bias]
    names = [*("gru." + k for k, _ in m.named_parameters()), "emb", "hw", "hb"]
    topt = torch.optim.SGD(tparams, lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.01)
    h = torch.zeros(4, B, H, dtype=torch.float64)

    def torch_loss(x, y, h):
        o, hn = m(emb(torch.tensor(x).long()), h)
        return torch.nn.functional.cross_entropy(head(o).reshape(T * B, V), torch.tensor(y).long().reshape(-1)), hn

    for x, y in batches[:6]:
        got = prog.step(x, y)
        topt.zero_grad()
        want, hn = torch_loss(x, y, h)
        want.backward()
        topt.step()
        h = hn.detach()
        assert abs(got - want.item()) <= 1e-12
        for k, q in zip(names, tparams):
            np.testing.assert_allclose(prog.params[k], q.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(prog.buffers["h"], h.numpy(), rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        want, _ = torch_loss(*batches[6], h)
    assert abs(prog.eval(*batches[6]) - want.item()) <= 1e-12


@pytest.mark.parametrize("kw", [{}, {"axis": 1}, {"axis": (0, 2)}, {"dims": (1,)}, {"dims": [0, 1, 2]}])
def test_flip_as_numpy_and_torch(kw):
    x = np.arange(24.0).reshape(2, 3, 4)
    prog = btjit.trace(lambda p: btjit.flip(p["x"], **kw) * 1.0, {"x": x}, dtype="float64")
    if "dims" in kw:
        want = torch.flip(torch.tensor(x), dims=kw["dims"]).numpy()
    else:
        want = np.flip(x, **kw)
    np.testing.assert_array_equal(prog(), want)
