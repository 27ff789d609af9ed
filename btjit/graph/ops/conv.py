"""Convolution: the op table's entries (conv_gemm / conv_wgrad / conv_dy, im2col / col2im, dwconv2d: shape rule, VJP,
numpy reference, lowering, gradient cases; the poolings' are in graph/ops/pool.py); the public functions built
from them with torch's semantics (btjit.conv2d, conv1d, the poolings, flatten) are in graph/conv_fns.py.

A float32 convolution with groups 1 and O a multiple of 8 is an implicit GEMM (conv_gemm, kernels/convgemm.py):
the patches of the (zero-padded) input are read in place, never written out; its weight gradient (conv_wgrad) is
the same kind of product over the output pixels, its input gradient the transposed convolution of the padded
gradient (stride 1, C a multiple of 8) or, else, a GEMM and col2im. Both read the output gradient as pixel rows,
made in one pass with relu's mask and the bias terms (conv_dy). The other convolutions are im2col (the
input's patches as rows, kernels/conv.py) followed by the GEMM lowering: (N*OH*OW, C*kh*kw) @ (C*kh*kw, O) per
group. A depthwise convolution (groups = channels = output channels) is direct (dwconv2d, k_dwconv): as a GEMM per
channel each of its filters was a one-column product. 1-D ops are the 2-D ones on a height-1 image."""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.graph.conv_fns import conv2d          # VJP rules are written with the public functions (one way)
from btjit.kernels.common import MAX_THREADS
from btjit.kernels.micro import MR

from btjit.graph.ops.matmul import par_gemm
from btjit.graph.ops.pool import _GEOM, POOL_GEOM, _patches, _pool_grad_ref
from btjit.graph.optable import Case, F, ShapeError, _float, op, par_parts



# ----------------------------------------------------------------------------- im2col / col2im
def _im2col_rule(types, attrs, fd):
    _float(types, "")
    (s, _), = types
    G = attrs["groups"]
    if len(s) != 4 or s[1] % G:
        raise ShapeError(f"im2col needs (N, C, H, W) with C divisible by groups={G}")
    return [((G, s[0] * attrs["oh"] * attrs["ow"], s[1] // G * attrs["kh"] * attrs["kw"]), fd)]


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
op("col2im", infer=lambda t, a, fd: [(tuple(a["x_shape"]), fd)], ref=_col2im_ref,   # also conv_transpose2d's
   vjp=lambda g, x, o, a: [T.emit("im2col", (g[0],), **{k: v for k, v in a.items() if k != "x_shape"})],
   lower=lambda e, L: _conv_row(L, 1, e.attrs["x_shape"], e.attrs, ocol=L.off(e.ins[0]), ox=L.off(e.outs[0])),
   cases=[Case((F(*_im2col_rule([(s[1], "f64")], a, "f64")[0][0]),), dict(a, x_shape=s[1])) for s, a in _ic])


def _conv_transpose_vjp(g, x, o, a):
    """The gradients of a transposed convolution (conv_fns.conv_transpose2d, computed as a GEMM and col2im) without
    its patch matrix: dx is the convolution it transposes, applied to g (an implicit GEMM), and dw that
    convolution's weight gradient (conv_wgrad, pixels of x as the output-gradient rows)."""
    _, X, Wt = x
    g = g[0]
    N, C, H, W = X.shape
    _, O, kh, kw = Wt.shape
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    dx = conv2d(g, Wt, None, (sh, sw), (ph, pw), (dh, dw))
    OH, OW = g.shape[2:]
    gp = g if not (ph or pw) else T.emit("slice_scatter", (g,), shape=(N, O, OH + 2 * ph, OW + 2 * pw),
                                         starts=(0, 0, ph, pw), stops=(N, O, ph + OH, pw + OW), steps=(1, 1, 1, 1))
    rows = T.reshape(T.transpose(X, (0, 2, 3, 1)), (N * H * W, C))
    dwt = T.emit("conv_wgrad", (gp, rows), **_cg(kh, kw, H, W, sh, sw, dh, dw))             # (Kpad, C), (o, i, j) rows
    if _kpad(O * kh * kw) != O * kh * kw:
        dwt = T.emit("slice", (dwt,), starts=(0, 0), stops=(O * kh * kw, C), steps=(1, 1))
    return [None, dx, T.transpose(T.reshape(dwt, (O, kh, kw, C)), (3, 0, 1, 2))]


op("conv_transpose_grad", infer=lambda t, a, fd: [t[0]], ref=lambda xs, a: (xs[0],), lower=lambda e, L: [], view=True,
   internal=True, vjp=_conv_transpose_vjp)      # y = its first input; the gradients of (x, w) by the rule above


# ----------------------------------------------------------------------------- implicit-GEMM convolution
def _kpad(K):
    return -(-K // MR) * MR


def _cg_dims(x_shape, a):
    """(N, C, H, W) of a conv_gemm input stored NCHW (nhwc 0) or NHWC (nhwc 1)."""
    N, *r = x_shape
    return (N, r[2], r[0], r[1]) if a["nhwc"] == 1 else (N, *r)


def _conv_gemm_rule(types, attrs, fd):
    _float(types, "")
    (sx, _), (sw, _) = types[:2]
    if len(sx) != 4 or len(sw) != 2:
        raise ShapeError("conv_gemm needs x (N, C, H, W) and wt (C*kh*kw, O)")
    N, C = _cg_dims(sx, attrs)[:2]
    if sw[0] != C * attrs["kh"] * attrs["kw"] or sw[1] % MR or (len(types) == 3 and tuple(types[2][0]) != (sw[1],)):
        raise ShapeError(f"conv_gemm: wt {sw} must be ({C * attrs['kh'] * attrs['kw']}, O) with O a multiple of {MR}")
    oh, ow = attrs["oh"], attrs["ow"]
    return [((N, sw[1], oh, ow) if attrs["tout"] else (N * oh * ow, sw[1]), fd)]


def _windows(x, a):
    """The patch matrix (N*OH*OW, K) of x in the weights' row order (the reference of conv_gemm / conv_wgrad)."""
    xs = x.transpose(0, 3, 1, 2) if a["nhwc"] == 1 else x
    N, C, H, W = xs.shape
    kh, kw, oh, ow = a["kh"], a["kw"], a["oh"], a["ow"]
    taps = np.zeros((N, oh, ow, C, kh, kw), x.dtype)
    for i in range(kh):
        for j in range(kw):
            ii, jj = (kh - 1 - i, kw - 1 - j) if a["flip"] else (i, j)
            v = xs[:, :, ii * a["dh"]:ii * a["dh"] + a["sh"] * (oh - 1) + 1:a["sh"],
                   jj * a["dw"]:jj * a["dw"] + a["sw"] * (ow - 1) + 1:a["sw"]]
            taps[:, :, :, :, i, j] = v.transpose(0, 2, 3, 1)
    taps = taps.transpose(0, 1, 2, 4, 5, 3) if a["nhwc"] else taps
    return taps.reshape(N * oh * ow, -1)


def _conv_gemm_ref(xs, a):
    y = _windows(xs[0], a) @ xs[1]
    y = y + xs[2] if len(xs) == 3 else y
    y = np.maximum(y, 0) if a.get("relu") else y
    return (y.reshape(len(xs[0]), a["oh"], a["ow"], -1).transpose(0, 3, 1, 2).copy() if a["tout"] else y,)


def _conv_wgrad_ref(xs, a):
    dw = _windows(xs[0], a).T @ xs[1]
    return (np.concatenate([dw, np.repeat(dw[-1:], _kpad(len(dw)) - len(dw), 0)]),)


def _conv_gemm_vjp(g, x, o, a):
    X, WT = x[:2]
    g = g[0]
    N, C, H, W = _cg_dims(X.shape, a)
    K, O = WT.shape
    kh, kw, dh, dw = a["kh"], a["kw"], a["dh"], a["dw"]
    if a["nhwc"] == 1 or a["flip"]:
        raise T.TraceError("conv_gemm: the gradient of a transposed convolution's gradient is not supported")
    bias = len(x) == 3
    if a["tout"]:       # y (N, O, OH, OW): the row-per-pixel gradient (N*P, O) the products read, in one pass
        relu = int(bool(a.get("relu")))
        outs = T.emit("conv_dy", (g,) + (o[0],) * relu, relu=relu, bias=int(bias))
        g, db = (outs[0], T.sum(outs[1], axis=0)) if bias else (outs, None)
    else:
        g = T.emit("relu_grad", (o[0], g)) if a.get("relu") else g
        db = T.sum(g, axis=0) if bias else None
    a = dict(a, tout=0, relu=0)
    dWT = T.emit("conv_wgrad", (X, g), **dict(a, nhwc=0))        # taps (c, i, j): measured the faster wgrad
    dWT = T.emit("slice", (dWT,), starts=(0, 0), stops=(K, O), steps=(1, 1)) if _kpad(K) != K else dWT
    if a["nhwc"]:                                                 # into the forward's (i, j, c) rows
        dWT = T.reshape(T.transpose(T.reshape(dWT, (C, kh * kw, O)), (1, 0, 2)), (K, O))
    if (a["sh"], a["sw"]) == (1, 1) and C % MR == 0:     # dx: the transposed convolution, implicit too
        ph, pw = dh * (kh - 1), dw * (kw - 1)
        oh, ow = a["oh"], a["ow"]
        gp = T.emit("slice_scatter", (T.reshape(g, (N, oh, ow, O)),), shape=(N, oh + 2 * ph, ow + 2 * pw, O),
                    starts=(0, ph, pw, 0), stops=(N, ph + oh, pw + ow, O), steps=(1, 1, 1, 1))
        wr = T.reshape(T.transpose(T.reshape(WT, (kh * kw, C, O)), (0, 2, 1)) if a["nhwc"] else  # taps (i, j, c)
                       T.transpose(T.reshape(WT, (C, kh * kw, O)), (1, 2, 0)), (kh * kw * O, C))
        tout = int(H * W >= MR)
        dX = T.emit("conv_gemm", (gp, wr), **dict(a, sh=1, sw=1, oh=H, ow=W, nhwc=1, flip=1, tout=tout, pt=ph, vh=oh))
        dX = dX if tout else T.transpose(T.reshape(dX, (N, H, W, C)), (0, 3, 1, 2))
    else:                                                   # the patches' gradient, summed back by col2im
        assert not a["nhwc"], "taps (i, j, c) only where dx is implicit (conv_fns._channels_inner)"
        dcol = T.emit("matmul", (g, WT), ta=False, tb=True)
        dX = T.emit("col2im", (T.reshape(dcol, (1,) + dcol.shape),), x_shape=tuple(X.shape), groups=1, ph=0, pw=0,
                    **{k: a[k] for k in ("kh", "kw", "sh", "sw", "dh", "dw", "oh", "ow")})
    return [dX, dWT] + ([db] if bias else [])


def _conv_gemm_lower(mode):
    def lower(e, L):
        X, B = e.ins[:2]
        a = e.attrs
        N, C, H, W = _cg_dims(X.shape, a)
        O = B.shape[1]
        blocks = -(-N * a["oh"] * a["ow"] // MR) if mode == 0 else _kpad(C * a["kh"] * a["kw"]) // MR
        parts = min(L.threads, MAX_THREADS, blocks) if par_gemm(N * a["oh"] * a["ow"] * C * a["kh"] * a["kw"] * O,
                                                               L.threads) else 1
        return [L.row("k_conv", split=parts, mode=mode, ox=L.off(X), ob=L.off(B), oc=L.off(e.outs[0]),
                       obias=L.off(e.ins[2]) if len(e.ins) == 3 else 0, N=N, C=C, H=H, W=W, O=O, OH=a["oh"],
                       OW=a["ow"], **{k: a[k] for k in ("kh", "kw", "sh", "sw", "dh", "dw", "nhwc", "flip", "tout")},
                       pt=a.get("pt", 0), vh=a.get("vh", 0), relu=int(a.get("relu", 0)) if mode == 0 else 0)]
    return lower


def _cg(kh, kw, oh, ow, sh=1, sw=1, dh=1, dw=1, nhwc=0, flip=0, tout=0):
    return dict(kh=kh, kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, oh=oh, ow=ow, nhwc=nhwc, flip=flip, tout=tout)


_cgc = [((F(2, 3, 5, 6), F(27, 8)), dict(_cg(3, 3, 3, 4, tout=1), relu=1)),
        ((F(1, 2, 7, 6), F(12, 16), F(16)), _cg(3, 2, 3, 4, 2, 1, 1, 2)),
        ((F(2, 4, 4, 8), F(16, 8)), _cg(1, 2, 4, 3, nhwc=1, flip=1))]
op("conv_gemm", infer=_conv_gemm_rule, ref=_conv_gemm_ref, lower=_conv_gemm_lower(0), vjp=_conv_gemm_vjp,
   internal=True, cases=[Case(s, a) for s, a in _cgc[:2]])
op("conv_wgrad", infer=lambda t, a, fd: [((_kpad(_cg_dims(t[0][0], a)[1] * a["kh"] * a["kw"]), t[1][0][1]), fd)],
   ref=_conv_wgrad_ref, lower=_conv_gemm_lower(1), internal=True,
   cases=[Case((s[0], F(_conv_gemm_rule([(s[0][1], "f64"), (s[1][1], "f64")], a, "f64")[0][0][0], s[1][1][1])), a)
          for s, a in ((s, dict(a, tout=0, relu=0)) for s, a in _cgc)])


# ----------------------------------------------------------------------------- the output gradient's layout
# pool > 0 (fuse.fuse_pool_grad): dy is the gradient of a pooling (mode pool - 1, the pooling's geometry in the
# attrs) of x (N, O, H, W), its first input, whose output gradient (N, O, oh, ow) is the second; made image by
# image in a scratch of one image per part (the last output), so the whole (N, O, H, W) dy is never stored.
def _dy_parts(N):
    return min(N, MAX_THREADS)


def _conv_dy_rule(types, attrs, fd):
    _float(types, "")
    pool = attrs.get("pool", 0)
    s = tuple(types[0][0])
    if pool and (len(types[1][0]) != 4 or tuple(types[1][0]) != s[:2] + (attrs["oh"], attrs["ow"])):
        raise ShapeError("conv_dy with pool needs x (N, O, H, W) and the pooling's output gradient (N, O, oh, ow)")
    if len(s) != 4 or len(types) != 1 + (pool > 0) + attrs["relu"] or (attrs["relu"] and tuple(types[-1][0]) != s):
        raise ShapeError("conv_dy needs dy (N, O, OH, OW), and with relu the convolution's output of its shape")
    return [((s[0] * s[2] * s[3], s[1]), fd)] + [((s[0], s[1]), fd)] * attrs["bias"] + \
        [((_dy_parts(s[0]), s[1] * s[2] * s[3]), fd)] * (pool > 0)


def _conv_dy_ref(xs, a):
    pool = a.get("pool", 0)
    g = _pool_grad_ref(xs[:2], dict(a, mode=pool - 1))[0] if pool else xs[0]
    g = np.where(xs[-1] > 0, g, g * 0) if a["relu"] else g
    gt = g.reshape(g.shape[0], g.shape[1], -1).transpose(0, 2, 1)
    scr = (np.zeros((_dy_parts(g.shape[0]), g[0].size), g.dtype),) if pool else ()
    return (gt.reshape(-1, g.shape[1]).copy(),) + (gt.sum(axis=1),) * a["bias"] + scr


def _conv_dy_lower(e, L):
    a = e.attrs
    pool = a.get("pool", 0)
    g = e.ins[0]
    N, O, H, W = g.shape
    pa = dict.fromkeys(("ox", "H", "W", "OH", "OW", "oscr") + POOL_GEOM[:6], 0)
    if pool:
        pa.update(ox=L.off(g), H=H, W=W, OH=a["oh"], OW=a["ow"], oscr=L.off(e.outs[-1]),
                  **{k: a[k] for k in POOL_GEOM[:6]})
    return [L.row("k_conv_dy", split=par_parts(L, g.size, N), og=L.off(e.ins[1] if pool else g), pool=pool,
                  oy=L.off(e.ins[-1]) if a["relu"] else 0, ogt=L.off(e.outs[0]),
                  odb=L.off(e.outs[1]) if a["bias"] else 0, N=N, O=O, P=H * W, relu=a["relu"], bias=a["bias"], **pa)]


_pdy = [(s, a) for s, a in (  # (x, dy of the pooling's output): 2x2 windows (odd edge), 3x3 stride 2 padded
    ((2, 8, 5, 7), dict(pool=1, kh=2, kw=2, sh=2, sw=2, ph=0, pw=0, oh=2, ow=3, relu=1, bias=1)),
    ((2, 16, 16, 19), dict(pool=1, kh=2, kw=2, sh=2, sw=2, ph=0, pw=0, oh=8, ow=9, relu=1, bias=1)),
    ((2, 16, 4, 4), dict(pool=2, kh=3, kw=3, sh=2, sw=2, ph=1, pw=1, oh=2, ow=2, relu=0, bias=1)),
    ((1, 8, 6, 5), dict(pool=1, kh=3, kw=3, sh=2, sw=2, ph=1, pw=1, oh=3, ow=3, relu=1, bias=0)))]
op("conv_dy", infer=_conv_dy_rule, ref=_conv_dy_ref, lower=_conv_dy_lower, internal=True, nondiff=True,
   cases=[Case((F(2, 8, 3, 5), F(2, 8, 3, 5)), dict(relu=1, bias=1)), Case((F(3, 16, 4, 5),), dict(relu=0, bias=1)),
          Case((F(2, 24, 6, 7), F(2, 24, 6, 7)), dict(relu=1, bias=0))] +
   [Case((F(*s), F(*s[:2], a["oh"], a["ow"])) + (F(*s),) * a["relu"], a) for s, a in _pdy])


# ----------------------------------------------------------------------------- depthwise convolution
def _dw_rule(types, attrs, fd):
    _float(types, "")
    (xs, _), (ws, _) = types
    if len(xs) != 4 or tuple(ws) != (xs[1], 1, attrs["kh"], attrs["kw"]):
        raise ShapeError(f"dwconv2d needs x (N, C, H, W) and w (C, 1, kh, kw), got {xs} and {ws}")
    return [((xs[0], xs[1], attrs["oh"], attrs["ow"]), fd)]


def _dw_ref(xs, a):
    x, w = xs
    y = np.zeros(x.shape[:2] + (a["oh"], a["ow"]), x.dtype)
    for i, j, oh, ow, ih, iw in _patches(x.shape, a):
        y[:, :, oh, ow] += x[:, :, ih, iw] * w[:, 0, i, j]
    return (y,)


def _dw_dx_ref(xs, a):
    g, w = xs
    dx = np.zeros(a["x_shape"], g.dtype)
    for i, j, oh, ow, ih, iw in _patches(dx.shape, a):
        dx[:, :, ih, iw] += g[:, :, oh, ow] * w[:, 0, i, j]
    return (dx,)


def _dw_dw_ref(xs, a):
    x, g = xs
    dw = np.zeros((x.shape[1], 1, a["kh"], a["kw"]), x.dtype)
    for i, j, oh, ow, ih, iw in _patches(x.shape, a):
        dw[:, 0, i, j] += (x[:, :, ih, iw] * g[:, :, oh, ow]).sum(axis=0)
    return (dw,)


def _dw_lower(mode):
    def lower(e, L):
        x_shape = e.attrs["x_shape"] if mode == 1 else e.ins[0].shape
        N, C, H, W = x_shape
        ox, ow, oy = {0: (e.ins[0], e.ins[1], e.outs[0]), 1: (e.outs[0], e.ins[1], e.ins[0]),
                      2: (e.ins[0], e.outs[0], e.ins[1])}[mode]
        return [L.row("k_dwconv", split=par_parts(L, N * C * H * W, C), mode=mode, ox=L.off(ox), ow=L.off(ow),
                      oy=L.off(oy), N=N, C=C, H=H, W=W, OH=e.attrs["oh"], OW=e.attrs["ow"],
                      **{k: e.attrs[k] for k in _GEOM[:8]})]
    return lower


def _dw_vjp(g, x, o, a):
    return [T.emit("dwconv2d_dx", (g[0], x[1]), x_shape=tuple(x[0].shape), **a),
            T.emit("dwconv2d_dw", (x[0], g[0]), **a)]


_dc = [((2, 3, 5, 6), _geom(3, 3, ph=1, pw=1, oh=5, ow=6)), ((1, 4, 7, 5), _geom(3, 2, 2, 1, 1, 0, 1, 2, oh=4, ow=3)),
       ((2, 2, 6, 6), _geom(3, 3, ph=2, pw=2, dh=2, dw=2, oh=6, ow=6)), ((3, 2, 1, 9), _geom(1, 5, pw=2, oh=1, ow=9))]
_dc = [(s, {k: v for k, v in a.items() if k != "groups"}) for s, a in _dc]
op("dwconv2d", infer=_dw_rule, ref=_dw_ref, lower=_dw_lower(0), vjp=_dw_vjp,
   cases=[Case((F(*s), F(s[1], 1, a["kh"], a["kw"])), a) for s, a in _dc])
op("dwconv2d_dx", infer=lambda t, a, fd: [(tuple(a["x_shape"]), fd)], ref=_dw_dx_ref, lower=_dw_lower(1),
   internal=True, cases=[Case((F(s[0], s[1], a["oh"], a["ow"]), F(s[1], 1, a["kh"], a["kw"])), dict(a, x_shape=s))
                         for s, a in _dc])
op("dwconv2d_dw", infer=lambda t, a, fd: [((t[0][0][1], 1, a["kh"], a["kw"]), fd)], ref=_dw_dw_ref,
   lower=_dw_lower(2), internal=True, cases=[Case((F(*s), F(s[0], s[1], a["oh"], a["ow"])), a) for s, a in _dc])
