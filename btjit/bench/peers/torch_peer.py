# btjit/bench/peers/torch_peer.py -- the PyTorch peer (eager; torch.compile for E5/E6 with compile=True).
# E1/E2: float64 0-d leaf tensors, graph rebuilt every step, torch.autograd.grad for dg/da, dg/db.
# E3/E4: torch.save / torch.load of a dict of the 7 E2 node values as 0-d float64 tensors.
# E5/E6: functional models over the named params of workloads.py (same names and init as every impl),
#        torch.optim.SGD, one pre-sampled batch reused every step. E6 with paper=True ("torch.paper"): the
#        paper's own PyTorch program, an nn.Module GPT, loaded with the same params.
#        Not here: timing (run_one.py).
import math
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from btjit.bench import workloads as W
from btjit.bench.peers import Runner


def _set_threads(threads):
    torch.set_num_threads(int(threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:                       # already set in this process
        pass


class ScalarRunner(Runner):
    def __init__(self, workload_id):
        s = W.WORKLOADS[workload_id].settings
        self.a = torch.tensor(s["a"], dtype=torch.float64, requires_grad=True)
        self.b = torch.tensor(s["b"], dtype=torch.float64, requires_grad=True)
        self.fn = W.e1 if workload_id == "E1" else (lambda a, b: W.e2(a, b, torch.relu))

    def step(self):
        g = self.fn(self.a, self.b)
        ga, gb = torch.autograd.grad(g, (self.a, self.b))
        return g

    def check(self):
        g = self.fn(self.a, self.b)
        ga, gb = torch.autograd.grad(g, (self.a, self.b))
        return dict(g=g.item(), dg_da=ga.item(), dg_db=gb.item())


class IORunner(Runner):
    note = "torch.save/torch.load of a dict of 7 0-d tensors"

    def __init__(self, workload_id):
        self._dir = tempfile.TemporaryDirectory(prefix="btjit_bench_")
        self.path = os.path.join(self._dir.name, "e2_nodes.pt")
        self.values = {k: torch.tensor(v, dtype=torch.float64) for k, v in W.e2_values().items()}
        torch.save(self.values, self.path)
        self.step = self.save if workload_id == "E3" else self.load

    def save(self):
        torch.save(self.values, self.path)

    def load(self):
        return torch.load(self.path)

    def check(self):
        self.save()
        return {k: float(v) for k, v in self.load().items()}


def mlp_loss(P, x, y):
    B = x.shape[0]
    h = torch.tanh(torch.addmm(P["b1"], P["emb"][x].reshape(B, -1), P["w1"]))   # (B,1024)
    return F.cross_entropy(torch.addmm(P["b2"], h, P["w2"]), y)


def gpt_loss(P, x, y, n_layer=6, n_head=6):
    B, T = x.shape
    C = P["wte"].shape[1]
    hs = C // n_head
    h = (P["wte"][x] + P["wpe"][:T]).reshape(B * T, C)                            # (B*T,C)
    for i in range(n_layer):
        p = f"h{i}."
        a = F.layer_norm(h, (C,), P[p + "ln1.g"], P[p + "ln1.b"], 1e-5)
        qkv = (a @ P[p + "attn.qkv.w"]).view(B, T, 3, n_head, hs).permute(2, 0, 3, 1, 4)   # (3,B,NH,T,hs)
        att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)     # (B,NH,T,hs)
        att = att.transpose(1, 2).reshape(B * T, C)
        h = h + torch.addmm(P[p + "attn.proj.b"], att, P[p + "attn.proj.w"])
        m = F.layer_norm(h, (C,), P[p + "ln2.g"], P[p + "ln2.b"], 1e-5)
        m = torch.relu(torch.addmm(P[p + "mlp.fc.b"], m, P[p + "mlp.fc.w"]))
        h = h + torch.addmm(P[p + "mlp.proj.b"], m, P[p + "mlp.proj.w"])
    h = F.layer_norm(h, (C,), P["lnf.g"], P["lnf.b"], 1e-5)
    logits = torch.addmm(P["head.b"], h, P["head.w"])                             # (B*T,V)
    return F.cross_entropy(logits, y.reshape(-1))


class _Head(nn.Module):
    """One causal self-attention head with its own key/query/value projections (no bias)."""

    def __init__(self, C, hs, T):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(C, hs, bias=False) for _ in range(3))
        self.register_buffer("tril", torch.tril(torch.ones(T, T)))

    def forward(self, x):                                                          # (B,T,C) -> (B,T,hs)
        T = x.shape[1]
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = F.softmax(wei.masked_fill(self.tril[:T, :T] == 0, float("-inf")), dim=-1)
        return wei @ self.value(x)


class _MultiHead(nn.Module):
    def __init__(self, C, n_head, T):
        super().__init__()
        self.heads = nn.ModuleList(_Head(C, C // n_head, T) for _ in range(n_head))
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class _Block(nn.Module):
    def __init__(self, C, n_head, T):
        super().__init__()
        self.sa = _MultiHead(C, n_head, T)
        self.ffwd = nn.Sequential(nn.Linear(C, 4 * C), nn.ReLU(), nn.Linear(4 * C, C))
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class PaperGPT(nn.Module):
    """The E6 GPT as the paper's PyTorch program builds it (BurTorch's experiments/exp5_gpt3_example/gpt.py,
    which is Karpathy's "Let's build GPT" model): nn.Module per head with its own key/query/value Linear, the
    heads concatenated, nn.Sequential FFN, nn.LayerNorm, nn.Embedding, position ids from torch.arange every
    call. Same function and parameters as gpt_loss; `layout()` maps them to workloads.py's names."""

    def __init__(self, V, T, C, n_layer=6, n_head=6):
        super().__init__()
        self.n_head = n_head
        self.tok, self.pos = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.Sequential(*(_Block(C, n_head, T) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T))
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))

    def layout(self):
        """[(workloads.py name, column slice or None, nn parameter)]: a Linear's weight holds the transposed
        columns of its (in, out) array; every other parameter holds its array as is."""
        C = self.tok.weight.shape[1]
        hs = C // self.n_head
        out = [("wte", None, self.tok.weight), ("wpe", None, self.pos.weight)]
        for i, b in enumerate(self.blocks):
            p = f"h{i}."
            out += [(p + "ln1.g", None, b.ln1.weight), (p + "ln1.b", None, b.ln1.bias)]
            out += [(p + "attn.qkv.w", slice(j * C + h * hs, j * C + (h + 1) * hs), getattr(head, part).weight)
                    for j, part in enumerate(("query", "key", "value")) for h, head in enumerate(b.sa.heads)]
            out += [(p + "attn.proj.w", None, b.sa.proj.weight), (p + "attn.proj.b", None, b.sa.proj.bias),
                    (p + "ln2.g", None, b.ln2.weight), (p + "ln2.b", None, b.ln2.bias),
                    (p + "mlp.fc.w", None, b.ffwd[0].weight), (p + "mlp.fc.b", None, b.ffwd[0].bias),
                    (p + "mlp.proj.w", None, b.ffwd[2].weight), (p + "mlp.proj.b", None, b.ffwd[2].bias)]
        return out + [("lnf.g", None, self.ln_f.weight), ("lnf.b", None, self.ln_f.bias),
                      ("head.w", None, self.lm_head.weight), ("head.b", None, self.lm_head.bias)]

    def load(self, params):
        with torch.no_grad():
            for name, cols, p in self.layout():
                v = params[name] if cols is None else params[name][:, cols]
                p.copy_(torch.from_numpy(v.T.copy() if name.endswith(".w") else v))

    def export(self, shapes):
        out = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        for name, cols, p in self.layout():
            v = p.detach().numpy()
            dst = out[name] if cols is None else out[name][:, cols]
            dst[...] = v.T if name.endswith(".w") else v
        return out


class TrainRunner(Runner):
    def __init__(self, workload_id, seed=0, compile=False, text=None, paper=False):
        w = W.WORKLOADS[workload_id]
        params, x, y, self.vocab, self.data = W.setup_batch(workload_id, seed, text)
        self.x, self.y = torch.from_numpy(x).long(), torch.from_numpy(y).long()
        self.model = None
        if paper and w.kind == "gpt":
            s = w.settings
            self.model = PaperGPT(self.vocab, s["block"], s["n_embd"], s["n_layer"], s["n_head"])
            self.model.load(params)
            self.shapes = {k: v.shape for k, v in params.items()}
            self.P, leaves = None, list(self.model.parameters())
            self.loss_fn = lambda _P, x, y: self.model(x, y)
            self.note = "eager, the paper's nn.Module GPT (a Linear per head for q, k, v)"
        else:
            self.P = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
            leaves = list(self.P.values())
            self.loss_fn = mlp_loss if w.kind == "mlp" else gpt_loss
            self.note = "eager, SDPA attention" if w.kind == "gpt" else "eager"
        self.opt = torch.optim.SGD(leaves, lr=w.settings["lr"])
        if compile:
            t0 = time.perf_counter()
            self.loss_fn = torch.compile(self.loss_fn)
            self._step()                                  # first call compiles forward and backward
            self.compile_seconds = time.perf_counter() - t0
            if self.model is not None:                    # back to the init params after that step
                self.model.load(params)
            else:
                with torch.no_grad():
                    for k, v in params.items():
                        self.P[k].copy_(torch.from_numpy(v))
            self.note = "torch.compile (default mode); compile_s includes one step"

    def _step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.P, self.x, self.y)
        loss.backward()
        self.opt.step()
        return loss

    def step(self):
        return self._step().item()

    def check(self):
        with torch.no_grad():
            loss = self.loss_fn(self.P, self.x, self.y).item()
        return dict(loss=loss, vocab=self.vocab, ln_vocab=math.log(self.vocab))

    def params(self):
        if self.model is not None:
            return self.model.export(self.shapes)
        return {k: v.detach().numpy().copy() for k, v in self.P.items()}


def make(workload_id, threads=1, seed=0, compile=False, text=None, paper=False, **_ignored):
    _set_threads(threads)
    kind = W.WORKLOADS[workload_id].kind
    if kind == "scalar":
        return ScalarRunner(workload_id)
    if kind == "io":
        return IORunner(workload_id)
    return TrainRunner(workload_id, seed=seed, compile=compile, text=text, paper=paper)
