"""Models as their authors wrote them, trained with btjit beside the same model in PyTorch (same initial weights,
same batches, float64):

1. makemore part 5's WaveNet (Karpathy's nn-zero-to-hero lecture 5): Embedding(27, 10) -> three times
   [FlattenConsecutive(2) -> Linear(no bias) -> BatchNorm1d over (B, T, C) -> Tanh] (the last one squeezes T to 1)
   -> Linear(n_hidden, 27) -> cross_entropy, block_size 8, running statistics (momentum 0.001) as btjit buffers.
   The torch side is torch.nn.functional.batch_norm on (N, C, L) (biased variance to normalise, unbiased for the
   running update; the lecture's own class uses the unbiased variance for both). 10 SGD steps: every loss within
   1e-10, params and running statistics within 1e-9, and prog.eval equals the torch model's eval-mode loss.
2. pytorch/examples' word_language_model shape: Embedding(V, E) -> two LSTM layers -> Linear(H, V) with the
   decoder tied to the embedding table (E == H), the hidden state (h, c of both layers) carried from one batch to
   the next as buffers through btjit.assign (torch: repackage_hidden, i.e. detach), btjit's side written with
   lstm_cell per time step, torch's with torch.nn.LSTM(num_layers=2). 5 SGD steps, no gradient clipping: every
   loss within 1e-10, params and the carried h / c within 1e-9.
3. nanoGPT's model.py forward with torch's spellings kept -- `idx.size()`, `.split(n_embd, dim=2)`,
   `.view(B, T, nh, hs).transpose(1, 2)`, `scaled_dot_product_attention(..., is_causal=True)`,
   `.transpose(1, 2).contiguous().view(B, T, C)`, `logits.view(-1, logits.size(-1))` -- run once with
   torch.nn.functional and once with btjit as the module: loss and every gradient against torch's, and the
   attention runs btjit's fused kernels.
4. equinox's MNIST CNN (Conv2d(1, 3, 4) valid, MaxPool2d(2, stride 1), sigmoid, log_softmax and the loss by
   np.take_along_axis, as its JAX code writes it) with AdamW decaying every array: 5 steps against torch.
"""
import numpy as np
import pytest

import btjit
from btjit.models.rnn_cells import lstm_cell

torch = pytest.importorskip("torch")
F = torch.nn.functional
LOSS_TOL, STATE_TOL = 1e-10, 1e-9


# ----------------------------------------------------------------------------- makemore part 5: WaveNet
V5, BLOCK, N_EMBD, N_HIDDEN, MOMENTUM = 27, 8, 10, 32, 0.001
LAYERS = [(N_EMBD * 2, N_HIDDEN), (N_HIDDEN * 2, N_HIDDEN), (N_HIDDEN * 2, N_HIDDEN)]


def _wavenet_init(rng):
    """The lecture's init: Linear weight randn(fan_in, fan_out) / fan_in**0.5 (last layer * 0.1), BatchNorm1d
    gamma 1 beta 0, running mean 0 var 1 (the batch norms' gains and biases perturbed so they are not trivial)."""
    p = {"C": rng.normal(size=(V5, N_EMBD))}
    for i, (fi, fo) in enumerate(LAYERS):
        p[f"W{i}"] = rng.normal(size=(fi, fo)) / fi ** 0.5
        p[f"gamma{i}"] = 1.0 + 0.1 * rng.normal(size=fo)
        p[f"beta{i}"] = 0.1 * rng.normal(size=fo)
    p["Wout"] = rng.normal(size=(N_HIDDEN, V5)) / N_HIDDEN ** 0.5 * 0.1
    p["bout"] = np.zeros(V5)
    bufs = {}
    for i in range(len(LAYERS)):
        bufs[f"rmean{i}"], bufs[f"rvar{i}"] = np.zeros(N_HIDDEN), np.ones(N_HIDDEN)
    return p, bufs


def _flatten_consecutive(x, n):
    """FlattenConsecutive(n): (B, T, C) -> (B, T // n, C * n), squeezing T when it becomes 1."""
    B, T, C = x.shape
    x = x.reshape(B, T // n, C * n)
    return x.reshape(B, C * n) if T // n == 1 else x


def _wavenet_loss(p, x, y):
    h = btjit.take(p["C"], x)                                          # (B, 8, 10)
    for i in range(len(LAYERS)):
        h = _flatten_consecutive(h, 2) @ p[f"W{i}"]                    # (B, 4, H), (B, 2, H), (B, H)
        h = btjit.batch_norm(h, p[f"gamma{i}"], p[f"beta{i}"], p[f"rmean{i}"], p[f"rvar{i}"],
                             momentum=MOMENTUM, axis=-1)
        h = btjit.tanh(h)
    return btjit.cross_entropy(h @ p["Wout"] + p["bout"], y)


class _TorchWaveNet(torch.nn.Module):
    """The same WaveNet in torch; batch norm as F.batch_norm on (N, C, L) so the statistics are torch's own."""

    def __init__(self, p, bufs):
        super().__init__()
        t = lambda a: torch.nn.Parameter(torch.tensor(a, dtype=torch.float64))  # noqa: E731
        self.C = t(p["C"])
        self.W = torch.nn.ParameterList([t(p[f"W{i}"]) for i in range(len(LAYERS))])
        self.gamma = torch.nn.ParameterList([t(p[f"gamma{i}"]) for i in range(len(LAYERS))])
        self.beta = torch.nn.ParameterList([t(p[f"beta{i}"]) for i in range(len(LAYERS))])
        self.Wout, self.bout = t(p["Wout"]), t(p["bout"])
        for i in range(len(LAYERS)):
            self.register_buffer(f"rmean{i}", torch.tensor(bufs[f"rmean{i}"], dtype=torch.float64))
            self.register_buffer(f"rvar{i}", torch.tensor(bufs[f"rvar{i}"], dtype=torch.float64))

    def forward(self, x, y):
        h = self.C[x]
        for i in range(len(LAYERS)):
            B, T, Cc = h.shape
            h = h.reshape(B, T // 2, Cc * 2)          # the lecture: view (its h is contiguous)
            if T // 2 == 1:
                h = h.squeeze(1)
            h = h @ self.W[i]
            ht = h.transpose(1, 2) if h.ndim == 3 else h              # (N, C, L) / (N, C)
            ht = F.batch_norm(ht, getattr(self, f"rmean{i}"), getattr(self, f"rvar{i}"), self.gamma[i],
                              self.beta[i], training=self.training, momentum=MOMENTUM, eps=1e-5)
            h = torch.tanh(ht.transpose(1, 2) if h.ndim == 3 else ht)
        return F.cross_entropy(h @ self.Wout + self.bout, y)


def _words_batches(rng, n, B):
    """makemore-shaped batches: (B, 8) contexts and (B,) next characters (random ids)."""
    out = []
    for _ in range(n):
        out.append((rng.integers(0, V5, (B, BLOCK)), rng.integers(0, V5, B)))
    return out


def test_makemore_part5_wavenet_matches_torch():
    rng = np.random.default_rng(5)
    params, bufs = _wavenet_init(rng)
    batches = _words_batches(rng, 10, 32)
    prog = btjit.trace(_wavenet_loss, params, *batches[0], buffers=bufs, optimizer=btjit.optim.SGD(lr=0.1),
                       dtype="float64")
    model = _TorchWaveNet(params, bufs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        loss = model(torch.tensor(x), torch.tensor(y))
        loss.backward()
        opt.step()
        got = prog.step(x, y)
        assert abs(got - loss.item()) <= LOSS_TOL, (got, loss.item())
    want = {"C": model.C, "Wout": model.Wout, "bout": model.bout}
    for i in range(len(LAYERS)):
        want.update({f"W{i}": model.W[i], f"gamma{i}": model.gamma[i], f"beta{i}": model.beta[i]})
    for k, v in want.items():
        np.testing.assert_allclose(prog.params[k], v.detach().numpy(), rtol=0, atol=STATE_TOL, err_msg=k)
    for i in range(len(LAYERS)):
        for k in (f"rmean{i}", f"rvar{i}"):
            np.testing.assert_allclose(prog.buffers[k], getattr(model, k).numpy(), rtol=0, atol=STATE_TOL,
                                       err_msg=k)
    assert not np.allclose(prog.buffers["rmean0"], 0.0)              # the running statistics did move
    model.eval()
    x, y = batches[0]
    with torch.no_grad():
        want_eval = model(torch.tensor(x), torch.tensor(y)).item()
    got_eval = prog.eval(x, y)
    assert abs(got_eval - want_eval) <= LOSS_TOL, (got_eval, want_eval)
    for i in range(len(LAYERS)):                                       # eval applied no assign
        np.testing.assert_allclose(prog.buffers[f"rmean{i}"], getattr(model, f"rmean{i}").numpy(), rtol=0,
                                   atol=STATE_TOL)


# ----------------------------------------------------------------------------- word_language_model: 2-layer LSTM
VL, EH, SEQ, BATCH, NLAYERS = 13, 8, 5, 3, 2
STATE = [f"{s}{l}" for l in range(NLAYERS) for s in ("h", "c")]


def _lstm_lm_loss(p, x, y):
    """x, y: (seq, batch) ints as word_language_model's get_batch gives them."""
    h = [p[f"h{l}"] for l in range(NLAYERS)]
    c = [p[f"c{l}"] for l in range(NLAYERS)]
    emb = btjit.take(p["encoder"], x)                                  # (T, B, E)
    outs = []
    for t in range(x.shape[0]):
        inp = emb[t]
        for l in range(NLAYERS):
            h[l], c[l] = lstm_cell(inp, h[l], c[l], p[f"weight_ih_l{l}"], p[f"weight_hh_l{l}"],
                                   p[f"bias_ih_l{l}"], p[f"bias_hh_l{l}"])
            inp = h[l]
        outs.append(inp)
    out = btjit.stack(outs)                                            # (T, B, H)
    logits = out @ p["encoder"].T + p["decoder_bias"]                  # tied: decoder.weight is encoder.weight
    for l in range(NLAYERS):                                           # carried to the next batch, no gradient
        btjit.assign(p[f"h{l}"], h[l])
        btjit.assign(p[f"c{l}"], c[l])
    return btjit.cross_entropy(logits.reshape(-1, VL), y.reshape(-1))


class _TorchRNNModel(torch.nn.Module):
    """word_language_model's RNNModel('LSTM', ntoken, ninp, nhid, nlayers, dropout=0, tie_weights=True)."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Embedding(VL, EH)
        self.rnn = torch.nn.LSTM(EH, EH, NLAYERS, dropout=0.0)
        self.decoder = torch.nn.Linear(EH, VL)
        self.decoder.weight = self.encoder.weight

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(output).view(-1, VL), hidden


def test_word_language_model_lstm_tied_carried_hidden_matches_torch():
    torch.manual_seed(0)
    model = _TorchRNNModel().double()
    with torch.no_grad():                                              # the example's init_weights
        model.encoder.weight.uniform_(-0.1, 0.1)
        model.decoder.bias.uniform_(-0.1, 0.1)                         # (the example zeroes it; not trivial here)
    params = {"encoder": model.encoder.weight.detach().numpy().copy(),
              "decoder_bias": model.decoder.bias.detach().numpy().copy()}
    for l in range(NLAYERS):
        for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            params[f"{k}_l{l}"] = getattr(model.rnn, f"{k}_l{l}").detach().numpy().copy()
    bufs = {k: np.zeros((BATCH, EH)) for k in STATE}
    rng = np.random.default_rng(7)
    data = rng.integers(0, VL, (5 * SEQ + 1, BATCH))                   # batchify's (n, batch) columns
    batches = [(data[i:i + SEQ], data[i + 1:i + 1 + SEQ]) for i in range(0, 5 * SEQ, SEQ)]
    prog = btjit.trace(_lstm_lm_loss, params, *batches[0], buffers=bufs, optimizer=btjit.optim.SGD(lr=0.5),
                       dtype="float64")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hidden = (torch.zeros(NLAYERS, BATCH, EH, dtype=torch.float64),
              torch.zeros(NLAYERS, BATCH, EH, dtype=torch.float64))
    for x, y in batches:
        hidden = tuple(t.detach() for t in hidden)                     # repackage_hidden
        opt.zero_grad()
        logits, hidden = model(torch.tensor(x), hidden)
        loss = F.cross_entropy(logits, torch.tensor(y).reshape(-1))
        loss.backward()
        opt.step()
        got = prog.step(x, y)
        assert abs(got - loss.item()) <= LOSS_TOL, (got, loss.item())
        for l in range(NLAYERS):
            np.testing.assert_allclose(prog.buffers[f"h{l}"], hidden[0][l].detach().numpy(), rtol=0,
                                       atol=STATE_TOL, err_msg=f"h{l}")
            np.testing.assert_allclose(prog.buffers[f"c{l}"], hidden[1][l].detach().numpy(), rtol=0,
                                       atol=STATE_TOL, err_msg=f"c{l}")
    assert model.decoder.weight is model.encoder.weight
    want = {"encoder": model.encoder.weight, "decoder_bias": model.decoder.bias}
    for l in range(NLAYERS):
        for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            want[f"{k}_l{l}"] = getattr(model.rnn, f"{k}_l{l}")
    for k, v in want.items():
        np.testing.assert_allclose(prog.params[k], v.detach().numpy(), rtol=0, atol=STATE_TOL, err_msg=k)
    assert not np.allclose(prog.buffers["h1"], 0.0)


# ----------------------------------------------------------------------------- nanoGPT's forward, torch's spellings
def _nanogpt_forward(p, idx, targets, lib, n_layer, n_head, n_embd):
    """model.py's GPT.forward / Block / CausalSelfAttention / MLP (bias=False, dropout 0, tied lm_head) written
    once: `lib` is torch.nn.functional or btjit; weights (out, in) as torch.nn.Linear keeps them."""
    ln = (lambda x, w: F.layer_norm(x, w.shape, w, None, 1e-5)) if lib is F else \
        (lambda x, w: btjit.layer_norm(x, w, None))
    b, t = idx.size()
    pos = torch.arange(0, t, dtype=torch.long) if lib is F else btjit.arange(0, t)
    x = p["wte"][idx] + p["wpe"][pos]
    for i in range(n_layer):
        h = ln(x, p[f"h{i}.ln_1"])
        B, T, C = h.size()
        q, k, v = (h @ p[f"h{i}.c_attn"].T).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = lib.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + y @ p[f"h{i}.c_proj"].T
        x = x + lib.gelu(ln(x, p[f"h{i}.ln_2"]) @ p[f"h{i}.c_fc"].T) @ p[f"h{i}.mlp_proj"].T
    logits = ln(x, p["ln_f"]) @ p["wte"].T
    return lib.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-4)])
def test_nanogpt_forward_with_torch_spellings_matches_torch(dtype, tol):
    n_layer, n_head, n_embd, block, V = 2, 2, 16, 8, 11
    rng = np.random.default_rng(0)
    p = {"wte": rng.normal(0, .2, (V, n_embd)), "wpe": rng.normal(0, .2, (block, n_embd)), "ln_f": np.ones(n_embd)}
    for i in range(n_layer):
        p.update({f"h{i}.ln_1": 1 + rng.normal(0, .1, n_embd), f"h{i}.c_attn": rng.normal(0, .2, (3 * n_embd, n_embd)),
                  f"h{i}.c_proj": rng.normal(0, .2, (n_embd, n_embd)), f"h{i}.ln_2": 1 + rng.normal(0, .1, n_embd),
                  f"h{i}.c_fc": rng.normal(0, .2, (4 * n_embd, n_embd)),
                  f"h{i}.mlp_proj": rng.normal(0, .2, (n_embd, 4 * n_embd))})
    idx, targets = rng.integers(0, V, (3, block)), rng.integers(0, V, (3, block))
    targets[0, :2] = -1                                                     # nanoGPT's ignore_index
    prog = btjit.trace(lambda q, i, t: _nanogpt_forward(q, i, t, btjit, n_layer, n_head, n_embd),
                       {k: v.astype(dtype) for k, v in p.items()}, idx, targets, dtype=dtype, grad=True)
    got = prog.value_and_grad(idx, targets)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    want = _nanogpt_forward(tp, torch.tensor(idx), torch.tensor(targets), F, n_layer, n_head, n_embd)
    want.backward()
    assert abs(got - want.item()) < tol
    for k in p:
        np.testing.assert_allclose(prog.grads[k], tp[k].grad.numpy(), rtol=tol, atol=tol * 1e-2, err_msg=k)
    assert "causal_attention" in str(prog.graph)


# ----------------------------------------------------------------------------- equinox's MNIST CNN
def _equinox_loss(p, x, y):
    """equinox's docs/examples/mnist.ipynb model, batched: Conv2d(1, 3, 4) valid -> MaxPool2d(2, stride 1) -> relu
    -> ravel -> Linear(1728, 512) -> sigmoid -> Linear(512, 64) -> relu -> Linear(64, 10) -> log_softmax, and its
    loss -mean(take_along_axis(pred_y, y[:, None], axis=1)), written with numpy's names as the JAX code is."""
    h = btjit.relu(btjit.max_pool2d(btjit.conv2d(x, p["cw"], p["cb"]), 2, stride=1))
    h = h.reshape(h.shape[0], -1)
    h = btjit.sigmoid(h @ p["w1"].T + p["b1"])
    h = btjit.relu(h @ p["w2"].T + p["b2"])
    logp = btjit.log_softmax(h @ p["w3"].T + p["b3"], axis=-1)
    return -np.mean(np.take_along_axis(logp, y[:, None], axis=1))


def test_equinox_mnist_cnn_with_adamw_matches_torch():
    """5 AdamW steps (lr 3e-4, weight decay 1e-4 on every array, biases included, as optax.adamw) of equinox's
    MNIST model on 28 x 28 batches of 8: every loss within 1e-10 and the params within 1e-9 of torch's."""
    rng = np.random.default_rng(6)
    shapes = {"cw": (3, 1, 4, 4), "cb": (3,), "w1": (512, 1728), "b1": (512,), "w2": (64, 512), "b2": (64,),
              "w3": (10, 64), "b3": (10,)}
    params = {k: rng.normal(0, 0.05, s) for k, s in shapes.items()}
    batches = [(rng.random((8, 1, 28, 28)), rng.integers(0, 10, 8)) for _ in range(5)]
    prog = btjit.trace(_equinox_loss, params, *batches[0], dtype="float64",
                       optimizer=btjit.optim.AdamW(lr=3e-4, weight_decay=1e-4))
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.AdamW(tp.values(), lr=3e-4, weight_decay=1e-4)
    for x, y in batches:
        h = F.relu(F.max_pool2d(F.conv2d(torch.tensor(x), tp["cw"], tp["cb"]), 2, stride=1)).flatten(1)
        h = F.relu(torch.sigmoid(h @ tp["w1"].T + tp["b1"]) @ tp["w2"].T + tp["b2"])
        logp = F.log_softmax(h @ tp["w3"].T + tp["b3"], dim=-1)
        loss = -torch.take_along_dim(logp, torch.tensor(y)[:, None], dim=1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        got = prog.step(x, y)
        assert abs(got - loss.item()) <= LOSS_TOL, (got, loss.item())
    for k in shapes:
        np.testing.assert_allclose(prog.params[k], tp[k].detach().numpy(), rtol=0, atol=STATE_TOL, err_msg=k)
