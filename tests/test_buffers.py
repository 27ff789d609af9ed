"""Buffers and btjit.assign: state a step reads and writes without training it (issue 28 item 1), the eval
program sharing the arena (item 2), and buffers through state_dict, checkpoints and exports."""
import numpy as np
import pytest

import btjit
from btjit.graph.trace import TraceError


def _ema(p, x):
    btjit.assign(p["rm"], p["rm"] * 0.9 + x.mean(axis=0) * 0.1)
    btjit.assign(p["n"], p["n"] + 1.0)
    h = x @ p["w"] + p["rm"][:2] * 0.0
    return (h * h).mean() if btjit.is_training() else (h * h).mean() * 2.0


def _prog(dtype="float64", **kw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3))
    params = {"w": rng.standard_normal((3, 2))}
    bufs = {"rm": np.zeros(3), "n": np.zeros(())}
    return btjit.trace(_ema, params, x, buffers=bufs, optimizer=btjit.optim.SGD(lr=0.1), dtype=dtype, **kw), x, params


def test_assign_updates_buffer_at_step_end():
    prog, x, params = _prog()
    w = params["w"].copy()
    rm = np.zeros(3)
    for k in range(3):
        loss = prog.step(x + k)
        h = (x + k) @ w
        assert loss == pytest.approx((h * h).mean(), rel=1e-12)        # read the old buffer: no effect here
        w -= 0.1 * 2 * (x + k).T @ h / h.size
        rm = rm * 0.9 + (x + k).mean(0) * 0.1
        np.testing.assert_allclose(prog.buffers["rm"], rm, rtol=1e-13)
        assert prog.buffers["n"] == k + 1
    np.testing.assert_allclose(prog.params["w"], w, rtol=1e-12)
    # forward() and value_and_grad() do not end a step: no assign
    prog.forward(x), prog.value_and_grad(x)
    assert prog.buffers["n"] == 3


def test_eval_shares_params_and_buffers():
    prog, x, _ = _prog()
    prog.step(x)
    n, rm = prog.buffers["n"].copy(), prog.buffers["rm"].copy()
    h = x @ prog.params["w"]
    assert prog.eval(x) == pytest.approx(2 * (h * h).mean(), rel=1e-12)     # is_training() False
    assert prog.buffers["n"] == n and (prog.buffers["rm"] == rm).all()       # assigns not applied
    prog.params["w"][...] = 0.5                                               # an edit seen by both
    assert prog.eval(x) == pytest.approx(2 * ((x @ np.full((3, 2), 0.5)) ** 2).mean(), rel=1e-12)
    ev = next(iter(prog._evals.values()))
    assert np.shares_memory(ev.params["w"], prog.params["w"]) and np.shares_memory(ev.buffers["rm"],
                                                                                    prog.buffers["rm"])
    prog.step(x)                                         # the eval program leaves the train step's state alone
    assert prog.buffers["n"] == n + 1
    assert prog.eval(x[:2]) == pytest.approx(2 * ((x[:2] @ prog.params["w"]) ** 2).mean(), rel=1e-12)


def test_train_and_eval_programs_load_their_kernels_together():
    """A program traced with _defer_kernels and its eval program (eval_program(defer=True)) load the library
    entries of both from one LIBRARY.ensure (`btjit train` compiles them in one parallel batch); they then
    train and evaluate as programs loaded one by one do."""
    from btjit.kernels.library import LIBRARY
    want, x, _ = _prog()
    prog, _, _ = _prog(_defer_kernels=True)
    ev = prog.eval_program(x, defer=True)
    assert prog.kernels is None and ev.kernels is None and prog.eval_program(x) is ev
    report = LIBRARY.ensure("f64", np.concatenate([prog.tape[:, 0], ev.tape[:, 0]]))
    for p in (prog, ev):
        p.load_kernels(report)
    assert set(report.entries) >= set(want.kernels.entries) and set(ev.kernels.entries) == set(report.entries)
    for k in range(3):
        assert prog.step(x + k) == want.step(x + k)
    assert prog.eval(x) == want.eval(x)
    np.testing.assert_array_equal(prog.buffers["rm"], want.buffers["rm"])


def test_trace_in_eval_mode():
    prog, x, params = _prog()
    ev = btjit.trace(_ema, params, x, buffers={"rm": np.zeros(3), "n": np.zeros(())}, training=False, grad=False,
                     dtype="float64")
    h = x @ params["w"]
    assert ev.forward(x) == pytest.approx(2 * (h * h).mean(), rel=1e-12) and not ev.graph.assigns
    with pytest.raises(RuntimeError, match="without an optimizer"):
        ev.step(x)
    with pytest.raises(TraceError, match="inside a function traced"):
        btjit.is_training()


def test_state_dict_round_trip():
    prog, x, _ = _prog()
    prog.step(x)
    d = prog.state_dict()
    assert set(d) >= {"param/w", "buffer/rm", "buffer/n"}
    prog2, _, _ = _prog()
    prog2.load_state_dict(d)
    assert prog.step(x) == prog2.step(x)
    assert (prog.buffers["rm"] == prog2.buffers["rm"]).all() and (prog.params["w"] == prog2.params["w"]).all()
    with pytest.raises(ValueError, match="buffer 'rm'"):
        prog2.load_state_dict({k: v for k, v in d.items() if k != "buffer/rm"})


def test_assign_errors_name_lines():
    x = np.ones((2, 3))

    def twice(p, x):
        btjit.assign(p["b"], x.sum(axis=0))
        btjit.assign(p["b"], x.sum(axis=0))
        return x.sum()
    with pytest.raises(TraceError, match=r"assigned twice: at test_buffers.py:\d+ and at test_buffers.py:\d+"):
        btjit.trace(twice, {}, x, buffers={"b": np.zeros(3)}, grad=False)

    def wrong_shape(p, x):
        btjit.assign(p["b"], x)
        return x.sum()
    with pytest.raises(TraceError, match=r"buffer 'b' is f64\[3\].*f64\[2,3\] — test_buffers.py:\d+"):
        btjit.trace(wrong_shape, {}, x, buffers={"b": np.zeros(3)}, grad=False, dtype="float64")

    def not_a_buffer(p, x):
        btjit.assign(p["w"], p["w"] * 2)
        return (x * p["w"]).sum()
    with pytest.raises(TraceError, match="must be a buffer"):
        btjit.trace(not_a_buffer, {"w": np.ones(3)}, x, buffers={"b": np.zeros(3)}, grad=False)
    with pytest.raises(ValueError, match="name of a parameter"):
        btjit.trace(not_a_buffer, {"w": np.ones(3)}, x, buffers={"w": np.zeros(3)}, grad=False)


def test_no_gradient_through_buffer():
    def f(p, x):
        btjit.assign(p["b"], p["w"] * 3.0)
        return (p["w"] * p["b"]).sum()
    prog = btjit.trace(f, {"w": np.ones(3)}, np.ones(1), buffers={"b": np.full(3, 2.0)}, grad=True, dtype="float64")
    prog.value_and_grad(np.ones(1))
    np.testing.assert_array_equal(prog.grads["w"], np.full(3, 2.0))    # d(w*b)/dw = b: b is a constant


# ----------------------------------------------------------------------------- checkpoints, --resume, exports
BN_MODEL = '''"""A makemore-style word model with batch norm over (B, T, C), channels last (makemore part 5)."""
import numpy as np

import btjit


def init_params(cfg, rng):
    V, E, H = cfg.vocab_size, cfg.n_embd, cfg.hidden
    return {"wte": rng.standard_normal((V, E)).astype(np.float32),
            "w1": (rng.standard_normal((E, H)) / np.sqrt(E)).astype(np.float32),
            "gain": np.ones(H, np.float32), "bias": np.zeros(H, np.float32),
            "head": (rng.standard_normal((H, V)) * 0.1).astype(np.float32)}


def init_buffers(cfg):
    return {"rm": np.zeros(cfg.hidden, np.float32), "rv": np.ones(cfg.hidden, np.float32)}


def logits(p, x):
    h = btjit.take(p["wte"], x) @ p["w1"]                           # (B, T, H)
    h = btjit.batch_norm(h, p["gain"], p["bias"], p["rm"], p["rv"], axis=-1)
    return btjit.tanh(h) @ p["head"]


def loss(p, x, y):
    lg = logits(p, x)
    return btjit.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1), ignore_index=-1)
'''


def test_buffers_through_checkpoints_and_resume_bit_exact(tmp_path):
    from test_cli import assert_same_state, final_state
    from test_usermodel import config, run
    from textdata import words
    (tmp_path / "bn.py").write_text(BN_MODEL)
    (tmp_path / "c.toml").write_text(config("bn.py", steps=20, sample_interval=10))
    (tmp_path / "w.txt").write_text(words())
    a = run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--out", tmp_path / "a")
    assert a.exit_code == 0 and "--- sample at step 10 ---" in a.output, a.output
    assert run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--out", tmp_path / "b",
               "--set", "train.steps=13").exit_code == 0
    res = run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--out", tmp_path / "b", "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000013.npz" in res.output, res.output
    ck = final_state(tmp_path / "a")
    assert ck.step == 20 and set(ck.buffers) == {"rm", "rv"} and np.abs(ck.buffers["rm"]).max() > 0.01
    assert_same_state(ck, final_state(tmp_path / "b"))          # buffers included, bit for bit
    s = run("sample", tmp_path / "a", "--n", 30, "--seed", 1)
    assert s.exit_code == 0 and s.stdout.strip(), s.output


FRESH = r"""
import json, sys
import numpy as np
import btjit.runtime as R
p = R.load(sys.argv[1])
d = np.load(sys.argv[2])
losses = [p.step(d[f"x{i}"]) for i in range(3)]
print(json.dumps({"losses": losses, "buffers": {k: v.tolist() for k, v in p.buffers.items()},
                  "imported": [m for m in ("numba", "llvmlite") if m in sys.modules]}))
"""


def test_buffers_in_exports_update_bitwise(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    prog, x, _ = _prog("float32")
    xs = [(x + k).astype(np.float32) for k in range(3)]
    prog.step(xs[0].astype(np.float32))                      # a trained state goes into the export
    prog.export(tmp_path / "e")
    np.savez(tmp_path / "b.npz", **{f"x{i}": v for i, v in enumerate(xs)})
    want = [prog.step(v) for v in xs]
    r = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "e"), str(tmp_path / "b.npz")], cwd=root,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["imported"] == [] and got["losses"] == want
    assert got["buffers"] == {k: v.tolist() for k, v in prog.buffers.items()}      # bitwise
    import btjit.runtime as R
    e = R.load(tmp_path / "e")
    assert set(e.state_dict()) == set(prog.state_dict())


def test_the_c_host_updates_buffers_as_python(tmp_path):
    import subprocess
    from test_export import CC, cc_build
    if CC is None:
        pytest.skip("no C compiler (cc/gcc) on this machine")
    prog, x, _ = _prog("float32")
    prog.export(tmp_path / "e")
    xs = [(x + k).astype(np.float32) for k in range(3)]
    (tmp_path / "b.bin").write_bytes(b"".join(v.tobytes() for v in xs))
    cc_build(tmp_path / "e", tmp_path / "train")
    r = subprocess.run([str(tmp_path / "train"), str(tmp_path / "e"), "3", str(tmp_path / "b.bin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    losses = [np.float32(prog.step(v)) for v in xs]
    lines = r.stdout.splitlines()
    assert [np.float32(ln.split()[-1]) for ln in lines[:3]] == losses
    assert len(lines) == 3 + len(prog.buffers)
    for ln, (k, v) in zip(lines[3:], prog.buffers.items()):
        s = 0.0
        for e in v.ravel():
            s += float(e)                                  # the C host's sum: in order, in double (%.17g)
        assert ln.split()[:3] == ["buffer", k, "sum"] and float(ln.split()[3]) == s, (ln, s)


def test_a_data_parallel_programs_eval_runs_on_one_replicas_kernels():
    """replicas=2 on two threads: the eval program runs on one replica's thread (no row split); without replicas
    it splits its products over both, and either way evaluates as one thread does."""
    from btjit.testing import split_kernels
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, 256)).astype(np.float32)
    w = {"w": (rng.standard_normal((256, 256)) * 0.05).astype(np.float32)}
    fn = lambda p, x: btjit.mean(btjit.tanh(x @ p["w"]) ** 2)  # noqa: E731
    opt = btjit.optim.SGD(lr=0.1)
    one = btjit.trace(fn, w, x, optimizer=opt, threads=1).eval(x)
    dp = btjit.trace(fn, w, x, optimizer=opt, replicas=2, threads=2)
    split = btjit.trace(fn, w, x, optimizer=opt, threads=2)
    assert dp.eval(x) == one and split.eval(x) == one
    ev_dp, ev_split = (next(iter(p._evals.values())) for p in (dp, split))
    assert ev_dp.threads == 1 and not split_kernels(ev_dp)
    assert ev_split.threads == 2 and split_kernels(ev_split)


def test_eval_at_another_batch_size_names_the_batch_sized_buffer():
    # a carried hidden state (B, H) as a buffer: eval at batch 4 works, at batch 2 the error says why
    rng = np.random.default_rng(0)
    p = {"W": rng.normal(size=(3, 5)).astype(np.float32)}

    def loss(p, x):
        h = btjit.tanh(x @ p["W"] + p["h"])
        btjit.assign(p["h"], h)
        return (h * h).mean()
    prog = btjit.trace(loss, p, np.ones((4, 3), np.float32), buffers={"h": np.zeros((4, 5), np.float32)},
                       optimizer=btjit.optim.SGD(lr=0.1))
    x = rng.normal(size=(4, 3)).astype(np.float32)
    prog.step(x)
    h = prog.buffers["h"].copy()
    assert prog.eval(x) == pytest.approx(float((np.tanh(x @ prog.params["W"] + h) ** 2).mean()), rel=1e-5)
    with pytest.raises(TraceError, match=r"(?s)batch shapes \[\(2, 3\)\].*step's are \[\(4, 3\)\].*h \(4, 5\)"):
        prog.eval(x[:2])
