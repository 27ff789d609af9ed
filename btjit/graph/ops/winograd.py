"""Winograd convolutions: the op table's wino / wino_wgrad entries (kernels/winograd.py's k_wino) and
use_winograd, the pass that puts them in place of a float32 program's 3x3 and 5x5, stride-1 implicit-GEMM convolutions
(conv_gemm: the forward and the input gradient; conv_wgrad: the weight gradient) where they are measured faster.
Same inputs, attributes and first output as the op they replace (their VJP rules and fusions are conv_gemm's,
applied before the pass); their second output is the rows' scratch."""
from __future__ import annotations

from btjit.graph.ir import Eqn
from btjit.graph.ops.conv import _cg, _cg_dims, _conv_gemm_ref, _conv_gemm_rule, _conv_wgrad_ref
from btjit.graph.ops.matmul import par_gemm
from btjit.graph.optable import TABLE, Case, F, op
from btjit.kernels.micro import MR
from btjit.kernels.winograd import WBUF, wino_parts, wino_scratch

MIN_MACS = 1 << 22      # below this many multiply-adds a thread the implicit GEMM, whose set-up is smaller


def _dims(x_shape, wt_shape, a):
    N, C, H, W = _cg_dims(x_shape, a)
    return N, C, H, W, wt_shape[1]


def tile_size(a, C, O) -> int:
    """m of the rows' F(m x m, r x r): 4 for a 3x3 window whose 36 transform rows of channels fit WBUF and whose
    output needs fewer products in 4x4 tiles than in 2x2 ones (36 multiply-adds per 16 outputs against 16 per 4,
    the transforms' memory traffic 2.25 rows an output against 4), else 2."""
    def tiles(m):
        return -(-a["oh"] // m) * -(-a["ow"] // m)
    return 4 if a["kh"] == 3 and 36 * max(C, O) <= WBUF and 36 * tiles(4) < 16 * tiles(2) else 2


def _kernel_layout(a):
    """(nhwc, taps) of k_wino for conv_gemm's attrs: x NHWC only for nhwc 1; taps (i, j, c) for nhwc 1 and 2."""
    return int(a["nhwc"] == 1), int(a["nhwc"] != 0)


def _scratch(dw, N, C, H, W, O, a):
    """Floats of the row's scratch: enough for every count of parts it may split into."""
    nhwc, tout = (0, 0) if dw else (_kernel_layout(a)[0], a["tout"])
    return max(p * wino_scratch(dw, a["kh"], tile_size(a, C, O), C, H, W, O, a["oh"], a["ow"], nhwc, tout, p)
               for p in range(1, wino_parts(dw, N, C) + 1))


def eligible(x_shape, O, a, threads) -> bool:
    """A 3x3 or 5x5 window at stride 1, no dilation; both channel counts multiples of MR, at least 32 (fewer: the
    products' steps too short for the transforms to pay; 16 on one thread in 4x4 tiles) and at most WBUF / T; an
    image per thread at least (a row splits over the images) and MIN_MACS multiply-adds a thread. Measured against
    the implicit GEMM (znver4; a 3x3 convolution's forward and both gradients, docs/benchmarks.md): 1.04-1.62x
    faster on one thread and 1.12-1.45x on two inside the rule (1 to 64 images of 4x4 to 26x26, 32 to 128 channels);
    0.60-0.98x with 8 or 16 channels. A 5x5 one: 1.57-1.85x on one thread, 1.16-1.70x on two (2 to 64 images of
    10x10 to 24x24, 32 to 64 channels); with 16 channels 1.05-1.34x on one thread but 0.70-0.79x on two, with 8
    0.65-0.92x. With tile_size's F(4x4, 3x3) where it picks it, a 3x3 one: 1.31-2.30x on one thread, 1.28-1.59x on
    two (8 to 64 images of 8x8 to 26x26, 32 to 224 channels; docs/benchmarks.md); with 16 channels 1.22-1.47x on one
    thread (0.93x at 14x14, its 4x4 tiles half over the edge) but 0.76-1.05x on two."""
    N, C, H, W = _cg_dims(x_shape, a)
    r = a["kh"]
    return (r in (3, 5) and (a["kw"], a["sh"], a["sw"], a["dh"], a["dw"]) == (r, 1, 1, 1, 1)
            and C % MR == 0 and O % MR == 0 and (r + 1) ** 2 * max(C, O) <= WBUF
            and (32 <= min(C, O) or 16 <= min(C, O) and threads == 1 and tile_size(a, C, O) == 4)
            and N >= threads and N * a["oh"] * a["ow"] * C * O * r * r >= MIN_MACS * threads)


def use_winograd(graph, threads) -> None:
    """conv_gemm and conv_wgrad eqns of a float32 graph run on `threads` -> wino and wino_wgrad where eligible."""
    if graph.float_dtype != "f32" or graph.precision != "fp32":
        return
    for i, e in enumerate(graph.eqns):
        if e.op in ("conv_gemm", "conv_wgrad") and eligible(e.ins[0].shape, e.ins[1].shape[1], e.attrs, threads):
            name = "wino" if e.op == "conv_gemm" else "wino_wgrad"
            types = TABLE[name].infer([(v.shape, v.dtype) for v in e.ins], e.attrs, graph.float_dtype)
            graph.eqns[i] = Eqn(name, e.ins, (e.outs[0],) + tuple(graph.new_var(*t) for t in types[1:]), e.attrs,
                                e.src)


def _wino_rule(types, attrs, fd):
    N, C, H, W, O = _dims(types[0][0], types[1][0], attrs)
    return _conv_gemm_rule(types, attrs, fd) + [((_scratch(False, N, C, H, W, O, attrs),), fd)]


def _wgrad_rule(types, attrs, fd):
    N, C, H, W = _cg_dims(types[0][0], attrs)
    O = types[1][0][1]
    return [((attrs["kh"] * attrs["kw"] * C, O), fd), ((_scratch(True, N, C, H, W, O, attrs),), fd)]


def _parts(L, dw, N, C, O, a):
    macs = N * a["oh"] * a["ow"] * C * O * a["kh"] * a["kw"]
    return min(L.threads, wino_parts(dw, N, C)) if par_gemm(macs, L.threads) else 1


def _lower(e, L):
    X, B = e.ins[:2]
    a = e.attrs
    N, C, H, W, O = _dims(X.shape, B.shape, a)
    nhwc, taps = _kernel_layout(a)
    parts = _parts(L, False, N, C, O, a)
    m = tile_size(a, C, O)
    sc = wino_scratch(False, a["kh"], m, C, H, W, O, a["oh"], a["ow"], nhwc, a["tout"], parts)
    return [L.row("k_wino", split=parts, ox=L.off(X), ow=L.off(B), oy=L.off(e.outs[0]),
                  obias=L.off(e.ins[2]) if len(e.ins) == 3 else 0, oscr=L.off(e.outs[1]), N=N, C=C, H=H, W=W, O=O,
                  OH=a["oh"], OW=a["ow"], nhwc=nhwc, taps=taps, flip=a["flip"], tout=a["tout"],
                  relu=int(a.get("relu", 0)), sc=sc, k=a["kh"], m=m)]


def _lower_dw(e, L):
    X, G = e.ins
    a = e.attrs
    N, C, H, W = _cg_dims(X.shape, a)
    O = G.shape[1]
    parts = _parts(L, True, N, C, O, a)
    m = tile_size(a, C, O)
    return [L.row("k_wino_dw", split=parts, ox=L.off(X), ody=L.off(G), odw=L.off(e.outs[0]), oscr=L.off(e.outs[1]),
                  N=N, C=C, H=H, W=W, O=O, OH=a["oh"], OW=a["ow"], taps=0, k=a["kh"], m=m,
                  sc=wino_scratch(True, a["kh"], m, C, H, W, O, a["oh"], a["ow"], 0, 0, parts))]


_cases = [((F(2, 8, 6, 7), F(72, 8)), _cg(3, 3, 4, 5, tout=1)),                    # NCHW in, (N, O, OH, OW) out
          ((F(2, 8, 4, 8), F(72, 16), F(16)), dict(_cg(3, 3, 2, 6, nhwc=2), relu=1)),   # taps (i, j, c), bias, relu
          # (2x2 tiles: 2 x 6 outputs; the other 3x3 cases' in 4x4 ones)
          ((F(2, 6, 7, 8), F(72, 8)), _cg(3, 3, 4, 5, nhwc=1, flip=1, tout=1)),     # NHWC in, flipped: an input grad
          ((F(2, 8, 9, 8), F(200, 16), F(16)), dict(_cg(5, 5, 5, 4, nhwc=2), relu=1)),  # 5x5, edge tiles
          ((F(1, 9, 10, 8), F(200, 8)), _cg(5, 5, 5, 6, nhwc=1, flip=1, tout=1))]
op("wino", infer=_wino_rule, ref=_conv_gemm_ref, lower=_lower, internal=True,
   cases=[Case(s, a) for s, a in _cases])
op("wino_wgrad", infer=_wgrad_rule, ref=_conv_wgrad_ref, lower=_lower_dw, internal=True,
   cases=[Case((s[0], F(s[0][1][0] * a["oh"] * a["ow"], s[1][1][1])), dict(a, tout=0, relu=0, nhwc=0))
          for s, a in _cases[:2] + _cases[3:4]])
