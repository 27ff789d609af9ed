"""btjit/models/rnn_cells.py against torch.nn.LSTMCell / GRUCell (same weights, gate order and semantics):
values and every gradient in float64 (1e-10) and float32, unrolled over a few steps, with and without biases;
and the fused graph: the gate arithmetic is one elementwise row forward and one backward (the gate slices
read in place, the gates' gradient written in place), nothing else but the products."""
import numpy as np
import pytest

import btjit
from btjit.models.rnn_cells import gru_cell, lstm_cell
from btjit.testing import check_grads

torch = pytest.importorskip("torch")

B, I, H, STEPS = 3, 5, 7, 3


def _setup(kind, bias, dtype, seed=0):
    cell = (torch.nn.LSTMCell if kind == "lstm" else torch.nn.GRUCell)(I, H, bias=bias).to(getattr(torch, dtype))
    rng = np.random.default_rng(seed)
    p = {k: v.detach().numpy().copy() for k, v in cell.state_dict().items()}
    p["h0"] = rng.normal(size=(B, H)).astype(dtype)
    if kind == "lstm":
        p["c0"] = rng.normal(size=(B, H)).astype(dtype)
    xs = rng.normal(size=(STEPS, B, I)).astype(dtype)
    w = rng.normal(size=(STEPS, B, H)).astype(dtype)
    return cell, p, xs, w


def _btjit_loss(kind, xs, w):
    def loss(p):
        h, c, total = p["h0"], p.get("c0"), 0.0
        for t in range(STEPS):
            args = (p["weight_ih"], p["weight_hh"], p.get("bias_ih"), p.get("bias_hh"))
            if kind == "lstm":
                h, c = lstm_cell(xs[t], h, c, *args)
                total = total + btjit.sum(c * c) * 0.1
            else:
                h = gru_cell(xs[t], h, *args)
            total = total + btjit.sum(h * w[t])
        return total
    return loss


def _torch(kind, cell, p, xs, w):
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    cell.load_state_dict({k: tp[k] for k in cell.state_dict()})
    h, c, total = tp["h0"], tp.get("c0"), 0.0
    for name, param in cell.named_parameters():
        param.grad = None
    for t in range(STEPS):
        x = torch.tensor(xs[t])
        if kind == "lstm":
            h, c = cell(x, (h, c))
            total = total + (c * c).sum() * 0.1
        else:
            h = cell(x, h)
        total = total + (h * torch.tensor(w[t])).sum()
    total.backward()
    grads = {k: dict(cell.named_parameters())[k].grad.numpy() for k in cell.state_dict()}
    grads.update({k: tp[k].grad.numpy() for k in ("h0", "c0") if k in tp})
    return total.item(), grads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_against_torch_float64(kind, bias):
    cell, p, xs, w = _setup(kind, bias, "float64")
    prog = btjit.trace(_btjit_loss(kind, xs, w), p, dtype="float64", grad=True)
    loss = prog.value_and_grad()
    want, grads = _torch(kind, cell, p, xs, w)
    assert abs(loss - want) <= 1e-10 * max(1.0, abs(want))
    assert set(grads) == set(prog.grads)
    for k, g in grads.items():
        np.testing.assert_allclose(prog.grads[k], g, rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_against_torch_float32(kind):
    cell, p, xs, w = _setup(kind, True, "float32", seed=1)
    prog = btjit.trace(_btjit_loss(kind, xs, w), p, dtype="float32", grad=True)
    loss = prog.value_and_grad()
    want, grads = _torch(kind, cell, p, xs, w)
    assert abs(loss - want) <= 1e-5 * max(1.0, abs(want))
    for k, g in grads.items():
        np.testing.assert_allclose(prog.grads[k], g, rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_finite_differences(kind):
    _, p, xs, w = _setup(kind, True, "float64", seed=2)
    check_grads(_btjit_loss(kind, xs, w), p)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_gate_arithmetic_is_one_row_forward_and_one_backward(kind):
    _, p, xs, w = _setup(kind, True, "float64")
    x = xs[0]

    def one_step(p):
        args = (p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"])
        h = lstm_cell(x, p["h0"], p["c0"], *args)[0] if kind == "lstm" else gru_cell(x, p["h0"], *args)
        return btjit.sum(h * w[0])
    g = btjit.trace(one_step, p, dtype="float64", grad=True).graph
    fwd, bwd = g.eqns[:g.n_forward], g.eqns[g.n_forward:]
    assert [e.op for e in fwd if e.op not in ("linear", "transpose")] == ["ew_fused", "sum"], str(g)
    gates = [e for e in bwd if e.op == "ew_fused"]
    assert len(gates) == 1, str(g)
    assert not any(e.op in ("slice", "slice_scatter", "concatenate") for e in g.eqns), str(g)
    assert any(s == (B, (4 if kind == "lstm" else 3) * H) for s in gates[0].attrs["oshapes"])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_against_torch_lstm_gru(kind):
    from btjit.models.rnn_cells import gru, lstm
    T_ = 4
    mod = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(I, H).double()
    rng = np.random.default_rng(5)
    p = {k[:-3]: v.detach().numpy().copy() for k, v in mod.state_dict().items()}    # weight_ih_l0 -> weight_ih
    p["h0"] = rng.normal(size=(B, H))
    p["c0"] = rng.normal(size=(B, H))
    xs, w = rng.normal(size=(T_, B, I)), rng.normal(size=(T_, B, H))

    def loss(p):
        args = (p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"])
        ys, last = lstm(xs, (p["h0"], p["c0"]), *args) if kind == "lstm" else gru(xs, p["h0"], *args)
        return btjit.sum(ys * w) + btjit.sum((last[1] if kind == "lstm" else last) * 0.3)
    if kind == "gru":
        del p["c0"]
    prog = btjit.trace(loss, p, dtype="float64", grad=True)
    got = prog.value_and_grad()
    g, G = prog.graph, 4 if kind == "lstm" else 3       # each step's gate gradient: one row writing (B, G H)
    assert sum((B, G * H) in e.attrs["oshapes"] for e in g.eqns[g.n_forward:] if e.op == "ew_fused") == T_
    assert not any(e.op == "slice_scatter" for e in g.eqns[g.n_forward:]), str(g)
    cats = [e for e in g.eqns[g.n_forward:] if e.op == "concatenate"]      # the steps' gate gradients, for dW_ih's
    assert [c.outs[0].shape for c in cats] == [(T_, B, G * H)], str(g)     # one product over all T steps
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    mod.load_state_dict({k + "_l0": torch.tensor(p[k]) for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")})
    h0 = (tp["h0"][None], tp["c0"][None]) if kind == "lstm" else tp["h0"][None]
    ys, last = mod(torch.tensor(xs), h0)
    last = last[1][0] if kind == "lstm" else last[0]
    want = (ys * torch.tensor(w)).sum() + (last * 0.3).sum()
    want.backward()
    assert abs(got - want.item()) < 1e-10 * max(1.0, abs(want.item()))
    for k in ("h0", "c0") if kind == "lstm" else ("h0",):
        np.testing.assert_allclose(prog.grads[k], tp[k].grad.numpy(), rtol=1e-10, atol=1e-12)
    for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        np.testing.assert_allclose(prog.grads[k], dict(mod.named_parameters())[k + "_l0"].grad.numpy(),
                                   rtol=1e-10, atol=1e-12)
