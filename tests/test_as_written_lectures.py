"""Karpathy's lecture code as written, beside torch (float64), for the parts tests/test_models_as_written.py does not
cover: makemore part 4's manual-backprop MLP (explicit batch norm with Bessel's 1/(n-1)), the lecture's gpt.py
(Head / MultiHeadAttention with a tril buffer, FeedForward, LayerNorm, lm_head; AdamW, eval) and micrograd's
nn.py MLP with its demo loop."""
import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = 1e-9


# ----------------------------------------------------------------------------- makemore part 4 (backprop ninja)
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


# ----------------------------------------------------------------------------- the lecture's gpt.py
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
