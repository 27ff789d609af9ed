"""Public models as their authors wrote them, beside torch (float64), for the parts tests/test_models_as_written.py
does not cover:

1. pytorch/examples' word_language_model RNNModel for 'GRU', 'RNN_TANH', 'RNN_RELU' (and 'LSTM' with clipping):
   2 layers, tied weights, the hidden state carried between batches as buffers (repackage_hidden), truncated BPTT
   over 3 batches with main.py's clip_grad_norm_(0.25) and SGD; init_hidden via prog.buffers; eval with dropout.
2. min-char-rnn (Karpathy's numpy RNN) with Adagrad and np.clip(dparam, -5, 5), against its own numpy update.
(makemore part 4, the lecture's gpt.py and micrograd's MLP: tests/test_as_written_lectures.py)
"""
import numpy as np
import pytest

import btjit
from btjit.models.rnn_cells import gru_cell, lstm_cell

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = 1e-9


# ----------------------------------------------------------------------------- 1. word_language_model RNNModel
NT, NH, SEQ, BSZ, NL = 11, 6, 4, 3, 2


def _rnn_step(kind, p, l, inp, h, c):
    w = (p[f"weight_ih_l{l}"], p[f"weight_hh_l{l}"], p[f"bias_ih_l{l}"], p[f"bias_hh_l{l}"])
    if kind == "LSTM":
        return lstm_cell(inp, h, c, *w)
    if kind == "GRU":
        return gru_cell(inp, h, *w), None
    pre = inp @ w[0].T + w[2] + h @ w[1].T + w[3]
    return (btjit.tanh(pre) if kind == "RNN_TANH" else btjit.relu(pre)), None


def _rnn_model_loss(kind, dropout):
    def loss(p, x, y):
        h = [p[f"h{l}"] for l in range(NL)]
        c = [p.get(f"c{l}") for l in range(NL)]
        emb = btjit.dropout(btjit.take(p["encoder.weight"], x), dropout)          # self.drop(self.encoder(input))
        layer_in = emb
        for l in range(NL):
            outs = []
            for t in range(x.shape[0]):
                h[l], c[l] = _rnn_step(kind, p, l, layer_in[t], h[l], c[l])
                outs.append(h[l])
            layer_in = btjit.stack(outs)
            if l < NL - 1:
                layer_in = btjit.dropout(layer_in, dropout)                       # nn.LSTM's dropout between layers
        output = btjit.dropout(layer_in, dropout)
        decoded = output @ p["encoder.weight"].T + p["decoder.bias"]                # tied
        for l in range(NL):
            btjit.assign(p[f"h{l}"], h[l])
            if kind == "LSTM":
                btjit.assign(p[f"c{l}"], c[l])
        return btjit.nll_loss(btjit.log_softmax(decoded.reshape(-1, NT), axis=1), y.reshape(-1))
    return loss


class RNNModel(torch.nn.Module):
    """word_language_model/model.py's RNNModel (tie_weights=True, so ninp == nhid)."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.ntoken, self.drop = ntoken, torch.nn.Dropout(dropout)
        self.encoder = torch.nn.Embedding(ntoken, ninp)
        if rnn_type in ["LSTM", "GRU"]:
            self.rnn = getattr(torch.nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            self.rnn = torch.nn.RNN(ninp, nhid, nlayers, nonlinearity=rnn_type[4:].lower(), dropout=dropout)
        self.decoder = torch.nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight
        torch.nn.init.uniform_(self.encoder.weight, -0.1, 0.1)                   # init_weights()
        torch.nn.init.uniform_(self.decoder.bias, -0.1, 0.1)                     # (the example zeroes it)
        self.rnn_type, self.nhid, self.nlayers = rnn_type, nhid, nlayers

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):          # main.py's
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def _rnn_setup(kind, dropout, seed=0):
    torch.manual_seed(seed)
    model = RNNModel(kind, NT, NH, NH, NL, dropout).double()
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    params = {"encoder.weight": sd["encoder.weight"], "decoder.bias": sd["decoder.bias"]}
    params.update({k[4:]: v for k, v in sd.items() if k.startswith("rnn.")})
    bufs = {f"h{l}": np.zeros((BSZ, NH)) for l in range(NL)}
    if kind == "LSTM":
        bufs.update({f"c{l}": np.zeros((BSZ, NH)) for l in range(NL)})
    rng = np.random.default_rng(seed)
    data = rng.integers(0, NT, (3 * SEQ + 1, BSZ))                               # batchify's columns
    batches = [(data[i:i + SEQ], data[i + 1:i + 1 + SEQ]) for i in range(0, 3 * SEQ, SEQ)]   # get_batch
    return model, params, bufs, batches


def _torch_hidden(kind, hidden, l):
    return (hidden[0][l], hidden[1][l]) if kind == "LSTM" else (hidden[l], None)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN_TANH", "RNN_RELU"])
def test_word_language_model_rnn_types_truncated_bptt_with_clip(kind):
    lr, clip = 20.0, 0.25                                                         # main.py's defaults
    model, params, bufs, batches = _rnn_setup(kind, 0.0)
    prog = btjit.trace(_rnn_model_loss(kind, 0.0), params, *batches[0], buffers=bufs, dtype="float64",
                       optimizer=btjit.optim.SGD(lr=lr), clip_norm=clip)
    model.train()
    hidden = model.init_hidden(BSZ)
    for x, y in batches:                                                          # main.py's train()
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(torch.tensor(x), hidden)
        loss = F.nll_loss(output, torch.tensor(y).reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        got = prog.step(x, y)
        assert abs(got - loss.item()) <= 1e-10, (got, loss.item())
        for l in range(NL):
            th, tc = _torch_hidden(kind, hidden, l)
            np.testing.assert_allclose(prog.buffers[f"h{l}"], th.detach().numpy(), rtol=0, atol=TOL)
            if tc is not None:
                np.testing.assert_allclose(prog.buffers[f"c{l}"], tc.detach().numpy(), rtol=0, atol=TOL)
    sd = model.state_dict()
    for k, v in prog.params.items():
        want = sd[k if k in ("encoder.weight", "decoder.bias") else "rnn." + k].numpy()
        np.testing.assert_allclose(v, want, rtol=0, atol=TOL, err_msg=k)
    # evaluate(): init_hidden, then the val batch in eval mode (the buffers set through prog.buffers)
    for k in prog.buffers:
        prog.buffers[k][...] = 0.0
    model.eval()
    x, y = batches[1]
    with torch.no_grad():
        output, _ = model(torch.tensor(x), model.init_hidden(BSZ))
        want = F.nll_loss(output, torch.tensor(y).reshape(-1)).item()
    assert abs(prog.eval(x, y) - want) <= 1e-10
    assert all((b == 0).all() for b in prog.buffers.values())                      # eval applies no assign


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_word_language_model_eval_with_dropout_is_models_eval(kind):
    model, params, bufs, batches = _rnn_setup(kind, 0.3, seed=1)
    prog = btjit.trace(_rnn_model_loss(kind, 0.3), params, *batches[0], buffers=bufs, dtype="float64",
                       optimizer=btjit.optim.SGD(lr=1.0), clip_norm=0.25)
    prog.step(*batches[0])                                                       # a training step with dropout
    hid = {k: v.copy() for k, v in prog.buffers.items()}
    names = {"encoder.weight": "encoder.weight", "decoder.weight": "encoder.weight", "decoder.bias": "decoder.bias"}
    model.load_state_dict({k: torch.tensor(prog.params[names.get(k, k[4:])]) for k in model.state_dict()})
    model.eval()
    h = torch.tensor(np.stack([hid[f"h{l}"] for l in range(NL)]))
    hidden = (h, torch.tensor(np.stack([hid[f"c{l}"] for l in range(NL)]))) if kind == "LSTM" else h
    x, y = batches[2]
    with torch.no_grad():
        output, _ = model(torch.tensor(x), hidden)
        want = F.nll_loss(output, torch.tensor(y).reshape(-1)).item()
    assert abs(prog.eval(x, y) - want) <= 1e-10


# ----------------------------------------------------------------------------- 2. min-char-rnn
MV, MH, MSEQ, MLR = 7, 10, 8, 1e-1


def _min_char_rnn_numpy(params, hprev, inputs, targets):
    """min-char-rnn.py's lossFun, as written (column vectors, the loss summed over the sequence)."""
    Wxh, Whh, Why, bh, by = (params[k] for k in ("Wxh", "Whh", "Why", "bh", "by"))
    xs, hs, ys, ps = {}, {}, {}, {}
    hs[-1] = np.copy(hprev)
    loss = 0
    for t in range(len(inputs)):
        xs[t] = np.zeros((MV, 1))
        xs[t][inputs[t]] = 1
        hs[t] = np.tanh(np.dot(Wxh, xs[t]) + np.dot(Whh, hs[t - 1]) + bh)
        ys[t] = np.dot(Why, hs[t]) + by
        ps[t] = np.exp(ys[t]) / np.sum(np.exp(ys[t]))
        loss += -np.log(ps[t][targets[t], 0])
    dWxh, dWhh, dWhy = np.zeros_like(Wxh), np.zeros_like(Whh), np.zeros_like(Why)
    dbh, dby = np.zeros_like(bh), np.zeros_like(by)
    dhnext = np.zeros_like(hs[0])
    for t in reversed(range(len(inputs))):
        dy = np.copy(ps[t])
        dy[targets[t]] -= 1
        dWhy += np.dot(dy, hs[t].T)
        dby += dy
        dh = np.dot(Why.T, dy) + dhnext
        dhraw = (1 - hs[t] * hs[t]) * dh
        dbh += dhraw
        dWxh += np.dot(dhraw, xs[t].T)
        dWhh += np.dot(dhraw, hs[t - 1].T)
        dhnext = np.dot(Whh.T, dhraw)
    raw = {"Wxh": dWxh.copy(), "Whh": dWhh.copy(), "Why": dWhy.copy(), "bh": dbh.copy(), "by": dby.copy()}
    for dparam in [dWxh, dWhh, dWhy, dbh, dby]:
        np.clip(dparam, -5, 5, out=dparam)
    return loss, {"Wxh": dWxh, "Whh": dWhh, "Why": dWhy, "bh": dbh, "by": dby}, hs[len(inputs) - 1], raw


def _min_char_rnn_loss(p, inputs, targets):
    """lossFun's forward with btjit: column vectors, np.dot, the softmax written out, hprev a buffer."""
    xs = btjit.one_hot(inputs, MV)                                              # (T, V): xs[t][inputs[t]] = 1
    h, loss = p["hprev"], 0
    for t in range(MSEQ):
        h = np.tanh(np.dot(p["Wxh"], xs[t].reshape(MV, 1)) + np.dot(p["Whh"], h) + p["bh"])
        y = np.dot(p["Why"], h) + p["by"]
        ps = np.exp(y) / np.sum(np.exp(y))
        loss += -np.log(ps[targets[t], 0])
    btjit.assign(p["hprev"], h)
    return loss


class _MinCharAdagrad(btjit.optim.Optimizer):
    """min-char-rnn's update: mem += dparam * dparam; param += -learning_rate * dparam / np.sqrt(mem + 1e-8)."""

    def __init__(self, lr):
        super().__init__(lr=lr)

    def init(self, name, param):
        return {"mem": np.zeros_like(param)}

    def update(self, p, g, state, hp, step):
        mem = state["mem"] + g * g
        return p + (-hp["lr"]) * g / np.sqrt(mem + 1e-8), {"mem": mem}


def test_min_char_rnn_adagrad_clip_value_against_its_numpy():
    rng = np.random.default_rng(2)
    params = {"Wxh": rng.normal(size=(MH, MV)) * 0.5, "Whh": rng.normal(size=(MH, MH)) * 0.5,
              "Why": rng.normal(size=(MV, MH)) * 0.5, "bh": np.zeros((MH, 1)), "by": np.zeros((MV, 1))}
    data = rng.integers(0, MV, 5 * MSEQ + 1)
    prog = btjit.trace(_min_char_rnn_loss, params, data[:MSEQ], data[1:MSEQ + 1], dtype="float64",
                       buffers={"hprev": np.zeros((MH, 1))}, optimizer=_MinCharAdagrad(MLR), clip_value=5.0)
    ref = {k: v.copy() for k, v in params.items()}
    mem = {k: np.zeros_like(v) for k, v in params.items()}
    hprev, clipped = np.zeros((MH, 1)), False
    for n in range(5):
        p = n * MSEQ
        inputs, targets = data[p:p + MSEQ], data[p + 1:p + MSEQ + 1]
        loss, grads, hprev, raw = _min_char_rnn_numpy(ref, hprev, inputs, targets)
        clipped |= any(np.abs(g).max() > 5 for g in raw.values())
        for k in ref:
            mem[k] += grads[k] * grads[k]
            ref[k] += -MLR * grads[k] / np.sqrt(mem[k] + 1e-8)
        got = prog.step(inputs, targets)
        assert abs(got - loss) <= 1e-10 * max(1, abs(loss)), (got, loss)
        np.testing.assert_allclose(prog.buffers["hprev"], hprev, rtol=0, atol=1e-12)
        for k in ref:
            np.testing.assert_allclose(prog.params[k], ref[k], rtol=0, atol=1e-10, err_msg=k)
    assert clipped                                                              # the clip did bite


@pytest.mark.parametrize("ids", [np.array(2), np.array([0, 3, 1])])
def test_ints_beside_an_index_array_as_numpy(ids):
    """numpy counts ints among the advanced indices: x[ids, 0], x[:, ids, 2], x[0, :, ids] (arrays' axes first)."""
    from btjit.testing import check_grads
    x = np.random.default_rng(0).normal(size=(4, 5, 6))
    cases = [lambda a, i: a[i, 0], lambda a, i: a[:, i, 2], lambda a, i: a[0, :, i], lambda a, i: a[i, 1, :],
             lambda a, i: a[-1, i], lambda a, i: a[..., i, 3], lambda a, i: a[1, i, 2], lambda a, i: a[:, i]]
    for f in cases:
        got = btjit.trace(lambda p, i: f(p["x"], i) * 1.0, {"x": x}, ids, dtype="float64").forward(ids)
        assert np.shape(got) == f(x, ids).shape and np.array_equal(got, f(x, ids))
    check_grads(lambda p: btjit.sum(p["x"][ids, 1] ** 2) + btjit.sum(p["x"][0, :, ids] ** 3)
                + btjit.sum(p["x"][:, ids, 2] ** 2), {"x": x})
