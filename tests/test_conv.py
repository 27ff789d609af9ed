"""btjit.conv2d / conv1d and the pooling functions against torch.nn.functional: outputs and the gradients of
input, weight and bias over many shapes (stride 1/2, padding 0/1/pair/same/valid, dilation 1/2, groups 1,
2 and depthwise, kernels 1/2/3/5, odd sizes, batch 1, unbatched), float32 and float64; finite differences in
float64; argument errors name the function, the shapes and the user's line."""
import numpy as np
import pytest

import btjit
from btjit.testing import check_grads

torch = pytest.importorskip("torch")
TF = torch.nn.functional

CONV2D = [  # x, w, kwargs
    ((2, 3, 7, 7), (4, 3, 3, 3), {}),
    ((1, 3, 8, 9), (5, 3, 3, 3), dict(stride=2, padding=1)),
    ((2, 4, 9, 7), (6, 2, 3, 3), dict(groups=2, padding=1)),
    ((2, 4, 7, 8), (4, 1, 3, 3), dict(groups=4, padding="same")),
    ((1, 2, 9, 9), (3, 2, 5, 5), dict(dilation=2, padding=2)),
    ((2, 3, 6, 5), (4, 3, 1, 1), dict(stride=2)),
    ((1, 3, 7, 6), (2, 3, 5, 3), dict(padding=(2, 1), stride=(2, 1))),
    ((2, 2, 6, 6), (3, 2, 2, 2), dict(padding="same")),
    ((1, 3, 5, 8), (2, 3, 3, 3), dict(padding="valid", dilation=(1, 2))),
    ((2, 6, 7, 7), (12, 1, 5, 5), dict(groups=6, stride=2, padding=2)),
    ((3, 5, 5), (2, 3, 3, 3), dict(padding=1)),                 # unbatched
    ((1, 1, 28, 28), (8, 1, 3, 3), {}),
    # O a multiple of 8: the implicit GEMM (conv_gemm); C a multiple of 8 and stride 1: its dx implicit too
    ((2, 8, 7, 6), (16, 8, 3, 3), dict(padding=1)),
    ((2, 16, 9, 8), (8, 16, 3, 2), dict(padding="same", dilation=2)),
    ((1, 8, 9, 9), (24, 8, 3, 3), dict(stride=2, padding=1)),    # dx by col2im (stride 2)
    ((3, 3, 6, 7), (8, 3, 2, 2), {}),                             # dx by col2im (C = 3); K = 12
    ((1, 8, 4, 4), (32, 8, 1, 1), {}),                            # 1x1, 16 output pixels
    ((2, 1, 5, 5), (8, 1, 2, 2), dict(padding=(1, 0))),           # K = 4 (< 8 rows of dW)
    ((4, 8, 3, 2), (16, 8, 2, 1), {}),                            # 4 pixels an image: stored by pixel rows
    # depthwise (groups = channels = outputs): direct, dwconv2d
    ((2, 5, 9, 8), (5, 1, 3, 3), dict(groups=5, stride=2, padding=1)),
    ((1, 3, 10, 7), (3, 1, 5, 3), dict(groups=3, padding=(2, 0), dilation=(1, 2))),
    ((2, 4, 6, 6), (4, 1, 2, 2), dict(groups=4, padding="same")),                   # "same" pads 0 before, 1 after
    ((3, 1, 7, 9), (1, 1, 3, 3), dict(stride=(1, 2))),                              # one channel, one filter
    ((1, 6, 5, 5), (6, 1, 7, 7), dict(groups=6, padding=3)),                        # a filter wider than the image
    ((1, 2, 130, 131), (2, 1, 3, 3), dict(groups=2, padding=1)),                    # a plane past k_dwconv's DW_PLANE
]
CONV1D = [
    ((2, 3, 11), (4, 3, 3), {}),
    ((1, 4, 10), (4, 1, 5), dict(groups=4, padding="same")),
    ((2, 2, 9), (3, 2, 3), dict(stride=2, padding=1, dilation=2)),
    ((3, 7), (2, 3, 1), {}),
    ((2, 8, 13), (16, 8, 3), dict(padding=2, dilation=2)),
    ((1, 2, 20000), (2, 1, 3), dict(groups=2, padding=1)),       # depthwise past DW_PLANE, rows past DW_ROW
]
POOL = [  # fn, x, args, kwargs
    ("max_pool2d", (2, 3, 6, 6), (2,), {}),
    ("max_pool2d", (1, 2, 7, 9), (3,), dict(stride=2, padding=1)),
    ("max_pool2d", (2, 2, 5, 5), (3,), dict(stride=1)),         # overlapping windows (flax)
    ("max_pool2d", (2, 2, 7, 6), ((3, 2),), dict(stride=(1, 2), padding=(1, 0))),
    ("avg_pool2d", (2, 3, 6, 6), (2,), {}),
    ("avg_pool2d", (1, 2, 7, 9), (3,), dict(stride=2, padding=1)),
    ("avg_pool2d", (3, 5, 5), (2,), dict(stride=1)),
    ("max_pool1d", (2, 3, 9), (2,), {}),
    ("max_pool1d", (2, 3, 10), (3,), dict(stride=2, padding=1)),
    ("avg_pool1d", (2, 3, 9), (3,), dict(stride=1, padding=1)),
    ("adaptive_avg_pool2d", (2, 4, 5, 5), (1,), {}),
    ("adaptive_avg_pool2d", (2, 4, 6, 4), ((3, 2),), {}),
    ("adaptive_avg_pool2d", (2, 3, 13, 13), (6,), {}),            # AlexNet's (6, 6) of a 13 x 13 map: overlapping
    ("adaptive_avg_pool2d", (3, 7, 5), ((4, None),), {}),         # unbatched, W kept
    ("adaptive_max_pool2d", (2, 4, 6, 4), ((3, 2),), {}),
    ("adaptive_max_pool2d", (2, 3, 7, 5), ((3, 4),), {}),
    ("adaptive_avg_pool1d", (2, 3, 10), (4,), {}),
    ("adaptive_max_pool1d", (2, 3, 10), (5,), {}),
    ("adaptive_max_pool1d", (2, 3, 11), (1,), {}),
    ("max_pool2d", (2, 3, 21, 18), (2,), {}),                     # 2 x 2 windows 8 at a time, an odd last row
    ("avg_pool2d", (1, 2, 16, 19), (2,), {}),
    ("max_pool2d", (2, 3, 7, 9), (2,), dict(ceil_mode=True)),    # 2 x 2 windows past the last row and column
    ("max_pool2d", (1, 2, 8, 7), (3,), dict(stride=2, padding=1, ceil_mode=True)),
    ("avg_pool2d", (1, 2, 8, 7), (3,), dict(stride=2, padding=1, ceil_mode=True)),    # divisors stop at the padding
    ("avg_pool2d", (2, 2, 7, 6), (3,), dict(stride=2, padding=1, count_include_pad=False)),
    ("avg_pool2d", (2, 2, 6, 6), (3,), dict(stride=2, padding=1, divisor_override=4)),
    ("avg_pool1d", (2, 3, 10), (3,), dict(stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ("max_pool1d", (2, 3, 10), (4,), dict(stride=3, padding=2, ceil_mode=True)),
]


CONV_T2D = [  # x, w (C, O/groups, kh, kw), kwargs: torch.nn.functional.conv_transpose2d
    ((2, 4, 5, 6), (4, 3, 3, 2), {}),
    ((1, 3, 4, 4), (3, 8, 4, 4), dict(stride=2, padding=1)),                 # a DCGAN / autoencoder upsampling
    ((2, 4, 5, 6), (4, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    ((2, 4, 3, 5), (4, 3, 3, 2), dict(stride=(2, 3), padding=(1, 0), dilation=(1, 2))),
    ((2, 4, 5, 5), (4, 3, 3, 3), dict(groups=2, stride=2)),
    ((1, 2, 4, 5), (2, 2, 3, 2), dict(dilation=2, padding=2, output_padding=1)),
    ((2, 3, 4, 4), (3, 2, 3, 3), dict(stride=3, padding=2, output_padding=2)),
    ((3, 4, 4), (3, 5, 2, 2), dict(stride=2)),                               # unbatched
    # 8k input channels: the gradients by the convolution it transposes (conv_transpose_grad, implicit GEMMs)
    ((2, 8, 4, 5), (8, 3, 4, 4), dict(stride=2, padding=1)),
    ((1, 16, 3, 3), (16, 8, 3, 3), {}),
    ((2, 8, 4, 4), (8, 4, 3, 2), dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2), dilation=(1, 2))),
    ((8, 3, 5), (8, 2, 3, 3), dict(stride=2, padding=1)),                    # unbatched
]
CONV_T1D = [
    ((2, 3, 7), (3, 4, 3), {}),
    ((2, 4, 6), (4, 2, 4), dict(stride=2, padding=1, output_padding=1, groups=2)),
    ((3, 5), (3, 2, 3), dict(stride=3, dilation=2)),
]


def _against_torch(fn, tfn, arrays, dtype, tol):
    """fn(traced arrays) vs tfn(torch tensors): the output and the gradient of sum(out * r) for every array."""
    names = [f"a{i}" for i in range(len(arrays))]
    want = tfn(*[torch.tensor(a, requires_grad=True) for a in arrays])
    r = np.random.default_rng(9).normal(size=tuple(want.shape))
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    (tfn(*ts) * torch.tensor(r)).sum().backward()

    def loss(p):
        y = fn(*[p[n] for n in names])
        return btjit.sum(y * r), {"y": y}
    prog = btjit.trace(loss, {n: a.astype(dtype) for n, a in zip(names, arrays)}, dtype=dtype, grad=True)
    prog.value_and_grad()
    np.testing.assert_allclose(prog.outputs["y"], want.detach().numpy(), rtol=tol, atol=tol)
    for n, t in zip(names, ts):
        np.testing.assert_allclose(prog.grads[n], t.grad.numpy(), rtol=tol, atol=tol, err_msg=n)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-4)])
@pytest.mark.parametrize("i", range(len(CONV2D)))
def test_conv2d_matches_torch(i, dtype, tol):
    xs, ws, kw = CONV2D[i]
    rng = np.random.default_rng(i)
    arrays = [rng.normal(size=xs), rng.normal(size=ws)] + ([rng.normal(size=ws[0])] if i % 2 == 0 else [])
    _against_torch(lambda *a: btjit.conv2d(*a, **kw), lambda *a: TF.conv2d(*a, **kw), arrays, dtype, tol)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-4)])
@pytest.mark.parametrize("i", range(len(CONV1D)))
def test_conv1d_matches_torch(i, dtype, tol):
    xs, ws, kw = CONV1D[i]
    rng = np.random.default_rng(i)
    arrays = [rng.normal(size=xs), rng.normal(size=ws)] + ([rng.normal(size=ws[0])] if i % 2 else [])
    _against_torch(lambda *a: btjit.conv1d(*a, **kw), lambda *a: TF.conv1d(*a, **kw), arrays, dtype, tol)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-4)])
@pytest.mark.parametrize("i", range(len(CONV_T2D) + len(CONV_T1D)))
def test_conv_transpose_matches_torch(i, dtype, tol):
    """conv_transpose2d / 1d: outputs and the gradients of x, w and b against torch's."""
    one = i >= len(CONV_T2D)
    xs, ws, kw = CONV_T1D[i - len(CONV_T2D)] if one else CONV_T2D[i]
    rng = np.random.default_rng(i)
    arrays = [rng.normal(size=xs), rng.normal(size=ws)] + ([rng.normal(size=ws[1] * kw.get("groups", 1))] if i % 2
                                                           else [])
    name = "conv_transpose1d" if one else "conv_transpose2d"
    _against_torch(lambda *a: getattr(btjit, name)(*a, **kw), lambda *a: getattr(TF, name)(*a, **kw), arrays, dtype,
                   tol)


def test_transposed_convolution_gradients_skip_the_patch_matrix():
    """With 8k input channels the backward is the transposed convolution's own convolution and weight gradient:
    no im2col row in the program."""
    def loss(p):
        return btjit.sum(btjit.conv_transpose2d(p["x"], p["w"], stride=2, padding=1) ** 2)
    p = {"x": np.ones((2, 8, 4, 4), np.float32), "w": np.ones((8, 3, 4, 4), np.float32)}
    text = str(btjit.trace(loss, p, grad=True).graph)
    assert "conv_transpose_grad" in text and "im2col" not in text and "conv_wgrad" in text


def test_a_conv_autoencoder_matches_finite_differences():
    """conv (stride 2) -> relu -> conv_transpose (stride 2) -> sigmoid -> squared error, as a small autoencoder."""
    rng = np.random.default_rng(3)
    p = {"w1": rng.normal(size=(4, 2, 3, 3)) * 0.4, "w2": rng.normal(size=(4, 2, 4, 4)) * 0.4,
         "b2": rng.normal(size=2) * 0.1}
    x = rng.normal(size=(2, 2, 8, 8))

    def loss(q, x):
        h = btjit.relu(btjit.conv2d(x, q["w1"], stride=2, padding=1))                     # (2, 4, 4, 4)
        r = btjit.sigmoid(btjit.conv_transpose2d(h, q["w2"], q["b2"], stride=2, padding=1))   # (2, 2, 8, 8)
        return btjit.mean((r - x) ** 2)
    check_grads(loss, p, x)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
@pytest.mark.parametrize("i", range(len(POOL)))
def test_pooling_matches_torch(i, dtype, tol):
    name, xs, args, kw = POOL[i]
    x = np.random.default_rng(i).normal(size=xs)
    _against_torch(lambda a: getattr(btjit, name)(a, *args, **kw), lambda a: getattr(TF, name)(a, *args, **kw),
                   [x], dtype, tol)


@pytest.mark.parametrize("xs,kw", [((2, 3, 4, 5), dict(scale_factor=2)), ((1, 2, 3, 4), dict(size=(6, 12))),
                                   ((2, 3, 5), dict(scale_factor=3)), ((1, 2, 3, 3), dict(scale_factor=(1, 2)))])
def test_interpolate_nearest_matches_torch(xs, kw):
    x = np.random.default_rng(0).normal(size=xs)
    _against_torch(lambda a: btjit.interpolate(a, **kw), lambda a: TF.interpolate(a, **kw), [x], "float64", 1e-12)


@pytest.mark.parametrize("padding,mode", [((1, 2, 0, 0), "reflect"), ((2, 1, 1, 3), "reflect"),
                                          ((1, 2, 0, 1), "replicate"), ((2, 2, 1, 1), "circular"),
                                          ((1, 0, 2, 1), "constant")])
def test_pad_matches_torch(padding, mode):
    x = np.random.default_rng(1).normal(size=(2, 3, 4, 5))
    kw = {"value": 0.5} if mode == "constant" else {}
    _against_torch(lambda a: btjit.pad(a, padding, mode, **kw), lambda a: TF.pad(a, padding, mode, **kw), [x],
                   "float64", 1e-12)


def test_numpy_pad_modes_match_numpy_and_pixel_shuffle_matches_torch():
    x = np.random.default_rng(2).normal(size=(2, 3, 4))
    for mode in ("reflect", "edge", "wrap"):
        got = btjit.trace(lambda p: (btjit.sum(p["x"]), {"y": np.pad(p["x"], ((0, 0), (2, 1), (1, 3)), mode)}),
                          {"x": x}, dtype="float64")
        got.forward()
        np.testing.assert_array_equal(got.outputs["y"], np.pad(x, ((0, 0), (2, 1), (1, 3)), mode))
    z = np.random.default_rng(3).normal(size=(2, 8, 3, 2))
    _against_torch(lambda a: btjit.pixel_shuffle(a, 2), lambda a: TF.pixel_shuffle(a, 2), [z], "float64", 0)


def test_flatten_matches_torch():
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    _against_torch(btjit.flatten, lambda a: torch.nn.Flatten()(a), [x], "float64", 0)    # start_dim 1 as nn.Flatten
    for args in [(1,), (0,), (1, 2), (2, -1)]:
        _against_torch(lambda a: btjit.flatten(a, *args), lambda a: torch.flatten(a, *args), [x], "float64", 0)


@pytest.mark.parametrize("i", [1, 3, 4, 9, 12, 13, 14])
def test_conv2d_gradients_match_finite_differences(i):
    xs, ws, kw = CONV2D[i]
    rng = np.random.default_rng(i)
    p = {"x": rng.normal(size=xs), "w": rng.normal(size=ws), "b": rng.normal(size=ws[0])}
    r = rng.normal(size=TF.conv2d(torch.tensor(p["x"]), torch.tensor(p["w"]), **kw).shape)
    check_grads(lambda q: btjit.sum(btjit.tanh(btjit.conv2d(q["x"], q["w"], q["b"], **kw)) * r), p)


def test_a_small_cnn_matches_finite_differences():
    """conv -> relu -> max_pool -> conv -> avg_pool -> flatten -> linear -> cross-entropy."""
    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(4, 2, 3, 3)) * 0.5, "b1": rng.normal(size=4) * 0.1,
         "w2": rng.normal(size=(6, 4, 3, 3)) * 0.3, "w3": rng.normal(size=(6, 3)) * 0.3}
    x, y = rng.normal(size=(3, 2, 9, 9)), np.array([0, 2, 1], np.int32)

    def loss(q, x, y):
        h = btjit.max_pool2d(btjit.relu(btjit.conv2d(x, q["w1"], q["b1"], padding=1)), 2)
        h = btjit.avg_pool2d(btjit.conv2d(h, q["w2"], stride=1, padding="same"), 2, stride=2)
        return btjit.cross_entropy(btjit.flatten(btjit.adaptive_avg_pool2d(h, 1)) @ q["w3"], y)
    check_grads(loss, p, x, y)


@pytest.mark.parametrize("call,message", [
    (lambda x, w: btjit.conv2d(x, w[:, :2]), "conv2d: x has 3 channels but w has 2 input channels: w must be (4, 3,"),
    (lambda x, w: btjit.conv2d(x, w, groups=2), "groups=2 must be a positive int dividing both the input's 3 channels"),
    (lambda x, w: btjit.conv2d(x, w, stride=0), "conv2d: stride must be >= 1, got 0"),
    (lambda x, w: btjit.conv2d(x, w, padding=1, padding_mode="mirror"), "padding_mode must be"),
    (lambda x, w: btjit.conv1d(x[:, :, 0], w[:, :2, 0]), "conv1d: x has 3 channels but w has 2 input channels: "
                                                         "w must be (4, 3, k) for 3 channels and groups=1 "
                                                         "(input shapes (2, 3, 8) and (4, 2, 3))"),
    (lambda x, w: btjit.conv2d(x, w, padding=-1), "padding must be >= 0, got -1"),
    (lambda x, w: btjit.conv2d(x, w, stride=2, padding="same"), "padding='same' needs stride 1"),
    (lambda x, w: btjit.conv2d(x, w, padding="full"), "padding must be"),
    (lambda x, w: btjit.conv2d(x[0, 0], w), "needs x (N, C, H, W)"),
    (lambda x, w: btjit.conv2d(x, w, dilation=9), "gives no output"),
    (lambda x, w: btjit.avg_pool2d(x, 2, stride=(1, 0)), "avg_pool2d: stride must be >= 1, got 0"),
    (lambda x, w: btjit.max_pool2d(x, 3, padding=2), "at most half the kernel size"),
    (lambda x, w: btjit.adaptive_avg_pool2d(x, (2, 0)), "output size (2, 0) must be positive"),
    (lambda x, w: btjit.max_pool2d(x, 2, dilation=2), "dilation 2 is not supported"),
    (lambda x, w: btjit.max_pool2d(x, 2, return_indices=True), "return_indices=True is not supported"),
    (lambda x, w: btjit.conv2d(x, w, btjit.reshape(w, (-1,))[:3]), "bias must have shape (4,)"),
    (lambda x, w: btjit.conv_transpose2d(x, w), "conv_transpose2d: x has 3 channels: w must be (3, O/groups, kh, kw)"),
    (lambda x, w: btjit.conv_transpose2d(x, w[:3], stride=2, output_padding=2),
     "output_padding (2, 2) must be smaller"),
    (lambda x, w: btjit.conv_transpose2d(x, w[:3], padding=5), "give an output of"),
    (lambda x, w: btjit.interpolate(x, scale_factor=0), "scale_factor 0 must be positive"),
    (lambda x, w: btjit.pad(x, (1, 2, 3)), "must hold (before, after) pairs"),
    (lambda x, w: btjit.pad(x, (8, 8), "reflect"), "reflect padding of (8, 8) on an axis of size 8"),
    (lambda x, w: btjit.pixel_shuffle(x, 2), "needs (N, C*2*2, H, W)"),
    (lambda x, w: btjit.interpolate(x, scale_factor=2, mode="bicubic"), "a mode of 'nearest' (1/2-d)"),
    (lambda x, w: btjit.interpolate(x, scale_factor=2, mode="linear"), "(got mode='linear')"),
    (lambda x, w: btjit.interpolate(x, scale_factor=2, align_corners=True), "align_corners only goes with"),
])
def test_bad_arguments_name_the_function_and_the_line(call, message):
    def loss(p):
        return btjit.sum(call(p["x"], p["w"]))
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(loss, {"x": np.zeros((2, 3, 8, 8)), "w": np.zeros((4, 3, 3, 3))}, grad=False)
    assert message in str(e.value) and "test_conv.py:" in str(e.value)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float64", 0)])
def test_max_pool_ties_go_to_the_first_maximum_as_torch(dtype, tol):
    """After a relu most 2 x 2 windows are ties at 0 (and some hold -0.0): dy goes where torch sends it."""
    x = np.maximum(np.random.default_rng(5).normal(size=(3, 4, 18, 26)), 0) * (np.arange(26) % 3 != 1)
    x[0, 0, 0, :4] = -0.0
    _against_torch(lambda a: btjit.max_pool2d(a, 2), lambda a: TF.max_pool2d(a, 2), [x], dtype, tol)


INTERP = [  # x, kwargs of torch.nn.functional.interpolate
    ((2, 3, 5, 6), dict(scale_factor=2, mode="bilinear", align_corners=False)),     # a U-Net's nn.Upsample
    ((2, 3, 5, 6), dict(scale_factor=2, mode="bilinear", align_corners=True)),
    ((1, 2, 5, 6), dict(size=(7, 4), mode="bilinear")),                             # down on W
    ((1, 2, 5, 6), dict(scale_factor=(1.7, 0.6), mode="bilinear")),
    ((1, 2, 5, 6), dict(scale_factor=1.5, mode="bilinear", recompute_scale_factor=True)),
    ((1, 2, 5, 6), dict(size=(7, 4))),                                              # nearest, not whole factors
    ((1, 2, 5, 6), dict(scale_factor=1.5)),
    ((1, 2, 5, 6), dict(size=(9, 13), mode="nearest-exact")),
    ((2, 3, 7), dict(scale_factor=2.5, mode="linear", align_corners=True)),
    ((2, 3, 7), dict(size=4, mode="linear")),
    ((2, 3, 7), dict(size=1, mode="linear", align_corners=True)),
]


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
@pytest.mark.parametrize("i", range(len(INTERP)))
def test_interpolate_matches_torch(i, dtype, tol):
    xs, kw = INTERP[i]
    _against_torch(lambda a: btjit.interpolate(a, **kw), lambda a: TF.interpolate(a, **kw),
                   [np.random.default_rng(i).normal(size=xs)], dtype, tol)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("xs,ws,kw", [((2, 3, 6, 7), (4, 3, 3, 3), dict(padding=1)),
                                      ((2, 3, 6, 7), (4, 3, 4, 3), dict(padding="same")),
                                      ((2, 3, 9), (4, 3, 3), dict(padding=2, dilation=2))])
def test_padding_mode_as_nn_conv(mode, xs, ws, kw):
    """nn.Conv2d / Conv1d's padding_mode (their _conv_forward), torch's keyword bias= beside b."""
    rng = np.random.default_rng(2)
    f, m = (btjit.conv1d, torch.nn.Conv1d) if len(xs) == 3 else (btjit.conv2d, torch.nn.Conv2d)
    m = m(3, 4, ws[2:], padding_mode=mode, **kw).double()
    _against_torch(lambda a, w, b: f(a, w, bias=b, padding_mode=mode, **kw), m._conv_forward,
                   [rng.normal(size=xs), rng.normal(size=ws), rng.normal(size=ws[0])], "float64", 1e-10)
