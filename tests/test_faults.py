"""Faults lose nothing (issue 5), the cases test_cache / test_checkpoint / test_cli leave open:

- the kernel library written by two processes at once, into a fresh cache dir that already holds a STALE
  entry (a different entry .py under the current name, with its compiled index): both processes get the
  right numbers, and a third loads the cache (numba's cache-hit counters, not a time);
- a NaN/Inf *gradient* with a finite loss: "stop" stops at that step, before the update, naming the step and
  the parameter (it used to apply the NaN update and stop one step later blaming the first parameter);
  "skip" skips just that step;
- a permission error while saving a checkpoint: the run stops with the reason and the last good checkpoint,
  leaves no temp file, and the training state in memory is exactly the state of an uninterrupted run.
"""
import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from textdata import tiny_config, write_run_files

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, os, sys, time, warnings
    import numpy as np, btjit
    go = sys.argv[1]
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.005)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = {"w": np.linspace(-1.0, 1.0, 6).reshape(2, 3)}
        x = np.linspace(0.5, 2.0, 8).reshape(4, 2)
        prog = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(x @ p["w"])), p, x, dtype="float64", grad=True)
        v = prog.value_and_grad(x)
    print(json.dumps({"value": v, "grad": prog.grads["w"].tolist(), "hit": prog.kernels.cache_hit,
                      "warnings": [str(m.message) for m in w if "btjit" in str(m.message)]}))
""")


def _expected():
    w = np.linspace(-1.0, 1.0, 6).reshape(2, 3)
    x = np.linspace(0.5, 2.0, 8).reshape(4, 2)
    t = np.tanh(x @ w)
    return float(t.sum()), x.T @ (1 - t * t)


def _spawn(cache_dir, go):
    env = dict(os.environ, BTJIT_CACHE_DIR=str(cache_dir),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(go)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    return p


def _result(p):
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


STALE_ENTRY = """# a stale library entry: same module layout as the real one, different code
from numba import carray, cfunc, types
SIG = types.int32(types.CPointer(types.float64), types.int64, types.CPointer(types.int32), types.int64,
                  types.CPointer(types.int64))


@cfunc(SIG, cache=True)
def entry(ap, na, iap, nia, rp):
    a = carray(ap, (na,))
    for i in range(na):
        a[i] = 42.0
    return 0
"""


def _plant_stale_entry(cache_dir):
    """Write a wrong k_reduce entry (one the program below uses: its sum) under the current library's name and
    compile it into the cache (an index for the very signature btjit uses), as an older btjit or a hand edit would
    have left it."""
    from btjit.kernels import library
    path = Path(cache_dir) / f"lib-{library.library_key()}" / "k_reduce_f64.py"
    path.parent.mkdir(parents=True)
    path.write_text(STALE_ENTRY)
    code = textwrap.dedent(f"""
        import ctypes, importlib.util, sys, numpy as np
        spec = importlib.util.spec_from_file_location("stale_entry", {str(path)!r})
        mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
        a = np.zeros(4); ia = np.zeros(4, np.int32); r = np.zeros(32, np.int64)
        mod.entry.ctypes(a.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), 4,
                         ia.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), 4,
                         r.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
        assert a[0] == 42.0
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert any(f.suffix == ".nbi" for f in (path.parent / "__pycache__").iterdir())
    return path


@pytest.mark.parametrize("start", ["fresh", pytest.param("stale", marks=pytest.mark.slow)])
def test_concurrent_compile_gives_right_results_then_a_third_process_hits(tmp_path, start):
    """Two processes compile the library entries of one program at once into a fresh cache dir (or one holding
    a stale entry); both are right; a third loads every entry from the cache. Before entry files got a
    content-derived mtime, two writers racing left an index whose stamp did not match the final file, so the
    third process recompiled."""
    stale = _plant_stale_entry(tmp_path) if start == "stale" else None
    want_v, want_g = _expected()
    go = tmp_path / "go"
    a, b = _spawn(tmp_path, go), _spawn(tmp_path, go)       # both imported and waiting
    go.touch()                                               # start compiling at the same moment
    ra, rb = _result(a), _result(b)
    for r in (ra, rb):
        assert abs(r["value"] - want_v) < 1e-12, r
        np.testing.assert_allclose(r["grad"], want_g, rtol=1e-12, atol=1e-14)
    if stale is not None:
        assert stale.read_text() != STALE_ENTRY              # the stale entry was replaced
    assert not list(tmp_path.rglob("*.tmp*"))                # no temp file left behind
    third = _result(_spawn(tmp_path, go))
    assert third["hit"] and third["value"] == ra["value"] and third["grad"] == ra["grad"], third
    assert not third["warnings"]


def test_every_writer_gives_an_entry_file_the_same_numba_stamp(tmp_path, monkeypatch):
    """The race above, made deterministic: however many processes (re)write an entry's .py, the file ends up
    with the same (mtime, size) -- numba's cache-index stamp -- so an index saved by any of them is valid."""
    from btjit.kernels import library
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    src = library.entry_source("k_unary", "f64")
    lib = library.Library()
    first = lib._write(lib.dir(), "k_unary_f64", src)
    st1 = os.stat(first)
    time.sleep(0.02)
    first.write_text("# stale\n" + src[8:])                   # same size, different content, new mtime
    second = library.Library()._write(lib.dir(), "k_unary_f64", src)
    st2 = os.stat(second)
    assert second == first and second.read_text() == src
    assert (st2.st_mtime_ns, st2.st_size) == (st1.st_mtime_ns, st1.st_size)


# ----------------------------------------------------------------------------- NaN/Inf gradients, finite loss
TINY = tiny_config(eval_interval=0, eval_batches=2)


def _corpus():
    rng = np.random.default_rng(0)
    words = ["the cat", "a dog", "my bird", "sees", "eats", "likes", "fish.", "seeds."]
    return " ".join(rng.choice(words) for _ in range(600)) + "\n"


@pytest.fixture
def setup(tmp_path):
    return write_run_files(tmp_path, TINY, _corpus())


def _run(*args):
    from btjit.cli import cli
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _error_line(res):
    assert res.exit_code != 0, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert lines[-1].startswith("error: ") and sum(l.startswith("error: ") for l in lines) == 1, res.output
    assert "Traceback" not in res.output
    return lines[-1]


def _events(run_dir, kind):
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            if json.loads(l)["event"] == kind]


@pytest.fixture
def nan_grad_at_step_17(monkeypatch):
    """The GPT loss plus 1e-3 * sqrt(d*d), d = head.b[0] - 0.25: finite everywhere, but at d == 0 its gradient
    is 0 * inf = NaN (a finite loss with a non-finite gradient). At step 17 head.b[0] is set to 0.25 for that
    one step (restored before step 18, unless the update moved it)."""
    import btjit
    import btjit.core.program
    from btjit.models import gpt
    real_loss, real_step = gpt.loss_fn, btjit.core.program.Program.step

    def loss_fn(cfg):
        f = real_loss(cfg)

        def wrapped(p, x, y):
            d = btjit.sum(p["head.b"][:1]) - 0.25
            return f(p, x, y) + 1e-3 * btjit.sqrt(d * d)
        return wrapped
    calls = {"n": 0, "saved": None}

    def step(self, *batch):
        calls["n"] += 1
        if calls["n"] == 17:
            calls["saved"] = float(self.params["head.b"][0])
            self.params["head.b"][0] = 0.25
            calls["before"] = {k: v.copy() for k, v in self.params.items()}
        loss = real_step(self, *batch)
        if calls["n"] == 17:
            calls["after"] = {k: v.copy() for k, v in self.params.items()}
            calls["loss"] = loss
            if self.params["head.b"][0] == 0.25:
                self.params["head.b"][0] = calls["saved"]
        return loss
    monkeypatch.setattr(gpt, "loss_fn", loss_fn)
    monkeypatch.setattr(btjit.core.program.Program, "step", step)
    return calls


def test_nonfinite_gradient_with_finite_loss_stops_at_that_step(setup, nan_grad_at_step_17):
    cfg, data, tmp = setup
    line = _error_line(_run("train", cfg, "--data", data, "--out", tmp / "s"))
    calls = nan_grad_at_step_17
    assert np.isfinite(calls["loss"])                       # the loss itself was finite
    assert "at step 17" in line and "first non-finite gradient: head.b" in line, line
    assert "stopped" in line and "Last good checkpoint" in line and "ckpt_00000010.npz" in line, line
    for k, v in calls["before"].items():                     # the bad update was not applied
        np.testing.assert_array_equal(calls["after"][k], v, err_msg=k)
    assert [e["step"] for e in _events(tmp / "s", "nonfinite")] == [17]


def test_nonfinite_gradient_with_finite_loss_is_skipped_in_skip_mode(setup, nan_grad_at_step_17):
    from btjit.train import checkpoint as K
    cfg, data, tmp = setup
    res = _run("train", cfg, "--data", data, "--out", tmp / "k", "--set", "train.on_nonfinite=skip")
    assert res.exit_code == 0, res.output
    assert "step 17: non-finite loss or update" in res.output and "first non-finite gradient: head.b" in res.output
    assert [e["step"] for e in _events(tmp / "k", "skip")] == [17]
    for k, v in nan_grad_at_step_17["before"].items():
        np.testing.assert_array_equal(nan_grad_at_step_17["after"][k], v, err_msg=k)
    ck, skipped = K.latest_valid(tmp / "k")
    assert ck.step == 30 and not skipped and all(np.isfinite(v).all() for v in ck.state.values())


# ----------------------------------------------------------------------------- permission error while saving
def test_permission_error_while_saving_stops_cleanly_and_keeps_memory_state(setup, monkeypatch):
    from btjit.train import checkpoint as K
    from btjit.train import config as C
    from btjit.train.trainer import TrainError, Trainer
    cfg_path, data, tmp = setup
    cfg = C.load(cfg_path)
    quiet = lambda s="": None  # noqa: E731
    Trainer(cfg, tmp / "ref", data_path=data, echo=quiet).run()     # uninterrupted reference
    ref20 = K.load(K.path_for(tmp / "ref", 20))

    real_savez, n = np.savez, {"saves": 0}

    def savez(f, **arrays):
        n["saves"] += 1
        if n["saves"] == 2:                                  # the step-20 checkpoint
            f.write(b"PK\x03\x04 partial")
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(getattr(f, "name", "")))
        return real_savez(f, **arrays)
    monkeypatch.setattr(np, "savez", savez)
    tr = Trainer(cfg, tmp / "p", data_path=data, echo=quiet)
    with pytest.raises(TrainError) as e:
        tr.run()
    msg = str(e.value)
    assert msg.startswith("stopped at step 20: cannot write checkpoint") and "ckpt_00000020.npz" in msg, msg
    assert "Permission denied" in msg and msg.endswith(f"Last good checkpoint: {K.path_for(tmp / 'p', 10)}"), msg
    assert [p.name for p in (tmp / "p").iterdir() if "ckpt" in p.name] == ["ckpt_00000010.npz"]
    assert K.load(K.path_for(tmp / "p", 10)).step == 10
    # the state in memory is the uninterrupted run's state at step 20: the failed write corrupted nothing
    assert tr.step == 20
    state = tr.prog.state_dict()
    assert set(state) == set(ref20.state)
    for k in state:
        np.testing.assert_array_equal(state[k], ref20.state[k], err_msg=k)
