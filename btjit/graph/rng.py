"""Randomness inside the step, the graph side: the public functions that draw numbers (btjit.rand_like,
randn_like, dropout, and the attention's dropout on the probabilities: causal_attention,
scaled_dot_product_attention), and what a Program sets up for them
(the key block's seed and replica words, the row that counts steps where the update does not).

Every number comes from the `rand` op (graph/ops/random.py) or the kept attention kernels, and is a pure
function of (the seed, the step count, the site -- the random op's number in trace order -- and the
element's index): btjit/kernels/rng.py. The ops read the graph's key block, an i32 value the memory plan
puts at the step counter (graph/memory.py), so nothing is saved but the step. In eval mode (btjit.is_training()
False) dropout emits nothing.
"""
from __future__ import annotations

import numpy as np

from btjit.graph import functional as F, trace as T
from btjit.graph.numpy_fns import repeat
from btjit.kernels import rng as K
from btjit.kernels.attention import KEPT_MIN_HS, KEPT_MIN_T


# ----------------------------------------------------------------------------- public tensor functions
def rand_like(x):
    """Uniform numbers in [0, 1) of x's shape, new every step (a pure function of the program's seed, the
    step count, this call's place in the function and the element's position)."""
    return _random(x, K.U_UNIFORM)


def randn_like(x):
    """Standard normal numbers of x's shape, new every step (as rand_like)."""
    return _random(x, K.U_NORMAL)


def rand(*size, dtype=None, device=None, requires_grad=False):
    """torch.rand: uniform numbers in [0, 1) of shape `size` (rand(B, 1, 1, 1) or rand((B, 1, 1, 1))), as rand_like;
    dtype (a float one) and device are accepted as torch's and the program's dtype is used."""
    return _random(_size(size, dtype, "rand"), K.U_UNIFORM)


def randn(*size, dtype=None, device=None, requires_grad=False):
    """torch.randn: standard normal numbers of shape `size`, as randn_like."""
    return _random(_size(size, dtype, "randn"), K.U_NORMAL)


def bernoulli(input, p=None):  # noqa: A002 -- torch's name
    """torch.bernoulli: 1 with probability `input` (or p, a number, of input's shape), else 0; no gradient."""
    x = T.lift(input)
    return _random(x.shape, K.U_UNIFORM) < (x if p is None else float(p))


def dropout(x, p=0.5, training=None, inplace=False):
    """torch's dropout: while training, zero each element with probability p and scale the others by
    1 / (1 - p); the identity in eval mode (or training=False) and when p == 0 (nothing is emitted). The
    backward uses the same mask, drawn again from the generator's counter."""
    return _dropout(x, _probability(p, "dropout", one=True), training)


def dropout2d(x, p=0.5, training=None, inplace=False):
    """torch's dropout2d / dropout1d: while training, zero whole channels -- x[n, c] of (N, C, ...) -- with
    probability p and scale the others by 1 / (1 - p); the identity in eval mode."""
    x = T.lift(x)
    if x.ndim < 3:
        raise T.TraceError(f"dropout2d: needs (N, C, ...) input, got {x.shape} — {T.user_src()}")
    return _dropout(x, _probability(p, "dropout2d", one=True), training, channels=True)


def causal_attention(qkv, n_head, dropout=0.0):
    """Fused causal self-attention: qkv (B, T, 3C) holding q | k | v -> (B, T, C), n_head heads of C/n_head;
    dropout on the probabilities while training, as torch's scaled_dot_product_attention(dropout_p=).

    The mask is drawn inside the kept kernels where they apply (attn_dropout_in_kernel), else the attention
    is traced as its ops written out (the same mask)."""
    qkv, p, nh = T.lift(qkv), _probability(dropout, "causal_attention"), int(n_head)
    if p == 0.0 or not T.current_graph().training:
        return F.causal_attention(qkv, nh)
    if attn_dropout_in_kernel(qkv.shape, nh):
        return T.emit("causal_attention", (qkv, _key()), n_head=nh, dropout=p, site=_site())[0]
    B, T_, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    q, k, v = (T.transpose(T.reshape(t, (B, T_, nh, C // nh)), (0, 2, 1, 3)) for t in T.split(qkv, 3, axis=2))
    return T.reshape(T.transpose(_attention_ops(q, k, v, p, causal=True), (0, 2, 1, 3)), (B, T_, C))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention: softmax(q k^T * scale [+ mask]) v over the last two axes
    of q (..., L, E), k (..., S, E), v (..., S, Ev); scale 1 / sqrt(E) by default; is_causal: query i sees keys
    j <= i; attn_mask: a boolean array (True = attend) or a float one added to the scores; dropout_p on the
    probabilities while training (none in eval mode). Causal self-attention of (B, H, T, hs) q, k, v, as nanoGPT
    calls it, runs the fused attention kernels (btjit.causal_attention on q | k | v). enable_gqa: k and v may have
    fewer heads (axis -3) than q, a divisor of them: each is repeated (repeat_interleave) to q's, as torch's."""
    q, k, v = T.lift(query), T.lift(key), T.lift(value)
    p = _probability(dropout_p, "scaled_dot_product_attention")
    if enable_gqa and q.ndim >= 3 and k.ndim == q.ndim and k.shape[-3] != q.shape[-3]:
        if q.shape[-3] % k.shape[-3] or v.shape[-3] != k.shape[-3]:
            raise T.TraceError(f"scaled_dot_product_attention: enable_gqa needs k's and v's heads (axis -3) to divide "
                               f"q's, got {q.shape}, {k.shape}, {v.shape} — {T.user_src()}")
        k, v = (repeat(t, q.shape[-3] // k.shape[-3], t.ndim - 3) for t in (k, v))
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim or k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise T.TraceError(f"scaled_dot_product_attention: q (..., L, E), k (..., S, E), v (..., S, Ev), got "
                           f"{q.shape}, {k.shape}, {v.shape} — {T.user_src()}")
    try:
        np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        gqa = "" if enable_gqa else " (k and v with fewer heads than q: enable_gqa=True)"
        raise T.TraceError(f"scaled_dot_product_attention: the leading axes of q {q.shape}, k {k.shape} and v "
                           f"{v.shape} do not broadcast{gqa} — {T.user_src()}") from None
    if is_causal and attn_mask is None and scale is None and q.ndim == 4 and q.shape == k.shape == v.shape:
        B, H, T_, hs = q.shape
        qkv = T.concatenate([T.reshape(T.transpose(t, (0, 2, 1, 3)), (B, T_, H * hs)) for t in (q, k, v)], 2)
        return T.transpose(T.reshape(causal_attention(qkv, H, p), (B, T_, H, hs)), (0, 2, 1, 3))
    return _attention_ops(q, k, v, p, is_causal, attn_mask, scale)


def _attention_ops(q, k, v, p, causal, mask=None, scale=None):
    """Attention written out as the op table's ops: softmax(q k^T * scale [masked]) with dropout p, times v."""
    L, S = q.shape[-2], k.shape[-2]
    att = T.matmul(q, T.swapaxes(k, -1, -2)) * float(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        att = T.where(np.tril(np.ones((L, S), bool)), att, -np.inf)
    if mask is not None:
        m = mask if isinstance(mask, T.Tracer) else np.asarray(mask)
        att = T.where(m, att, -np.inf) if isinstance(m, np.ndarray) and m.dtype == bool else att + m
    return T.matmul(_dropout(F.softmax(att), p), v)


def attn_dropout_in_kernel(qkv_shape, nh) -> bool:
    """Whether the kept attention kernels (the only ones that draw a dropout mask) take this shape: T and the
    head size >= 8."""
    return qkv_shape[1] >= KEPT_MIN_T and qkv_shape[2] // 3 // nh >= KEPT_MIN_HS


def _probability(p, op, one=False):
    """p as a float in [0, 1) (one: [0, 1], torch's dropout of p = 1 zeroes everything); else an error."""
    if isinstance(p, (T.Tracer, bool)) or not isinstance(p, (int, float, np.number)) or \
            not (0.0 <= float(p) <= 1.0 if one else 0.0 <= float(p) < 1.0):
        raise T.TraceError(f"{op}: the dropout probability must be a number in [0, {'1]' if one else '1)'}, got "
                           f"{p!r} — {T.user_src()}")
    return float(p)


def _dropout(x, p, training=None, channels=False):
    """x with its elements (channels: its (N, C) channels, one number each) kept with probability 1 - p and
    scaled by 1 / (1 - p), while training."""
    x = T.lift(x)
    if p == 0.0 or not (T.current_graph().training if training is None else training):
        return x
    if p == 1.0:                # torch's: every element dropped
        return x * 0.0
    like = x[(slice(None), slice(None)) + (slice(0, 1),) * (x.ndim - 2)] if channels else x
    return x * ((_random(like, K.U_UNIFORM) >= p) * (1.0 / (1.0 - p)))


def _key() -> T.Tracer:
    """The graph's key block: an i32 value the memory plan puts at the step counter."""
    g = T.current_graph()
    if g.rng_key is None:
        g.rng_key = g.new_var((K.KEY_SIZE,), "i32")
    return T.Tracer(g.rng_key, g)


def _site() -> int:
    g = T.current_graph()
    g.rng_sites += 1
    return g.rng_sites - 1


def _size(size, dtype, op):
    size = size[0] if len(size) == 1 and not isinstance(size[0], (int, np.integer)) else size
    if dtype is not None and not any(f in str(dtype) for f in ("float", "double")):
        raise T.TraceError(f"{op}: dtype must be a float one (the program's is used), got {dtype} — {T.user_src()}")
    if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in size):
        raise T.TraceError(f"{op}: the size must be ints, got {size!r} — {T.user_src()}")
    return tuple(int(n) for n in size)


def _random(x, kind):
    """Numbers of x's shape (x a traced value or a shape)."""
    shape = x if isinstance(x, tuple) else T.lift(x).shape
    return T.emit("rand", (_key(),), shape=shape, site=_site(), kind=kind)


# ----------------------------------------------------------------------------- the program's side
def set_key(IA, okey: int, seed: int) -> None:
    """Write the seed into every replica's key block (rows of IA) and each replica's index."""
    lo, hi = K.seed_words(seed)
    for r in range(IA.shape[0]):
        IA[r, okey + K.KEY_SEED], IA[r, okey + K.KEY_SEED + 1], IA[r, okey + K.KEY_REPLICA] = lo, hi, r


def step_rows(update_rows, L, plan, hyper) -> list:
    """[k_step_set] after the update (and its assigns): the key block's step count (`prog.step_count`, saved in
    checkpoints as opt/step) copied from the optimizer's step slot, so both count the same steps (a skipped
    step in neither) and the random numbers are new every step."""
    if not update_rows:
        return []
    return [L.row("k_step_set", ostep=plan.int_state, ofrom=hyper["step"])]
