"""Elementwise fusion (btjit/graph/fuse_ew.py + the k_ew_program interpreter): fused chains against the same
program unfused (trace(..., fuse_elementwise=False)), forward and every gradient, float32 and float64,
broadcasting both ways, where, the backward's recomputation of forward values, and a new chain compiling
nothing once the interpreter is in the library."""
import math

import numpy as np
import pytest

import btjit


def gelu(x):              # a NewGELU-like chain (0.0447: not GELU's 0.044715, which becomes one gelu op)
    return 0.5 * x * (1.0 + btjit.tanh(math.sqrt(2.0 / math.pi) * (x + 0.0447 * x ** 3)))


CHAINS = {
    "gelu": (lambda p: btjit.sum(gelu(p["x"] @ p["w"]) * p["c"]), {"x": (6, 5), "w": (5, 7), "c": (6, 7)}),
    "broadcast both ways": (lambda p: btjit.sum(btjit.tanh(p["a"] * p["b"] + p["a"]) / (1.0 + btjit.exp(-p["b"]))
                                                * p["c"]), {"a": (3, 1, 5), "b": (4, 1), "c": (3, 4, 5)}),
    "where and comparisons": (lambda p: btjit.sum(btjit.where(p["x"] > p["y"], p["x"] * 2.0, btjit.sigmoid(p["y"]))
                                                  * btjit.maximum(p["x"], 0.1) + btjit.abs(p["y"]) * (p["y"] <= 0.2)),
                              {"x": (5, 8), "y": (5, 8)}),
    "unary zoo": (lambda p: btjit.sum(btjit.sqrt(btjit.exp(p["x"]) + 1.0) * btjit.log(1.0 + p["x"] * p["x"])
                                      - btjit.relu(p["x"]) * 0.5 + p["x"] ** 1.5 * 0.0 + btjit.minimum(p["x"], -p["x"])),
                  {"x": (9, 11)}),
    "long residual mlp": (lambda p: btjit.sum(btjit.tanh(gelu(p["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["x"]) ** 2),
                          {"x": (16, 12), "w1": (12, 20), "b1": (20,), "w2": (20, 12)}),
    # slices of an outside value read in place (step 1) or loaded (step 2), one also read by a product; the
    # gradient of split pieces written into their concatenation (one piece's gradient an outside value)
    "slices": (lambda p: btjit.sum(btjit.tanh(p["g"][:, :4]) * p["g"][:, 8:] + btjit.sigmoid(p["g"][:, ::3])
                                   + (p["g"][:, :4] @ p["w"]) ** 2), {"g": (5, 12), "w": (4, 4)}),
    "concatenation of a chain's value and another": (
        lambda p: btjit.sum(btjit.concatenate([btjit.tanh(p["a"]) * p["b"], p["b"]], -1) @ p["w"]),
        {"a": (4, 3), "b": (4, 3), "w": (6, 2)}),
    "split gradient": (lambda p: btjit.sum(_pieces(*btjit.split(p["g"] @ p["w"], 3, axis=-1))),
                       {"g": (6, 5), "w": (5, 12)}),
    # the gradients of column slices that tile the input: a concatenation of (6, 1) pieces, whose regions have
    # a stride of 4 along the iteration space's rows, so the group is not fused (its outputs are written in place)
    "product of every column": (lambda p: btjit.sum(np.prod(p["g"] @ p["w"], axis=1) * p["c"]),
                                {"g": (6, 5), "w": (5, 4), "c": (6,)}),
    # two chains reading the same arrays (an optimizer's param and state updates): one group, one pass
    "siblings": (lambda p: _siblings(p["a"], p["b"], p["w"]), {"a": (5, 6), "b": (5, 6), "w": (6, 3)}),
    # a product and the add / subtract reading it: one FMA / FMS / FNMA instruction each (fuse_ew.multiply_add)
    "multiply-adds": (lambda p: btjit.sum((p["a"] * p["b"] + p["c"]) * (p["a"] * p["c"] - p["b"])
                                          + btjit.tanh(p["c"] - p["a"] * p["b"]) * p["a"]),
                      {"a": (7, 9), "b": (7, 9), "c": (7, 9)}),
    # sums and differences of two products (FMA2 / FMS2), one of them across a sign (Lion's update)
    "two-products": (lambda p: btjit.sum(btjit.tanh(p["a"] * p["b"] + p["c"] * 0.5) *
                                         (p["c"] * 0.9 - 0.01 * np.sign(p["a"] * p["b"] - p["c"] * p["c"]))),
                     {"a": (5, 300), "b": (5, 300), "c": (5, 300)}),
    # products and sums with a scalar (the interpreter's a*x + b*y and a*x + b forms), on either side
    "scalar operands": (lambda p: btjit.sum(btjit.tanh(2.0 - p["a"]) * (p["a"] - 0.5) + (0.25 + p["b"]) * (p["b"] * 1.5)
                                            + btjit.sin(0.9 * p["a"] + 0.1 * p["b"]) * (p["c"] * 0.3 - p["a"] * 0.7)
                                            + btjit.exp(p["c"] - 3.0 * p["a"]) + (1.0 - p["c"] * p["b"]) * 2.0
                                            + btjit.tanh(p["b"] / 3.0) * (p["c"] / p["a"])),
                        {"a": (3, 1100), "b": (3, 1100), "c": (3, 1100)}),
}


def _siblings(a, b, w):
    t, u = btjit.tanh(a * b), a * 0.5 + b
    return btjit.sum(t @ w + u @ w)


def _pieces(a, b, c):
    return btjit.sigmoid(a) * b + c * 2.0 + btjit.tanh(c) * a + b


def _params(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return {k: (np.abs(rng.normal(size=s)) + 0.1 if k == "x" and len(s) == 2 and s == (9, 11) else
                rng.normal(0, 0.5, size=s)).astype(dtype) for k, s in shapes.items()}


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_chain_equals_unfused(name, dtype):
    fn, shapes = CHAINS[name]
    p = _params(shapes, dtype)
    fused = btjit.trace(fn, p, dtype=dtype, grad=True)
    plain = btjit.trace(fn, p, dtype=dtype, grad=True, fuse_elementwise=False)
    assert any(e.op == "ew_fused" for e in fused.graph.eqns) and not any(e.op == "ew_fused" for e in plain.graph.eqns)
    assert fused.tape.shape[0] < plain.tape.shape[0]
    if name == "siblings":          # forward: tanh(a*b) and a*0.5 + b one pass over a and b (two values out)
        assert len(fused.graph.eqns[0].outs) == 2 and fused.graph.eqns[0].op == "ew_fused"
    tol = 1e-13 if dtype == "float64" else 3e-6
    assert fused.value_and_grad() == pytest.approx(plain.value_and_grad(), rel=tol, abs=tol)
    for k in p:
        g, want = fused.grads[k], plain.grads[k]
        np.testing.assert_allclose(g, want, rtol=tol * 10, atol=tol * 10 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lone_unary_op_runs_on_the_interpreter(dtype):
    """A unary op between two products (an RNN's tanh) is a one-instruction ew_fused row, not a k_unary row of its
    own: a program with one compiles no kernel for it. Values and gradients as the unfused program's."""
    from btjit.kernels.library import LIBRARY
    def fn(p):
        return btjit.sum((btjit.sqrt(btjit.tanh(p["x"] @ p["w1"]) @ p["w2"] + 3.0)) @ p["w3"])
    p = _params({"x": (6, 5), "w1": (5, 7), "w2": (7, 4), "w3": (4, 3)}, dtype, seed=2)
    fused = btjit.trace(fn, p, dtype=dtype, grad=True)
    plain = btjit.trace(fn, p, dtype=dtype, grad=True, fuse_elementwise=False)
    assert not any(e.op in ("tanh", "sqrt") for e in fused.graph.eqns)
    assert any(e.op == "tanh" for e in plain.graph.eqns)
    assert "k_unary" not in {LIBRARY.entry_of(op)[0] for op in fused.tape[:, 0]}
    tol = 1e-13 if dtype == "float64" else 3e-6
    assert fused.value_and_grad() == pytest.approx(plain.value_and_grad(), rel=tol, abs=tol)
    for k in p:
        np.testing.assert_allclose(fused.grads[k], plain.grads[k], rtol=tol * 10, atol=tol * 10)


def test_fused_chain_trains_like_the_unfused_one():
    fn, shapes = CHAINS["long residual mlp"]
    p = _params(shapes, "float64", seed=3)
    progs = [btjit.trace(fn, p, dtype="float64", optimizer=btjit.optim.AdamW(lr=1e-2), fuse_elementwise=f)
             for f in (True, False)]
    for _ in range(5):
        a, b = (q.step() for q in progs)
        assert a == pytest.approx(b, rel=1e-12)
    for k in p:
        np.testing.assert_allclose(progs[0].params[k], progs[1].params[k], rtol=1e-11, atol=1e-13)


def test_backward_recomputes_forward_values_instead_of_storing_them():
    """GELU's forward is one fused row storing only its result; the backward's fused row recomputes tanh(u)
    and the other intermediates from the matmul output rather than reading them."""
    c = np.random.default_rng(1).normal(size=(6, 7))
    fn = lambda p: btjit.sum(gelu(p["x"] @ p["w"]) * c)  # noqa: E731
    p = _params({"x": (6, 5), "w": (5, 7)}, "float32")
    prog = btjit.trace(fn, p, dtype="float32", grad=True)
    fwd = [e for e in prog.graph.eqns[:prog.graph.n_forward] if e.op == "ew_fused"]
    bwd = [e for e in prog.graph.eqns[prog.graph.n_forward:] if e.op == "ew_fused"]
    assert len(fwd) == 1 and len(fwd[0].outs) == 1 and bwd
    assert any(op == "tanh" for op, *_ in bwd[0].attrs["body"])       # recomputed in the backward
    plain = btjit.trace(fn, p, dtype="float32", grad=True, fuse_elementwise=False)
    assert prog.plan.float_size < plain.plan.float_size       # fewer float values kept (the programs are ints)


def test_a_new_chain_compiles_nothing_once_the_interpreter_is_loaded():
    p = {"x": np.linspace(0.1, 2.0, 12).reshape(3, 4).astype(np.float32)}
    first = btjit.trace(lambda p: btjit.sum(btjit.tanh(p["x"]) * p["x"] + 1.0), p, grad=True)
    assert "k_ew_program_f32" in first.kernels.entries
    second = btjit.trace(lambda p: btjit.sum(btjit.sigmoid(p["x"] * 3.0) / (p["x"] + 2.0) - btjit.exp(-p["x"])), p,
                         grad=True)
    assert "k_ew_program_f32" in second.kernels.entries and second.kernels.compiled == []
    x = p["x"].astype(np.float64)
    want = (1 / (1 + np.exp(-3 * x)) / (x + 2) - np.exp(-x)).sum()
    assert second.value_and_grad() == pytest.approx(want, rel=1e-5)


def test_split_gates_are_read_in_place_and_their_gradient_written_as_one_array():
    fn, shapes = CHAINS["split gradient"]
    g = btjit.trace(fn, _params(shapes, "float64"), dtype="float64", grad=True).graph
    ops = [e.op for e in g.eqns]
    assert ops.count("ew_fused") == 2 and not {"slice", "slice_scatter", "concatenate", "add"} & set(ops), str(g)
    bwd = next(e for e in g.eqns[g.n_forward:] if e.op == "ew_fused")
    assert (6, 12) in bwd.attrs["oshapes"] and len(bwd.attrs["oview"]) == len(bwd.outs) + 2


def test_an_optimizers_update_reading_the_same_arrays_is_one_pass():
    """Lion's new param and new state are two chains sharing only their inputs (m and g): one fused group,
    so one pass over the params, grads and state (fuse_ew's sibling join)."""
    p = _params({"x": (4, 6), "w": (6, 3)}, "float32")
    prog = btjit.trace(lambda q, x: btjit.sum((x @ q["w"]) ** 2), {"w": p["w"]}, p["x"],
                       optimizer=btjit.optim.Lion(lr=1e-3, weight_decay=0.1))
    g = prog.graph
    update = [e for e in g.eqns[g.n_backward:] if e.op == "ew_fused" and e.attrs["shape"] != ()]
    assert len(update) == 1 and len(update[0].outs) == 2


def test_multiply_add_instructions():
    """multiply_add turns a product read only by the add / subtract after it into FMA (x*y + z), FMS (x*y - z)
    or FNMA (z - x*y), and two products read only by the sum after them into FMA2 (x*y + z*w) / FMS2 (x*y - z*w),
    also where a product was made earlier and its factors are unchanged in between; not when the product is
    read again later, read twice by the sum, or the sum would overwrite one of the product's operands; the
    chains that have them run them (the CHAINS cases)."""
    from btjit.graph.fuse_ew import multiply_add
    from btjit.kernels.elementwise import B_ADD, B_MUL, B_SUB, U_EXP, U_SIGN
    from btjit.kernels.fused import BIN, FMA, FMA2, FMS, FMS2, FNMA, HEAD, WIDTH
    mul, add, sub = BIN + B_MUL, BIN + B_ADD, BIN + B_SUB
    assert multiply_add([(mul, 3, 1, -2, 0), (add, 4, 3, 5, 0)]) == [(FMA, 4, 1, -2, 5)]
    assert multiply_add([(mul, 3, 1, 2, 0), (add, -1, 5, 3, 0)]) == [(FMA, -1, 1, 2, 5)]
    assert multiply_add([(mul, 3, 1, 2, 0), (sub, 4, 3, 5, 0)]) == [(FMS, 4, 1, 2, 5)]
    assert multiply_add([(mul, 3, 1, 2, 0), (sub, 4, 5, 3, 0), (U_EXP, 3, 4, 4, 0), (add, 6, 3, 3, 0)]) == \
        [(FNMA, 4, 1, 2, 5), (U_EXP, 3, 4, 4, 0), (add, 6, 3, 3, 0)]                # 3 written again first
    assert multiply_add([(mul, 3, 1, -2, 0), (mul, 4, 5, 6, 0), (sub, 7, 4, 3, 0)]) == [(FMS2, 7, 5, 6, 1, -2)]
    folded = multiply_add([(mul, 3, 1, -2, 0), (U_SIGN, 4, 5, 5, 0), (mul, 6, 7, 4, 0), (sub, -3, 3, 6, 0)])
    assert folded == [(U_SIGN, 4, 5, 5, 0), (FMS2, -3, 1, -2, 7, 4)]               # p * s - lr * sign(c)
    kept = [[(mul, 3, 1, 2, 0), (add, 4, 3, 5, 0), (U_EXP, 6, 3, 3, 0)],          # the product read later
            [(mul, 3, 1, 2, 0), (add, 4, 3, 3, 0)],                                # read twice by the sum
            [(mul, 3, 1, 2, 0), (add, 1, 3, 5, 0)],                                # the sum overwrites x
            [(mul, -3, 1, 2, 0), (add, 4, -3, 5, 0)]]                              # a product in the arena
    for instrs in kept:
        assert multiply_add(instrs) == instrs
    assert multiply_add([(mul, 3, 1, 2, 0), (mul, 4, 3, 6, 0), (add, 7, 3, 4, 0)]) == \
        [(mul, 3, 1, 2, 0), (FMA, 7, 3, 6, 3)]                                    # a product of the product
    moved = [(mul, 3, -1, 2, 0), (U_EXP, -4, 5, 5, 0), (FMA, 6, 7, 8, 3)]         # the arena written between
    assert multiply_add(moved) == moved
    for chain, want in (("multiply-adds", {FMA, FMS, FNMA}), ("two-products", {FMA2, FMS2})):
        prog = btjit.trace(CHAINS[chain][0], _params(CHAINS[chain][1], "float64"), dtype="float64", grad=True)
        ops = set()
        for r in prog.tape:
            if btjit.core.program.LIBRARY.entry_of(r[0])[0] == "k_ew_program":
                P = prog.ia[r[1]:]
                ops |= {int(P[HEAD + 4 * P[1] + WIDTH * t]) for t in range(P[0])}
        assert want <= ops, chain


class _ScalarForms(btjit.optim.Optimizer):
    """An update whose param and state arrays are written in place by every scalar form of the interpreter
    (fused._affine): as the first term or the second, p - lr * v, b * s + (1 - b) * g, 0.5 * t - 0.25, 2 * u,
    1.5 + w."""
    def __init__(self):
        super().__init__(lr=0.1, b=0.9)

    def init(self, name, param):
        return {k: np.full_like(param, 0.5) for k in "stuw"}

    def update(self, p, g, st, hp, step):
        v = (1 - hp["b"]) * g + hp["b"] * st["s"]
        t = 0.5 * st["t"] - 0.25 + g
        return p - hp["lr"] * v, {"s": v, "t": t, "u": 2.0 * st["u"], "w": 1.5 + st["w"]}


def test_updates_written_in_place_with_scalar_operands():
    rng = np.random.default_rng(5)
    w0, x = rng.normal(size=(40, 70)), rng.normal(size=(8, 40))
    prog = btjit.trace(lambda q, x: btjit.sum(btjit.tanh(x @ q["w"])), {"w": w0}, x, optimizer=_ScalarForms(),
                       dtype="float64")
    w, st = w0.copy(), {k: np.full_like(w0, 0.5) for k in "stuw"}
    for _ in range(3):
        prog.step(x)
        g = x.T @ (1 - np.tanh(x @ w) ** 2)
        st = {"s": 0.1 * g + 0.9 * st["s"], "t": 0.5 * st["t"] - 0.25 + g, "u": 2 * st["u"], "w": 1.5 + st["w"]}
        w = w - 0.1 * st["s"]
    np.testing.assert_allclose(prog.params["w"], w, rtol=1e-12, atol=1e-12)
    for k in "stuw":
        np.testing.assert_allclose(prog.opt_state[k]["w"], st[k], rtol=1e-12, atol=1e-12, err_msg=k)
