"""Indexing traced values as numpy does: x[idx] (ints, slices of any step, None, Ellipsis, integer arrays)
and x[idx] = value, composed of the slice, slice_set and take ops (the last a gather along axis 0). Registered
as the Tracer's __getitem__ / __setitem__ (btjit/graph/trace.py's METHODS)."""
from __future__ import annotations

import builtins

import numpy as np

from btjit.graph.trace import (METHODS, TraceError, Tracer, broadcast_to, current_graph, emit, lift, reshape,
                               swapaxes, transpose, user_src, where)


class Positions(Tracer):
    """Positions along an axis (argsort's, topk's indices) as floats of the program's dtype, argmax's convention (no
    gradient; `(ix == y)` compares with integer labels), that index as the int32 array they were made from: x[ix],
    take, take_along_axis / x.gather(dim, ix) use it. x[...] = v on them drops it (a float array then)."""
    __slots__ = ("ints",)

    def __init__(self, ints):
        f = emit("to_float", (ints,))
        super().__init__(f.node, f.graph)
        self.ints = ints

    def __setitem__(self, idx, value):
        super().__setitem__(idx, value)
        self.ints = None


def _ints(i):
    """An index with Positions replaced by their int32 array."""
    if isinstance(i, tuple):
        return tuple(map(_ints, i))
    return i.ints if isinstance(i, Positions) and i.ints is not None else i


def _advanced(i) -> bool:
    return isinstance(i, (Tracer, list, range)) or isinstance(i, np.ndarray) and i.dtype.kind in "iu"


def getitem(x, idx):
    x, idx = lift(x), _ints(idx)
    if isinstance(idx, np.ndarray) and idx.dtype == bool:        # a constant mask: the indices where it is true
        if idx.shape != x.shape[:idx.ndim]:
            raise TraceError(f"getitem: a boolean mask of shape {idx.shape} for a value of shape {x.shape} — "
                             f"{user_src()}")
        idx = np.nonzero(idx)
        idx = idx[0] if len(idx) == 1 else idx
    if isinstance(idx, Tracer) and idx.node.dtype != "i32":
        raise TraceError(f"getitem: a traced float index (a mask like x[x > 0]?) selects a number of elements only "
                         f"known at run time; use btjit.where(mask, x, 0.0) — {user_src()}")
    if _advanced(idx):
        return take(x, list(idx) if isinstance(idx, range) else idx)
    if isinstance(idx, tuple) and any(map(_advanced, idx)) and any(map(_is_int, idx)) \
            and not any(i is None for i in idx):
        return _ints_and_arrays(x, idx)
    if isinstance(idx, tuple) and builtins.sum(map(_advanced, idx)) > 1:
        return _take_leading(x, idx)
    if isinstance(idx, tuple) and any(_advanced(i) for i in idx):
        return _take_on_axis(x, idx)
    if any(isinstance(i, slice) and (i.step or 1) < 0 for i in (idx if isinstance(idx, tuple) else (idx,))):
        return _reversed(x, idx)
    starts, stops, steps, out_shape = _region(x, idx)
    out = x
    if (starts, stops, steps) != ([0] * x.ndim, list(x.shape), [1] * x.ndim):
        out = emit("slice", (x,), starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))
    return reshape(out, tuple(out_shape))


def _reversed(x, idx):
    """x[..., ::-1, ...] (slices of negative step): the positive-step slice of the same elements, then a gather
    of that axis in the slice's order."""
    idx = _expand(x, idx if isinstance(idx, tuple) else (idx,))
    base, gathers, d, out = [], [], 0, 0
    for i in idx:
        if isinstance(i, slice) and (i.step or 1) < 0:
            ids = np.arange(*i.indices(x.shape[d]))
            lo = int(ids.min()) if ids.size else 0
            base.append(slice(lo, lo + 1 if ids.size == 0 else int(ids.max()) + 1))
            gathers.append((out, ids - lo))
        else:
            base.append(i)
        d += i is not None
        out += not isinstance(i, (int, np.integer))
    y = getitem(x, tuple(base))
    for ax, ids in gathers:
        y = swapaxes(take(swapaxes(y, 0, ax), ids), 0, ax) if ids.size else y[(slice(None),) * ax + (slice(0, 0),)]
    return y


def _expand(x, idx):
    """idx with its Ellipsis replaced by the full slices it stands for."""
    k = next((j for j, i in enumerate(idx) if i is Ellipsis), None)      # `is`: idx may hold arrays
    if k is not None:
        used = builtins.sum(i is not None and i is not Ellipsis for i in idx)    # None takes no input axis
        idx = idx[:k] + (slice(None),) * (x.ndim - used) + idx[k + 1:]
    return idx


def _is_int(i) -> bool:
    return isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))


def _ints_and_arrays(x, idx):
    """x[ids, 0], x[:, ids, 2], x[0, :, ids] (min-char-rnn's `ps[targets[t], 0]`): numpy counts the ints among the
    advanced indices (0-d arrays broadcast with the others), so the ints index first, as basic indexing, then the
    arrays; where the ints and arrays are not one adjacent block numpy puts the arrays' axes first."""
    idx = _expand(x, idx)
    if len(idx) > x.ndim:
        raise TraceError(f"getitem: {len(idx)} indices for a value of {x.ndim} dims — {user_src()}")
    at = [j for j, i in enumerate(idx) if _is_int(i) or _advanced(i)]
    y = getitem(x, tuple(i if _is_int(i) else slice(None) for i in idx))
    rest = tuple(i for i in idx if not _is_int(i))
    z = getitem(y, rest[0] if len(rest) == 1 else rest)
    arrays = [j for j, i in enumerate(rest) if _advanced(i)]
    if at == list(range(at[0], at[-1] + 1)) or len(arrays) != 1:
        return z                                     # several arrays: on the leading axes, their axes first there
    k, nd = arrays[0], np.ndim(rest[arrays[0]]) if not isinstance(rest[arrays[0]], Tracer) else rest[arrays[0]].ndim
    order = list(range(k, k + nd)) + [d for d in range(z.ndim) if not k <= d < k + nd]
    return transpose(z, tuple(order)) if order != list(range(z.ndim)) else z


def _take_on_axis(x, idx):
    """x[:, ..., ids, ...]: one integer array among slices (numpy's result: the ids' axis where they stand)."""
    idx = _expand(x, idx)
    k = next(j for j, i in enumerate(idx) if _advanced(i))
    ids = idx[k]
    others = [i for j, i in enumerate(idx) if j != k]
    nd = ids.ndim if isinstance(ids, Tracer) else np.ndim(ids)
    if nd == 0 and all(isinstance(i, slice) for i in others):           # x[:, i] with a 0-d i: that axis goes
        y = _take_on_axis(x, idx[:k] + (reshape(ids, (1,)) if isinstance(ids, Tracer) else [ids],) + idx[k + 1:])
        return reshape(y, tuple(y.shape[:k]) + tuple(y.shape[k + 1:]))
    if not all(isinstance(i, slice) for i in others) or nd != 1:
        raise TraceError(f"getitem: an integer index array can stand with slices only (one 1-d array), got "
                         f"{tuple(type(i).__name__ for i in idx)} — {user_src()}")
    y = getitem(x, tuple(slice(None) if j == k else i for j, i in enumerate(idx)))
    return swapaxes(take(swapaxes(y, 0, k), ids), 0, k)


def _positions(x, idx):
    """(flat, stride, arrays) of integer arrays idx on x's leading axes: flat = sum(i_j * stride_j) broadcast (a
    numpy array if every i_j is constant, else traced), stride = the leading axes' size in all, arrays = the i_j
    (constants reduced modulo their axis)."""
    k = len(idx)
    if not all(map(_advanced, idx)) or k > x.ndim:
        raise TraceError(f"getitem: several integer index arrays must index the leading axes, with nothing after "
                         f"them, got {tuple(type(i).__name__ for i in idx)} — {user_src()}")
    arrs = [i if isinstance(i, Tracer) else np.asarray(list(i) if isinstance(i, range) else i) for i in idx]
    for j, a in enumerate(arrs):
        if not isinstance(a, Tracer):
            if a.dtype.kind not in "iu":
                raise TraceError(f"getitem: index array {j} must be integer, got {a.dtype} — {user_src()}")
            if a.size and (a.min() < -x.shape[j] or a.max() >= x.shape[j]):
                raise TraceError(f"getitem: index {j} out of range for axis {j} of size {x.shape[j]} — "
                                 f"{user_src()}")
            arrs[j] = a % x.shape[j]
        elif a.node.dtype != "i32":
            raise TraceError(f"getitem: index array {j} must be integer, got a float value — {user_src()}")
    try:
        shape = np.broadcast_shapes(*(tuple(a.shape) for a in arrs))
    except ValueError:
        raise TraceError(f"getitem: index arrays of shapes {[tuple(a.shape) for a in arrs]} do not broadcast — "
                         f"{user_src()}") from None
    flat, stride = 0, 1
    for j in reversed(range(k)):
        a = arrs[j] if isinstance(arrs[j], Tracer) else np.asarray(arrs[j], np.int64)
        flat = flat + (a * stride if stride != 1 else a)
        stride *= x.shape[j]
    if not isinstance(flat, Tracer):
        flat = np.broadcast_to(flat, shape)
    elif tuple(flat.shape) != shape:
        flat = broadcast_to(flat, shape)
    return flat, stride, arrs


def _take_leading(x, idx):
    """x[i0, i1, ...]: integer arrays (broadcast together) on x's leading axes, as numpy (logprobs[range(n), y]):
    one take from x's leading axes flattened, at the flat index sum(i_j * stride_j)."""
    flat, stride, _ = _positions(x, idx)
    return take(reshape(x, (stride,) + x.shape[len(idx):]), flat)


def setitem(x, idx, value):
    """The value of x with x[idx] = value (basic indexing: ints, slices, None, Ellipsis)."""
    x, idx = lift(x), _ints(idx)
    if _advanced(idx) or isinstance(idx, tuple) and any(map(_advanced, idx)):
        return _set_arrays(x, idx, value)
    starts, stops, steps, shape = _region(x, idx)
    value = lift(value, x)
    region = tuple(len(range(*s)) for s in zip(starts, stops, steps))
    if value.ndim and tuple(shape) != region:      # x[:, 0] = v: v broadcasts to x[:, 0]'s shape, as numpy's
        try:
            np.broadcast_shapes(value.shape, tuple(shape))
        except ValueError:
            raise TraceError(f"slice_set: a value of shape {value.shape} cannot be assigned to a region of shape "
                             f"{region} (x[...] of shape {tuple(shape)}) — {user_src()}") from None
        value = reshape(broadcast_to(value, shape), region)
    return emit("slice_set", (x, value), starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))


def _set_arrays(x, idx, value):
    """x[i0, i1, ...] = value with integer arrays (and ints) on x's leading axes, as numpy's (x[range(n), y] -= 1,
    x[[0, 2]] = v): each position takes the value assigned to it last. Constant arrays: the winners are found while
    tracing, and the result is where(assigned, the values gathered, x). Traced arrays (labels): the positions must
    be distinct, which one position is (dC[ix] += v with a traced ix) and a constant array among them makes sure of
    (range(n) beside y); then the result is x plus the differences scattered in (take's gradient)."""
    idx = _expand(x, idx if isinstance(idx, tuple) else (idx,))
    while idx and isinstance(idx[-1], slice) and idx[-1] == slice(None):
        idx = idx[:-1]
    k = len(idx) - 1
    one_d = k > 0 and _advanced(idx[k]) and (idx[k].ndim if isinstance(idx[k], Tracer) else np.ndim(idx[k])) == 1
    if one_d and all(isinstance(i, slice) and i == slice(None) for i in idx[:k]):   # x[:, ids] = v: on axis k
        v = lift(value, x)
        v = broadcast_to(v, getitem(x, idx).shape) if v.ndim else v
        return swapaxes(_set_arrays(swapaxes(x, 0, k), (idx[k],), swapaxes(v, 0, k) if v.ndim else v), 0, k)
    if not idx or not all(_advanced(i) or _is_int(i) for i in idx):
        raise TraceError(f"setitem: integer index arrays in an assignment must index the leading axes, with ints "
                         f"and nothing but full slices after them (x[rows, cols] = v, x[range(n), y] -= 1), got "
                         f"{tuple(type(i).__name__ for i in idx)} — {user_src()}")
    idx = tuple(np.asarray(i, np.int64) if _is_int(i) else i for i in idx)
    flat, stride, arrs = _positions(x, idx)
    rest = x.shape[len(idx):]
    rows = reshape(x, (stride,) + rest)
    value = lift(value, x)
    try:
        value = broadcast_to(value, tuple(flat.shape) + rest)
    except TraceError:
        raise TraceError(f"setitem: a value of shape {value.shape} cannot be assigned to x[...] of shape "
                         f"{tuple(flat.shape) + rest} — {user_src()}") from None
    n = int(np.prod(flat.shape, dtype=np.int64))
    value = reshape(value, (n,) + rest)
    if not isinstance(flat, Tracer):
        src = np.full(stride, -1, np.int64)
        src[flat.ravel()] = np.arange(n)                 # numpy's assignment: the last value at a position stays
        keep = (src >= 0).reshape((stride,) + (1,) * len(rest))
        return reshape(where(keep, take(value, np.maximum(src, 0)), rows), x.shape)
    if n > 1 and not any(not isinstance(a, Tracer) and np.unique(np.broadcast_to(a, flat.shape)).size == n
                         for a in arrs):
        raise TraceError(f"setitem: traced index arrays may assign only distinct positions, which a constant array "
                         f"of distinct indices among them makes sure of (x[range(n), y] = v); or write it with "
                         f"btjit.where / one_hot — {user_src()}")
    flat = reshape(flat, (n,))
    diff = value - take(rows, flat)
    return reshape(rows + emit("take_grad", (diff, flat), rows=stride), x.shape)


def _region(x, idx):
    """(starts, stops, steps) per axis of x and the result's shape for a basic index."""
    idx = _expand(x, idx if isinstance(idx, tuple) else (idx,))
    starts, stops, steps, out_shape = [], [], [], []
    d = 0
    for i in idx:
        if i is None:
            out_shape.append(1)
            continue
        if d >= x.ndim:
            raise TraceError(f"getitem: too many indices for a {x.ndim}-d value — {user_src()}")
        n = x.shape[d]
        if isinstance(i, slice):
            lo, hi, st = i.indices(n)
            if st <= 0:
                raise TraceError(f"setitem: only positive slice steps can index an assignment — {user_src()}")
            starts.append(lo); stops.append(hi); steps.append(st)
            out_shape.append(len(range(lo, hi, st)))
        elif isinstance(i, (int, np.integer)):
            if not -n <= i < n:
                raise TraceError(f"getitem: index {i} out of range for axis {d} of size {n} — {user_src()}")
            i = int(i) % n
            starts.append(i); stops.append(i + 1); steps.append(1)
        else:
            raise TraceError(f"getitem: unsupported index {i!r} — {user_src()}")
        d += 1
    for n in x.shape[d:]:
        starts.append(0); stops.append(n); steps.append(1)
        out_shape.append(n)
    return starts, stops, steps, out_shape


def take(table, idx):
    """table[idx] along axis 0 with an integer index array (embedding lookup)."""
    table, idx = lift(table), _ints(idx)
    if not isinstance(idx, Tracer):
        idx = np.asarray(idx)
        if idx.dtype.kind not in "iu":
            raise TraceError(f"take: index array must be integer, got {idx.dtype} — {user_src()}")
        if idx.size and (idx.min() < -table.shape[0] or idx.max() >= table.shape[0]):
            raise TraceError(f"take: index out of range for axis 0 of size {table.shape[0]} — {user_src()}")
        idx = Tracer(current_graph().const(idx % table.shape[0], "i32"), current_graph())
    return emit("take", (table, idx))


METHODS.update({"__getitem__": getitem, "__setitem__": setitem})
