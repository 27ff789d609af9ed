"""The notebook API of a traced program as a user drives it: load_state_dict refuses names the program does not
have, a partial optimizer state and other shapes (naming the key, loading nothing), and loads into programs of
another batch size, thread count or dtype; prog.params / grads / outputs / opt_state (and the exported
runtime's) copy what is assigned into the arena, by [name] = or update(), and refuse to lose an entry."""
import numpy as np
import pytest

import btjit
import btjit.runtime


def _loss(p, x, y):
    h = x @ p["w"] + p["b"]
    btjit.assign(p["rm"], 0.9 * p["rm"] + 0.1 * btjit.mean(h, axis=0))
    return btjit.cross_entropy(h, y), {"h": h}


def _data(n=8, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(dtype)
    return x, (x[:, 0] > 0).astype(np.int32)


def _prog(n=8, opt=None, **kw):
    rng = np.random.default_rng(1)
    p = {"w": rng.normal(size=(4, 3)), "b": np.zeros(3)}
    return btjit.trace(_loss, p, *_data(n, dtype=np.dtype(kw.get("dtype", "float32"))), buffers={"rm": np.zeros(3)},
                       optimizer=opt or btjit.optim.AdamW(lr=0.05), **kw)


def _trained():
    prog = _prog()
    for i in range(3):
        prog.step(*_data(seed=i))
    return prog


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update({"param/zzz": np.ones(3)}), r"has param/zzz, which this program does not"),
    (lambda d: d.update({"buffer/rm2": np.ones(3)}), r"has buffer/rm2, which this program does not"),
    (lambda d: d.update({"opt/momentum_buffer": d["opt/exp_avg"]}), r"has opt/momentum_buffer, which"),
    (lambda d: d.pop("opt/exp_avg_sq"), r"optimizer state 'opt/exp_avg_sq': the state dict has opt/exp_avg but not"),
    (lambda d: d.update({"opt/exp_avg": d["opt/exp_avg"][:5]}), r"'opt/exp_avg': the state dict has shape \(5,\)"),
    (lambda d: d.update({"opt/exp_avg": np.float32(1.0)}), r"'opt/exp_avg': the state dict has shape \(\)"),
    (lambda d: d.update({"param/b": np.ones(4)}), r"param 'b': the state dict has shape \(4,\)"),
    (lambda d: d.pop("buffer/rm"), r"buffer 'rm': the state dict has no buffer/rm"),
])
def test_a_state_dict_that_does_not_fit_is_refused_whole(edit, needle):
    sd = _trained().state_dict()
    edit(sd)
    prog = _prog()
    before = prog.state_dict()
    with pytest.raises(ValueError, match=needle):
        prog.load_state_dict(sd)
    after = prog.state_dict()                        # nothing loaded, not even the entries before the bad one
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_a_dict_of_params_only_loads_and_keeps_the_optimizer_state():
    """A forward program's state dict (params, buffers, step) loads into a training program; its optimizer state
    stays; a forward-only program takes a training program's state dict, the optimizer's entries ignored."""
    trained = _trained()
    fwd = btjit.trace(_loss, {k: np.zeros_like(v) for k, v in trained.params.items()}, *_data(),
                      buffers={"rm": np.zeros(3)})
    fwd.load_state_dict(trained.state_dict())
    assert fwd.forward(*_data()) == trained.forward(*_data())
    prog = _trained()
    state = prog.opt_state["exp_avg"]["w"].copy()
    prog.load_state_dict(fwd.state_dict())
    np.testing.assert_array_equal(prog.opt_state["exp_avg"]["w"], state)
    np.testing.assert_array_equal(prog.params["w"], fwd.params["w"])


def test_a_state_dict_moves_between_batch_sizes_threads_and_dtypes():
    sd = _trained().state_dict()
    small, ref = _prog(n=4), _prog(n=4)
    small.load_state_dict(sd)
    ref.load_state_dict(_prog(n=4).state_dict() | sd)
    x, y = _data(4, seed=5)
    assert [small.step(x, y) for _ in range(3)] == [ref.step(x, y) for _ in range(3)]
    assert small.step_count == ref.step_count == 6
    two, one = _prog(threads=2), _prog(threads=1)
    two.load_state_dict(sd)
    one.load_state_dict(sd)
    assert [two.step(*_data(seed=7)) for _ in range(3)] == [one.step(*_data(seed=7)) for _ in range(3)]
    wide = _prog(dtype="float64")
    wide.load_state_dict(sd)                         # float32 values cast to float64 exactly
    for k, v in sd.items():
        got = wide.state_dict()[k]
        assert got.dtype == (np.float64 if v.dtype.kind == "f" else v.dtype), k
        np.testing.assert_array_equal(got, v, err_msg=k)
    narrow = _prog()
    narrow.load_state_dict(wide.state_dict())
    np.testing.assert_array_equal(narrow.params["w"], sd["param/w"])


def _assign_through_views(prog):
    """Edits through every view reach the arena; an entry cannot be dropped or added."""
    x, y = _data()
    prog.params.update({"w": np.zeros((4, 3))})
    prog.params.update(b=np.zeros(3))
    assert prog.forward(x, y) == pytest.approx(np.log(3.0), rel=1e-6)
    prog.grads["w"] = np.ones((4, 3))
    assert np.all(prog.grads["w"] == 1.0)
    prog.opt_state["exp_avg"]["w"] = np.full((4, 3), 2.0)
    assert np.all(prog.opt_state["exp_avg"]["w"] == 2.0)
    assert np.all(prog.state_dict()["opt/exp_avg"][:12] == 2.0)
    prog.buffers.update({"rm": np.full(3, 5.0)})
    assert np.all(prog.state_dict()["buffer/rm"] == 5.0)
    prog.outputs["h"] = np.ones((8, 3))
    assert np.all(prog.outputs["h"] == 1.0)
    for views in (prog.params, prog.grads, prog.buffers, prog.outputs):
        name = next(iter(views))
        for drop in (lambda: views.pop(name), lambda: views.__delitem__(name), views.clear, views.popitem,
                     lambda: views.setdefault("new", np.ones(3))):
            with pytest.raises(TypeError, match="none can be removed or added"):
                drop()
        assert name in views
    with pytest.raises(ValueError, match=r"prog.grads\['w'\] = an array of shape \(2,\): the grad has shape"):
        prog.grads["w"] = np.ones(2)
    with pytest.raises(KeyError, match=r"prog.params\['q'\]: no such param"):
        prog.params.update(q=np.ones(3))


def test_views_copy_into_the_arena(tmp_path):
    prog = _trained()
    rt = btjit.runtime.load(prog.export(tmp_path / "exp"))
    rt.load_state_dict(prog.state_dict())
    for p in (prog, rt):
        _assign_through_views(p)
    for k, v in prog.state_dict().items():
        np.testing.assert_array_equal(rt.state_dict()[k], v, err_msg=k)
    assert rt.step(*_data(seed=3)) == prog.step(*_data(seed=3))


def test_the_lr_of_a_program_without_an_optimizer_says_so():
    fwd = btjit.trace(_loss, {"w": np.ones((4, 3)), "b": np.zeros(3)}, *_data(), buffers={"rm": np.zeros(3)})
    for use in (lambda: fwd.lr, lambda: setattr(fwd, "lr", 0.1)):
        with pytest.raises(AttributeError, match="prog.lr: this program was traced without an optimizer"):
            use()
    assert not hasattr(fwd, "lr")
    prog = _prog()
    prog.lr = 0.25
    assert prog.lr == 0.25 and prog.hp["lr"] == 0.25


def test_an_optimizer_state_of_params_in_another_order_is_refused():
    """The opt/ blocks hold each param's state in the arena's order: a program traced with the params dict in
    another order would take w's moments for b's. The state dict says where each param's state lies (opt/order,
    numbers) and such a load is refused, loading nothing; in the same order it loads exactly."""
    a = _trained()
    d = a.state_dict()
    assert d["opt/order"].dtype == np.int64 and all(np.isfinite(v).all() for v in d.values())
    rng = np.random.default_rng(1)
    swapped = btjit.trace(_loss, {"b": np.zeros(3), "w": rng.normal(size=(4, 3))}, *_data(),
                          buffers={"rm": np.zeros(3)}, optimizer=btjit.optim.AdamW(lr=0.05))
    before = swapped.state_dict()
    with pytest.raises(ValueError, match=r"saved from a program holding the params in another order"):
        swapped.load_state_dict(d)
    assert all(np.array_equal(v, before[k]) for k, v in swapped.state_dict().items())     # nothing loaded
    same = _prog()
    same.load_state_dict(d)
    for s in ("exp_avg", "exp_avg_sq"):
        for k in ("w", "b"):
            np.testing.assert_array_equal(same.opt_state[s][k], a.opt_state[s][k])
