"""How btjit's convolutions run, checked on the graph and against torch: the implicit GEMM (no patch matrix)
split over threads bitwise, depthwise convolutions direct, pooling ties and splits, the output gradient and
padding in one pass each, a relu and a pooling's gradient made inside the convolution's own passes."""
import numpy as np
import pytest

import btjit
from btjit.testing import split_kernels

torch = pytest.importorskip("torch")
TF = torch.nn.functional


def test_implicit_gemm_graph_and_threads():
    """A float32 convolution with O a multiple of 8 runs as conv_gemm (no patch matrix; its dx a transposed
    implicit convolution), split over two threads bitwise equal to one; with precision="bf16" it keeps im2col
    (its products read bf16)."""
    rng = np.random.default_rng(3)
    p = {"w": rng.normal(size=(16, 8, 3, 3)).astype(np.float32) * 0.2, "b": rng.normal(size=16).astype(np.float32),
         "h": rng.normal(size=(4, 8, 12, 11)).astype(np.float32)}
    x = rng.normal(size=(4, 8, 12, 11)).astype(np.float32)
    r = rng.normal(size=(4, 16, 12, 11)).astype(np.float32)

    def loss(q, x):
        return btjit.sum(btjit.conv2d(x * q["h"], q["w"], q["b"], padding=1) * r)
    runs = []
    for threads in (1, 2):
        prog = btjit.trace(loss, p, x, grad=True, threads=threads)
        ops = [e.op for e in prog.graph.eqns]
        assert "im2col" not in ops and "col2im" not in ops and ops.count("conv_gemm") == 2, ops
        runs.append((prog.value_and_grad(x), {k: prog.grads[k].copy() for k in p},
                     split_kernels(prog)))
    (l1, g1, k1), (l2, g2, k2) = runs
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1)
    assert not k1 and "k_conv" in k2
    bf = btjit.trace(loss, p, x, grad=True, precision="bf16")
    assert "im2col" in [e.op for e in bf.graph.eqns]


def test_depthwise_convolution_is_direct_and_split_over_threads_bitwise():
    """A depthwise convolution (MobileNet's, ConvNeXt's 7 x 7) runs as dwconv2d (no patch matrix, no GEMM), its
    three kernels split over the channels on two threads, bitwise equal to one thread; with a channel multiplier
    (O = 2C) it keeps im2col."""
    rng = np.random.default_rng(6)
    p = {"w": rng.normal(size=(32, 1, 3, 3)).astype(np.float32), "b": rng.normal(size=32).astype(np.float32)}
    x = rng.normal(size=(8, 32, 30, 30)).astype(np.float32)
    r = rng.normal(size=(8, 32, 15, 15)).astype(np.float32)

    def loss(q, x):
        return btjit.sum(btjit.conv2d(x, q["w"], q["b"], stride=2, padding=1, groups=32) * r)
    runs = []
    for threads in (1, 2):
        prog = btjit.trace(loss, p, x, grad=True, threads=threads)
        ops = [e.op for e in prog.graph.eqns]
        assert {"dwconv2d", "dwconv2d_dw"} <= set(ops) and "im2col" not in ops and "matmul" not in ops, ops
        runs.append((prog.value_and_grad(x), {k: prog.grads[k].copy() for k in p}, split_kernels(prog)))
    (l1, g1, k1), (l2, g2, k2) = runs
    assert l1 == l2 and all(np.array_equal(g1[k], g2[k]) for k in g1)
    assert not k1 and k2.get("k_dwconv") == 2
    w2 = rng.normal(size=(64, 1, 3, 3)).astype(np.float32)
    mult = btjit.trace(lambda q, x: btjit.sum(btjit.conv2d(x, q["w"], groups=32)), {"w": w2}, x, grad=True)
    assert "dwconv2d" not in [e.op for e in mult.graph.eqns]


def test_pooling_and_transposes_split_over_threads_bitwise():
    """Pooling and batched transposes of >= 64K elements run on the threads (their rows split), bitwise equal to
    one thread."""
    rng = np.random.default_rng(4)
    p = {"x": rng.normal(size=(16, 16, 36, 34)).astype(np.float32)}
    r = rng.normal(size=(16, 16, 17, 18)).astype(np.float32)

    def loss(q):
        y = btjit.max_pool2d(q["x"], 2) + btjit.avg_pool2d(q["x"], 3, stride=2)[:, :, :17, :17].mean()
        return btjit.sum(btjit.transpose(y, (0, 1, 3, 2)) * r)
    out = []
    for threads in (1, 2):
        prog = btjit.trace(loss, p, grad=True, threads=threads)
        out.append((prog.value_and_grad(), prog.grads["x"].copy(),
                    split_kernels(prog)))
    assert out[0][0] == out[1][0] and np.array_equal(out[0][1], out[1][1])
    assert {"k_pool2d", "k_transpose"} <= set(out[1][2]) and not out[0][2]


def test_output_gradient_and_padding_take_one_pass_each_on_the_threads():
    """A convolution's output gradient becomes the rows its products read in one conv_dy pass (relu's mask, the
    transpose and the bias terms), its paddings one k_pad pass each; at >= 64K elements both split over two
    threads, bitwise equal to one; values and gradients as torch's."""
    rng = np.random.default_rng(8)
    x, w, b = (rng.normal(size=s).astype(np.float32) for s in ((16, 8, 20, 22), (16, 8, 3, 3), (16,)))
    r = rng.normal(size=(16, 16, 20, 22)).astype(np.float32)

    def loss(q, x):
        return btjit.sum(btjit.relu(btjit.conv2d(x * q["s"], q["w"], q["b"], padding=1)) * r)
    p = {"w": w * 0.3, "b": b, "s": np.ones_like(x)}
    out = []
    for threads in (1, 2):
        prog = btjit.trace(loss, p, x, grad=True, threads=threads)
        ops = [e.op for e in prog.graph.eqns]
        assert ops.count("conv_dy") == 1 and "relu_grad" not in ops and ops.count("slice_scatter") == 2, ops
        out.append((prog.value_and_grad(x), {k: prog.grads[k].copy() for k in p},
                    split_kernels(prog)))
    assert out[0][0] == out[1][0] and all(np.array_equal(out[0][1][k], out[1][1][k]) for k in p)
    assert not out[0][2] and {"k_conv_dy", "k_pad"} <= set(out[1][2])
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    (torch.relu(TF.conv2d(torch.tensor(x) * ts["s"], ts["w"], ts["b"], padding=1)) * torch.tensor(r)).sum().backward()
    for k in p:
        got, want = out[0][1][k], ts[k].grad.numpy()
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max(), err_msg=k)


def test_relu_after_a_convolution_runs_inside_it():
    """conv2d then relu is one conv_gemm(relu=1) equation (the activation applied as the product stores), its
    gradient through the output as relu's; values and gradients as torch's."""
    rng = np.random.default_rng(6)
    x, w, b = rng.normal(size=(2, 8, 9, 10)), rng.normal(size=(16, 8, 3, 3)) * 0.3, rng.normal(size=16)
    r = rng.normal(size=(2, 16, 9, 10))
    ts = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    (torch.relu(TF.conv2d(*ts, padding=1)) * torch.tensor(r)).sum().backward()
    prog = btjit.trace(lambda q: btjit.sum(btjit.relu(btjit.conv2d(q["x"], q["w"], q["b"], padding=1)) * r),
                       {"x": x, "w": w, "b": b}, dtype="float64", grad=True)
    assert [e.attrs.get("relu") for e in prog.graph.eqns if e.op == "conv_gemm"][0] == 1
    assert "relu" not in [e.op for e in prog.graph.eqns]
    prog.value_and_grad()
    for n, t in zip("xwb", ts):
        np.testing.assert_allclose(prog.grads[n], t.grad.numpy(), rtol=1e-10, atol=1e-10, err_msg=n)


POOL_AFTER_CONV = [  # x, w, the pooling after conv -> [relu]: 2x2 (the vector path, an odd edge), 3x3 stride 2 padded
    ((3, 8, 20, 21), (16, 8, 3, 3), lambda a: btjit.max_pool2d(a, 2), lambda a: TF.max_pool2d(a, 2), True),
    ((2, 8, 9, 9), (8, 8, 3, 3), lambda a: btjit.max_pool2d(a, 2), lambda a: TF.max_pool2d(a, 2), False),
    ((2, 3, 12, 11), (16, 3, 3, 3), lambda a: btjit.max_pool2d(a, 3, stride=2, padding=1),
     lambda a: TF.max_pool2d(a, 3, stride=2, padding=1), True),
    ((2, 8, 10, 10), (8, 8, 3, 3), lambda a: btjit.avg_pool2d(a, 2), lambda a: TF.avg_pool2d(a, 2), True),
]


@pytest.mark.parametrize("i", range(len(POOL_AFTER_CONV)))
def test_pooling_gradient_made_inside_the_convolutions_output_gradient(i):
    """conv2d [-> relu] -> a pooling: the pooling's gradient is made image by image inside the conv_dy pass (no
    pool2d_grad equation, no (N, O, H, W) gradient stored); values and gradients as torch's."""
    xs, ws, pool, tpool, relu = POOL_AFTER_CONV[i]
    rng = np.random.default_rng(20 + i)
    x, w, b = (rng.normal(size=s).astype(np.float32) for s in (xs, ws, ws[:1]))
    act, tact = (btjit.relu, torch.relu) if relu else (lambda a: a, lambda a: a)
    r = rng.normal(size=tuple(tpool(torch.zeros(xs[0], ws[0], xs[2] - 2, xs[3] - 2)).shape)).astype(np.float32)

    def loss(q, x):
        return btjit.sum(pool(act(btjit.conv2d(x * q["s"], q["w"], q["b"]))) * r)
    p = {"w": w * 0.3, "b": b, "s": np.ones_like(x)}
    prog = btjit.trace(loss, p, x, grad=True)
    ops = [e.op for e in prog.graph.eqns]
    dy = [e for e in prog.graph.eqns if e.op == "conv_dy"]
    assert "pool2d_grad" not in ops and len(dy) == 1 and dy[0].attrs["pool"] > 0, ops
    got = prog.value_and_grad(x)
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in p.items()}
    want = (tpool(tact(TF.conv2d(torch.tensor(x) * ts["s"], ts["w"], ts["b"]))) * torch.tensor(r)).sum()
    want.backward()
    np.testing.assert_allclose(got, want.item(), rtol=1e-4)
    for k in p:
        g, t = prog.grads[k], ts[k].grad.numpy()
        np.testing.assert_allclose(g, t, rtol=2e-4, atol=2e-4 * np.abs(t).max(), err_msg=k)


@pytest.mark.parametrize("stride,padding,C,kw", [(1, 1, 8, {}), (1, (2, 1), 8, {}), (1, "same", 16, {}),
                                                (2, 1, 8, {}), (1, 1, 3, {}), (1, 3, 8, {"dilation": 2}),
                                                (2, (1, 2), 8, {"groups": 2})])
def test_a_padded_convolutions_input_gradient_is_made_unpadded(stride, padding, C, kw):
    """The input gradient of a zero-padded convolution (the transposed implicit convolution, or col2im: stride 2,
    3 channels, groups) is made at the unpadded input's shape, not made padded and then cropped by a slice; the
    gradients against torch in float64."""
    rng = np.random.default_rng(5)
    w, h = rng.normal(size=(8, C // kw.get("groups", 1), 3, 4)) * 0.3, rng.normal(size=(2, C, 9, 10))
    x = rng.normal(size=(2, C, 9, 10))

    def loss(q, x):
        return btjit.sum(btjit.relu(btjit.conv2d(btjit.tanh(x * q["h"]), q["w"], stride=stride, padding=padding,
                                                 **kw)) ** 2)
    prog = btjit.trace(loss, {"w": w, "h": h}, x, grad=True, dtype="float64")
    made = {o.id: e.op for e in prog.graph.eqns for o in e.outs}
    assert not [e for e in prog.graph.eqns if e.op == "slice" and made.get(e.ins[0].id) in ("conv_gemm", "col2im")]
    assert any(e.op in ("conv_gemm", "col2im") and e.outs[0].shape == x.shape for e in prog.graph.eqns)
    tw, th = torch.tensor(w, requires_grad=True), torch.tensor(h, requires_grad=True)
    want = (TF.relu(TF.conv2d(torch.tanh(torch.tensor(x) * th), tw, stride=stride, padding=padding, **kw)) ** 2).sum()
    want.backward()
    assert abs(prog.value_and_grad(x) - want.item()) <= 1e-10 * abs(want.item())
    for k, t in (("w", tw), ("h", th)):
        np.testing.assert_allclose(prog.grads[k], t.grad.numpy(), rtol=1e-9, atol=1e-10)
