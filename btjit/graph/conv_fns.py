"""The public convolution and pooling functions (btjit.conv2d, conv1d, conv_transpose2d, conv_transpose1d,
max_pool2d, avg_pool2d, max_pool1d, avg_pool1d, the adaptive avg / max pools 1d and 2d, pad, flatten), with
torch.nn.functional's semantics, built from the op table's conv_gemm / im2col / col2im / pool2d entries
(graph/ops/conv.py, graph/ops/pool.py) and the tracer's matmul, reshape and transpose. Bad arguments raise a
TraceError naming the function, the shapes and the user's line."""
from __future__ import annotations

import numpy as np

from btjit.kernels.conv import POOL_AVG, POOL_MAX
from btjit.kernels.micro import MR

from btjit.graph import trace as T
from btjit.graph.numpy_fns import flatten as np_flatten
from btjit.graph.numpy_more import pad as np_pad


def _fail(fn, msg, *xs):
    shapes = " and ".join(str(tuple(x.shape)) for x in xs)
    raise T.TraceError(f"{fn}: {msg} (input shapes {shapes}) — {T.user_src()}")


def _tuple(fn, v, n, what):
    t = (v,) * n if isinstance(v, (int, np.integer)) else tuple(v)
    if len(t) != n or not all(isinstance(i, (int, np.integer)) for i in t):
        raise T.TraceError(f"{fn}: {what} must be an int or {n} ints, got {v!r} — {T.user_src()}")
    return tuple(int(i) for i in t)


def _out(fn, size, k, s, lo, hi, d, xs):
    for name, v, least in (("stride", s, 1), ("dilation", d, 1), ("padding", min(lo, hi), 0)):
        if v < least:
            _fail(fn, f"{name} must be >= {least}, got {v}", *xs)
    o = (size + lo + hi - d * (k - 1) - 1) // s + 1
    if o < 1 or k < 1:
        _fail(fn, f"window {k} (stride {s}, dilation {d}, padding {lo}+{hi}) gives no output on a size-{size} "
                  f"axis", *xs)
    return o


def _implicit(groups, out_channels, pixels) -> bool:
    """Whether a convolution runs as an implicit GEMM (conv_gemm, no patch matrix)."""
    return groups == 1 and out_channels % MR == 0 and pixels >= MR and T.current_graph().precision == "fp32"


def _bias(fn, b, bias):
    """b, or torch's keyword bias= (F.conv2d(x, w, bias=b))."""
    if b is not None and bias is not None:
        raise T.TraceError(f"{fn}: b and bias are one argument (bias is torch's name), given twice — {T.user_src()}")
    return b if bias is None else bias


def _unbatched(f, x, *args):
    """f of x with a batch axis of 1 added (torch's unbatched (C, H, W) input), the axis removed after."""
    y = f(T.reshape(x, (1,) + x.shape), *args)
    return T.reshape(y, y.shape[1:])


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros", *, bias=None):
    """torch.nn.functional.conv2d: x (N, C, H, W) or (C, H, W), w (O, C/groups, kh, kw), b (O,) or None;
    padding an int, a pair, "same" (stride 1; the odd extra pixel after, as torch) or "valid"; padding_mode
    nn.Conv2d's: "zeros", "reflect", "replicate" or "circular" (x padded so by btjit.pad first). `bias=` is
    torch's name for b."""
    return _conv2d(x, w, _bias("conv2d", b, bias), stride, padding, dilation, groups, "conv2d", padding_mode)


def _conv2d(x, w, b, stride, padding, dilation, groups, _fn, padding_mode="zeros", _shown=None):
    x, w = T.lift(x), T.lift(w)
    if x.ndim == 3:
        return _unbatched(_conv2d, x, w, b, stride, padding, dilation, groups, _fn, padding_mode, _shown)
    shown = _shown or (x, w)             # the shapes the user passed (conv1d's (N, C, L), (O, C/groups, k))
    kdims = "k" if _fn == "conv1d" else "kh, kw"
    if x.ndim != 4 or w.ndim != 4:
        _fail(_fn, f"needs x (N, C, H, W) and w (O, C/groups, {kdims})", *shown)
    N, C, H, W = x.shape
    O, Cg, kh, kw = w.shape
    G = groups
    if not isinstance(G, (int, np.integer)) or G < 1 or C % G or O % G:
        _fail(_fn, f"groups={G!r} must be a positive int dividing both the input's {C} channels and w's {O} "
                   f"output channels", *shown)
    if Cg != C // G:
        _fail(_fn, f"x has {C} channels but w has {Cg} input channels{' per group' if G > 1 else ''}: w must be "
                   f"({O}, {C // G}, {kdims}) for {C} channels and groups={G}", *shown)
    if padding_mode not in ("zeros",) + tuple(TORCH_PAD)[1:]:
        raise T.TraceError(f"{_fn}: padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got "
                           f"{padding_mode!r} — {T.user_src()}")
    sh, sw = _tuple(_fn, stride, 2, "stride")
    dh, dw = _tuple(_fn, dilation, 2, "dilation")
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise T.TraceError(f"{_fn}: padding must be an int, a pair, 'same' or 'valid', got {padding!r} — "
                               f"{T.user_src()}")
        if padding == "same" and (sh, sw) != (1, 1):
            _fail(_fn, "padding='same' needs stride 1 (as torch)", *shown)
        th, tw = (dh * (kh - 1), dw * (kw - 1)) if padding == "same" else (0, 0)
        (ph, ph2), (pw, pw2) = (th // 2, th - th // 2), (tw // 2, tw - tw // 2)
    else:
        ph, pw = _tuple(_fn, padding, 2, "padding")
        ph2, pw2 = ph, pw
    oh = _out(_fn, H, kh, sh, ph, ph2, dh, shown)
    ow = _out(_fn, W, kw, sw, pw, pw2, dw, shown)
    if padding_mode != "zeros" and (ph or ph2 or pw or pw2):   # nn.Conv2d's: F.pad in that mode, then no padding
        x = pad(x, (pw, pw2, ph, ph2), padding_mode)
        N, C, H, W = x.shape
        ph = ph2 = pw = pw2 = 0
    K, Og, P = Cg * kh * kw, O // G, oh * ow
    if b is not None:
        b = T.lift(b)
        if tuple(b.shape) != (O,):
            _fail(_fn, f"the bias must have shape ({O},)", *shown, b)
    if G == C == O and T.current_graph().precision == "fp32":    # depthwise: direct (one filter per channel)
        y = T.emit("dwconv2d", (x, w), kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, oh=oh, ow=ow)
        return y if b is None else y + T.reshape(b, (O, 1, 1))
    if _implicit(G, O, N * P):
        if ph or ph2 or pw or pw2:      # an implicit GEMM over the padded image (conv_gemm: no patch matrix)
            x = T.emit("slice_scatter", (x,), shape=(N, C, H + ph + ph2, W + pw + pw2), starts=(0, 0, ph, pw),
                       stops=(N, C, ph + H, pw + W), steps=(1, 1, 1, 1))
        cin = _channels_inner(C, sh, sw)
        wt = T.transpose(T.reshape(T.transpose(w, (0, 2, 3, 1)) if cin else w, (O, K)))   # rows in the taps' order
        y = T.emit("conv_gemm", (x, wt) + ((b,) if b is not None else ()), kh=kh,
                   kw=kw, sh=sh, sw=sw, dh=dh, dw=dw, oh=oh, ow=ow, nhwc=2 if cin else 0, flip=0, tout=int(P >= MR))
        return y if P >= MR else T.reshape(T.transpose(T.reshape(y, (N, P, O)), (0, 2, 1)), (N, O, oh, ow))
    cols = T.emit("im2col", (x,), kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, oh=oh, ow=ow, groups=G)
    if G == 1:          # (N*P, K) @ (K, O) [+ b]: one GEMM (with the bias, a fused linear)
        y = T.reshape(cols, (N * P, K)) @ T.transpose(T.reshape(w, (O, K)))
        y = T.transpose(T.reshape(y if b is None else y + b, (N, P, O)), (0, 2, 1))
    else:               # (G, N*P, Cg*kh*kw) @ (G, K, O/G): one GEMM per group
        y = T.matmul(cols, T.transpose(T.reshape(w, (G, Og, K)), (0, 2, 1)))
        y = y if b is None else y + T.reshape(b, (G, 1, Og))
        y = T.transpose(T.reshape(y, (G, N, P, Og)), (1, 0, 3, 2))
    return T.reshape(y, (N, O, oh, ow))


def _channels_inner(C, sh, sw) -> bool:
    """The taps' order of an implicit-GEMM convolution over an NCHW input: (i, j, c), the channels the inner loop
    of the micro-kernel, where its gradient dx is implicit too (stride 1, 8k channels); else (c, i, j), the
    window's columns inner. Measured on 8 shapes (3x3 to 7x7, 8 to 128 channels; znver5, one thread): the forward
    1.1-1.3x faster with the channels inner, none slower."""
    return (sh, sw) == (1, 1) and C % MR == 0


def conv_transpose2d(x, w, b=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *, bias=None):
    """torch.nn.functional.conv_transpose2d: x (N, C, H, W) or (C, H, W), w (C, O/groups, kh, kw), b (O,) or None;
    the output (N, O, (H-1)*stride - 2*padding + dilation*(kh-1) + output_padding + 1, ...). Each input pixel's
    products with the window (one GEMM, per group) are summed into the output by col2im, the adjoint of the
    patches a convolution reads (its gradient is that convolution's patch matrix)."""
    return _conv_transpose2d(x, w, _bias("conv_transpose2d", b, bias), stride, padding, output_padding, groups,
                             dilation, "conv_transpose2d")


def _conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation, _fn):
    x, w = T.lift(x), T.lift(w)
    if x.ndim == 3:
        return _unbatched(_conv_transpose2d, x, w, b, stride, padding, output_padding, groups, dilation, _fn)
    if x.ndim != 4 or w.ndim != 4:
        _fail(_fn, "needs x (N, C, H, W) and w (C, O/groups, kh, kw)", x, w)
    N, C, H, W = x.shape
    _, Og, kh, kw = w.shape
    G = int(groups)
    if G < 1 or C % G or w.shape[0] != C:
        _fail(_fn, f"x has {C} channels: w must be ({C}, O/groups, kh, kw) with {C} divisible by groups={G}", x, w)
    (sh, sw), (ph, pw), (dh, dw) = (_tuple(_fn, v, 2, n) for v, n in ((stride, "stride"), (padding, "padding"),
                                                                      (dilation, "dilation")))
    oph, opw = _tuple(_fn, output_padding, 2, "output_padding")
    if not (0 <= oph < max(sh, dh) and 0 <= opw < max(sw, dw)):
        _fail(_fn, f"output_padding {(oph, opw)} must be smaller than the stride {(sh, sw)} or the dilation "
                   f"{(dh, dw)} (as torch)", x, w)
    OH, OW = (H - 1) * sh - 2 * ph + dh * (kh - 1) + oph + 1, (W - 1) * sw - 2 * pw + dw * (kw - 1) + opw + 1
    if OH < 1 or OW < 1 or min(sh, sw, dh, dw, ph + 1, pw + 1) < 1:
        _fail(_fn, f"stride {(sh, sw)}, padding {(ph, pw)} and dilation {(dh, dw)} give an output of {(OH, OW)}", x, w)
    O = Og * G
    rows = T.reshape(T.transpose(T.reshape(x, (N, G, C // G, H * W)), (1, 0, 3, 2)), (G, N * H * W, C // G))
    cols = T.matmul(rows, T.reshape(w, (G, C // G, Og * kh * kw)))           # (G, N*H*W, Og*kh*kw)
    y = T.emit("col2im", (cols,), x_shape=(N, O, OH, OW), kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw,
               oh=H, ow=W, groups=G)
    if _implicit(G, C, N * H * W) and oph < sh and opw < sw:   # x's and w's gradients by implicit GEMMs
        y = T.emit("conv_transpose_grad", (y, x, w), stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw))
    if b is not None:
        b = T.lift(b)
        if tuple(b.shape) != (O,):
            _fail(_fn, f"the bias must have shape ({O},)", x, w, b)
        y = y + T.reshape(b, (O, 1, 1))
    return y


def conv_transpose1d(x, w, b=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *, bias=None):
    """torch.nn.functional.conv_transpose1d: x (N, C, L) or (C, L), w (C, O/groups, k)."""
    x, w, b = T.lift(x), T.lift(w), _bias("conv_transpose1d", b, bias)
    if x.ndim not in (2, 3) or w.ndim != 3:
        _fail("conv_transpose1d", "needs x (N, C, L) and w (C, O/groups, k)", x, w)
    fn = "conv_transpose1d"
    pair = lambda v, what, unit: (unit,) + _tuple(fn, v, 1, what)  # noqa: E731 -- H is 1: stride 1, no padding
    y = _conv_transpose2d(T.reshape(x, x.shape[:-1] + (1, x.shape[-1])), T.reshape(w, w.shape[:2] + (1, w.shape[2])),
                          b, pair(stride, "stride", 1), pair(padding, "padding", 0),
                          pair(output_padding, "output_padding", 0), groups, pair(dilation, "dilation", 1), fn)
    return T.reshape(y, y.shape[:-2] + (y.shape[-1],))


def conv1d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros", *, bias=None):
    """torch.nn.functional.conv1d: x (N, C, L) or (C, L), w (O, C/groups, k); padding an int, "same" or "valid";
    padding_mode as conv2d's."""
    x, w, b = T.lift(x), T.lift(w), _bias("conv1d", b, bias)
    if x.ndim not in (2, 3) or w.ndim != 3:
        _fail("conv1d", "needs x (N, C, L) and w (O, C/groups, k)", x, w)
    one = lambda v, what: (1,) + _tuple("conv1d", v, 1, what)  # noqa: E731
    pads = padding if isinstance(padding, str) else (0,) + _tuple("conv1d", padding, 1, "padding")
    y = _conv2d(T.reshape(x, x.shape[:-1] + (1, x.shape[-1])), T.reshape(w, w.shape[:2] + (1, w.shape[2])), b,
                one(stride, "stride"), pads, one(dilation, "dilation"), groups, "conv1d", padding_mode, (x, w))
    return T.reshape(y, y.shape[:-2] + (y.shape[-1],))


def _pool(fn, mode, x, kernel_size, stride, padding, nd, dilation=1, ceil_mode=False, count_include_pad=True,
          divisor_override=None, return_indices=False):
    x = T.lift(x)
    if x.ndim not in (nd + 1, nd + 2):
        _fail(fn, f"needs ({'N, C, H, W' if nd == 2 else 'N, C, L'}) or an unbatched input", x)
    k = _tuple(fn, kernel_size, nd, "kernel_size")
    s = k if stride is None or stride == [] else _tuple(fn, stride, nd, "stride")
    p = _tuple(fn, padding, nd, "padding")
    if _tuple(fn, dilation, nd, "dilation") != (1,) * nd:
        _fail(fn, f"dilation {dilation} is not supported (only 1)", x)
    if return_indices:
        _fail(fn, "return_indices=True is not supported", x)
    if divisor_override is not None and (not isinstance(divisor_override, (int, np.integer)) or divisor_override < 1):
        _fail(fn, f"divisor_override must be a positive int, got {divisor_override!r}", x)
    if nd == 1:
        k, s, p = (1,) + k, (1,) + s, (0,) + p
    if any(2 * pi > ki for pi, ki in zip(p, k)):
        _fail(fn, f"padding {p[-nd:]} must be at most half the kernel size {k[-nd:]}", x)
    H, W = (1,) + x.shape[-1:] if nd == 1 else x.shape[-2:]
    o = [_out(fn, n, ki, si, pi, pi, 1, (x,)) for n, ki, si, pi in zip((H, W), k, s, p)]
    if ceil_mode:       # torch: one more window where the last would start inside the input or its left padding
        o = [oi + 1 if (oi * si < n + pi and (n + 2 * pi - ki) % si) else oi
             for oi, n, ki, si, pi in zip(o, (H, W), k, s, p)]
    xi = T.reshape(x, x.shape[:-1] + (1, x.shape[-1])) if nd == 1 else x
    y = T.emit("pool2d", (xi,), mode=mode, kh=k[0], kw=k[1], sh=s[0], sw=s[1], ph=p[0], pw=p[1], oh=o[0], ow=o[1])
    if mode == POOL_AVG:    # the kernel divides by kh*kw; torch's divisor may differ per window
        count = np.multiply.outer(*[_window_counts(n, oi, ki, si, pi, count_include_pad)
                                    for n, oi, ki, si, pi in zip((H, W), o, k, s, p)])
        if divisor_override is not None:
            count = np.full_like(count, divisor_override)
        if (count != k[0] * k[1]).any():
            y = y * (k[0] * k[1] / count)
    return T.reshape(y, x.shape[:-1] + (o[1],)) if nd == 1 else y


def _window_counts(n, o, k, s, p, include_pad):
    """The elements each of o windows (size k, stride s, padding p) covers along a size-n axis, as torch's
    average pooling counts them: padding included (count_include_pad) but never past it, else inside only."""
    start = np.arange(o) * s - p
    if include_pad:
        return np.minimum(start + k, n + p) - start
    return np.minimum(start + k, n) - np.maximum(start, 0)


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """torch.nn.functional.max_pool2d (padding with -inf; stride defaults to kernel_size; dilation 1 only)."""
    return _pool("max_pool2d", POOL_MAX, x, kernel_size, stride, padding, 2, dilation, ceil_mode,
                 return_indices=return_indices)


def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """torch.nn.functional.avg_pool2d, its divisor rules included (count_include_pad, ceil_mode's last windows,
    divisor_override)."""
    return _pool("avg_pool2d", POOL_AVG, x, kernel_size, stride, padding, 2, 1, ceil_mode, count_include_pad,
                 divisor_override)


def max_pool1d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """torch.nn.functional.max_pool1d: x (N, C, L) or (C, L)."""
    return _pool("max_pool1d", POOL_MAX, x, kernel_size, stride, padding, 1, dilation, ceil_mode,
                 return_indices=return_indices)


def avg_pool1d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    """torch.nn.functional.avg_pool1d: x (N, C, L) or (C, L)."""
    return _pool("avg_pool1d", POOL_AVG, x, kernel_size, stride, padding, 1, 1, ceil_mode, count_include_pad)


def adaptive_avg_pool2d(x, output_size):
    """torch's adaptive_avg_pool2d: x (N, C, H, W) or (C, H, W) averaged over torch's windows (rows
    floor(i H / oh) .. ceil((i + 1) H / oh), likewise columns); output_size an int, a pair or None (keep)."""
    return _adaptive("adaptive_avg_pool2d", POOL_AVG, x, output_size, 2)


def adaptive_max_pool2d(x, output_size):
    """torch's adaptive_max_pool2d: the max over the windows adaptive_avg_pool2d averages."""
    return _adaptive("adaptive_max_pool2d", POOL_MAX, x, output_size, 2)


def adaptive_avg_pool1d(x, output_size):
    """torch's adaptive_avg_pool1d: x (N, C, L) or (C, L), adaptive_avg_pool2d's windows along L."""
    return _adaptive("adaptive_avg_pool1d", POOL_AVG, x, output_size, 1)


def adaptive_max_pool1d(x, output_size):
    """torch's adaptive_max_pool1d: x (N, C, L) or (C, L), adaptive_max_pool2d's windows along L."""
    return _adaptive("adaptive_max_pool1d", POOL_MAX, x, output_size, 1)


def _adaptive(fn, mode, x, output_size, nd):
    """Sizes that divide the input's: one pool row (kernel = stride = the quotient). Others, axis by axis (both
    reductions are separable): averages by a constant (n, o) matrix of window weights, maxima window by window."""
    x = T.lift(x)
    if x.ndim not in (nd + 1, nd + 2):
        _fail(fn, f"needs ({'N, C, H, W' if nd == 2 else 'N, C, L'}) or an unbatched input", x)
    sizes = x.shape[-nd:]
    given = (output_size,) * nd if output_size is None or isinstance(output_size, (int, np.integer)) else \
        tuple(output_size)
    if len(given) == nd:                    # None keeps an axis's size
        given = tuple(n if o is None else o for o, n in zip(given, sizes))
    out = _tuple(fn, given, nd, "output_size")
    if any(o < 1 for o in out):
        _fail(fn, f"output size {out} must be positive", x)
    if mode == POOL_AVG and all(o == 1 for o in out) and np.prod(sizes) > 1:    # a global average: one mean
        return T.mean(x, axis=tuple(range(x.ndim - nd, x.ndim)), keepdims=True)
    if not any(n % o for n, o in zip(sizes, out)):
        k = tuple(n // o for n, o in zip(sizes, out))
        return _pool(fn, mode, x, k, k, 0, nd)
    for ax, (n, o) in zip(range(x.ndim - nd, x.ndim), zip(sizes, out)):
        if n == o:
            continue
        lo = [i * n // o for i in range(o)]
        hi = [-(-(i + 1) * n // o) for i in range(o)]
        y = T.swapaxes(x, ax, -1)
        if mode == POOL_AVG:
            m = np.zeros((n, o))
            for i in range(o):
                m[lo[i]:hi[i], i] = 1.0 / (hi[i] - lo[i])
            y = T.matmul(y, m)
        else:
            y = T.concatenate([T.max(y[..., a:b], -1, keepdims=True) for a, b in zip(lo, hi)], -1)
        x = T.swapaxes(y, ax, -1)
    return x


TORCH_PAD = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def pad(x, pad, mode="constant", value=0.0):
    """torch.nn.functional.pad: `pad` lists (before, after) pairs from the last axis backwards, (1, 1, 2, 2) pads W
    by 1 and H by 2; modes "constant" (value), "reflect", "replicate" and "circular"."""
    x = T.lift(x)
    if mode not in TORCH_PAD or len(pad) % 2 or len(pad) // 2 > x.ndim:
        _fail("pad", f"pad {tuple(pad)} must hold (before, after) pairs for at most {x.ndim} axes, mode one of "
                     f"{tuple(TORCH_PAD)} (got {mode!r})", x)
    pairs = [tuple(pad[i:i + 2]) for i in range(0, len(pad), 2)][::-1]
    return np_pad(x, [(0, 0)] * (x.ndim - len(pairs)) + pairs, TORCH_PAD[mode], value)


def flatten(x, start_dim=1, end_dim=-1):
    """torch.flatten: dims start_dim..end_dim merged into one (start_dim 1 by default, as torch.nn.Flatten)."""
    return np_flatten(x, start_dim, end_dim)
