"""Bad input gets an error that names the problem (issue 5): tracing errors name the op, the shapes and the
user's source line (checked exactly, not just the file); step() rejects wrong shapes/dtypes and out-of-range
ids without touching the arena, and copies non-contiguous or read-only arrays correctly. What
test_program_api.py already checks (matmul shape mismatch, `if` on a traced value, np.nanmedian, int as float, int
params, the unused-parameter warning, basic step() rejections) is not repeated; this file covers the rest of the
list.
Config/CLI errors are in test_cli.py / test_config.py; the gaps they left in test_errors_cli.py."""
import inspect
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import btjit


def line_of(fn, marker: str) -> str:
    """'test_errors.py:<n>' of the line of fn's source that contains `marker`."""
    src, start = inspect.getsourcelines(fn)
    hits = [start + i for i, l in enumerate(src) if marker in l]
    assert len(hits) == 1, (marker, hits)
    return f"test_errors.py:{hits[0]}"


def trace_error(fn, params, *batch, marker=None, at=None, **kw):
    """Trace fn expecting a TraceError; the message must end with the user's line: the line of fn holding
    `marker`, or the first line of the function `at` (a one-line lambda: the innermost user frame)."""
    kw.setdefault("dtype", "float64")
    kw.setdefault("grad", True)
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(fn, params, *batch, **kw)
    msg = str(e.value)
    want = line_of(fn, marker) if at is None else f"test_errors.py:{at.__code__.co_firstlineno}"
    assert msg.endswith(want), msg
    return msg


W = {"w": np.ones((3, 4))}


# ----------------------------------------------------------------------------- tracing
def test_a_missing_name_in_the_programs_dicts_lists_the_known_ones():
    fn = lambda p, x: btjit.sum((x @ p["w"]) * p["h"])       # noqa: E731
    x = np.ones((2, 3))
    with pytest.raises(KeyError, match=r"p\['W'\]: no such param or buffer \(known: w, h\)"):
        btjit.trace(lambda p, x: btjit.sum(x @ p["W"]), W, x, buffers={"h": np.ones(4)}, dtype="float64")
    prog = btjit.trace(fn, W, x, buffers={"h": np.ones(4)}, optimizer=btjit.optim.SGD(lr=0.1, momentum=0.9),
                       dtype="float64")
    for where, d, known in [("prog.params", prog.params, "w"), ("prog.grads", prog.grads, "w"),
                            ("prog.buffers", prog.buffers, "h"),
                            ("prog.opt_state", prog.opt_state, "momentum_buffer"),
                            ("prog.opt_state['momentum_buffer']", prog.opt_state["momentum_buffer"], "w")]:
        with pytest.raises(KeyError, match=rf"{re.escape(where)}\['W'\]: no such .* \(known: {known}\)$"):
            d["W"]
        assert isinstance(d, dict) and list(d) == [known] and d.get("W") is None
    prog.step(x)
    assert prog.opt_state["momentum_buffer"]["w"].shape == (3, 4) and prog.grads["w"].shape == (3, 4)


@pytest.mark.parametrize("form", ["if", "while", "float", "int", "range", "index", "asarray", "item"])
def test_concrete_value_of_a_traced_value(form):
    def fn(p):
        s = btjit.sum(p["w"])
        if form == "if":
            if s > 0:  # HERE
                return s
        elif form == "while":
            while s > 0:  # HERE
                s = s - 1.0
        elif form == "float":
            return s * float(s)  # HERE
        elif form == "int":
            return s * int(s)  # HERE
        elif form == "range":
            return s * len(range(s))  # HERE
        elif form == "index":
            return p["w"][s].sum()  # HERE
        elif form == "asarray":
            return btjit.sum(np.asarray(p["w"]))  # HERE
        elif form == "item":
            return s * s.item()  # HERE
        return s
    src, start = inspect.getsourcelines(fn)
    line = next(start + i for i, l in enumerate(src) if "# HERE" in l and f'form == "{form}"' in src[i - 1])
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(fn, W, dtype="float64", grad=True)
    msg = str(e.value)
    assert msg.endswith(f"test_errors.py:{line}"), msg
    if form == "asarray":
        assert "cannot be converted to a numpy array" in msg
    elif form == "index":
        assert msg.startswith("getitem: a traced float index"), msg
    else:
        assert "data-dependent control flow" in msg and "btjit.where" in msg


@pytest.mark.parametrize("call,name", [
    (lambda x: np.nanmedian(x), "np.nanmedian"), (lambda x: np.nanmean(x), "np.nanmean"),
    (lambda x: np.arctan(x), "np.arctan"),
    (lambda x: np.exp(x, dtype=np.float32), "np.exp"), (lambda x: np.add.reduce(x), "np.add"),
    (lambda x: np.unique(x), "np.unique"),
])
def test_unsupported_numpy_function_names_it_and_the_line(call, name):
    def fn(p):
        return btjit.sum(call(p["w"]))
    msg = trace_error(fn, W, at=call)
    assert f"numpy function {name} is not supported on traced values" in msg, msg


@pytest.mark.parametrize("value,dtype", [(np.zeros(3, np.int32), "int32"), (np.zeros(3, bool), "bool"),
                                         (np.zeros(3, complex), "complex128"), (np.array(["a"]), "<U1")])
def test_non_float_parameter_names_the_parameter(value, dtype):
    with pytest.raises(TypeError, match=rf"parameter 'bad' has dtype {re.escape(dtype)}; parameters must be float"):
        btjit.trace(lambda p: btjit.sum(p["w"]), {"w": np.ones(3), "bad": value}, grad=True)


def test_param_that_never_reaches_the_loss_warns_at_the_callers_line():
    def fn(p, x):
        m = btjit.where(p["gate"] > 0, 1.0, 0.0)          # only through a comparison: no gradient path
        _ = btjit.exp(p["dead"])                            # computed, but not used by the loss
        return btjit.sum(p["w"] * x * m)
    params = {"w": np.ones(3), "gate": np.ones(3), "dead": np.ones(3)}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        btjit.trace(fn, params, np.ones(3), dtype="float64", grad=True)  # <-- the warning points here
    msgs = [w for w in rec if "btjit" in str(w.message)]
    assert sorted(str(w.message).split("'")[1] for w in msgs) == ["dead", "gate"]
    assert all("does not reach the loss; its gradient is always zero" in str(w.message) for w in msgs)
    here = line_of(test_param_that_never_reaches_the_loss_warns_at_the_callers_line, "# <-- the warning " + "points")
    assert all(f"{Path(w.filename).name}:{w.lineno}" == here for w in msgs)


@pytest.mark.parametrize("use,op", [(lambda p, i: p["w"] * i, "mul"), (lambda p, i: btjit.exp(i), "exp"),
                                    (lambda p, i: i.sum() * p["w"], "sum"), (lambda p, i: 1.0 / i + p["w"], "div"),
                                    (lambda p, i: btjit.softmax(i) * p["w"], "softmax"),
                                    (lambda p, i: btjit.where(i, p["w"], 0.0), "where")])
def test_integer_input_used_as_float(use, op):
    def fn(p, i):
        return btjit.sum(use(p, i))
    msg = trace_error(fn, {"w": np.ones(3)}, np.arange(3, dtype=np.int32), at=use)
    assert msg.startswith(f"{op}:") or op == "where", msg
    assert "integer" in msg and ("where floats are needed" in msg or "not integer" in msg), msg


@pytest.mark.parametrize("bad,needles", [
    (lambda p: p["a"] + p["b"], ["add: shapes do not broadcast", "(3, 4) and (5,)"]),
    (lambda p: p["a"].reshape(5, 2), ["reshape: cannot reshape (3, 4) into (5, 2)"]),
    (lambda p: btjit.concatenate([p["a"], p["b"]], axis=0), ["concatenate: all inputs must agree", "(3, 4) and (5,)"]),
    (lambda p: btjit.layer_norm(p["a"], p["b"], p["b"]), ["layernorm: weight and bias must have shape (4,)"]),
    (lambda p: btjit.cross_entropy(p["a"], np.zeros(4, np.int32)),
     ["cross_entropy: targets shape (4,) must equal logits shape (3, 4) without its last axis"]),
    (lambda p: btjit.softmax(p["a"], axis=2), ["softmax: axis 2 out of range for 2-d input"]),
    (lambda p: p["a"].sum(axis=2), ["sum: axis 2 out of range for 2-d input"]),
    (lambda p: p["a"][3], ["getitem: index 3 out of range for axis 0 of size 3"]),
    (lambda p: p["a"][0, 0, 0], ["getitem: too many indices for a 2-d value"]),
    (lambda p: btjit.setitem(p["a"], slice(None, None, -1), 0.0), ["setitem: only positive slice steps can index an"]),
    (lambda p: btjit.split(p["a"], 2, axis=0), ["split: axis 0 of size 3 does not divide into 2 sections"]),
    (lambda p: btjit.broadcast_to(p["a"], (3, 5)), ["broadcast_to: cannot broadcast (3, 4) to (3, 5)"]),
    (lambda p: p["a"].transpose(0, 0), ["transpose: bad axes (0, 0) for a 2-d input"]),
    (lambda p: btjit.causal_attention(p["a"].reshape(1, 3, 4), 2), ["causal_attention: qkv must be (B, T, 3*C)"]),
    (lambda p: p["a"] @ p["b"], ["matmul: shapes (3, 4) and (5, 1) do not align (4 != 5)"]),
    (lambda p: btjit.take(p["a"], np.array([0.5])), ["take: index array must be integer, got float64"]),
    (lambda p: btjit.take(p["a"], [0, 3]), ["take: index out of range for axis 0 of size 3"]),
    (lambda p: btjit.cross_entropy(p["a"], np.array([0, 4, 1])), ["cross_entropy: target values must be in [0, 4)",
                                                                  "max 4"]),
    (lambda p: btjit.cross_entropy(p["a"], np.array([0, -1, 1])), ["cross_entropy: target values must be in [0, 4)",
                                                                   "min -1"]),
    (lambda p: btjit.cross_entropy(p["a"], np.array([0.0, 1.0, 1.0])), ["cross_entropy: targets must be integer"]),
])
def test_shape_and_argument_errors_name_op_shapes_and_line(bad, needles):
    params = {"a": np.ones((3, 4)), "b": np.ones(5)}
    if "matmul" in needles[0]:
        params["b"] = np.ones((5, 1))

    def fn(p):
        return btjit.sum(bad(p))
    msg = trace_error(fn, params, at=bad)
    for n in needles:
        assert n in msg, (n, msg)


def test_error_in_a_helper_names_the_helpers_line():
    def block(x, w):
        return x @ w  # HELPER

    def fn(p, x):
        return btjit.sum(block(x, p["w"]))
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(fn, {"w": np.ones((5, 2))}, np.ones((2, 4)), dtype="float64", grad=True)
    msg = str(e.value)
    assert msg.startswith("matmul:") and msg.endswith(line_of(block, "# HELPER")), msg


def test_integer_values_can_be_sliced_inside_the_trace():
    """Was a TraceError ("integer arrays can only be reshaped or used as indices"): the GPT pattern
    x[:, :-1] / x[:, 1:] and a transposed index now trace, and give numpy's values."""
    emb = np.random.default_rng(0).normal(size=(5, 5))
    x = np.array([[0, 1, 2, 3], [4, 3, 2, 1]], np.int32)
    prog = btjit.trace(lambda p, x: btjit.cross_entropy(btjit.take(p["emb"], x[:, :-1]), x[:, 1:]), {"emb": emb}, x,
                       dtype="float64", grad=True)
    z = emb[x[:, :-1]]
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    assert prog.value_and_grad(x) == pytest.approx(-np.take_along_axis(lp, x[:, 1:, None], -1).mean(), rel=1e-12)
    prog2 = btjit.trace(lambda p, x: btjit.sum(btjit.take(p["emb"], x.T) ** 2), {"emb": emb}, x, dtype="float64",
                        grad=True)
    assert prog2.value_and_grad(x) == pytest.approx((emb[x.T] ** 2).sum(), rel=1e-12)


def test_cross_entropy_accepts_a_0d_integer_target():
    prog = btjit.trace(lambda p: btjit.cross_entropy(p["w"], np.int64(2)), {"w": np.arange(4.0)}, dtype="float64",
                       grad=True)
    lp = np.arange(4.0) - np.log(np.exp(np.arange(4.0)).sum())
    assert abs(prog.value_and_grad() + lp[2]) < 1e-12


def test_tracer_from_another_trace_is_an_error_not_an_alias():
    """A tracer kept from an earlier trace used to alias whatever value had the same id in the new graph
    (a silently wrong loss: 615 instead of 45). Now it is a TraceError naming the op and line."""
    kept = {}

    def first(p):
        kept["t"] = p["w"] * 2.0
        return btjit.sum(p["w"])
    w = np.arange(6.0).reshape(3, 2)
    btjit.trace(first, {"w": w}, dtype="float64", grad=True)

    def second(p):
        return btjit.sum(p["w"] + kept["t"])  # HERE
    params = {"w": w, "a": np.ones(1), "b": np.full((3, 2), 100.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msg = trace_error(second, params, marker="# HERE")
        assert msg.startswith("add: uses a traced value from another btjit.trace call"), msg
        with pytest.raises(btjit.TraceError, match="the returned value is a traced value from another"):
            btjit.trace(lambda p: kept["t"], params, dtype="float64")
    with pytest.raises(btjit.TraceError, match="can only be used inside a function traced by btjit.trace"):
        btjit.exp(kept["t"])


@pytest.mark.parametrize("ret,needle", [
    (lambda p: 3.0, "must return a traced value (got float)"),
    (lambda p: (btjit.sum(p["w"]), {"h": np.ones(3)}), "output 'h' is not a traced value"),
    (lambda p: p["w"] * 2.0, "the loss must be a float scalar to differentiate, got shape (3, 4)"),
])
def test_bad_return_values(ret, needle):
    with pytest.raises(btjit.TraceError) as e:
        btjit.trace(ret, W, dtype="float64", grad=True)
    assert needle in str(e.value)


def test_bad_trace_arguments():
    with pytest.raises(ValueError, match="dtype must be float32 or float64, got 'float16'"):
        btjit.trace(lambda p: btjit.sum(p["w"]), W, dtype="float16", grad=True)
    with pytest.raises(TypeError, match="params must be a dict"):
        btjit.trace(lambda p: btjit.sum(p[0]), [np.ones(3)], grad=True)
    with pytest.raises(TypeError, match="batch argument 'x' has dtype <U1"):
        btjit.trace(lambda p, x: btjit.sum(p["w"]), W, np.array(["a"]), grad=True)


# ----------------------------------------------------------------------------- step()
def _gpt_like():
    """An embedding + head model: int ids (B, T) in, int targets out; float32 as in training."""
    rng = np.random.default_rng(0)
    params = {"emb": rng.normal(size=(7, 5)).astype(np.float32), "head": rng.normal(size=(5, 4)).astype(np.float32)}

    def loss(p, x, y):
        return btjit.cross_entropy(btjit.take(p["emb"], x) @ p["head"], y)
    x = rng.integers(0, 7, (3, 2)).astype(np.int32)
    y = rng.integers(0, 4, (3, 2)).astype(np.int32)
    return params, loss, x, y


def _put(a, v):
    a = a.copy()
    a.flat[1] = v
    return a


def _fresh(params, loss, x, y):
    return btjit.trace(loss, params, x, y, optimizer=btjit.optim.AdamW(lr=0.01))


@pytest.mark.parametrize("which,bad,needle", [
    ("x", lambda x: x.astype(np.float32), r"batch argument 0 \(x\): expected int array of shape \(3, 2\), got float32"),
    ("y", lambda y: y.reshape(2, 3), r"batch argument 1 \(y\): expected int array of shape \(3, 2\), got int32 \(2, 3\)"),
    ("x", lambda x: x[None], r"expected int array of shape \(3, 2\), got int32 \(1, 3, 2\)"),
    ("x", lambda x: x.tolist(), None),                                   # a nested list: converted, fine
    ("x", lambda x: x.astype(np.int64), None),                           # any int dtype: converted
    ("x", lambda x: x.astype(np.uint8), None),
    ("x", lambda x: _put(x, -1), r"argument 0 \(x\): index values must be in \[0, 7\), got min -1"),
    ("x", lambda x: _put(x, 7), r"argument 0 \(x\): index values must be in \[0, 7\), got min \d+ max 7"),
    ("x", lambda x: _put(x.astype(np.int64), -2 ** 40), r"argument 0 \(x\): index values must be in \[0, 7\)"),
    ("y", lambda y: _put(y, 4), r"argument 1 \(y\): index values must be in \[0, 4\)"),
    ("y", lambda y: y - 4, r"argument 1 \(y\): index values must be in \[0, 4\), got min -4"),
    ("x", lambda x: x.astype(np.int64) + 2 ** 32, r"index values must be in \[0, 7\), got min 429496729\d"),
    ("x", lambda x: x.astype(np.uint64) + np.uint64(2 ** 63), r"index values must be in \[0, 7\), got min 92233720368"),
])
def test_step_rejects_bad_batches_and_leaves_the_state_untouched(which, bad, needle):
    params, loss, x, y = _gpt_like()
    prog = _fresh(params, loss, x, y)
    prog.step(x, y)
    before = prog.state_dict()
    args = {"x": x, "y": y}
    args[which] = bad(args[which])
    if needle is None:
        ref = _fresh(params, loss, x, y)
        ref.step(x, y)
        assert prog.step(args["x"], args["y"]) == ref.step(x, y)
        return
    with pytest.raises(ValueError, match=needle):
        prog.step(args["x"], args["y"])
    after = prog.state_dict()
    for k in before:                                 # no update, no optimizer step counted
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    ref = _fresh(params, loss, x, y)                 # and the program still computes the right thing
    ref.step(x, y)
    assert prog.step(x, y) == ref.step(x, y)
    for k in prog.params:
        np.testing.assert_array_equal(prog.params[k], ref.params[k])


def test_float_batch_dtype_mismatch_is_explained_not_cast():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    prog = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(x @ p["w"])), {"w": np.ones((3, 2), np.float32)}, x,
                       optimizer=btjit.optim.SGD(lr=0.1))
    for bad, got in [(x.astype(np.float64), "float64"), (x.astype(np.float16), "float16"),
                     ((x > 0).astype(np.int32), "int32")]:
        with pytest.raises(ValueError, match=rf"argument 0 \(x\): expected float32 array of shape \(4, 3\), got {got}"):
            prog.step(bad)


@pytest.mark.parametrize("layout", ["strided", "fortran", "reversed", "readonly", "broadcast", "0-strided-int"])
def test_non_contiguous_and_read_only_batches_are_copied_correctly(layout):
    rng = np.random.default_rng(1)
    big = rng.normal(size=(8, 6)).astype(np.float32)
    ids = rng.integers(0, 5, size=(4,)).astype(np.int32)
    x = {"strided": big[::2, ::2], "fortran": np.asfortranarray(big[:4, :3]), "reversed": big[:4, :3][::-1, ::-1],
         "readonly": big[:4, :3].copy(), "broadcast": np.broadcast_to(big[0, :3], (4, 3)),
         "0-strided-int": big[:4, :3]}[layout]
    if layout == "readonly":
        x.setflags(write=False)
    if layout == "0-strided-int":
        ids = np.broadcast_to(np.int64(3), (4,))
    assert layout == "readonly" or not x.flags.c_contiguous or layout == "0-strided-int"

    def loss(p, x, i):
        return btjit.sum(btjit.tanh(x @ p["w"]) * btjit.take(p["e"], i))
    params = {"w": rng.normal(size=(3, 2)).astype(np.float32), "e": rng.normal(size=(5, 2)).astype(np.float32)}
    xc, ic = np.ascontiguousarray(x), np.ascontiguousarray(ids, dtype=np.int32)
    a = btjit.trace(loss, params, xc, ic, optimizer=btjit.optim.SGD(lr=0.1))
    b = btjit.trace(loss, params, xc, ic, optimizer=btjit.optim.SGD(lr=0.1))
    for _ in range(3):
        assert a.step(x, ids) == b.step(xc, ic)
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    assert a.forward(x, ids) == b.forward(xc, ic)


def test_out_of_range_index_into_a_folded_embedding_is_caught_before_any_update():
    """Through the embedding fold (graph/fuse.py) the table is read by take_sum: same native check."""
    from btjit.models import mlp
    cfg = mlp.MLPConfig(vocab_size=5, context=3, n_emb=4, n_hidden=8)
    params = mlp.init_params(cfg, 0)
    x = np.zeros((16, 3), np.int32)
    y = np.zeros(16, np.int32)
    prog = btjit.trace(mlp.loss_fn(cfg), params, x, y, optimizer=btjit.optim.SGD(lr=0.1))
    assert "take_sum" in [e.op for e in prog.graph.eqns]
    before = prog.state_dict()
    with pytest.raises(ValueError, match=r"batch argument 0 \(x\): index values must be in \[0, 5\), got min 0 max 5"):
        prog.step(_put(x, 5), y)
    for k, v in prog.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
