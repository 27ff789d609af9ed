"""The paper's GPT and MLP, traced by btjit, against independent PyTorch implementations of the same models
(tests/torch_models.py): loss, EVERY parameter gradient, and a 10-step SGD loss trajectory. Skipped when
torch is absent (.ci/run installs it)."""
import numpy as np
import pytest

import btjit
from btjit.models import gpt, mlp

torch = pytest.importorskip("torch")
import torch_models as TM  # noqa: E402


def test_gpt_param_count_is_the_papers():
    p = gpt.init_params(gpt.GPTConfig(vocab_size=65), 0)
    assert sum(v.size for v in p.values()) == 46337


def test_mlp_param_count_is_the_papers():
    p = mlp.init_params(mlp.MLPConfig(), 0)
    assert sum(v.size for v in p.values()) == 1079003


def _gpt_case(B, activation="relu", n_layer=2, seed=0):
    cfg = gpt.GPTConfig(vocab_size=13, n_layer=n_layer, n_head=3, n_embd=12, block_size=6, activation=activation)
    rng = np.random.default_rng(seed)
    params = gpt.init_params(cfg, seed)
    params = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in params.items()}  # break symmetry
    x = rng.integers(0, 13, (B, 6)).astype(np.int32)
    y = rng.integers(0, 13, (B, 6)).astype(np.int32)
    return cfg, params, x, y


def _compare_grads(prog, P, rtol=2e-4):
    for name, g in prog.grads.items():
        want = P[name].grad.numpy()
        scale = max(np.abs(want).max(), 1e-6)
        assert np.abs(g - want).max() <= rtol * scale + 1e-7, f"gradient of {name}"


@pytest.mark.parametrize("B,activation", [(1, "relu"), (4, "relu"), (3, "gelu"), (67, "relu")])
def test_gpt_loss_and_every_gradient_match_torch(B, activation):
    cfg, params, x, y = _gpt_case(B, activation)
    prog = btjit.trace(gpt.loss_fn(cfg), params, x, y, grad=True)
    loss = prog.value_and_grad(x, y)
    P = TM.tensors(params)
    ref = TM.gpt_loss(P, torch.tensor(x), torch.tensor(y), cfg.n_layer, cfg.n_head, activation)
    ref.backward()
    assert abs(loss - ref.item()) < 1e-5 * max(1, abs(ref.item()))
    assert set(prog.grads) == set(P)
    _compare_grads(prog, P)


def test_gpt_sgd_trajectory_matches_torch():
    cfg, params, x, y = _gpt_case(4, seed=1)
    prog = btjit.trace(gpt.loss_fn(cfg), params, x, y, optimizer=btjit.optim.SGD(lr=0.5))
    P = TM.tensors(params)
    opt = torch.optim.SGD(P.values(), lr=0.5)
    rng = np.random.default_rng(5)
    for step in range(10):
        xb = rng.integers(0, 13, x.shape).astype(np.int32)
        yb = rng.integers(0, 13, y.shape).astype(np.int32)
        opt.zero_grad()
        ref = TM.gpt_loss(P, torch.tensor(xb), torch.tensor(yb), cfg.n_layer, cfg.n_head)
        ref.backward()
        opt.step()
        got = prog.step(xb, yb)
        assert abs(got - ref.item()) < 2e-5 * max(1, abs(ref.item())), f"step {step}: {got} vs {ref.item()}"
    for k, v in prog.params.items():
        np.testing.assert_allclose(v, P[k].detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("B", [8, 40])       # 40 > vocab 11: the embedding fold of graph/fuse.py applies
def test_mlp_loss_gradients_and_trajectory_match_torch(B):
    cfg = mlp.MLPConfig(vocab_size=11, context=5, n_emb=6, n_hidden=32)
    params = mlp.init_params(cfg, 3)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (B, 5)).astype(np.int32)
    y = rng.integers(0, 11, B).astype(np.int32)
    g = btjit.trace(mlp.loss_fn(cfg), params, x, y, grad=True)
    assert any(e.op == "take_sum" for e in g.graph.eqns) == (B > 11)
    loss = g.value_and_grad(x, y)
    P = TM.tensors(params)
    ref = TM.mlp_loss(P, torch.tensor(x), torch.tensor(y))
    ref.backward()
    assert abs(loss - ref.item()) < 1e-5 * max(1, ref.item())
    _compare_grads(g, P)
    prog = btjit.trace(mlp.loss_fn(cfg), params, x, y, optimizer=btjit.optim.SGD(lr=0.1))
    P = TM.tensors(params)
    opt = torch.optim.SGD(P.values(), lr=0.1)
    for step in range(10):
        opt.zero_grad()
        ref = TM.mlp_loss(P, torch.tensor(x), torch.tensor(y))
        ref.backward()
        opt.step()
        assert abs(prog.step(x, y) - ref.item()) < 2e-5 * max(1, ref.item()), f"step {step}"


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw", "adamw_clip"])
def test_optimizers_match_torch(opt_name):
    cfg, params, x, y = _gpt_case(2, n_layer=1, seed=2)
    P = TM.tensors(params)
    clip = 0.05 if opt_name.endswith("clip") else None
    if opt_name == "sgd_momentum":
        ours, theirs = btjit.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01), \
            torch.optim.SGD(P.values(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        ours, theirs = btjit.optim.AdamW(lr=1e-2, weight_decay=0.1), \
            torch.optim.AdamW(P.values(), lr=1e-2, weight_decay=0.1)
    prog = btjit.trace(gpt.loss_fn(cfg), params, x, y, optimizer=ours, clip_norm=clip)
    for step in range(5):
        theirs.zero_grad()
        ref = TM.gpt_loss(P, torch.tensor(x), torch.tensor(y), cfg.n_layer, cfg.n_head)
        ref.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(P.values()), clip)
        theirs.step()
        got = prog.step(x, y)
        assert abs(got - ref.item()) < 5e-5 * max(1, ref.item()), f"step {step}"
    for k, v in prog.params.items():
        np.testing.assert_allclose(v, P[k].detach().numpy(), rtol=2e-4, atol=2e-5, err_msg=k)
