"""The fuzzer's op builders for array ops (test_fuzz.py): unary and binary elementwise ops (kept in safe
domains and GAP away from kinks and ties), reductions with keepdims, reshapes, transposes, getitem with slices,
ints, None and Ellipsis, concatenate, split, matmul, softmax, where and take. Each appends zero or more steps to
a Builder (fuzz_builder.py); None = not applicable now."""
from __future__ import annotations

import numpy as np

import btjit
from fuzz_builder import BT, GAP, Builder, _broadcasts, _positive


def op_unary(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    name = bld.choice(["neg", "exp", "log", "sqrt", "tanh", "sigmoid", "gelu", "relu", "abs", "pow", "rpow",
                       "copy", "np.exp", "np.tanh", "np.sqrt", "np.log", "abs()"])
    if name in ("relu", "abs", "abs()") and np.abs(x).min() < GAP:
        return None
    if name in ("exp", "np.exp") and x.max() > 4:
        return None
    if name in ("log", "sqrt", "np.sqrt", "np.log"):
        pos = _positive(bld, k)
        fn = {"log": lambda xp, v: xp.log(v), "sqrt": lambda xp, v: xp.sqrt(v),
              "np.sqrt": lambda xp, v: np.sqrt(v), "np.log": lambda xp, v: np.log(v)}[name]
        return bld.add(lambda xp, env, P, B: fn(xp, pos(env)), f"{name}(positive(v{k}))", kind=name)
    if name == "pow":
        p = bld.choice([3.0, 2.0, 1.0, 0.5, -1.5, -1.0])
        if p in (0.5, -1.5):
            pos = _positive(bld, k)
            return bld.add(lambda xp, env, P, B: pos(env) ** p, f"positive(v{k}) ** {p}", kind="pow")
        if p < 0 and np.abs(x).min() < 0.3:
            return None
        return bld.add(lambda xp, env, P, B: env[k] ** p, f"v{k} ** {p}", kind="pow")
    if name == "rpow":                     # constant base ** traced exponent (pow2 with a constant)
        if x.max() > 4:
            return None
        base = bld.choice([2.0, 0.5, 3.0])
        return bld.add(lambda xp, env, P, B: base ** env[k], f"{base} ** v{k}", kind="rpow")
    fns = {"neg": lambda xp, v: -v, "exp": lambda xp, v: xp.exp(v), "tanh": lambda xp, v: xp.tanh(v),
           "sigmoid": lambda xp, v: xp.sigmoid(v), "gelu": lambda xp, v: xp.gelu(v, approximate="tanh"),
           "relu": lambda xp, v: xp.relu(v), "abs": lambda xp, v: xp.abs(v), "abs()": lambda xp, v: abs(v),
           "copy": lambda xp, v: (btjit.copy(v) if xp is BT else v.copy()),
           "np.exp": lambda xp, v: np.exp(v), "np.tanh": lambda xp, v: np.tanh(v)}
    fn = fns[name]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k]), f"{name}(v{k})", kind=name)


def op_binary(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    name = bld.choice(["add", "sub", "mul", "div", "maximum", "minimum", "pow2", "np.add", "np.multiply"])
    get, y = bld.operand(x.shape)
    swap = bld.b()
    if name == "div":                      # the denominator is kept away from zero
        den_val = x if swap else y
        if np.abs(den_val).min() < 0.3:
            return None
    if name in ("maximum", "minimum") and np.abs(np.subtract(x, y)).min() < GAP:
        return None
    if name == "pow2":                     # positive traced base ** operand
        if not (np.max(y) < 3 and np.min(y) > -3):
            return None
        pos = _positive(bld, k)
        return bld.add(lambda xp, env, P, B: pos(env) ** get(xp, env, P, B), f"positive(v{k}) ** operand", kind="pow2")
    ops = {"add": lambda xp, a, b: a + b, "sub": lambda xp, a, b: a - b, "mul": lambda xp, a, b: a * b,
           "div": lambda xp, a, b: a / b, "maximum": lambda xp, a, b: xp.maximum(a, b),
           "minimum": lambda xp, a, b: xp.minimum(a, b), "np.add": lambda xp, a, b: np.add(a, b),
           "np.multiply": lambda xp, a, b: np.multiply(a, b)}
    fn = ops[name]
    if swap:
        return bld.add(lambda xp, env, P, B: fn(xp, get(xp, env, P, B), env[k]), f"{name}(operand, v{k})", kind=name)
    return bld.add(lambda xp, env, P, B: fn(xp, env[k], get(xp, env, P, B)), f"{name}(v{k}, operand)", kind=name)


def _axes(bld, ndim):
    form = bld.i(0, 3)
    if form == 0 or ndim == 0:
        return None
    if form == 1:
        return bld.i(-ndim, ndim - 1)
    axes = sorted({bld.i(0, ndim - 1) for _ in range(bld.i(1, ndim))})
    return tuple(a - ndim if bld.b() else a for a in axes)


def op_reduce(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    name = bld.choice(["sum", "mean", "max", ".sum", ".mean", ".max", "np.sum", "np.mean", "np.max"])
    axis, keep = _axes(bld, x.ndim), bld.b()
    if name.endswith("max"):
        ax = tuple(range(x.ndim)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
        ax = tuple(a % x.ndim for a in ax) if x.ndim else ()
        moved = np.moveaxis(x, ax, tuple(range(x.ndim - len(ax), x.ndim))).reshape(-1, int(np.prod(
            [x.shape[a] for a in ax], dtype=int)))
        if moved.shape[1] >= 2:
            top = np.sort(moved, axis=1)
            if (top[:, -1] - top[:, -2]).min() < GAP:
                return None
    base = name.split(".")[-1]
    if name.startswith("np."):
        fn = lambda xp, v: getattr(np, base)(v, axis=axis, keepdims=keep)  # noqa: E731
    elif name.startswith("."):
        fn = lambda xp, v: getattr(v, base)(axis=axis, keepdims=keep)  # noqa: E731
    else:
        fn = lambda xp, v: getattr(xp, base)(v, axis=axis, keepdims=keep)  # noqa: E731
    return bld.add(lambda xp, env, P, B: fn(xp, env[k]), f"{name}(v{k}, axis={axis}, keepdims={keep})", kind=name)


def _factor(bld, n, max_rank=5):
    """A random factorization of n into at most max_rank dims (some 1s inserted)."""
    dims = []
    while n > 1 and len(dims) < max_rank - 1:
        d = bld.choice([d for d in range(2, n + 1) if n % d == 0])
        dims.append(d)
        n //= d
    dims.append(n)
    for _ in range(bld.i(0, 2)):
        if len(dims) < max_rank:
            dims.insert(bld.i(0, len(dims)), 1)
    return dims


def op_reshape(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    dims = _factor(bld, x.size)
    if int(np.prod(dims)) != x.size:
        return None
    if bld.b() and dims:
        dims[bld.i(0, len(dims) - 1)] = -1
    shape = tuple(dims)
    how = bld.i(0, 2)
    fn = [lambda xp, v: v.reshape(shape), lambda xp, v: xp.reshape(v, shape),
          lambda xp, v: v.reshape(*shape) if shape else v.reshape(())][how]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k]), f"reshape(v{k}, {shape})")


def op_transpose(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 2)
    if k is None:
        return None
    nd = bld.vals[k].ndim
    how = bld.i(0, 3)
    if how == 0:
        return bld.add(lambda xp, env, P, B: env[k].T, f"v{k}.T")
    if how == 1:
        a1, a2 = bld.i(-nd, nd - 1), bld.i(-nd, nd - 1)
        return bld.add(lambda xp, env, P, B: xp.swapaxes(env[k], a1, a2), f"swapaxes(v{k}, {a1}, {a2})")
    perm = tuple(int(p) for p in bld.rng.permutation(nd))
    if how == 2:
        return bld.add(lambda xp, env, P, B: env[k].transpose(perm), f"v{k}.transpose{perm}")
    return bld.add(lambda xp, env, P, B: np.transpose(env[k], perm), f"np.transpose(v{k}, {perm})")


def op_getitem(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    shape = bld.vals[k].shape
    idx = []
    for d in range(bld.i(1, len(shape))):
        n = shape[d]
        kind = bld.i(0, 3)
        if kind == 0:
            idx.append(slice(None))
        elif kind == 1:
            i = bld.i(-n, n - 1)
            idx.append(i)
        else:
            start = bld.i(-n, n - 1) if bld.b() else None
            stop = bld.i(-n, n) if bld.b() else None
            step = bld.i(1, 3) if bld.b() else None
            s = slice(start, stop, step)
            if len(range(*s.indices(n))) == 0:
                return None
            idx.append(s)
        if bld.i(0, 5) == 0:
            idx.append(None)
    if bld.i(0, 3) == 0:
        idx.insert(bld.i(0, len(idx)), Ellipsis)
    idx = tuple(idx)
    return bld.add(lambda xp, env, P, B: env[k][idx], f"v{k}[{idx}]")


def op_concat(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    x = bld.vals[k]
    ax = bld.i(0, x.ndim - 1)
    parts = [lambda xp, env, P, B: env[k]]
    for _ in range(bld.i(1, 2)):
        kind = bld.i(0, 2)
        if kind == 0:                   # fan-out: the same value again
            parts.append(lambda xp, env, P, B: env[k])
        else:
            s = list(x.shape)
            s[ax] = bld.i(1, 3)
            if kind == 1:
                kp = bld.new_param(tuple(s))
                parts.append(lambda xp, env, P, B, kp=kp: env[kp])
            else:
                c = bld.const(tuple(s))
                parts.append(lambda xp, env, P, B, c=c: c)
    order = [int(i) for i in bld.rng.permutation(len(parts))]
    neg = bld.b()
    axis = ax - x.ndim if neg else ax
    return bld.add(lambda xp, env, P, B: xp.concatenate([parts[i](xp, env, P, B) for i in order], axis=axis),
                   f"concatenate(v{k} & {len(parts) - 1} more, axis={axis})")


def op_split(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1 and max(v.shape) >= 2)
    if k is None:
        return None
    x = bld.vals[k]
    ax = bld.choice([a for a in range(x.ndim) if x.shape[a] >= 2])
    n = x.shape[ax]
    if bld.b():
        secs = bld.choice([d for d in range(1, n + 1) if n % d == 0])
    else:
        secs = sorted({bld.i(1, n - 1) for _ in range(bld.i(1, 2))})
    return bld.add(lambda xp, env, P, B: list(xp.split(env[k], secs, axis=ax)), f"split(v{k}, {secs}, axis={ax})")


def op_matmul(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    a = bld.vals[k]
    K = a.shape[-1]
    form = bld.i(0, 4)
    if form == 0:
        bshape = (K,)
    elif form in (1, 2):
        bshape = (K, bld.i(1, 4))
    else:
        bshape = tuple(bld.broadcast_partner(a.shape[:-2]) if a.ndim > 2 else (bld.i(1, 2),)[:bld.i(0, 1)]) + \
            (K, bld.i(1, 3))
    kb = bld.pick(lambda v: v.shape == bshape)
    if kb is None or bld.b():
        kb = bld.new_param(bshape)
    swap = form == 2 and a.ndim >= 2           # (a @ b)^T computed as b^T @ a^T: transposed operands
    if swap:
        return bld.add(lambda xp, env, P, B: xp.swapaxes(env[kb], -1, -2) @ xp.swapaxes(env[k], -1, -2),
                       f"v{kb}^T @ v{k}^T")
    how = bld.i(0, 2)
    fn = [lambda xp, p, q: p @ q, lambda xp, p, q: xp.matmul(p, q), lambda xp, p, q: np.matmul(p, q)][how]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k], env[kb]), f"v{k} @ v{kb}")


def op_softmax(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None:
        return None
    name = bld.choice(["softmax", "log_softmax"])
    axis = bld.choice([-1, bld.vals[k].ndim - 1])
    return bld.add(lambda xp, env, P, B: getattr(xp, name)(env[k], axis=axis), f"{name}(v{k})")


def op_where(bld: Builder):
    k = bld.pick()
    x = bld.vals[k]
    get, y = bld.operand(x.shape)
    if bld.b():                                  # a constant numpy mask
        mshape = bld.broadcast_partner(x.shape)
        mask = bld.rng.random(mshape) < 0.5
        cond = lambda xp, env, P, B: mask  # noqa: E731
        text = f"mask{mshape}"
    else:                                        # a traced comparison c > t (a float 0/1 value when traced)
        kc = bld.pick(lambda v: _broadcasts(v.shape, x.shape))
        c = bld.vals[kc]
        t = float(np.round(bld.rng.normal(0, 0.5), 2))
        if np.abs(c - t).min() < GAP:
            return None
        op = bld.choice([">", "<", ">=", "<="])
        f = {">": lambda a: a > t, "<": lambda a: a < t, ">=": lambda a: a >= t, "<=": lambda a: a <= t}[op]
        cond = lambda xp, env, P, B: f(env[kc])  # noqa: E731
        text = f"v{kc} {op} {t}"
    if bld.b():
        return bld.add(lambda xp, env, P, B: xp.where(cond(xp, env, P, B), env[k], get(xp, env, P, B)),
                       f"where({text}, v{k}, operand)")
    return bld.add(lambda xp, env, P, B: xp.where(cond(xp, env, P, B), get(xp, env, P, B), env[k]),
                   f"where({text}, operand, v{k})")


def op_take(bld: Builder):
    k = bld.pick(lambda v: v.ndim >= 1)
    if k is None or bld.i(0, 2) == 0:
        k = bld.new_param((bld.i(1, 6),) + bld.shape(1))
    rows = bld.vals[k].shape[0]
    ishape = bld.shape(2)
    how = bld.i(0, 4)
    idx = bld.int_index(ishape, rows, allow_negative=how != 3)   # negative ids wrap only in a direct take
    if how == 3 and ishape:                   # an int array reshaped (a view of the input) before the gather
        flat = lambda B: idx(B).reshape(-1)      # noqa: E731
        fn = lambda xp, t, i: xp.take(t, xp.reshape(i, (-1,)) if xp is BT else i)  # noqa: E731
        return bld.add(lambda xp, env, P, B: fn(xp, env[k], idx(B) if xp is BT else flat(B)),
                       f"take(v{k}, int{ishape}.reshape(-1))")
    if how == 4:                                  # a Python list of ints as the index
        lst = [int(i) for i in bld.rng.integers(-rows, rows, size=bld.i(1, 4))]
        return bld.add(lambda xp, env, P, B: env[k][lst], f"v{k}[{lst}]")
    fn = [lambda xp, t, i: xp.take(t, i), lambda xp, t, i: t[i], lambda xp, t, i: np.take(t, i)][how % 3]
    return bld.add(lambda xp, env, P, B: fn(xp, env[k], idx(B)), f"take(v{k}, int{ishape})")
