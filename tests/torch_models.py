"""Independent PyTorch implementations of the paper's GPT (E6) and makemore MLP (E5), used as references by
tests/test_models.py. Written directly from PAPER.md, not from btjit's code; they load btjit's named numpy
parameters (weights stored (in, out))."""
import math

import torch
import torch.nn.functional as F


def gpt_loss(P, idx, targets, n_layer, n_head, activation="relu"):
    """P: dict name -> torch tensor (requires_grad as the caller wants). Returns the mean cross-entropy."""
    B, T = idx.shape
    x = P["wte"][idx] + P["wpe"][:T]
    C = x.shape[-1]
    hs = C // n_head
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(n_layer):
        h = f"h{i}."
        a = F.layer_norm(x, (C,), P[h + "ln1.g"], P[h + "ln1.b"], eps=1e-5)
        q, k, v = (a @ P[h + "attn.qkv.w"]).split(C, dim=-1)
        q, k, v = (t.view(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ P[h + "attn.proj.w"] + P[h + "attn.proj.b"]
        m = F.layer_norm(x, (C,), P[h + "ln2.g"], P[h + "ln2.b"], eps=1e-5)
        m = m @ P[h + "mlp.fc.w"] + P[h + "mlp.fc.b"]
        m = F.relu(m) if activation == "relu" else F.gelu(m, approximate="tanh")
        x = x + m @ P[h + "mlp.proj.w"] + P[h + "mlp.proj.b"]
    x = F.layer_norm(x, (C,), P["lnf.g"], P["lnf.b"], eps=1e-5)
    logits = x @ P["head.w"] + P["head.b"]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1).long())


def mlp_loss(P, x, y):
    e = P["emb"][x.long()]
    h = torch.tanh(e.view(x.shape[0], -1) @ P["w1"] + P["b1"])
    return F.cross_entropy(h @ P["w2"] + P["b2"], y.long())


def tensors(params, dtype=torch.float32):
    return {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in params.items()}


def sgd_steps_as_torch(prog, module, batches, torch_loss, lr=0.1, momentum=0.9):
    """Step prog (traced with btjit.optim.SGD(lr, momentum=momentum), float64) and module under torch.optim.SGD over
    the batches: each step's loss as torch_loss(*batch)'s to 1e-10, the params after them to 1e-9."""
    import numpy as np
    import pytest
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    for batch in batches:
        opt.zero_grad()
        want = torch_loss(*batch)
        want.backward()
        opt.step()
        assert prog.step(*batch) == pytest.approx(want.item(), rel=1e-10)
    for k, v in module.named_parameters():
        np.testing.assert_allclose(prog.params[k], v.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=k)
