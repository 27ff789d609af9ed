"""Pooling: the op table's pool2d and pool2d_grad (max or average over windows of the last two axes, any window,
stride and padding; shape rule, VJP, numpy reference, lowering to kernels/conv.py's k_pool2d, gradient cases).
The public poolings (btjit.max_pool2d, avg_pool2d, their 1-d and adaptive forms) are in graph/conv_fns.py; the
window geometry here (_GEOM, _patches) is the convolutions' too (graph/ops/conv.py)."""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.kernels.conv import POOL_AVG, POOL_MAX

from btjit.graph.optable import Case, F, ShapeError, _float, op, par_parts

_GEOM = ("kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "oh", "ow")
POOL_GEOM = _GEOM[:6] + _GEOM[8:]   # a pooling's (no dilation)


def _patches(shape, a):
    """(i, j, oh, ow, ih, iw) of every patch element inside an image of `shape` (N, C, H, W)."""
    H, W = shape[2:]
    for i in range(a["kh"]):
        for j in range(a["kw"]):
            for oh in range(a["oh"]):
                ih = oh * a["sh"] - a["ph"] + i * a["dh"]
                for ow in range(a["ow"]):
                    iw = ow * a["sw"] - a["pw"] + j * a["dw"]
                    if 0 <= ih < H and 0 <= iw < W:
                        yield i, j, oh, ow, ih, iw


def _pool_rule(types, attrs, fd):
    _float(types, "")
    s = types[0][0]
    if len(s) < 2:
        raise ShapeError("pooling needs (..., H, W)")
    return [(tuple(s[:-2]) + (attrs["oh"], attrs["ow"]), fd)]


def _pool_ref(xs, a):
    x, = xs
    out = np.full(x.shape[:-2] + (a["oh"], a["ow"]), -np.inf if a["mode"] == POOL_MAX else 0.0)
    for i, j, oh, ow, ih, iw in _patches((0, 0) + x.shape[-2:], dict(a, dh=1, dw=1)):
        v = x[..., ih, iw]
        out[..., oh, ow] = np.maximum(out[..., oh, ow], v) if a["mode"] == POOL_MAX else out[..., oh, ow] + v
    return (out if a["mode"] == POOL_MAX else out / (a["kh"] * a["kw"]),)


def _pool_grad_ref(xs, a):
    x, g = xs
    dx = np.zeros_like(x)
    xf, gf, dxf = x.reshape(-1, *x.shape[-2:]), g.reshape(-1, *g.shape[-2:]), dx.reshape(-1, *x.shape[-2:])
    wins = {}
    for i, j, oh, ow, ih, iw in _patches((0, 0) + x.shape[-2:], dict(a, dh=1, dw=1)):
        wins.setdefault((oh, ow), []).append((i, j, ih, iw))
    for (oh, ow), cells in wins.items():
        cells = [(ih, iw) for _, _, ih, iw in sorted(cells)]      # window order: row by row
        for p in range(xf.shape[0]):
            if a["mode"] == POOL_MAX:
                ih, iw = cells[int(np.argmax([xf[p, h, w] for h, w in cells]))]
                dxf[p, ih, iw] += gf[p, oh, ow]
            else:
                for ih, iw in cells:
                    dxf[p, ih, iw] += gf[p, oh, ow] / (a["kh"] * a["kw"])
    return (dx,)


def _pool_lower(back):
    def lower(e, L):
        x = e.ins[0]
        a = e.attrs
        offs = dict(ox=L.off(x), oy=L.off(e.ins[1]), odx=L.off(e.outs[0])) if back else \
            dict(ox=L.off(x), oy=L.off(e.outs[0]), odx=0)
        NC = x.size // (x.shape[-1] * x.shape[-2])
        return [L.row("k_pool2d", split=par_parts(L, x.size, NC), back=back, mode=a["mode"], **offs, NC=NC,
                       H=x.shape[-2], W=x.shape[-1], OH=a["oh"], OW=a["ow"], **{k: a[k] for k in _GEOM[:6]})]
    return lower


def _pg(mode, k, s, p, o):
    return dict(mode=mode, kh=k[0], kw=k[1], sh=s[0], sw=s[1], ph=p[0], pw=p[1], oh=o[0], ow=o[1])


_pc = [(F(2, 3, 6, 5), _pg(m, (2, 2), (2, 2), (0, 0), (3, 2))) for m in (POOL_MAX, POOL_AVG)] + \
      [(F(1, 2, 5, 7), _pg(m, (3, 3), (1, 2), (1, 1), (5, 4))) for m in (POOL_MAX, POOL_AVG)] + \
      [(F(3, 1, 9), _pg(m, (1, 3), (1, 1), (0, 1), (1, 9))) for m in (POOL_MAX, POOL_AVG)]
op("pool2d", infer=_pool_rule, ref=_pool_ref, lower=_pool_lower(0),
   vjp=lambda g, x, o, a: [T.emit("pool2d_grad", (x[0], g[0]), **a)], cases=[Case((s,), a) for s, a in _pc])
op("pool2d_grad", infer=lambda t, a, fd: [(tuple(t[0][0]), fd)], ref=_pool_grad_ref, internal=True,
   lower=_pool_lower(1),
   cases=[Case((s, F(*(s[1][:-2] + (a["oh"], a["ow"])))), a) for s, a in _pc])
