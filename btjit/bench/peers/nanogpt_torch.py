"""nanoGPT in PyTorch eager, the peer of `btjit bench --suite nanogpt`: a compact transcription of karpathy/nanoGPT's
model.py (HEAD: pre-LN blocks, LayerNorm/Linear with `bias`, SDPA causal attention with dropout_p while training,
exact GELU, tied lm_head, its init, configure_optimizers' decay groups) and of train.py's loop (get_lr, eval of
eval_iters random batches of both splits every eval_interval, forward, backward, clip_grad_norm_, AdamW step, the
loop that runs max_iters + 1 steps; the forward under `torch.autocast("cpu", torch.bfloat16)` where the config's
`[train] precision` is "bf16", as train.py's `ctx` on a device with bf16), driven by btjit's TOML config
(configs/nanogpt_cpu.toml) so both sides train the same recipe on the same data: the bundled Tiny Shakespeare,
char-level, nanoGPT's prepare.py 90/10 split.

Run by path in its own process (it imports no btjit, only torch, numpy and the standard library):
    python btjit/bench/peers/nanogpt_torch.py CONFIG.toml [--set train.steps=N ...] [--threads N]
prints train.py's log lines on stderr and ONE JSON line on stdout (the parent times the process): steps,
ms_per_step (mean of the timed steps: forward, backward, clip, update), val_losses [[step, loss], ...], val_loss
(the last), n_params, threads. tests/test_nanogpt.py checks GPT here against btjit/models/nanogpt.py.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

CORPUS = Path(__file__).resolve().parents[2] / "corpora" / "tinyshakespeare.txt.gz"


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.resid_dropout = nn.Dropout(c.dropout)
        self.n_head, self.n_embd, self.dropout = c.n_head, c.n_embd, c.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(c.n_embd, c.bias), CausalSelfAttention(c)
        self.ln_2, self.mlp = LayerNorm(c.n_embd, c.bias), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """model.py's GPT; `c` has vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout), h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=LayerNorm(c.n_embd, c.bias)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_lr(it, lr, warmup_iters, lr_decay_iters, min_lr):
    """train.py's get_lr."""
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def shakespeare_char():
    """data/shakespeare_char/prepare.py: (train ids, val ids, vocab size) as int64 arrays."""
    data = gzip.decompress(CORPUS.read_bytes()).decode("utf-8")
    stoi = {ch: i for i, ch in enumerate(sorted(set(data)))}
    ids = np.array([stoi[c] for c in data], dtype=np.int64)
    n = int(len(ids) * 0.9)
    return ids[:n], ids[n:], len(stoi)


def train(cfg: dict, threads=None, log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """train.py's loop for a btjit config dict ([model] [train] [optim] of configs/nanogpt_cpu.toml)."""
    m, t, o = cfg["model"], cfg["train"], cfg["optim"]
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(t.get("seed", 1337))
    train_ids, val_ids, vocab = shakespeare_char()
    block, batch = m["block_size"], t["batch_size"]
    max_iters = t["steps"] - 1                              # train.py runs max_iters + 1 steps
    decay_iters = o.get("decay_steps") or t["steps"]
    eval_interval, eval_iters = t.get("eval_interval", 250), t.get("eval_batches", 20)
    model = GPT(argparse.Namespace(vocab_size=vocab, block_size=block, n_layer=m["n_layer"], n_head=m["n_head"],
                                   n_embd=m["n_embd"], dropout=m.get("dropout", 0.0), bias=m.get("bias", False)))
    optimizer = model.configure_optimizers(o["weight_decay"], o["lr"], tuple(o["betas"]))
    bf16 = t.get("precision", "fp32") == "bf16"
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def get_batch(split):
        data = train_ids if split == "train" else val_ids
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([torch.from_numpy(data[i:i + block]) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block]) for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss(splits=("train", "val")):
        out = {}
        model.eval()
        for split in splits:
            with ctx():
                out[split] = float(np.mean([model(*get_batch(split))[1].item() for _ in range(eval_iters)]))
        model.train()
        return out

    val_losses, step_s, it = [], 0.0, 0
    X, Y = get_batch("train")
    while True:
        lr = get_lr(it, o["lr"], o.get("warmup_steps", 0), decay_iters, o.get("lr_min", 0.0))
        for group in optimizer.param_groups:
            group["lr"] = lr
        if eval_interval and it % eval_interval == 0:
            losses = estimate_loss()
            log(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            val_losses.append([it, losses["val"]])
        t0 = time.perf_counter()
        with ctx():
            _, loss = model(X, Y)
        X, Y = get_batch("train")
        loss.backward()
        if o.get("clip_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        step_s += dt
        log(f"iter {it}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms")
        it += 1
        if it > max_iters:
            break
    if val_losses[-1][0] != it:                               # btjit's trainer also evaluates at the end
        val_losses.append([it, estimate_loss(("val",))["val"]])
    return dict(impl="torch-bf16" if bf16 else "torch", status="ok", steps=it, ms_per_step=1000.0 * step_s / it,
                val_losses=val_losses, val_loss=val_losses[-1][1], n_params=sum(p.numel() for p in model.parameters()),
                threads=torch.get_num_threads(), version=torch.__version__)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value, as `btjit train --set` (a TOML value)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    a = ap.parse_args(argv)
    cfg = tomllib.loads(Path(a.config).read_text())
    for item in a.set:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = tomllib.loads(f"v = {value}")["v"]
    row = train(cfg, a.threads)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
