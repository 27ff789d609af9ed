# btjit/bench/peers/torch_peer.py -- the PyTorch peer (eager; torch.compile for E5/E6 with compile=True).
# E1/E2: float64 0-d leaf tensors, graph rebuilt every step, torch.autograd.grad for dg/da, dg/db.
# E3/E4: torch.save / torch.load of a dict of the 7 E2 node values as 0-d float64 tensors.
# E5/E6: functional models over the named params of workloads.py (same names and init as every impl),
#        torch.optim.SGD, one pre-sampled batch reused every step. Not here: timing (run_one.py).
import math
import os
import tempfile
import time

import torch
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


def split_heads(params, n_head=6):
    """The GPT params with every layer's attn.qkv.w (C, 3C) split into one (C, hs) leaf per head and per
    q/k/v ("h0.attn.q3.w" ...): the parameter layout of a model built from per-head modules."""
    out = {}
    for k, v in params.items():
        if not k.endswith("attn.qkv.w"):
            out[k] = v
            continue
        C = v.shape[0]
        hs = C // n_head
        for j, part in enumerate("qkv"):
            for h in range(n_head):
                out[k.replace("qkv", f"{part}{h}")] = v[:, j * C + h * hs:j * C + (h + 1) * hs]
    return out


def join_heads(P, n_head=6):
    """Inverse of split_heads."""
    out = {k: v for k, v in P.items() if ".attn.q" not in k and ".attn.k" not in k and ".attn.v" not in k}
    for k in [k for k in P if k.endswith("attn.q0.w")]:
        out[k.replace("q0", "qkv")] = torch.cat([P[k.replace("q0", f"{part}{h}")]
                                                 for part in "qkv" for h in range(n_head)], dim=1)
    return out


def gpt_loss_perhead(P, x, y, n_layer=6, n_head=6):
    """gpt_loss written the way the paper's PyTorch reference is usually written (Karpathy's "Let's build
    GPT" model): one module-like block per head, each with its own q/k/v projections, an explicit
    masked_fill + softmax, and torch.cat of the heads. Same function, more (smaller) eager ops."""
    B, T = x.shape
    C = P["wte"].shape[1]
    hs = C // n_head
    mask = torch.tril(torch.ones(T, T)) == 0
    h = P["wte"][x] + P["wpe"][:T]                                                  # (B,T,C)
    for i in range(n_layer):
        p = f"h{i}."
        a = F.layer_norm(h, (C,), P[p + "ln1.g"], P[p + "ln1.b"], 1e-5)
        heads = []
        for j in range(n_head):
            q, k, v = (a @ P[f"{p}attn.{part}{j}.w"] for part in "qkv")             # (B,T,hs) each
            wei = (q @ k.transpose(-2, -1)) * hs ** -0.5
            wei = F.softmax(wei.masked_fill(mask, float("-inf")), dim=-1)
            heads.append(wei @ v)
        h = h + torch.cat(heads, dim=-1) @ P[p + "attn.proj.w"] + P[p + "attn.proj.b"]
        m = F.layer_norm(h, (C,), P[p + "ln2.g"], P[p + "ln2.b"], 1e-5)
        m = torch.relu(m @ P[p + "mlp.fc.w"] + P[p + "mlp.fc.b"])
        h = h + m @ P[p + "mlp.proj.w"] + P[p + "mlp.proj.b"]
    h = F.layer_norm(h, (C,), P["lnf.g"], P["lnf.b"], 1e-5)
    logits = h @ P["head.w"] + P["head.b"]                                          # (B,T,V)
    return F.cross_entropy(logits.view(B * T, -1), y.reshape(-1))


class TrainRunner(Runner):
    def __init__(self, workload_id, seed=0, compile=False, text=None, perhead=False):
        w = W.WORKLOADS[workload_id]
        params, x, y, self.vocab, self.data = W.setup_batch(workload_id, seed, text)
        self.perhead = perhead and w.kind == "gpt"
        if self.perhead:
            params = split_heads(params)
        self.P = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
        self.x, self.y = torch.from_numpy(x).long(), torch.from_numpy(y).long()
        self.loss_fn = mlp_loss if w.kind == "mlp" else gpt_loss_perhead if self.perhead else gpt_loss
        self.opt = torch.optim.SGD(list(self.P.values()), lr=w.settings["lr"])
        self.note = ("eager, q/k/v projections per head (Karpathy-style)" if self.perhead else
                     "eager, SDPA attention" if w.kind == "gpt" else "eager")
        if compile:
            t0 = time.perf_counter()
            self.loss_fn = torch.compile(self.loss_fn)
            self._step()                                  # first call compiles forward and backward
            self.compile_seconds = time.perf_counter() - t0
            with torch.no_grad():                         # back to the init params after that step
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
        P = join_heads(self.P) if self.perhead else self.P
        return {k: v.detach().numpy().copy() for k, v in P.items()}


def make(workload_id, threads=1, seed=0, compile=False, text=None, perhead=False, **_ignored):
    _set_threads(threads)
    kind = W.WORKLOADS[workload_id].kind
    if kind == "scalar":
        return ScalarRunner(workload_id)
    if kind == "io":
        return IORunner(workload_id)
    return TrainRunner(workload_id, seed=seed, compile=compile, text=text, perhead=perhead)
