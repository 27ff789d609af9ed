"""nanoGPT (btjit/models/nanogpt.py) against PyTorch nanoGPT (btjit/bench/peers/nanogpt_torch.py, model.py's
transcription) at sizes other than the recipe's: depths 1-3, 1 to 8 heads (head sizes 3 to 48), contexts 1, 7, 16,
33 and 128 (the last in the AdamW test; sequences shorter than block_size too), batches 1/3/5, with and without
biases, vocab 65 and 97. The loss and every gradient (float64: 1e-10 / 1e-9, float32: 1e-5 / 1e-4); 3 AdamW steps
with nanoGPT's configure_optimizers groups (decay on >= 2-dim params) and clip; dropout > 0 evaluated (prog.eval)
at other batch shapes; the sampler's logits for a prompt longer than block_size (nanoGPT's generate crops to the
last block_size tokens); threads=2 bit for bit threads=1 with dropout; precision="bf16" trains."""
import numpy as np
import pytest

import btjit
from btjit.models import nanogpt

torch = pytest.importorskip("torch")
from test_nanogpt import torch_gpt, torch_grads  # noqa: E402

F64 = (np.float64, 1e-10, 1e-9)
F32 = (np.float32, 1e-5, 1e-4)


def _case(n_layer, n_head, n_embd, block, T, B, bias, V, dtype, seed=0, dropout=0.0):
    cfg = nanogpt.NanoGPTConfig(vocab_size=V, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                bias=bias, dropout=dropout)
    rng = np.random.default_rng(seed)
    params = {k: (v + rng.normal(0, 0.05, v.shape)).astype(dtype)            # off the init: nonzero biases
              for k, v in nanogpt.init_params(cfg, seed).items()}
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    if T > 1:
        y[0, :2] = -1                                                          # ignore_index=-1
    return cfg, params, x, y


def _tdt(dtype):
    return torch.float64 if dtype == np.float64 else torch.float32


def _long(a):
    return torch.tensor(a, dtype=torch.long)


# (n_layer, n_head, n_embd, block_size, T, B, bias, vocab)
SIZES = [(1, 1, 24, 1, 1, 1, False, 65),       # block_size 1
         (2, 3, 48, 33, 33, 3, True, 97),      # odd context, odd vocab
         (3, 8, 64, 16, 9, 5, False, 97),      # a sequence shorter than block_size
         (2, 8, 24, 7, 7, 3, True, 65)]        # head size 3


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "L{}H{}C{}blk{}T{}B{}{}V{}".format(*s[:6], "b" * s[6], s[7]))
@pytest.mark.parametrize("dtype,tol_loss,tol_grad", [F64, F32], ids=["f64", "f32"])
def test_loss_and_gradients_match_pytorch_nanogpt_at_other_sizes(size, dtype, tol_loss, tol_grad):
    cfg, params, x, y = _case(*size, dtype)
    prog = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, grad=True, dtype=dtype)
    loss = prog.value_and_grad(x, y)
    model = torch_gpt(cfg, params, _tdt(dtype))
    _, ref = model(_long(x), _long(y))
    ref.backward()
    assert abs(loss - ref.item()) <= tol_loss * max(1.0, abs(ref.item()))
    want = torch_grads(model)
    assert set(prog.grads) == set(want)
    for k, g in prog.grads.items():
        assert np.abs(g - want[k]).max() <= tol_grad * max(np.abs(want[k]).max(), 1e-6), k


@pytest.mark.parametrize("size,dtype,atol", [((2, 3, 48, 33, 20, 3, True, 97), np.float64, 1e-10),
                                             ((1, 4, 64, 128, 128, 1, True, 65), np.float32, 1e-4)],
                         ids=["f64", "f32"])
def test_adamw_decay_on_matrices_matches_configure_optimizers(size, dtype, atol):
    """3 steps of AdamW with decay on the >= 2-dim params only (btjit.optim.decay_matrices, `[optim] decay =
    "matrices"`) and clip 1.0, against model.configure_optimizers' two groups. float32's atol: Adam's division by
    sqrt(v) scales rounding up (torch float32 is itself ~3e-5 off torch float64 here)."""
    cfg, params, x, y = _case(*size, dtype, seed=3)
    model = torch_gpt(cfg, params, _tdt(dtype))
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95))
    prog = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, clip_norm=1.0, dtype=dtype,
                       optimizer=btjit.optim.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                                   groups=btjit.optim.decay_matrices()))
    rng = np.random.default_rng(7)
    V, C = cfg.vocab_size, cfg.n_embd
    for step in range(3):
        xb, yb = (rng.integers(0, V, x.shape).astype(np.int32) for _ in range(2))
        _, ref = model(_long(xb), _long(yb))
        ref.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        got = prog.step(xb, yb)
        assert abs(got - ref.item()) <= 10 * atol * max(1.0, ref.item()), f"step {step}: {got} vs {ref.item()}"
    sd = model.state_dict()
    for k, v in prog.params.items():
        want = sd[k].numpy()
        want = want.T if v.ndim == 2 and ".h." in k else want
        if k.endswith("c_attn.bias"):     # the key bias's gradient is 0 in exact arithmetic: rounding noise
            v, want = np.delete(v, np.s_[C:2 * C]), np.delete(want, np.s_[C:2 * C])
        np.testing.assert_allclose(v, want, rtol=0, atol=atol, err_msg=k)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-5)], ids=["f64", "f32"])
def test_dropout_model_in_eval_mode_matches_pytorch_eval_at_other_shapes(dtype, tol):
    cfg, params, x, y = _case(2, 3, 48, 16, 16, 3, True, 97, dtype, dropout=0.2)
    prog = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, dtype=dtype,
                       optimizer=btjit.optim.AdamW(lr=1e-3, groups=btjit.optim.decay_matrices()))
    prog.step(x, y)
    model = torch_gpt(cfg, {k: v.copy() for k, v in prog.params.items()}, _tdt(dtype)).eval()
    rng = np.random.default_rng(1)
    for shape in ((1, 5), (5, 16), (2, 1)):
        xe, ye = (rng.integers(0, 97, shape).astype(np.int32) for _ in range(2))
        with torch.no_grad():
            _, ref = model(_long(xe), _long(ye))
        assert abs(prog.eval(xe, ye) - ref.item()) <= tol * max(1.0, ref.item()), shape


@pytest.mark.parametrize("block", [1, 7])
def test_sampler_logits_crop_a_long_prompt_to_block_size_as_generate(block):
    """btjit's Sampler (`btjit sample`) reads the logits of the last block_size tokens, as nanoGPT's generate
    (idx_cond = idx[:, -block_size:], logits[:, -1, :]): the same logits for every prefix of a longer prompt."""
    from btjit.train import config as config_mod
    from btjit.train.data import Vocab
    from btjit.train.registry import model_for
    from btjit.train.sampling import Sampler
    V = 97
    cfg, params, _, _ = _case(2, 3, 48, block, block, 1, True, V, np.float64)
    section = config_mod.loads(f'[model]\nkind = "nanogpt"\nn_layer = 2\nn_head = 3\nn_embd = 48\n'
                               f'block_size = {block}\nbias = true\n').model
    sampler = Sampler(model_for(section, V), Vocab([chr(33 + i) for i in range(V)]), params, "float64")
    model = torch_gpt(cfg, params, torch.float64).eval()
    ctx = [int(t) for t in np.random.default_rng(2).integers(0, V, 3 * block + 2)]
    for n in range(1, len(ctx) + 1):
        idx = _long([ctx[:n][-block:]])
        with torch.no_grad():
            want = model(idx, torch.zeros_like(idx))[0][0, -1].numpy()
        np.testing.assert_allclose(sampler._logits(ctx[:n]), want, rtol=0, atol=1e-12, err_msg=str(n))


def test_two_threads_train_bit_for_bit_as_one_with_dropout():
    cfg, params, x, y = _case(2, 3, 96, 33, 33, 5, True, 97, np.float32, dropout=0.1)
    runs = []
    for threads in (1, 2):
        prog = btjit.trace(nanogpt.loss_fn(cfg), {k: v.copy() for k, v in params.items()}, x, y, clip_norm=1.0,
                           threads=threads, seed=3,
                           optimizer=btjit.optim.AdamW(lr=1e-3, groups=btjit.optim.decay_matrices()))
        runs.append(([prog.step(x, y) for _ in range(3)], {k: v.copy() for k, v in prog.params.items()}))
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert np.array_equal(v, runs[1][1][k]), k


def test_bf16_precision_trains():
    cfg, params, x, y = _case(2, 2, 48, 16, 16, 4, False, 65, np.float32)
    prog = btjit.trace(nanogpt.loss_fn(cfg), params, x, y, precision="bf16",
                       optimizer=btjit.optim.AdamW(lr=3e-3, weight_decay=0.1, groups=btjit.optim.decay_matrices()))
    losses = [prog.step(x, y) for _ in range(15)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]
