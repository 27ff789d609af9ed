# Tests for btjit/kernels/{attn_loops,attn_lanes}.py: the causal attention kernels (per-sequence loops, the
# sequence-vectorized bl pair, the generated lanes and pairs kernels with their layout moves, and when the
# generated ones are used) on float32 and float64 arenas against float64 numpy references, backward also
# against central finite differences; optionally attention and GELU against PyTorch.
# Each test also checks that a kernel writes nothing outside its declared outputs.
import functools

import numpy as np
import pytest

from btjit.kernels import attn_lanes, attn_loops as KA
from kernel_harness import DTS, Arena, attn_bwd_ref, attn_ref, check, fd_grad, gelu_ref, rnd, row


def run_attn(dt, qkv, dy, B, T, C, NH, scale):
    ar = Arena(dt)
    osc = ar.put("scale", np.array([scale]))
    oq, ody = ar.put("qkv", qkv), ar.put("dy", dy)
    oy, oP, odq = ar.put("y", size=B * T * C), ar.put("P", size=B * NH * T * T), ar.put("dqkv", size=B * T * 3 * C)
    a = ar.build()
    ia = np.zeros(1, np.int32)
    KA.k_attn_fwd(a, ia, row(oq, oy, oP, B, T, C, NH, osc))
    KA.k_attn_bwd(a, ia, row(oq, oP, ody, odq, B, T, C, NH, osc))
    ar.only_wrote("y", "P", "dqkv")
    return ar


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("B,T,C,NH", [(1, 8, 24, 6), (4, 8, 24, 6), (2, 5, 6, 3), (3, 1, 4, 1), (2, 7, 10, 1)])
def test_attention(dt, B, T, C, NH):
    rng = np.random.default_rng(B * 1000 + T * 10 + C)
    qkv, dy = rnd(rng, (B * T, 3 * C), dt, 1.5), rnd(rng, (B * T, C), dt)
    scale = float(dt(1.0 / np.sqrt(C // NH)))
    ar = run_attn(dt, qkv, dy, B, T, C, NH, scale)
    y, P = attn_ref(qkv, B, T, C, NH, scale)
    check(ar.get("y", y.shape), y, dt)
    Pk = ar.get("P", P.shape)
    check(Pk, P, dt)
    assert np.all(Pk[np.triu(np.ones((T, T), bool), 1)[None].repeat(B * NH, 0).reshape(-1, T)] == 0)
    check(ar.get("dqkv", qkv.shape), attn_bwd_ref(qkv, dy, B, T, C, NH, scale), dt)


def check_bl_pair(dt, B, T, C, NH, nb, fwd, bwd, seed, wrote_P=True):
    """Run a forward/backward pair with the bl rows and layouts (nb lane blocks; the pairs kernels take the
    same rows without nb) against the references; they may write only y, P (unless not wrote_P), W (forward)
    and dqkv, S (backward)."""
    rng = np.random.default_rng(seed)
    qkv, dy = rnd(rng, (B * T, 3 * C), dt, 1.5), rnd(rng, (B * T, C), dt)
    scale = float(dt(1.0 / np.sqrt(C // NH)))
    ar = Arena(dt)
    osc = ar.put("scale", np.array([scale]))
    oq, ody = ar.put("qkv", qkv), ar.put("dy", dy)
    oy, oP = ar.put("y", size=B * T * C), ar.put("P", size=B * NH * T * T)
    fd = "f32" if dt == np.float32 else "f64"
    oW, odq = ar.put("W", size=KA.attn_scratch_size(B, T, C, NH, fd)), ar.put("dqkv", size=B * T * 3 * C)
    oS = ar.put("S", size=KA.attn_bwd_scratch_size(B, T, C, NH, fd))
    a = ar.build()
    ia = np.zeros(1, np.int32)
    fwd(a, ia, row(oq, oy, oP, oW, B, T, C, NH, osc, nb))
    P = ("P",) if wrote_P else ()
    ar.only_wrote("y", *P, "W")
    bwd(a, ia, row(oP, oW, ody, odq, oS, B, T, C, NH, osc, nb))
    ar.only_wrote("y", *P, "W", "dqkv", "S")
    check(ar.get("y", (B * T, C)), attn_ref(qkv, B, T, C, NH, scale)[0], dt)
    check(ar.get("dqkv", qkv.shape), attn_bwd_ref(qkv, dy, B, T, C, NH, scale), dt)


@functools.lru_cache(maxsize=None)
def _generated(name, T, hs):
    """The generated entry `name` for (T, hs) as the library loads it (its object code, called through its
    address), as f(a, ia, r)."""
    import ctypes
    from btjit.kernels.library import LIBRARY
    LIBRARY.load(name, "f32", (T, hs))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = ctypes.CFUNCTYPE(ctypes.c_int32, p, i64, p, i64, p)(LIBRARY.loaded[(name, "f32", (T, hs))].address)
    return lambda a, ia, r: fn(a.ctypes.data, a.size, ia.ctypes.data, ia.size, r.ctypes.data)


def _lanes_pair(T, hs):
    """The rows the lowering gives a lanes attention (k_attn_bl_move in, the generated entry, k_attn_bl_move out) as one
    forward / backward pair taking the bl pair's rows."""
    gf, gb = _generated("k_attn_fwd_lanes", T, hs), _generated("k_attn_bwd_lanes", T, hs)

    def fwd(a, ia, r):
        oq, oy, oP, oW, B, T_, C, NH, osc, nb = r[1:11]
        KA.k_attn_bl_move(a, ia, row(oq, oW, B, 3 * T_ * C, nb, 0))
        gf(a, ia, row(oW, oP, oy, B, T_, C, NH, osc, nb))

    def bwd(a, ia, r):
        oP, oW, ody, odq, oS, B, T_, C, NH, osc, nb = r[1:12]
        oD = oS + B * T_ * C
        KA.k_attn_bl_move(a, ia, row(ody, oS, B, T_ * C, nb, 0))
        gb(a, ia, row(oW, oP, oS, oD, B, T_, C, NH, osc, nb))
        KA.k_attn_bl_move(a, ia, row(oD, odq, B, 3 * T_ * C, nb, 1))
    return fwd, bwd


def _pairs_pair(T, hs):
    """The generated pairs entries as a forward / backward pair taking the bl pair's rows."""
    gf, gb = _generated("k_attn_fwd_pairs", T, hs), _generated("k_attn_bwd_pairs", T, hs)

    def fwd(a, ia, r):
        oq, oy, oP, oW, B, T_, C, NH, osc = r[1:10]
        gf(a, ia, row(oq, oy, oW, B, T_, C, NH, osc))

    def bwd(a, ia, r):
        oP, oW, ody, odq, oS, B, T_, C, NH, osc = r[1:11]
        gb(a, ia, row(ody, odq, oW, oS, B, T_, C, NH, osc))
    return fwd, bwd


@pytest.mark.parametrize("dt", DTS)
@pytest.mark.parametrize("B,T,C,NH,nb", [(16, 8, 24, 6, 1), (17, 8, 24, 6, 3), (20, 5, 6, 3, 2), (16, 1, 4, 1, 4)])
def test_attention_sequence_vectorized_pair(dt, B, T, C, NH, nb):
    """k_attn_fwd_bl / k_attn_bwd_bl, nb lane blocks (the last one shorter when nb does not divide B)."""
    check_bl_pair(dt, B, T, C, NH, nb, KA.k_attn_fwd_bl, KA.k_attn_bwd_bl, B * 100 + nb)


@pytest.mark.parametrize("B,T,C,NH,nb", [(16, 8, 24, 6, 1), (67, 8, 24, 6, 2), (64, 8, 24, 6, 2), (20, 5, 6, 3, 1),
                                         (40, 3, 4, 2, 2), (33, 1, 4, 1, 1), (16, 2, 40, 4, 1), (48, 8, 64, 8, 1)])
def test_attention_generated_lanes(B, T, C, NH, nb):
    """The vector kernels generated for (T, hs) (kernels/attn_lanes.py), as the library loads them, with the
    layout rows around them, in the bl pair's layouts: blocks of 16 lanes exactly, of 34/33 (the last chunk
    overlapping the one before), and of 20 and 33 (one overlap each)."""
    from btjit.kernels import attn_lanes
    assert attn_lanes.eligible(T, C // NH, B, nb, "f32")
    fwd, bwd = _lanes_pair(T, C // NH)
    check_bl_pair(np.float32, B, T, C, NH, nb, fwd, bwd, B * 100 + T)


@pytest.mark.parametrize("B,T,C,NH", [(1, 8, 24, 6), (2, 8, 24, 6), (15, 8, 24, 6), (1, 8, 32, 8), (3, 5, 6, 3),
                                     (1, 1, 4, 1), (5, 3, 8, 2), (4, 8, 24, 6), (1, 4, 9, 3), (1, 3, 20, 2),
                                     (1, 2, 5, 5), (1, 3, 16, 2), (1, 2, 10, 5), (1, 2, 15, 3), (1, 4, 56, 7)])
def test_attention_generated_pairs(B, T, C, NH):
    """The small-batch generated kernels (lanes over (sequence, head) pairs, 8 wide): padded lanes (B*NH < 8),
    exactly 8, several chunks with the last overlapping (12, 90), T = 1, head sizes 1-10; one sequence of
    <= 8 heads of <= 8 moved between the layouts by vector shuffles, the rest by scalar moves. They leave P
    alone."""
    assert attn_lanes.pairs_eligible(T, C // NH, "f32") and B < KA.BL_MIN_B
    fwd, bwd = _pairs_pair(T, C // NH)
    check_bl_pair(np.float32, B, T, C, NH, 1, fwd, bwd, B * 100 + T, wrote_P=False)


def test_attention_generated_lanes_eligibility():
    """Used for float32 when every lane block holds >= 16 sequences and the body is bounded; otherwise the
    loop kernels run."""
    assert attn_lanes.eligible(8, 4, 64, 1, "f32") and attn_lanes.eligible(8, 4, 32, 2, "f32")
    assert not attn_lanes.eligible(8, 4, 64, 1, "f64")
    assert not attn_lanes.eligible(8, 4, 31, 2, "f32")        # blocks of 16 and 15
    assert not attn_lanes.eligible(8, 4, 17, 3, "f32")
    assert not attn_lanes.eligible(64, 4, 64, 1, "f32")       # 2080 score terms
    assert attn_lanes.eligible(8, 8, 16, 1, "f32") and attn_lanes.pairs_eligible(8, 8, "f32")   # 1296 <= 1400
    assert not attn_lanes.pairs_eligible(16, 2, "f32")        # 136 scores x 24 operations
    assert not attn_lanes.pairs_eligible(4, 48, "f32")        # T * hs > 64


def test_attention_bwd_finite_diff():
    rng = np.random.default_rng(5)
    B, T, C, NH = 2, 4, 6, 2
    qkv, dy = rnd(rng, (B * T, 3 * C), np.float64), rnd(rng, (B * T, C), np.float64)
    scale = 1.0 / np.sqrt(C // NH)
    ar = run_attn(np.float64, qkv, dy, B, T, C, NH, scale)
    fd = fd_grad(lambda v: (attn_ref(v, B, T, C, NH, scale)[0] * dy).sum(), qkv)
    check(ar.get("dqkv", qkv.shape), fd, np.float64, 1e-7)
    check(attn_bwd_ref(qkv, dy, B, T, C, NH, scale), fd, np.float64, 1e-7)


# ---------------------------------------------------------------- optional extra reference
def test_against_torch_optional():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    B, T, C, NH = 2, 8, 24, 6
    qkv = rnd(rng, (B * T, 3 * C), np.float64)
    ar = run_attn(np.float64, qkv, np.zeros((B * T, C)), B, T, C, NH, 1.0 / np.sqrt(C // NH))
    x = torch.tensor(qkv).view(B, T, 3, NH, C // NH).permute(2, 0, 3, 1, 4)
    yt = torch.nn.functional.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=True)
    check(ar.get("y", (B * T, C)), yt.transpose(1, 2).reshape(B * T, C).numpy(), np.float64)
    xs = rnd(rng, 50, np.float64, 3.0)
    check(gelu_ref(xs), torch.nn.functional.gelu(torch.tensor(xs), approximate="tanh").numpy(), np.float64)
