"""Karpathy's llama2.c `model.py` (a small LLaMA) as a user writes it for btjit, beside the same model in PyTorch
(llama2.c's classes, LoRA left out): RMSNorm with torch.rsqrt, rotary embeddings applied with real arithmetic
(reshape (..., -1, 2), unbind(-1), the cos / sin products, torch.stack(..., dim=-1).flatten(3)), grouped-query
attention with repeat_kv (a None axis, expand, reshape), scaled_dot_product_attention(is_causal=True) or the manual
path with the -inf triu mask, the SwiGLU feed-forward w2(F.silu(w1(x)) * w3(x)), tied embeddings, dropout 0, and
cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1).

The btjit side keeps model.py's lines, torch's names replaced by btjit's (`torch.rsqrt` -> `btjit.rsqrt`,
`self.wq(x)` -> `btjit.linear(x, p[...])`). `.float()` is btjit's program dtype (a no-op on floats): the torch
reference computes in its own dtype too (llama2.c's `.float()` upcasts would round a float64 run to float32).
Checks: the loss and every gradient against torch's (float64 1e-10 / 1e-9, float32 1e-5 / 1e-4), AdamW steps with
llama2.c's param groups and train.py's grad clip, and the inference path `self.output(h[:, [-1], :])`."""
import math
import types

import numpy as np
import pytest

import btjit

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


def model_args(dim, n_heads, n_kv_heads, vocab_size, max_seq_len, multiple_of=32, n_layers=2):
    hidden_dim = int(2 * (4 * dim) / 3)                                  # FeedForward's rule
    hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
    return types.SimpleNamespace(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                 vocab_size=vocab_size, hidden_dim=hidden_dim, norm_eps=1e-5,
                                 max_seq_len=max_seq_len, dropout=0.0)


# --- btjit: model.py's functions, modules as functions of p (the state_dict's names) ----------------------------
def rmsnorm(p, name, x, eps):
    def _norm(x):
        return x * btjit.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    output = _norm(x.float()).type_as(x)
    return output * p[name + ".weight"]


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    """Inside the trace, as model.py writes it (torch.arange -> btjit.arange, torch.outer -> btjit.outer)."""
    freqs = 1.0 / (theta ** (btjit.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = btjit.arange(end, device=freqs.device)  # type: ignore
    freqs = btjit.outer(t, freqs).float()  # type: ignore
    freqs_cos = btjit.cos(freqs)  # real part
    freqs_sin = btjit.sin(freqs)  # imaginary part
    return freqs_cos, freqs_sin


def precompute_freqs_cis_np(dim: int, end: int, theta: float = 10000.0):
    """Outside the trace (a buffer computed once, as model.py's __init__ does), with numpy."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2)[: (dim // 2)] / dim))
    freqs = np.outer(np.arange(end), freqs)
    return np.cos(freqs), np.sin(freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.reshape(shape) if isinstance(freqs_cis, np.ndarray) else freqs_cis.view(shape)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    # reshape xq and xk to match the complex representation
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)

    # reshape freqs_cos and freqs_sin for broadcasting
    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)

    # apply rotation using real numbers
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos

    # flatten last two dimensions
    xq_out = btjit.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = btjit.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)

    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep: int):
    """torch.repeat_interleave(x, dim=2, repeats=n_rep)"""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


def attention(p, name, args, x, freqs_cos, freqs_sin, flash, mask):
    n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    n_rep, head_dim = args.n_heads // n_kv_heads, args.dim // args.n_heads
    bsz, seqlen, _ = x.shape

    # QKV
    xq, xk, xv = (btjit.linear(x, p[f"{name}.{w}.weight"]) for w in ("wq", "wk", "wv"))
    xq = xq.view(bsz, seqlen, args.n_heads, head_dim)
    xk = xk.view(bsz, seqlen, n_kv_heads, head_dim)
    xv = xv.view(bsz, seqlen, n_kv_heads, head_dim)

    # RoPE relative positional embeddings
    xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)

    # grouped multiquery attention: expand out keys and values
    xk = repeat_kv(xk, n_rep)  # (bs, seqlen, n_local_heads, head_dim)
    xv = repeat_kv(xv, n_rep)  # (bs, seqlen, n_local_heads, head_dim)

    # make heads into a batch dimension
    xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
    xk = xk.transpose(1, 2)
    xv = xv.transpose(1, 2)

    if flash:
        output = btjit.scaled_dot_product_attention(xq, xk, xv, attn_mask=None, dropout_p=args.dropout,
                                                    is_causal=True)
    else:
        # manual implementation
        scores = btjit.matmul(xq, xk.transpose(2, 3)) / math.sqrt(head_dim)
        scores = scores + mask[:, :, :seqlen, :seqlen]   # (bs, n_local_heads, seqlen, cache_len + seqlen)
        scores = btjit.softmax(scores.float(), dim=-1).type_as(xq)
        scores = btjit.dropout(scores, args.dropout)
        output = btjit.matmul(scores, xv)  # (bs, n_local_heads, seqlen, head_dim)

    # restore time as batch dimension and concat heads
    output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)

    # final projection into the residual stream
    output = btjit.linear(output, p[f"{name}.wo.weight"])
    return btjit.dropout(output, args.dropout)


def feed_forward(p, name, args, x):
    w = lambda k, v: btjit.linear(v, p[f"{name}.{k}.weight"])  # noqa: E731
    return btjit.dropout(w("w2", btjit.silu(w("w1", x)) * w("w3", x)), args.dropout)


def transformer_block(p, name, args, x, freqs_cos, freqs_sin, flash, mask):
    xn = rmsnorm(p, name + ".attention_norm", x, args.norm_eps)
    h = x + attention(p, name + ".attention", args, xn, freqs_cos, freqs_sin, flash, mask)
    out = h + feed_forward(p, name + ".feed_forward", args, rmsnorm(p, name + ".ffn_norm", h, args.norm_eps))
    return out


def transformer(p, tokens, targets, args, flash=True, freqs="traced"):
    """Transformer.forward; targets None: the inference path (the logits of the last position)."""
    _bsz, seqlen = tokens.shape
    h = btjit.embedding(tokens, p["tok_embeddings.weight"])
    h = btjit.dropout(h, args.dropout)
    if freqs == "buffers":                      # model.py's register_buffer: btjit.trace(..., buffers=)
        fc, fs = p["freqs_cos"], p["freqs_sin"]
    else:
        fc, fs = (precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len) if freqs == "traced" else
                  precompute_freqs_cis_np(args.dim // args.n_heads, args.max_seq_len))
    freqs_cos = fc[:seqlen]
    freqs_sin = fs[:seqlen]
    mask = np.triu(np.full((1, 1, args.max_seq_len, args.max_seq_len), float("-inf")), 1)   # the register_buffer

    for layer in range(args.n_layers):
        h = transformer_block(p, f"layers.{layer}", args, h, freqs_cos, freqs_sin, flash, mask)
    h = rmsnorm(p, "norm", h, args.norm_eps)

    if targets is not None:
        logits = btjit.linear(h, p["tok_embeddings.weight"])              # output.weight is tok_embeddings'
        return btjit.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return btjit.linear(h[:, [-1], :], p["tok_embeddings.weight"])    # note: using list [-1] to preserve the time dim


# --- torch: llama2.c's model.py (LoRA left out; `.float()` -> the model's dtype, see the docstring) ---------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x).type_as(x) * self.weight


def t_precompute_freqs_cis(dim, end, theta=10000.0, dtype=torch.float64):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].to(dtype) / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).to(dtype)
    return torch.cos(freqs), torch.sin(freqs)


def t_reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(shape)


def t_apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    xq_r, xq_i = xq.reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    freqs_cos = t_reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = t_reshape_for_broadcast(freqs_sin, xq_r)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def t_repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                      head_dim)


class Attention(nn.Module):
    def __init__(self, args, flash):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_local_heads, self.n_local_kv_heads = args.n_heads, self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.flash = flash
        mask = torch.full((1, 1, args.max_seq_len, args.max_seq_len), float("-inf"))
        self.register_buffer("mask", torch.triu(mask, diagonal=1), persistent=False)

    def forward(self, x, freqs_cos, freqs_sin):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = t_apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        xk, xv = t_repeat_kv(xk, self.n_rep), t_repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if self.flash:
            output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=None, dropout_p=0.0, is_causal=True)
        else:
            scores = torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)
            scores = scores + self.mask[:, :, :seqlen, :seqlen]
            scores = F.softmax(scores, dim=-1).type_as(xq)
            output = torch.matmul(scores, xv)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args, flash):
        super().__init__()
        self.attention, self.feed_forward = Attention(args, flash), FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cos, freqs_sin):
        h = x + self.attention.forward(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args, flash=True, dtype=torch.float64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(args, flash) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight
        freqs_cos, freqs_sin = t_precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, dtype=dtype)
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(self, tokens, targets=None):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cos, freqs_sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cos, freqs_sin)
        h = self.norm(h)
        if targets is not None:
            logits = self.output(h)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return self.output(h[:, [-1], :])


# --- the checks -------------------------------------------------------------------------------------------------
CONFIGS = {   # dim, n_heads, n_kv_heads, vocab, seq len, batch, multiple_of (hidden: 192, 128, 149)
    "d64_kv2_flash": (64, 4, 2, 100, 32, 2, 32, True),
    "d48_kv4_manual": (48, 4, 4, 32, 16, 4, 32, False),
    "d56_kv2_odd_manual": (56, 4, 2, 67, 19, 3, 1, False),
    "d56_kv2_odd_flash": (56, 4, 2, 67, 19, 3, 1, True),
}
TOL = {"float64": (1e-10, 1e-9), "float32": (1e-5, 1e-4)}


def build(cfg, dtype, seed=0):
    dim, nh, nkv, V, T, B, mult, flash = CONFIGS[cfg]
    args = model_args(dim, nh, nkv, V, T, multiple_of=mult)
    torch.manual_seed(seed)
    tdt = getattr(torch, dtype)
    net = Transformer(args, flash, dtype=tdt).to(tdt)
    with torch.no_grad():      # weights big enough that attention is not uniform; norms' gains not all 1
        for k, v in net.named_parameters():
            v.copy_(1 + 0.2 * torch.randn_like(v) if v.ndim == 1 else torch.randn_like(v) * 0.6 / v.shape[-1] ** 0.5)
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    assert "output.weight" not in params                                    # tied: one param
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(4):
        x, y = rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)
        y[0, :3] = -1                                                       # ignore_index=-1
        batches.append((x, y))
    return args, flash, net, params, batches


def _close(got, want, tol, what):
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_llama_loss_and_grads_match_torch(cfg, dtype):
    args, flash, net, params, batches = build(cfg, dtype)
    freqs = {"d48_kv4_manual": "buffers", "d56_kv2_odd_manual": "numpy"}.get(cfg, "traced")
    fc, fs = precompute_freqs_cis_np(args.dim // args.n_heads, args.max_seq_len)
    prog = btjit.trace(lambda p, x, y: transformer(p, x, y, args, flash, freqs), params, *batches[0], dtype=dtype,
                       grad=True, buffers={"freqs_cos": fc, "freqs_sin": fs} if freqs == "buffers" else None)
    ltol, gtol = TOL[dtype]
    for x, y in batches[:2]:
        net.zero_grad()
        want = net(torch.tensor(x).long(), torch.tensor(y).long())
        want.backward()
        _close(prog.value_and_grad(x, y), want.item(), ltol, "loss")
        for k, v in net.named_parameters():
            _close(prog.grads[k], v.grad.numpy(), gtol, "grad " + k)
    if flash:
        assert "causal_attention" in str(prog.graph)       # scaled_dot_product_attention(is_causal=True): fused


@pytest.mark.parametrize("cfg", ["d64_kv2_flash", "d56_kv2_odd_manual"])
def test_llama_adamw_steps_match_torch(cfg):
    """llama2.c's configure_optimizers (decay on >= 2-d params) and train.py's clip_grad_norm_(1.0), 4 steps."""
    args, flash, net, params, batches = build(cfg, "float64", seed=1)
    opt = btjit.optim.AdamW(lr=5e-3, betas=(0.9, 0.95), weight_decay=0.1, groups=btjit.optim.decay_matrices())
    prog = btjit.trace(lambda p, x, y: transformer(p, x, y, args, flash), params, *batches[0], dtype="float64",
                       optimizer=opt, clip_norm=1.0)
    decay = [v for v in net.parameters() if v.dim() >= 2]
    nodecay = [v for v in net.parameters() if v.dim() < 2]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                             lr=5e-3, betas=(0.9, 0.95))
    for x, y in batches:
        topt.zero_grad()
        want = net(torch.tensor(x).long(), torch.tensor(y).long())
        want.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        topt.step()
        _close(prog.step(x, y), want.item(), 1e-10, "loss")
    for k, v in net.named_parameters():
        _close(prog.params[k], v.detach().numpy(), 1e-9, k)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_llama_inference_logits_of_the_last_position(dtype):
    """model.py's inference path: self.output(h[:, [-1], :]) (a list index keeping the time axis)."""
    args, flash, net, params, batches = build("d56_kv2_odd_flash", dtype)
    x = batches[0][0]
    prog = btjit.trace(lambda p, x: transformer(p, x, None, args, flash), params, x, dtype=dtype)
    with torch.no_grad():
        want = net(torch.tensor(x).long()).numpy()
    got = prog(x)
    assert got.shape == want.shape == (x.shape[0], 1, args.vocab_size)
    _close(got, want, TOL[dtype][0] * 10, "logits")


def test_a_tied_weight_passed_twice_warns():
    """torch's state_dict() lists llama2.c's tied weight twice (tok_embeddings.weight, output.weight: one tensor);
    passed as it is, btjit would train two params that drift apart from torch's one: a warning names both."""
    args, flash, net, params, batches = build("d48_kv4_manual", "float64")
    sd = {k: v.numpy() for k, v in net.state_dict().items()}
    assert sd["output.weight"] is not sd["tok_embeddings.weight"]                # two arrays over one memory

    def loss(p, x, y):
        return btjit.cross_entropy(btjit.linear(btjit.embedding(x, p["tok_embeddings.weight"]), p["output.weight"]), y)
    with pytest.warns(UserWarning, match="'tok_embeddings.weight' and 'output.weight' are one array"):
        btjit.trace(loss, sd, *batches[0], dtype="float64", grad=True)
