"""nanoGPT's model.py GPT (btjit/models/nanogpt.py) against PyTorch nanoGPT: the transcription of model.py in
btjit/bench/peers/nanogpt_torch.py (the `btjit bench --suite nanogpt` peer, so the bench's torch side is checked
here too), loaded with btjit's params. At dropout 0, bias True and False: the loss (1e-5) and every gradient (1e-4)
in float32, 1e-10 in float64, and a 10-step AdamW trajectory with nanoGPT's clip. Also the param names (nanoGPT's
state_dict), counts, init, the config keys and the registry."""
import argparse
import math
from pathlib import Path

import numpy as np
import pytest

import btjit
from btjit.models import nanogpt
from btjit.train import config as config_mod
from btjit.train.registry import model_for

torch = pytest.importorskip("torch")
from btjit.bench.peers import nanogpt_torch as NG  # noqa: E402

V, T = 11, 8
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _case(bias, dtype=np.float32, B=3, seed=0, n_layer=2):
    cfg = nanogpt.NanoGPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=2, n_embd=16, bias=bias)
    rng = np.random.default_rng(seed)
    params = {k: (v + rng.normal(0, 0.05, v.shape)).astype(dtype)            # off the init: nonzero biases
              for k, v in nanogpt.init_params(cfg, seed).items()}
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    y[0, :3] = -1                                                              # ignore_index=-1 positions
    return cfg, params, x, y


def torch_gpt(cfg, params, dtype=torch.float32):
    """PyTorch nanoGPT holding btjit's params (Linear weights transposed to torch's (out, in))."""
    model = NG.GPT(argparse.Namespace(**{k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer",
                                                                     "n_head", "n_embd", "dropout", "bias")})).to(dtype)
    sd = {k: torch.tensor(v.T if v.ndim == 2 and ".h." in k else v) for k, v in params.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd, strict=True)
    return model


def torch_grads(model):
    g = {k: p.grad.numpy() for k, p in model.named_parameters()}
    return {k: (v.T if v.ndim == 2 and ".h." in k else v) for k, v in g.items()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,tol_loss,tol_grad", [(np.float32, 1e-5, 1e-4), (np.float64, 1e-10, 1e-10)])
def test_loss_and_every_gradient_match_pytorch_nanogpt(bias, dtype, tol_loss, tol_grad):
    cfg, params, x, y = _case(bias, dtype)
    prog = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, grad=True, dtype=dtype)
    loss = prog.value_and_grad(x, y)
    model = torch_gpt(cfg, params, torch.float32 if dtype == np.float32 else torch.float64)
    _, ref = model(torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long))
    ref.backward()
    assert abs(loss - ref.item()) <= tol_loss * max(1.0, abs(ref.item()))
    want = torch_grads(model)
    assert set(prog.grads) == set(want)                       # the tie: wte's gradient has lm_head's part
    for k, g in prog.grads.items():
        scale = max(np.abs(want[k]).max(), 1e-6)
        assert np.abs(g - want[k]).max() <= tol_grad * scale, k


@pytest.mark.parametrize("bias", [True, False])
def test_adamw_trajectory_matches_pytorch_nanogpt(bias):
    cfg, params, x, y = _case(bias, seed=1, B=4)
    model = torch_gpt(cfg, params)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    prog = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, clip_norm=1.0,
                       optimizer=btjit.optim.AdamW(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1))
    rng = np.random.default_rng(5)
    for step in range(10):
        xb = rng.integers(0, V, x.shape).astype(np.int32)
        yb = rng.integers(0, V, y.shape).astype(np.int32)
        _, ref = model(torch.tensor(xb, dtype=torch.long), torch.tensor(yb, dtype=torch.long))
        ref.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        got = prog.step(xb, yb)
        assert abs(got - ref.item()) < 2e-5 * max(1.0, ref.item()), f"step {step}: {got} vs {ref.item()}"
    sd = model.state_dict()
    for k, v in prog.params.items():
        want = sd[k].numpy()
        want = want.T if v.ndim == 2 and ".h." in k else want
        if k.endswith("c_attn.bias"):     # the key bias's gradient is 0 in exact arithmetic (a query's scores all
            C = cfg.n_embd                # shift by q.b): both sides' rounding noise, which Adam scales up to eps
            v, want = np.delete(v, np.s_[C:2 * C]), np.delete(want, np.s_[C:2 * C])
        np.testing.assert_allclose(v, want, rtol=1e-4, atol=1e-5, err_msg=k)


def test_recipe_program_matches_pytorch_nanogpt_over_its_warmup():
    """configs/nanogpt_cpu.toml's program as `btjit train` builds it (its size, AdamW with decay on the matrices
    only, clip 1.0) and its lr schedule, against the torch peer's model, configure_optimizers and get_lr from the
    same init and batches: 120 steps (the warm-up and the first decay steps) agree to float32 rounding."""
    from btjit.train import runparts, schedule
    cfg = config_mod.load(CONFIGS / "nanogpt_cpu.toml")
    o, m = cfg.optim, model_for(cfg.model, 65)
    params = m.init_params(np.random.default_rng(0))
    model = torch_gpt(m.cfg, params)
    opt = model.configure_optimizers(o.weight_decay, o.lr, o.betas)
    rng = np.random.default_rng(1)
    batch = lambda: tuple(rng.integers(0, 65, (12, 64)).astype(np.int32) for _ in range(2))  # noqa: E731
    prog = runparts.build_program(cfg, m, {k: v.copy() for k, v in params.items()}, *batch())
    for it in range(120):
        lr = schedule.lr_at(it, o.lr, o.schedule, o.warmup_steps, o.decay_steps, o.lr_min)
        assert lr == NG.get_lr(it, o.lr, o.warmup_steps, o.decay_steps, o.lr_min)
        for g in opt.param_groups:
            g["lr"] = lr
        prog.lr = lr
        x, y = batch()
        _, ref = model(torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long))
        ref.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        got = prog.step(x, y)
        assert abs(got - ref.item()) < 1e-5, f"step {it}: {got} vs {ref.item()}"
    sd = model.state_dict()
    for k, v in prog.params.items():
        want = sd[k].numpy()
        np.testing.assert_allclose(v, want.T if v.ndim == 2 and ".h." in k else want, rtol=1e-4, atol=1e-5, err_msg=k)


def test_dropout_sites_train_and_eval():
    """dropout 0.2 at the four sites: eval mode is the dropout-0 model exactly; training draws masks from the seed
    (the same seed the same loss, another seed another loss) and changes the loss at every site."""
    from dataclasses import replace
    cfg, params, x, y = _case(True, B=4, n_layer=1)
    base = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, grad=True).value_and_grad(x, y)
    drop = replace(cfg, dropout=0.2)
    assert btjit.trace(nanogpt.loss_fn(drop), params, x, y, grad=True, training=False).value_and_grad(x, y) == base
    losses = [btjit.trace(nanogpt.loss_fn(drop), params, x, y, grad=True, seed=s).value_and_grad(x, y)
              for s in (1, 1, 2)]
    assert losses[0] == losses[1] != losses[2] and abs(losses[0] - base) > 1e-4
    prog = btjit.trace(nanogpt.loss_fn(drop), params, x, y, grad=True)
    assert prog.graph.rng_sites == 4     # model.py's four: embeddings, attention probabilities, both c_proj outputs


def test_names_counts_and_init_are_nanogpts():
    cfg = nanogpt.NanoGPTConfig(vocab_size=65)                 # the CPU recipe: 4/4/128, block 64, no bias
    p = nanogpt.init_params(cfg, 1337)
    model = NG.GPT(argparse.Namespace(**{k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer",
                                                                     "n_head", "n_embd", "dropout", "bias")}))
    assert list(p) == [k for k in model.state_dict() if k != "lm_head.weight"]   # the same names, same order
    assert sum(v.size for v in p.values()) == 804_096 and nanogpt.n_params(cfg) == model.get_num_params()
    assert round(nanogpt.n_params(cfg) / 1e6, 2) == 0.80                        # "number of parameters: 0.80M"
    assert all(v.dtype == np.float32 for v in p.values())
    proj = np.concatenate([v.ravel() for k, v in p.items() if k.endswith("c_proj.weight")])
    fc = np.concatenate([v.ravel() for k, v in p.items() if k.endswith("c_fc.weight")])
    assert abs(proj.std() - 0.02 / math.sqrt(8)) < 2e-4 and abs(fc.std() - 0.02) < 3e-4
    assert all(np.all(v == 1) for k, v in p.items() if k.endswith("ln_1.weight") or k.endswith("ln_f.weight"))
    pb = nanogpt.init_params(nanogpt.NanoGPTConfig(vocab_size=65, bias=True), 0)
    assert all(np.all(v == 0) for k, v in pb.items() if k.endswith(".bias"))
    assert len(pb) - len(p) == 4 * 6 + 1                      # per block 2 LayerNorms + 4 Linears, and ln_f


def test_longer_than_block_size_is_refused():
    cfg, params, _, _ = _case(False)
    x = np.zeros((1, T + 1), np.int32)
    with pytest.raises(ValueError, match="block size is only 8"):
        btjit.trace(nanogpt.loss_fn(cfg), params, x, x, grad=True)


def test_config_kind_nanogpt_and_its_keys(tmp_path):
    for name in ("nanogpt_cpu", "nanogpt_shakespeare_char"):
        cfg = config_mod.load(CONFIGS / f"{name}.toml")
        assert cfg.model.kind == "nanogpt" and cfg.model.bias is False
        m = model_for(cfg.model, 65)
        assert m.format == "text" and m.cfg.dropout == cfg.model.dropout and m.mean_over_batch
    cpu = config_mod.load(CONFIGS / "nanogpt_cpu.toml")
    assert (cpu.train.steps, cpu.train.batch_size, cpu.model.block_size, cpu.optim.betas) == (2001, 12, 64, (0.9, 0.99))
    with pytest.raises(config_mod.ConfigError, match=r"model.dropout must be in \[0, 1\)"):
        config_mod.loads('[model]\nkind = "nanogpt"\ndropout = 1.0')
    with pytest.raises(config_mod.ConfigError, match='model.dropout is only used with model.kind = "gpt" or "nanogpt"'):
        config_mod.loads('[model]\nkind = "mlp"\ndropout = 0.1\n[data]\nformat = "lines"')
    with pytest.raises(config_mod.ConfigError, match='model.bias is only used with model.kind = "nanogpt"'):
        config_mod.loads('[model]\nkind = "gpt"\nbias = true')
    with pytest.raises(config_mod.ConfigError, match="model.bias: expected bool"):
        config_mod.loads('[model]\nkind = "nanogpt"\nbias = 1')
