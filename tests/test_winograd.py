"""Winograd F(2x2, 3x3), F(4x4, 3x3) and F(2x2, 5x5) convolutions (k_wino): where a float32 program's 3x3 and 5x5
stride-1 convolutions use them, their forward and both gradients against the float64 program (direct implicit GEMMs),
edge tiles of odd sizes, threads bitwise, the kernel's three modes on every layout against numpy, and an export run
bitwise."""
import numpy as np
import pytest

import btjit
from btjit.graph.ops.winograd import _dims, eligible, tile_size
from btjit.kernels.common import PART, ROW, SPLIT
from btjit.kernels.winograd import k_wino, k_wino_dw, wino_parts, wino_scratch
from btjit.testing import split_kernels


def net(p, x, y):           # the pytorch/examples MNIST net's two convolutions, a padded one first (edge tiles)
    h = btjit.relu(btjit.conv2d(x * p["s"], p["w1"], p["b1"], padding=p["w1"].shape[2] // 2))
    h = btjit.relu(btjit.conv2d(h, p["w2"], p["b2"]))
    return btjit.cross_entropy(btjit.flatten(btjit.adaptive_avg_pool2d(h, 1)), y)


def params(rng, C=32, r=3):
    return {"s": rng.uniform(0.5, 1.5, size=(1, C, 1, 1)), "w1": rng.normal(size=(32, C, r, r)) * 0.3 / r,
            "b1": rng.normal(size=32) * 0.1, "w2": rng.normal(size=(64, 32, r, r)) * 0.3 / r, "b2": np.zeros(64)}


def ops(prog):
    return [e.op for e in prog.graph.eqns]


def tile_sizes(prog):       # m of each wino eqn's F(m x m, r x r), in the graph's order
    dims = [(e.attrs, _dims(e.ins[0].shape, e.ins[1].shape, e.attrs)) for e in prog.graph.eqns if e.op == "wino"]
    return [tile_size(a, d[1], d[4]) for a, d in dims]


@pytest.mark.parametrize("r,shape,tiles", [(3, (6, 32, 11, 9), [4, 4, 4, 4]), (3, (8, 32, 8, 8), [4, 2, 4, 4]),
                                           (5, (6, 32, 11, 9), [2, 2, 2, 2])])
def test_winograd_forward_and_gradients_match_the_direct_float64_program(r, shape, tiles):
    """11 x 9: odd edge tiles; 8 x 8: the second convolution's 6 x 6 output in 2 x 2 tiles (as many products as
    4 x 4 ones), its input gradient's 8 x 8 in 4 x 4."""
    rng = np.random.default_rng(0)
    p = params(rng, r=r)
    x, y = rng.normal(size=shape), rng.integers(0, 64, shape[0]).astype(np.int32)
    p32 = {k: v.astype(np.float32) for k, v in p.items()}
    f32 = btjit.trace(net, p32, x.astype(np.float32), y, grad=True, threads=1)
    f64 = btjit.trace(net, p, x, y, grad=True, dtype="float64", threads=1)
    assert ops(f32).count("wino") == 4 and ops(f32).count("wino_wgrad") == 2, ops(f32)      # forwards and dx's
    assert tile_sizes(f32) == tiles
    assert "wino" not in ops(f64) and "conv_gemm" in ops(f64)
    l32, l64 = f32.value_and_grad(x.astype(np.float32), y), f64.value_and_grad(x, y)
    assert abs(l32 - l64) <= 1e-5 * abs(l64)
    for k in p:
        g32, g64 = f32.grads[k], f64.grads[k]
        assert np.abs(g32 - g64).max() <= 2e-5 * np.abs(g64).max(), k


def test_winograd_rows_split_over_threads_bitwise():
    rng = np.random.default_rng(1)
    p = {k: v.astype(np.float32) for k, v in params(rng).items()}
    x, y = rng.normal(size=(8, 32, 12, 12)).astype(np.float32), rng.integers(0, 64, 8).astype(np.int32)
    runs = []
    for threads in (1, 2):
        prog = btjit.trace(net, p, x, y, grad=True, threads=threads)
        assert "wino_wgrad" in ops(prog)
        runs.append((prog.value_and_grad(x, y), {k: prog.grads[k].copy() for k in p}, split_kernels(prog)))
    (l1, g1, k1), (l2, g2, k2) = runs
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1)
    assert not k1 and k2.get("k_wino") == 2


def test_the_rule_keeps_small_and_other_convolutions_on_the_implicit_gemm():
    a = dict(kh=3, kw=3, sh=1, sw=1, dh=1, dw=1, oh=24, ow=24, nhwc=0, flip=0, tout=1)
    assert eligible((64, 32, 26, 26), 64, a, 1) and eligible((64, 32, 26, 26), 64, a, 2)
    assert not eligible((64, 16, 26, 26), 64, a, 2)                   # 16 channels: steps too short on two
    assert eligible((64, 16, 26, 26), 64, a, 1)                       # threads; on one, in 4x4 tiles
    assert not eligible((64, 16, 8, 8), 64, dict(a, oh=6, ow=6), 1)   # (not in 2x2 ones)
    assert not eligible((1, 32, 26, 26), 64, a, 2)                    # fewer images than threads
    assert not eligible((64, 32, 26, 26), 64, dict(a, sh=2, sw=2, oh=12, ow=12), 1)
    assert eligible((64, 32, 28, 28), 64, dict(a, kh=5, kw=5), 1)
    assert not eligible((64, 32, 28, 28), 64, dict(a, kh=5, kw=3), 1) and not eligible((64, 32, 28, 28), 64,
                                                                                        dict(a, kh=7, kw=7), 1)
    assert not eligible((2, 32, 4, 4), 32, dict(a, oh=2, ow=2), 1)    # too little work
    assert tile_size(a, 32, 64) == 4 and tile_size(a, 224, 224) == 4        # 24 x 24: 36 4x4 tiles, not 144 2x2
    assert tile_size(a, 32, 256) == 2                                       # 36 rows of 256 channels: over WBUF
    assert tile_size(dict(a, oh=6, ow=6), 32, 64) == 2 and tile_size(dict(a, oh=5, ow=5), 32, 64) == 2
    assert tile_size(dict(a, oh=6, ow=7), 32, 64) == 4 and tile_size(dict(a, kh=5, kw=5), 32, 64) == 2
    rng = np.random.default_rng(2)
    p = {k: v.astype(np.float32) for k, v in params(rng).items()}
    x, y = rng.normal(size=(6, 32, 11, 9)).astype(np.float32), rng.integers(0, 64, 6).astype(np.int32)
    assert "wino" not in ops(btjit.trace(net, p, x, y, grad=True, precision="bf16"))


def _conv_ref(x, w):        # x (N, C, H, W), w (O, C, r, r): the valid cross-correlation (torch's conv2d)
    r = w.shape[2]
    OH, OW = x.shape[2] - r + 1, x.shape[3] - r + 1
    return sum(np.einsum("nchw,oc->nohw", x[:, :, i:i + OH, j:j + OW], w[:, :, i, j]) for i in range(r)
               for j in range(r))


@pytest.mark.parametrize("r,m,dtype,N,C,H,W,O,nhwc,tout,relu,bias,flip,taps,parts", [
    (3, 2, "float64", 2, 8, 6, 6, 8, 0, 1, 0, 1, 0, 0, 1), (3, 2, "float64", 3, 16, 7, 9, 24, 1, 0, 1, 1, 1, 1, 2),
    (3, 2, "float32", 4, 32, 13, 12, 16, 1, 1, 0, 0, 1, 0, 3), (3, 2, "float64", 2, 8, 5, 5, 8, 1, 1, 0, 0, 0, 0, 1),
    (3, 4, "float64", 2, 8, 10, 10, 8, 0, 1, 0, 1, 0, 0, 1), (3, 4, "float64", 3, 16, 9, 11, 24, 1, 0, 1, 1, 1, 1, 2),
    (3, 4, "float32", 4, 32, 13, 12, 16, 1, 1, 0, 0, 1, 0, 3), (3, 4, "float64", 2, 8, 5, 6, 8, 1, 1, 0, 0, 0, 0, 1),
    (5, 2, "float64", 2, 8, 9, 8, 8, 0, 1, 0, 1, 0, 0, 1), (5, 2, "float64", 3, 16, 10, 11, 24, 1, 0, 1, 1, 1, 1, 2),
    (5, 2, "float32", 3, 32, 14, 12, 16, 1, 1, 0, 0, 1, 0, 2), (5, 2, "float64", 1, 8, 5, 6, 8, 0, 0, 0, 0, 0, 1, 1)])
def test_kernel_modes_on_every_layout_against_numpy(r, m, dtype, N, C, H, W, O, nhwc, tout, relu, bias, flip, taps,
                                                    parts):
    """k_wino (the forward: NCHW or NHWC in, pixel rows or NCHW out, bias, relu, flipped filters) and k_wino_dw
    (the weight gradient, taps in both orders), r x r windows in m x m tiles, each row run in `parts` parts one
    after another."""
    rng = np.random.default_rng(N * C + H)
    x, w, b = rng.normal(size=(N, C, H, W)), rng.normal(size=(O, C, r, r)), rng.normal(size=O)
    OH, OW = H - r + 1, W - r + 1
    dy = rng.normal(size=(N, OH, OW, O))
    wt = (w.transpose(1, 2, 3, 0) if taps == 0 else w.transpose(2, 3, 1, 0)).reshape(r * r * C, O)
    sc = max(wino_scratch(False, r, m, C, H, W, O, OH, OW, nhwc, tout, parts),
             wino_scratch(True, r, m, C, H, W, O, OH, OW, 0, 0, parts))
    blocks = {"x": (x.transpose(0, 2, 3, 1) if nhwc else x).ravel(), "wt": wt.ravel(),
              "y": N * O * OH * OW, "b": b, "dy": dy.ravel(), "dw": r * r * C * O, "scr": parts * sc}
    off, pos = {}, 64
    for k, v in blocks.items():
        off[k] = pos
        pos += (np.size(v) if not isinstance(v, int) else v) + 64
    a, ia = np.full(pos, np.nan, dtype), np.zeros(4, np.int32)      # NaN around and in the scratch: nothing read
    for k, v in blocks.items():
        if not isinstance(v, int):
            a[off[k]:off[k] + v.size] = v

    def run(kernel, n, *args):
        for j in range(n):
            r = np.zeros(ROW, np.int64)
            r[1:1 + len(args)] = args
            r[PART], r[SPLIT] = j, n
            kernel(a, ia, r)
    p0 = min(parts, wino_parts(False, N, C))
    run(k_wino, p0, off["x"], off["wt"], off["y"], off["b"] if bias else 0, off["scr"], N, C, H, W, O, OH, OW, nhwc,
        taps, flip, tout, relu, wino_scratch(False, r, m, C, H, W, O, OH, OW, nhwc, tout, p0), r, m)
    got = a[off["y"]:off["y"] + N * O * OH * OW]
    got = got.reshape(N, O, OH, OW) if tout else got.reshape(N, OH, OW, O).transpose(0, 3, 1, 2)
    want = _conv_ref(x, w[:, :, ::-1, ::-1] if flip else w) + (b[None, :, None, None] if bias else 0)
    want = np.maximum(want, 0) if relu else want
    tol = 1e-12 if dtype == "float64" else 2e-6 if m + r == 5 else 1e-5     # the points +-2, 1/24: float32 loses more
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    if nhwc:                # the weight gradient reads NCHW x: its own row below
        a[off["x"]:off["x"] + x.size] = x.ravel()
    p1 = min(parts, wino_parts(True, N, C))
    run(k_wino_dw, p1, off["x"], off["dy"], off["dw"], off["scr"], N, C, H, W, O, OH, OW, taps,
        wino_scratch(True, r, m, C, H, W, O, OH, OW, 0, 0, p1), r, m)
    dw = np.zeros((O, C, r, r))
    for i in range(r):
        for j in range(r):
            dw[:, :, i, j] = np.einsum("nchw,nhwo->oc", x[:, :, i:i + OH, j:j + OW], dy)
    want = (dw.transpose(1, 2, 3, 0) if taps == 0 else dw.transpose(2, 3, 1, 0)).reshape(r * r * C, O)
    got = a[off["dw"]:off["dw"] + r * r * C * O].reshape(r * r * C, O)
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


@pytest.mark.parametrize("r", [3, 5])
def test_a_winograd_program_exports_and_runs_bitwise(tmp_path, r):
    from test_export import _exports_run_bitwise
    rng = np.random.default_rng(4)
    p = {k: v.astype(np.float32) for k, v in params(rng, r=r).items()}
    data = [(rng.normal(size=(6, 32, 11, 9)).astype(np.float32), rng.integers(0, 64, 6).astype(np.int32))
            for _ in range(3)]
    prog = btjit.trace(net, p, *data[0], optimizer=btjit.optim.AdamW(lr=1e-2), threads=1)
    _exports_run_bitwise(tmp_path, [("wino", prog, data, "k_wino")])
