"""Convolution and pooling: the op table's entries (im2col / col2im, pool2d / pool2d_grad: shape rule, VJP,
numpy reference, lowering, gradient cases) and the public functions built from them with torch's semantics
(btjit.conv2d, conv1d, max_pool2d, avg_pool2d, max_pool1d, avg_pool1d, adaptive_avg_pool2d, flatten).

A convolution is im2col (the input's patches as rows, btjit/kernels/conv.py) followed by the existing GEMM
lowering: (N*OH*OW, C*kh*kw) @ (C*kh*kw, O) per group, so its forward, input gradient (a GEMM, then col2im)
and weight gradient (a GEMM over all output pixels) run on the same kernels as a linear layer. 1-D ops are the
2-D ones on a height-1 image."""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.kernels.conv import POOL_AVG, POOL_MAX

from btjit.graph.optable import Case, F, ShapeError, _float, op

_GEOM = ("kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "oh", "ow")


# ----------------------------------------------------------------------------- im2col / col2im
def _im2col_rule(types, attrs, fd):
    _float(types, "")
    (s, _), = types
    G = attrs["groups"]
    if len(s) != 4 or s[1] % G:
        raise ShapeError(f"im2col needs (N, C, H, W) with C divisible by groups={G}")
    return [((G, s[0] * attrs["oh"] * attrs["ow"], s[1] // G * attrs["kh"] * attrs["kw"]), fd)]


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


def _to_cols(c6, a):
    """(N, C, kh, kw, OH, OW) -> k_im2col's layout (G, N*OH*OW, Cg*kh*kw)."""
    N, C = c6.shape[:2]
    G = a["groups"]
    c = c6.reshape(N, G, C // G, a["kh"], a["kw"], a["oh"], a["ow"]).transpose(1, 0, 5, 6, 2, 3, 4)
    return c.reshape(G, N * a["oh"] * a["ow"], -1)


def _from_cols(col, a, N, C):
    """The inverse of _to_cols."""
    G = a["groups"]
    c = col.reshape(G, N, a["oh"], a["ow"], C // G, a["kh"], a["kw"]).transpose(1, 0, 4, 5, 6, 2, 3)
    return c.reshape(N, C, a["kh"], a["kw"], a["oh"], a["ow"])


def _im2col_ref(xs, a):
    x, = xs
    c6 = np.zeros(x.shape[:2] + (a["kh"], a["kw"], a["oh"], a["ow"]), x.dtype)
    for i, j, oh, ow, ih, iw in _patches(x.shape, a):
        c6[:, :, i, j, oh, ow] = x[:, :, ih, iw]
    return (_to_cols(c6, a),)


def _col2im_ref(xs, a):
    dx = np.zeros(a["x_shape"], xs[0].dtype)
    c6 = _from_cols(xs[0], a, *dx.shape[:2])
    for i, j, oh, ow, ih, iw in _patches(dx.shape, a):
        dx[:, :, ih, iw] += c6[:, :, i, j, oh, ow]
    return (dx,)


def _conv_row(L, back, x_shape, a, **offs):
    N, C, H, W = x_shape
    return [L.row("k_im2col", back=back, **offs, N=N, G=a["groups"], Cg=C // a["groups"], H=H, W=W, OH=a["oh"],
                  OW=a["ow"], **{k: a[k] for k in _GEOM[:8]})]


def _geom(kh, kw, sh=1, sw=1, ph=0, pw=0, dh=1, dw=1, oh=1, ow=1, groups=1):
    return dict(kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, oh=oh, ow=ow, groups=groups)


_ic = [(F(2, 3, 5, 6), _geom(3, 3, oh=3, ow=4)), (F(1, 4, 7, 5), _geom(3, 2, 2, 1, 1, 0, 1, 2, oh=4, ow=3, groups=2)),
       (F(2, 2, 4, 4), _geom(3, 3, ph=1, pw=1, dh=2, dw=2, oh=2, ow=2, groups=2))]
op("im2col", infer=_im2col_rule, ref=_im2col_ref,
   lower=lambda e, L: _conv_row(L, 0, e.ins[0].shape, e.attrs, ox=L.off(e.ins[0]), ocol=L.off(e.outs[0])),
   vjp=lambda g, x, o, a: [T.emit("col2im", (g[0],), x_shape=tuple(x[0].shape), **a)],
   cases=[Case((s,), a) for s, a in _ic])
op("col2im", infer=lambda t, a, fd: [(tuple(a["x_shape"]), fd)], ref=_col2im_ref, internal=True,
   lower=lambda e, L: _conv_row(L, 1, e.attrs["x_shape"], e.attrs, ocol=L.off(e.ins[0]), ox=L.off(e.outs[0])),
   cases=[Case((F(*_im2col_rule([(s[1], "f64")], a, "f64")[0][0]),), dict(a, x_shape=s[1])) for s, a in _ic])


# ----------------------------------------------------------------------------- pooling
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
        return [L.row("k_pool2d", back=back, mode=a["mode"], **offs, NC=x.size // (x.shape[-1] * x.shape[-2]),
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
