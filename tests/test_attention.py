# Tests for the flash-style causal attention (btjit/kernels/attention.py), the kept-probabilities kernels
# (btjit/kernels/attn_kept.py) and the lowering rule that picks them (attention.kind, btjit/graph/ops/nn.py
# _attn_lower): the kernels at many (T, hs) on float32 and float64 arenas against numpy (forward, logsumexps or
# probabilities, backward; finite differences in float64), writing nothing outside their outputs; programs on
# both sides of each threshold of the rule; the E6 shapes keeping their kernels; whole GPTs whose loss and
# gradients match across the kernels.
import numpy as np
import pytest

import btjit
from btjit.kernels import attention as A
from btjit.kernels import attn_kept as K
from btjit.kernels.library import OPCODE
from kernel_harness import Arena, attn_bwd_ref, attn_ref, check, fd_grad, rnd, row

DTS = [np.float32, np.float64]
# every T of (1, 7, 8, 33, 64, 130, 256) and every hs of (4, 12, 16, 32, 64), 13 pairs
PAIRS = [(1, 4), (1, 32), (7, 12), (7, 64), (8, 16), (8, 4), (33, 32), (33, 12), (64, 64), (64, 4),
         (130, 16), (130, 12), (256, 32)]


def lse_ref(qkv, B, T, C, NH, scale):
    hs = C // NH
    x = qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    S = x[0] @ x[1].transpose(0, 1, 3, 2) * scale
    S = np.where(np.tril(np.ones((T, T), bool)), S, -np.inf)
    mx = S.max(-1, keepdims=True)
    return (mx + np.log(np.exp(S - mx).sum(-1, keepdims=True))).ravel()


def run_pair(kind, dt, qkv, dy, B, T, C, NH, scale):
    """The forward then the backward of the flash or the kept pair on an arena; its P holds the rows'
    logsumexps (flash) or the probabilities, rows padded to Tp (kept)."""
    M = A if kind == "flash" else K
    ar = Arena(dt)
    osc = ar.put("scale", np.array([scale]))
    oq, ody = ar.put("qkv", qkv), ar.put("dy", dy)
    oy, oP = ar.put("y", size=B * T * C), ar.put("P", size=B * NH * T * (1 if kind == "flash" else K.padded(T)))
    oW, odq = ar.put("W", size=M.fwd_scratch(B, T, C, NH)), ar.put("dqkv", size=B * T * 3 * C)
    oS = ar.put("S", size=M.bwd_scratch(B, T, C, NH))
    a = ar.build()
    ia = np.zeros(1, np.int32)
    getattr(M, f"k_attn_fwd_{kind}")(a, ia, row(oq, oy, oP, oW, B, T, C, NH, osc))
    ar.only_wrote("y", "P", "W")
    bwd = (oq, oP, oW, ody, odq, oS) if kind == "flash" else (oq, oP, ody, odq, oS)
    getattr(M, f"k_attn_bwd_{kind}")(a, ia, row(*bwd, B, T, C, NH, osc))
    ar.only_wrote("y", "P", "W", "dqkv", "S")
    return ar


def probs_ref(qkv, B, T, C, NH, scale):
    """The probabilities (B, NH, T, Tp), rows padded with zeros."""
    hs = C // NH
    x = qkv.astype(np.float64).reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)
    S = np.where(np.tril(np.ones((T, T), bool)), x[0] @ x[1].transpose(0, 1, 3, 2) * scale, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    return np.concatenate([P, np.zeros((B, NH, T, K.padded(T) - T))], -1)


KERNEL_CASES = [("flash", T, hs) for T, hs in PAIRS] + \
    [("kept", T, hs) for T, hs in PAIRS + [(16, 8), (23, 9), (200, 8)] if T >= 8 and hs >= 8]


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("kind,T,hs", KERNEL_CASES)
def test_kernels_match_numpy(dt, kind, T, hs):
    NH = 2 if T * hs <= 4096 else 1
    B = 2 if T <= 64 else 1
    C = NH * hs
    rng = np.random.default_rng(T * 100 + hs)
    qkv, dy = rnd(rng, (B * T, 3 * C), dt, 1.5), rnd(rng, (B * T, C), dt)
    scale = float(dt(1.0 / np.sqrt(hs)))
    ar = run_pair(kind, dt, qkv, dy, B, T, C, NH, scale)
    check(ar.get("y", (B * T, C)), attn_ref(qkv, B, T, C, NH, scale)[0], dt)
    P = lse_ref(qkv, B, T, C, NH, scale) if kind == "flash" else probs_ref(qkv, B, T, C, NH, scale).ravel()
    check(ar.get("P"), P, dt)
    check(ar.get("dqkv", qkv.shape), attn_bwd_ref(qkv, dy, B, T, C, NH, scale), dt)


@pytest.mark.parametrize("kind,T,hs", [("flash", 9, 4), ("flash", 20, 3), ("flash", 17, 16), ("kept", 8, 8),
                                       ("kept", 20, 8), ("kept", 17, 16), ("kept", 35, 12)])
def test_backward_finite_differences(kind, T, hs):
    B, NH = 1, 2
    C = NH * hs
    rng = np.random.default_rng(T)
    qkv, dy = rnd(rng, (B * T, 3 * C), np.float64), rnd(rng, (B * T, C), np.float64)
    scale = 1.0 / np.sqrt(hs)
    ar = run_pair(kind, np.float64, qkv, dy, B, T, C, NH, scale)
    fd = fd_grad(lambda v: (attn_ref(v, B, T, C, NH, scale)[0] * dy).sum(), qkv)
    check(ar.get("dqkv", qkv.shape), fd, np.float64, 1e-7)


def test_flash_large_scores_stay_finite():
    """Scores of +-60 (exp overflows float32 without the running max) and T spanning three key tiles."""
    B, T, NH, hs = 1, 150, 1, 8
    C = NH * hs
    rng = np.random.default_rng(3)
    qkv, dy = rnd(rng, (B * T, 3 * C), np.float32, 8.0), rnd(rng, (B * T, C), np.float32)
    scale = float(np.float32(1.0 / np.sqrt(hs)))
    ar = run_pair("flash", np.float32, qkv, dy, B, T, C, NH, scale)
    check(ar.get("y", (B * T, C)), attn_ref(qkv, B, T, C, NH, scale)[0], np.float32, 1e-4)
    check(ar.get("dqkv", qkv.shape), attn_bwd_ref(qkv, dy, B, T, C, NH, scale), np.float32, 1e-4)


def _program(B, T, C, NH, dtype, seed=0, threads=1):
    rng = np.random.default_rng(seed)
    qkv = rng.normal(size=(B, T, 3 * C)).astype(dtype)
    w = rng.normal(size=(B, T, C)).astype(dtype)
    prog = btjit.trace(lambda p: btjit.sum(btjit.causal_attention(p["qkv"], NH) * w), {"qkv": qkv}, dtype=dtype,
                       grad=True, threads=threads)     # one thread: no row split
    return prog, qkv.astype(np.float64), w


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("B,T,C,NH,want", [
    (2, 7, 32, 2, None), (2, 8, 32, 2, "kept"), (17, 7, 32, 2, None), (17, 8, 32, 2, "kept"),      # KEPT_MIN_T
    (3, 63, 8, 2, None), (3, 64, 8, 2, "flash"), (3, 64, 14, 2, "flash"), (3, 64, 16, 2, "kept"),  # KEPT_MIN_HS
    (2, 8, 16, 2, None), (2, 9, 16, 2, "kept"), (1, 8, 18, 2, "kept"), (1, 8, 64, 1, "kept"),     # KEPT_MIN_THS
    (2, 16, 32, 2, "kept"), (1, 192, 16, 2, "kept"), (1, 193, 16, 2, "flash")])                   # KEPT_MAX_RATIO
def test_lowering_rule_both_sides(dtype, B, T, C, NH, want):
    """Both sides of each threshold of attention.kind: the small-T kernels, the kept pair or the flash pair,
    the same values either way."""
    from btjit.graph.ops import TABLE
    prog, qkv, w = _program(B, T, C, NH, dtype)
    ops = {int(r[0]) for r in prog.tape}
    pairs = {k: {OPCODE[f"k_attn_fwd_{k}"], OPCODE[f"k_attn_bwd_{k}"]} for k in ("kept", "flash")}
    assert A.kind(T, C // NH) == want
    for k, p in pairs.items():
        assert (p <= ops) == (want == k) and (p <= ops or not ops & p)
    loss = prog.value_and_grad()
    y = TABLE["causal_attention"].ref([qkv], {"n_head": NH})[0]
    dq = TABLE["causal_attention_grad"].ref([qkv, None, None, w.astype(np.float64)], {"n_head": NH})[0]
    tol = 1e-10 if dtype == "float64" else 2e-4
    assert loss == pytest.approx(float(np.sum(y * w)), rel=tol, abs=tol)
    np.testing.assert_allclose(prog.grads["qkv"], dq, rtol=tol, atol=tol)


@pytest.mark.parametrize("B,kernels", [(64, ("k_attn_bl_move", "k_attn_fwd_lanes", "k_attn_bwd_lanes")),
                                       (1, ("k_attn_fwd_pairs", "k_attn_bwd_pairs"))])
def test_e6_shapes_keep_their_kernels(B, kernels):
    """The paper's E6 attention (T 8, hs 4) at batch 64 and 1 runs the generated kernels (at 64 with the bl
    layout rows around them)."""
    from btjit.kernels.library import LIBRARY
    prog, _, _ = _program(B, 8, 24, 6, "float32")
    names = {LIBRARY.entry_of(int(r[0]))[0] for r in prog.tape}
    assert {n for n in names if "attn" in n} == set(kernels)


@pytest.mark.parametrize("block_size", [64, 130])
@pytest.mark.parametrize("kind", ["kept", "flash"])
def test_gpt_kernels_match_small_t_kernels(monkeypatch, block_size, kind):
    """A whole GPT (2 layers, width 16, 2 heads) in float64: loss and every gradient with the kept or the flash
    kernels equal those of the kernels below both thresholds."""
    from btjit.models import gpt
    cfg = gpt.GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=16, block_size=block_size)
    params = {k: v.astype(np.float64) for k, v in gpt.init_params(cfg, 0).items()}
    rng = np.random.default_rng(1)
    x = rng.integers(0, 11, (2, block_size)).astype(np.int32)
    y = rng.integers(0, 11, (2, block_size)).astype(np.int32)
    progs, kept_min, flash_min = [], A.KEPT_MIN_T, A.FLASH_MIN_T
    for kept_t, flash_t in ((kept_min, flash_min) if kind == "kept" else (10 ** 9, flash_min), (10 ** 9, 10 ** 9)):
        monkeypatch.setattr(A, "KEPT_MIN_T", kept_t)
        monkeypatch.setattr(A, "FLASH_MIN_T", flash_t)
        progs.append(btjit.trace(gpt.loss_fn(cfg), params, x, y, dtype="float64", grad=True, threads=1))
    fast, ref = progs
    assert OPCODE[f"k_attn_fwd_{kind}"] in {int(r[0]) for r in fast.tape}
    assert not {OPCODE["k_attn_fwd_kept"], OPCODE["k_attn_fwd_flash"]} & {int(r[0]) for r in ref.tape}
    assert fast.value_and_grad(x, y) == pytest.approx(ref.value_and_grad(x, y), rel=1e-12)
    for k in params:
        np.testing.assert_allclose(fast.grads[k], ref.grads[k], rtol=1e-9, atol=1e-13, err_msg=k)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("B", [1, 2, 5])
def test_two_thread_kept_kernels_match_the_serial_ones(dtype, B):
    """With 2 threads (no replicas) the kept pair's rows are split over blocks of sequences (one block when B is
    1): the same values and gradients as on one thread, bit for bit."""
    from btjit.kernels.library import LIBRARY
    from btjit.testing import split_kernels
    progs = []
    for threads in (1, 2):
        progs.append(_program(B, 24, 32, 2, dtype, threads=threads))
    (serial, _, _), (par, _, _) = progs
    names = {LIBRARY.entry_of(int(r[0]))[0] for r in par.tape}
    kept = {"k_attn_fwd_kept", "k_attn_bwd_kept"}
    assert {n for n in names if "attn" in n} == kept
    assert {n for n in split_kernels(par) if "attn" in n} == (kept if B > 1 else set())
    assert par.value_and_grad() == serial.value_and_grad()
    np.testing.assert_array_equal(par.grads["qkv"], serial.grads["qkv"])
