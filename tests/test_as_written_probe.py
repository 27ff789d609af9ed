"""Public models as their authors wrote them, beside torch (float64), for the parts tests/test_models_as_written.py
does not cover:

1. pytorch/examples' word_language_model RNNModel for 'GRU', 'RNN_TANH', 'RNN_RELU' (and 'LSTM' with clipping):
   2 layers, tied weights, the hidden state carried between batches as buffers (repackage_hidden), truncated BPTT
   over 3 batches with main.py's clip_grad_norm_(0.25) and SGD; init_hidden via prog.buffers; eval with dropout.
2. min-char-rnn (Karpathy's numpy RNN) with Adagrad and np.clip(dparam, -5, 5), against its own numpy update.
3. makemore part 4's manual-backprop MLP (explicit batch norm with Bessel's 1/(n-1)) and micrograd's MLP.
4. The lecture's gpt.py (Head / MultiHeadAttention with a tril buffer, FeedForward, LayerNorm, lm_head).
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


# ----------------------------------------------------------------------------- 3. makemore part 4 (backprop ninja)
def _part4(p, Xb, Yb, lib):
    """The lecture's forward pass "chunkated into smaller steps", torch's spellings, Bessel's 1/(n-1) variance;
    the running statistics as part 3 keeps them (momentum 0.001); eval mode on them."""
    n = Yb.shape[0]
    C, W1, b1, W2, b2, bngain, bnbias = (p[k] for k in ("C", "W1", "b1", "W2", "b2", "bngain", "bnbias"))
    emb = C[Xb]
    embcat = emb.view(emb.shape[0], -1)
    hprebn = embcat @ W1 + b1
    training = btjit.is_training() if lib is btjit else p["training"]
    if training:
        bnmeani = 1 / n * hprebn.sum(0, keepdim=True)
        bndiff = hprebn - bnmeani
        bndiff2 = bndiff ** 2
        bnvar = 1 / (n - 1) * (bndiff2).sum(0, keepdim=True)
    else:
        bnmeani, bnvar = p["bnmean_running"], p["bnvar_running"]
        bndiff = hprebn - bnmeani
    bnvar_inv = (bnvar + 1e-5) ** -0.5
    bnraw = bndiff * bnvar_inv
    hpreact = bngain * bnraw + bnbias
    h = lib.tanh(hpreact)
    logits = h @ W2 + b2
    logit_maxes = logits.max(1, keepdim=True).values
    norm_logits = logits - logit_maxes
    counts = norm_logits.exp()
    counts_sum = counts.sum(1, keepdims=True)
    counts_sum_inv = counts_sum ** -1
    probs = counts * counts_sum_inv
    logprobs = probs.log()
    loss = -logprobs[range(n), Yb].mean()
    if not training:
        return loss, {}
    new = {"bnmean_running": 0.999 * p["bnmean_running"] + 0.001 * bnmeani,
           "bnvar_running": 0.999 * p["bnvar_running"] + 0.001 * bnvar}
    if lib is btjit:                                   # the manual backward (exercise 2), as aux outputs
        for k, v in new.items():
            btjit.assign(p[k], v)
        dlogits = btjit.softmax(logits, 1) - btjit.one_hot(Yb, logits.shape[1])    # dlogits[range(n), Yb] -= 1
        dlogits = dlogits / n
        dh = dlogits @ W2.T
        dhpreact = (1.0 - h ** 2) * dh
        dhprebn = bngain * bnvar_inv / n * (n * dhpreact - dhpreact.sum(0) - n / (n - 1) * bnraw
                                            * (dhpreact * bnraw).sum(0))
        return loss, {"W2": h.T @ dlogits, "b2": dlogits.sum(0), "bngain": (bnraw * dhpreact).sum(0, keepdim=True),
                      "bnbias": dhpreact.sum(0, keepdim=True), "W1": embcat.T @ dhprebn, "b1": dhprebn.sum(0)}
    return loss, new


def test_makemore_part4_manual_backprop_mlp_matches_torch():
    rng = np.random.default_rng(4)
    n_embd, n_hidden, block, V, n = 10, 64, 3, 27, 32
    params = {"C": rng.normal(size=(V, n_embd)), "W1": rng.normal(size=(n_embd * block, n_hidden)) * (5 / 3) /
              (n_embd * block) ** 0.5, "b1": rng.normal(size=n_hidden) * 0.1,
              "W2": rng.normal(size=(n_hidden, V)) * 0.1, "b2": rng.normal(size=V) * 0.1,
              "bngain": rng.normal(size=(1, n_hidden)) * 0.1 + 1.0, "bnbias": rng.normal(size=(1, n_hidden)) * 0.1}
    bufs = {"bnmean_running": np.zeros((1, n_hidden)), "bnvar_running": np.ones((1, n_hidden))}
    batches = [(rng.integers(0, V, (n, block)), rng.integers(0, V, n)) for _ in range(5)]
    prog = btjit.trace(lambda p, x, y: _part4(p, x, y, btjit), params, *batches[0], buffers=bufs, dtype="float64",
                       optimizer=btjit.optim.SGD(lr=0.1))
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tb = {k: torch.tensor(v) for k, v in bufs.items()}
    for Xb, Yb in batches:
        loss, new = _part4({**tp, **tb, "training": True}, torch.tensor(Xb), torch.tensor(Yb), torch)
        for t in tp.values():
            t.grad = None
        loss.backward()
        got = prog.step(Xb, Yb)
        assert abs(got - loss.item()) <= 1e-12
        for k, t in tp.items():
            np.testing.assert_allclose(prog.grads[k], t.grad.numpy(), rtol=0, atol=1e-12, err_msg=k)
            if k != "C":
                np.testing.assert_allclose(prog.outputs[k], t.grad.numpy(), rtol=0, atol=1e-12, err_msg=k)
        with torch.no_grad():
            for k, t in tp.items():
                t -= 0.1 * t.grad
            tb = {k: v.detach() for k, v in new.items()}
    for k, t in {**tp, **tb}.items():
        np.testing.assert_allclose({**prog.params, **prog.buffers}[k], t.detach().numpy(), rtol=0, atol=1e-12)
    with torch.no_grad():
        want = _part4({**tp, **tb, "training": False}, torch.tensor(Xb), torch.tensor(Yb), torch)[0].item()
    assert abs(prog.eval(Xb, Yb) - want) <= 1e-12


# ----------------------------------------------------------------------------- 4. the lecture's gpt.py
GV, GE, GH, GL, GB = 13, 16, 4, 2, 8         # vocab, n_embd, n_head, n_layer, block_size


def _gpt(p, idx, targets, lib, dropout, training):
    """gpt.py's BigramLanguageModel / Block / MultiHeadAttention / Head / FeedForward, written once for torch and
    btjit: the tril buffer, masked_fill(tril[:T, :T] == 0, -inf), k.shape[-1]**-0.5, torch.cat of the heads."""
    drop = (lambda x: F.dropout(x, dropout, training)) if lib is torch else (lambda x: btjit.dropout(x, dropout))
    lin = lambda x, k, bias=True: x @ p[k + ".weight"].T + (p[k + ".bias"] if bias else 0)  # noqa: E731
    ln = lambda x, k: F.layer_norm(x, (GE,), p[k + ".weight"], p[k + ".bias"]) if lib is torch else \
        btjit.layer_norm(x, (GE,), p[k + ".weight"], p[k + ".bias"])                          # noqa: E731
    B, T = idx.shape
    tok_emb = p["token_embedding_table.weight"][idx]
    pos_emb = p["position_embedding_table.weight"][lib.arange(T)]
    x = tok_emb + pos_emb
    for i in range(GL):
        b, outs = f"blocks.{i}.", []
        h = ln(x, b + "ln1")
        for j in range(GH):
            hd = f"{b}sa.heads.{j}."
            k, q, v = (lin(h, hd + n, bias=False) for n in ("key", "query", "value"))
            wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
            wei = wei.masked_fill(p["tril"][:T, :T] == 0, float("-inf"))
            wei = drop(F.softmax(wei, dim=-1) if lib is torch else btjit.softmax(wei, dim=-1))
            outs.append(wei @ v)
        x = x + drop(lin(lib.cat(outs, dim=-1), b + "sa.proj"))
        h = lin(ln(x, b + "ln2"), b + "ffwd.net.0")
        x = x + drop(lin(F.relu(h) if lib is torch else btjit.relu(h), b + "ffwd.net.2"))
    logits = lin(ln(x, "ln_f"), "lm_head")
    B, T, C = logits.shape
    logits = logits.view(B * T, C)
    return (F.cross_entropy if lib is torch else btjit.cross_entropy)(logits, targets.view(B * T))


def _gpt_params(rng):
    p = {"token_embedding_table.weight": rng.normal(size=(GV, GE)), "ln_f.weight": 1 + 0.1 * rng.normal(size=GE),
         "position_embedding_table.weight": rng.normal(size=(GB, GE)), "ln_f.bias": 0.1 * rng.normal(size=GE),
         "lm_head.weight": rng.normal(size=(GV, GE)) * 0.2, "lm_head.bias": rng.normal(size=GV) * 0.02}
    for i in range(GL):
        b = f"blocks.{i}."
        for j in range(GH):
            for n in ("key", "query", "value"):
                p[f"{b}sa.heads.{j}.{n}.weight"] = rng.normal(size=(GE // GH, GE)) * 0.2
        p.update({b + "sa.proj.weight": rng.normal(size=(GE, GE)) * 0.2, b + "sa.proj.bias": 0.02 * rng.normal(size=GE),
                  b + "ffwd.net.0.weight": rng.normal(size=(4 * GE, GE)) * 0.2,
                  b + "ffwd.net.0.bias": 0.02 * rng.normal(size=4 * GE),
                  b + "ffwd.net.2.weight": rng.normal(size=(GE, 4 * GE)) * 0.1,
                  b + "ffwd.net.2.bias": 0.02 * rng.normal(size=GE)})
        for n in ("ln1", "ln2"):
            p.update({f"{b}{n}.weight": 1 + 0.1 * rng.normal(size=GE), f"{b}{n}.bias": 0.1 * rng.normal(size=GE)})
    return p


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_lecture_gpt_adamw_and_eval_match_torch(dropout):
    rng = np.random.default_rng(8)
    params = _gpt_params(rng)
    tril = np.tril(np.ones((GB, GB)))                                       # register_buffer('tril', ...)
    batches = [(rng.integers(0, GV, (3, GB)), rng.integers(0, GV, (3, GB))) for _ in range(5)]
    prog = btjit.trace(lambda p, x, y: _gpt(p, x, y, btjit, dropout, None), params, *batches[0], dtype="float64",
                       buffers={"tril": tril}, optimizer=btjit.optim.AdamW(lr=1e-3))      # torch's AdamW defaults
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.AdamW(tp.values(), lr=1e-3)
    tb = {"tril": torch.tensor(tril)}
    for x, y in batches:
        got = prog.step(x, y)
        if dropout:
            continue
        loss = _gpt({**tp, **tb}, torch.tensor(x), torch.tensor(y), torch, 0.0, True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(got - loss.item()) <= 1e-10, (got, loss.item())
    if dropout:
        with torch.no_grad():
            for k, t in tp.items():
                t.copy_(torch.tensor(prog.params[k]))
    for k, t in tp.items():
        np.testing.assert_allclose(prog.params[k], t.detach().numpy(), rtol=0, atol=1e-9, err_msg=k)
    x, y = batches[0]
    with torch.no_grad():                                                   # model.eval(): no dropout
        want = _gpt({**tp, **tb}, torch.tensor(x), torch.tensor(y), torch, dropout, False).item()
    assert abs(prog.eval(x, y) - want) <= 1e-10
    if dropout:
        assert abs(prog.step(x, y) - want) > 1e-6                           # training has dropout


# ----------------------------------------------------------------------------- micrograd's nn.py MLP and demo loop
def test_micrograd_mlp_demo_loop_matches_torch():
    import random
    from btjit.micrograd import Value

    class Neuron:                                     # micrograd/nn.py, as written (Module's zero_grad inlined)
        def __init__(self, nin, nonlin=True):
            self.w, self.b, self.nonlin = [Value(random.uniform(-1, 1)) for _ in range(nin)], Value(0), nonlin

        def __call__(self, x):
            act = sum((wi * xi for wi, xi in zip(self.w, x)), self.b)
            return act.relu() if self.nonlin else act

        def parameters(self):
            return self.w + [self.b]

    class MLP:
        def __init__(self, nin, nouts):
            sz = [nin] + nouts
            self.layers = [[Neuron(sz[i], nonlin=i != len(nouts) - 1) for _ in range(sz[i + 1])]
                           for i in range(len(nouts))]

        def __call__(self, x):
            for layer in self.layers:
                x = [n(x) for n in layer]
                x = x[0] if len(x) == 1 else x
            return x

        def parameters(self):
            return [p for layer in self.layers for n in layer for p in n.parameters()]
    random.seed(1337)
    model, rng = MLP(2, [8, 8, 1]), np.random.default_rng(0)
    X, yb = rng.normal(size=(6, 2)), np.array([1, -1, 1, -1, 1, -1])
    for k in range(3):                                # demo.ipynb's loss() and update
        tw = [torch.tensor(p.data, dtype=torch.float64, requires_grad=True) for p in model.parameters()]
        scores = [model(list(map(Value, xrow))) for xrow in X]
        losses = [(1 + -yi * scorei).relu() for yi, scorei in zip(yb, scores)]
        total_loss = sum(losses) * (1.0 / len(losses)) + 1e-4 * sum((p * p for p in model.parameters()))
        for p in model.parameters():
            p.grad = 0
        total_loss.backward()
        it, h = iter(tw), torch.tensor(X)               # torch, the same params in nn.py's order
        for layer in model.layers:
            ws = [torch.stack([next(it) for _ in n.w] + [next(it)]) for n in layer]
            W = torch.stack(ws)
            h = h @ W[:, :-1].T + W[:, -1]
            h = h.relu() if layer[0].nonlin else h
        want = (1 - torch.tensor(yb) * h[:, 0]).relu().mean() + 1e-4 * sum(t * t for t in tw)
        want.backward()
        assert total_loss.data == pytest.approx(want.item(), rel=1e-12)
        np.testing.assert_allclose([p.grad for p in model.parameters()], [t.grad.item() for t in tw], atol=1e-12)
        for p in model.parameters():
            p.data -= (1.0 - 0.9 * k / 100) * p.grad
