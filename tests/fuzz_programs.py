"""The fuzzer's random programs (test_fuzz.py): the op builders for network ops (layer_norm, cross_entropy,
causal attention small and at the kept kernels' sizes), broadcast_to, long elementwise chains (one fused row)
and take with an index computed from integers (roll, slice, assignment, stack, transpose); the table of all
op builders; and `programs`, the hypothesis strategy drawing a program, its numpy replay, params and batch."""
from __future__ import annotations

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st

import btjit
from fuzz_builder import BT, GAP, NP, Builder
from fuzz_ops import (op_binary, op_concat, op_getitem, op_matmul, op_reduce, op_reshape, op_softmax, op_split,
                      op_take, op_transpose, op_unary, op_where)


def op_layer_norm(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1 and v.shape[-1] >= 2)
    if k is None:
        return None
    C = bld.vals[k].shape[-1]
    kw, kb = bld.new_param((C,)), bld.new_param((C,))
    eps = bld.choice([1e-5, 1e-3, 0.1])
    return bld.add(lambda xp, env, P, B: xp.layer_norm(env[k], env[kw], env[kb], eps=eps),
                   f"layer_norm(v{k}, eps={eps})")


def op_cross_entropy(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1 and v.shape[-1] >= 2)
    if k is None:
        return None
    x = bld.vals[k]
    idx = bld.int_index(x.shape[:-1], x.shape[-1], allow_negative=False)
    return bld.add(lambda xp, env, P, B: xp.cross_entropy(env[k], idx(B)), f"cross_entropy(v{k}, targets)")


def op_attention(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    T = bld.choice([d for d in range(1, min(x.size, 5) + 1) if x.size % d == 0])
    nh, hs = bld.i(1, 2), bld.i(1, 2)
    kw = bld.new_param((x.size // T, 3 * nh * hs))
    return bld.add(lambda xp, env, P, B: xp.causal_attention(xp.reshape(env[k], (1, T, -1)) @ env[kw], nh),
                   f"causal_attention(v{k} as (1,{T},.) @ v{kw}, n_head={nh})")


def op_attention_wide(bld: Builder):
    """Attention at the sizes of the kept kernels (T 8-16, head size 6-10): a (1, T, 3 C) param scaled by
    tanh of a value's sum (bounded, so the scores stay where finite differences are accurate; params of at
    most 480 floats, so the element-by-element finite differences stay cheap)."""
    k = bld.pick()
    T, nh, hs = bld.i(8, 16), 1, bld.i(6, 10)
    kw = bld.new_param((1, T, 3 * nh * hs))
    return bld.add(lambda xp, env, P, B: xp.causal_attention(xp.tanh(xp.sum(env[k])) * env[kw], nh),
                   f"causal_attention(tanh(sum(v{k})) * v{kw}, n_head={nh})")


def op_broadcast_to(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    shape = tuple(d if d != 1 else bld.i(1, 3) for d in x.shape)
    if bld.b() and len(shape) < 4:
        shape = (bld.i(1, 3),) + shape
    return bld.add(lambda xp, env, P, B: xp.broadcast_to(env[k], shape), f"broadcast_to(v{k}, {shape})")


CHAIN_STEPS = ("tanh", "sigmoid", "scale", "shift", "square", "where", "max")


def _chain(xp, v, steps):
    for s, c in steps:
        v = {"tanh": lambda: xp.tanh(v), "sigmoid": lambda: xp.sigmoid(v), "scale": lambda: v * c,
             "shift": lambda: v + c, "square": lambda: v * v * 0.5, "where": lambda: xp.where(v > c, v, v * 0.25),
             "max": lambda: xp.maximum(v, c)}[s]()
    return v


def op_chain(bld: Builder):
    """A long elementwise chain on one value (one fused row forward, one backward); the kinks of where and
    maximum are kept GAP away from every intermediate value."""
    k = bld.pick()
    v, steps = bld.vals[k], []
    for _ in range(bld.i(3, 8)):
        s, c = bld.choice(CHAIN_STEPS), float(np.round(bld.rng.uniform(-1.5, 1.5), 3))
        if s in ("where", "max") and np.abs(v - c).min() < GAP:
            s = "tanh"
        steps.append((s, c))
        v = _chain(NP, v, steps[-1:])
    return bld.add(lambda xp, env, P, B: _chain(xp, env[k], steps), f"chain(v{k}, {steps})", kind="chain")


def _int_ix(xp, i, how, hi):
    if how == "roll":
        return xp.roll(i, 1, 1)
    if how == "slice":
        return i[:, 1:]
    if how == "assign":                            # makemore's MLP context: rolled, a blank token at column 0
        j = xp.roll(i, 1, 1)
        j[:, 0] = hi - 1
        return j
    if how == "stack":
        return xp.stack([i[0], i[-1]], 1)
    return i.T


def op_int_index(bld: Builder):
    """take with an index computed inside the program from an integer input or constant."""
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None or bld.i(0, 2) == 0:
        k = bld.new_param((bld.i(1, 6),) + bld.shape(1))
    rows = bld.vals[k].shape[0]
    idx = bld.int_index((bld.i(1, 3), bld.i(2, 4)), rows, allow_negative=False)
    how = bld.choice(["roll", "slice", "assign", "stack", "transpose"])
    return bld.add(lambda xp, env, P, B: xp.take(env[k], _int_ix(xp, idx(B), how, rows)),
                   f"take(v{k}, {how}(int index))", kind=f"int {how}")


OPS = [op_unary, op_unary, op_binary, op_binary, op_reduce, op_reshape, op_transpose, op_getitem, op_concat,
       op_split, op_matmul, op_softmax, op_where, op_take, op_layer_norm, op_cross_entropy, op_attention,
       op_attention_wide, op_broadcast_to, op_chain, op_int_index]


@st.composite
def programs(draw, max_ops=20):
    bld = Builder(draw)
    for _ in range(draw(st.integers(1, 3), label="initial params")):
        bld.new_param(bld.shape())
    for _ in range(draw(st.integers(1, max_ops), label="ops")):
        OPS[draw(st.integers(0, len(OPS) - 1), label="op")](bld)
    # the loss: a weighted sum over a subset of the values (always the last one), so most values fan out
    n = len(bld.vals)
    chosen = sorted({n - 1} | {k for k in range(n) if draw(st.booleans())})
    weights = {k: bld.rng.normal(size=bld.vals[k].shape) for k in chosen}
    expose = draw(st.booleans(), label="expose intermediates as outputs")
    steps = list(bld.steps)

    def replay(xp, P, batch):
        env = []
        for f in steps:
            out = f(xp, env, P, batch)
            env.extend(out if isinstance(out, list) else [out])
        loss = 0.0
        for k in chosen:
            loss = loss + xp.sum(env[k] * weights[k])
        return loss, env

    def fn(p, *batch):
        loss, env = replay(BT, p, list(batch))
        if not isinstance(loss, btjit.graph.trace.Tracer):   # only constants reached the loss
            loss = btjit.sum(btjit.graph.trace.lift(float(loss)))
        if expose:
            return loss, {f"v{k}": v for k, v in enumerate(env) if isinstance(v, btjit.graph.trace.Tracer)}
        return loss

    event(f"{len(bld.steps) // 5 * 5}-{len(bld.steps) // 5 * 5 + 4} steps")
    note("\n".join(bld.log) + f"\nloss = sum over v{chosen} of weighted sums; expose={expose}")
    return fn, replay, bld.params, bld.batch, expose
