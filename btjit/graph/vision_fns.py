"""More of torch.nn.functional's image functions, built from the op table's im2col / col2im and the tracer's
reshapes, transposes, gathers and poolings: unfold and fold (the patches as columns and their sum back into an
image), interpolate (nearest, linear, bilinear), pixel_shuffle / pixel_unshuffle, channel_shuffle (ShuffleNet),
local_response_norm (AlexNet, GoogLeNet) and lp_pool1d / lp_pool2d. Bad arguments raise a TraceError naming the
function, the shapes and the user's line."""
from __future__ import annotations

import numpy as np

from btjit.graph import trace as T
from btjit.graph.numpy_fns import repeat, sign
from btjit.graph.conv_fns import _fail, _out, _tuple, avg_pool1d, avg_pool2d, pad


def _geometry(fn, kernel_size, dilation, padding, stride):
    return [_tuple(fn, v, 2, n) for v, n in ((kernel_size, "kernel_size"), (dilation, "dilation"),
                                             (padding, "padding"), (stride, "stride"))]


def unfold(x, kernel_size, dilation=1, padding=0, stride=1):
    """torch.nn.functional.unfold: x (N, C, H, W) -> (N, C*kh*kw, L), column l the patch of output pixel l (row
    major), its rows in (c, i, j) order; zero padding."""
    x = T.lift(x)
    if x.ndim != 4:
        _fail("unfold", "needs x (N, C, H, W)", x)
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = _geometry("unfold", kernel_size, dilation, padding, stride)
    N, C, H, W = x.shape
    oh, ow = _out("unfold", H, kh, sh, ph, ph, dh, (x,)), _out("unfold", W, kw, sw, pw, pw, dw, (x,))
    cols = T.emit("im2col", (x,), kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, oh=oh, ow=ow, groups=1)
    return T.transpose(T.reshape(cols, (N, oh * ow, C * kh * kw)), (0, 2, 1))


def fold(x, output_size, kernel_size, dilation=1, padding=0, stride=1):
    """torch.nn.functional.fold: x (N, C*kh*kw, L) -> (N, C, H, W) for output_size (H, W), each column's patch
    summed into its place (unfold's adjoint; the parts in the padding dropped)."""
    x = T.lift(x)
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = _geometry("fold", kernel_size, dilation, padding, stride)
    H, W = _tuple("fold", output_size, 2, "output_size")
    if x.ndim != 3 or x.shape[1] % (kh * kw):
        _fail("fold", f"needs x (N, C*{kh}*{kw}, L)", x)
    N, K, L = x.shape
    oh, ow = _out("fold", H, kh, sh, ph, ph, dh, (x,)), _out("fold", W, kw, sw, pw, pw, dw, (x,))
    if oh * ow != L:
        _fail("fold", f"output_size {(H, W)} with kernel {(kh, kw)}, stride {(sh, sw)}, padding {(ph, pw)} and "
                      f"dilation {(dh, dw)} holds {oh} x {ow} = {oh * ow} blocks, but x has L = {L}", x)
    cols = T.reshape(T.transpose(x, (0, 2, 1)), (1, N * L, K))
    return T.emit("col2im", (cols,), x_shape=(N, K // (kh * kw), H, W), kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw,
                  dh=dh, dw=dw, oh=oh, ow=ow, groups=1)


def pixel_unshuffle(x, downscale_factor):
    """torch.nn.functional.pixel_unshuffle: (N, C, H*r, W*r) -> (N, C*r*r, H, W), pixel_shuffle's inverse."""
    x, r = T.lift(x), int(downscale_factor)
    if x.ndim != 4 or r < 1 or x.shape[2] % r or x.shape[3] % r:
        _fail("pixel_unshuffle", f"needs (N, C, H*{r}, W*{r})", x)
    N, C, H, W = x.shape
    y = T.transpose(T.reshape(x, (N, C, H // r, r, W // r, r)), (0, 1, 3, 5, 2, 4))
    return T.reshape(y, (N, C * r * r, H // r, W // r))


def channel_shuffle(x, groups):
    """torch.nn.functional.channel_shuffle (ShuffleNet): x (N, C, ...) with its channels (g, C/g) reordered as
    (C/g, g)."""
    x, g = T.lift(x), int(groups)
    if x.ndim < 3 or g < 1 or x.shape[1] % g:
        _fail("channel_shuffle", f"needs (N, C, ...) with C divisible by groups={g}", x)
    N, C = x.shape[:2]
    y = T.swapaxes(T.reshape(x, (N, g, C // g) + x.shape[2:]), 1, 2)
    return T.reshape(y, x.shape)


def local_response_norm(x, size, alpha=1e-4, beta=0.75, k=1.0):
    """torch.nn.functional.local_response_norm: x / (k + alpha * mean of x^2 over `size` neighbouring channels)
    ** beta, the window zero-padded (size // 2 before, (size - 1) // 2 after) and divided by size, as torch."""
    x, n = T.lift(x), int(size)
    if x.ndim < 3 or n < 1:
        _fail("local_response_norm", f"needs (N, C, ...) and size >= 1, got size {size!r}", x)
    N, C = x.shape[:2]
    sq = T.reshape(x * x, (N, 1, C, -1))                                   # channels as the pooled rows
    sq = pad(sq, (0, 0, n // 2, (n - 1) // 2))
    div = T.reshape(avg_pool2d(sq, (n, 1), stride=1), x.shape)
    return x / (div * float(alpha) + float(k)) ** float(beta)


def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None):
    """torch.nn.functional.interpolate of x (N, C, L) or (N, C, H, W) to `size` or by `scale_factor` (an int or
    float, or one per spatial axis), in mode "nearest" (torch's source pixel floor(i * in / out); whole factors
    repeat each pixel), "nearest-exact", "linear" (1-d) or "bilinear" (2-d), with torch's align_corners. Each
    axis is a gather of the source pixels (and, linear, a weighted sum of two), so its gradient sums back."""
    x = T.lift(x)
    nd = x.ndim - 2
    modes = {"nearest": (1, 2), "nearest-exact": (1, 2), "linear": (1,), "bilinear": (2,)}
    if nd not in modes.get(mode, ()) or (size is None) == (scale_factor is None):
        _fail("interpolate", f"needs (N, C, L) or (N, C, H, W), one of size and scale_factor, and a mode of "
                             f"{', '.join(f'{k!r} ({chr(47).join(map(str, v))}-d)' for k, v in modes.items())} "
                             f"(got mode={mode!r})", x)
    if align_corners is not None and mode.startswith("nearest"):
        _fail("interpolate", f"align_corners only goes with the linear modes (as torch), got mode={mode!r}", x)
    if size is not None:
        want, sf = _tuple("interpolate", size, nd, "size"), (None,) * nd
    else:
        sf = (scale_factor,) * nd if isinstance(scale_factor, (int, float, np.number)) else tuple(scale_factor)
        if len(sf) != nd or not all(f > 0 for f in sf):
            _fail("interpolate", f"scale_factor {scale_factor!r} must be positive, one or one per spatial axis", x)
        want = tuple(int(np.floor(n * float(f))) for n, f in zip(x.shape[2:], sf))
        sf = (None,) * nd if recompute_scale_factor else sf
    if min(want) < 1:
        _fail("interpolate", f"gives an output of size {want}", x)
    for k, (o, n, f) in enumerate(zip(want, x.shape[2:], sf)):
        ax = (slice(None),) * (2 + k)
        if mode == "nearest" and o % n == 0:
            x = repeat(x, o // n, axis=2 + k) if o != n else x
            continue
        scale = n / o if f is None else 1.0 / float(f)   # torch's area_pixel_compute_scale
        dst = np.arange(o, dtype=np.float64)
        if mode.startswith("nearest"):
            src = np.floor((dst + (0.5 if mode == "nearest-exact" else 0.0)) * scale)
            x = x[ax + (np.minimum(src.astype(np.int64), n - 1),)]
            continue
        if align_corners:
            src = dst * ((n - 1) / (o - 1) if o > 1 else 0.0)
        else:
            src = np.maximum((dst + 0.5) * scale - 0.5, 0.0)
        i0 = np.minimum(src.astype(np.int64), n - 1)
        i1 = np.minimum(i0 + 1, n - 1)
        lam = (src - i0).reshape((o,) + (1,) * (nd - 1 - k))
        x = x[ax + (i0,)] * (1.0 - lam) + x[ax + (i1,)] * lam
    return x


def pixel_shuffle(x, upscale_factor):
    """torch.nn.functional.pixel_shuffle: (N, C*r*r, H, W) -> (N, C, H*r, W*r)."""
    x, r = T.lift(x), int(upscale_factor)
    if x.ndim != 4 or r < 1 or x.shape[1] % (r * r):
        _fail("pixel_shuffle", f"needs (N, C*{r}*{r}, H, W)", x)
    N, C, H, W = x.shape
    y = T.transpose(T.reshape(x, (N, C // (r * r), r, r, H, W)), (0, 1, 4, 2, 5, 3))
    return T.reshape(y, (N, C // (r * r), H * r, W * r))


def lp_pool2d(x, norm_type, kernel_size, stride=None, ceil_mode=False):
    """torch.nn.functional.lp_pool2d: (sum of x^p over each window)^(1/p), as torch computes it (the windows' mean
    of x^p times their size; p = inf is max_pool2d's)."""
    kh, kw = _tuple("lp_pool2d", kernel_size, 2, "kernel_size")
    return _lp(avg_pool2d(T.lift(x) ** float(norm_type), (kh, kw), stride, 0, ceil_mode), norm_type, kh * kw)


def lp_pool1d(x, norm_type, kernel_size, stride=None, ceil_mode=False):
    """torch.nn.functional.lp_pool1d: lp_pool2d's rule over windows of the last axis."""
    k, = _tuple("lp_pool1d", kernel_size, 1, "kernel_size")
    return _lp(avg_pool1d(T.lift(x) ** float(norm_type), k, stride, 0, ceil_mode), norm_type, k)


def _lp(mean, p, n):
    """torch's tail of lp_pool: (sign(m) relu(|m|) n)^(1/p) of the windows' means m of x^p."""
    return (sign(mean) * T.relu(T.abs(mean)) * float(n)) ** (1.0 / float(p))
