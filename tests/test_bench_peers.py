# tests/test_bench_peers.py -- the `btjit bench` peers and harness: workload definitions (parameter counts,
# the paper's E1/E2 answers, E5/E6 data helpers on generated data), every installed peer's E1/E2 values and
# gradients, E3/E4 round trips, E5/E6 runners (initial loss ~ ln V, one step moves the params, torch and
# JAX agree), and the subprocess harness (row keys, "not installed" rows, ratios, table). A peer whose
# package is absent is skipped with a reason. No timing assertions; no files from ../shared/data.
import importlib
import math
import os

import numpy as np
import pytest

from btjit.bench import harness, peers
from btjit.bench import workloads as W

PEER_MODULES = {"torch": "btjit.bench.peers.torch_peer", "jax": "btjit.bench.peers.jax_peer",
                "micrograd": "btjit.bench.peers.micrograd_peer", "autograd": "btjit.bench.peers.autograd_peer"}


def peer(name):
    pytest.importorskip(name, reason=f"peer package {name} not installed")
    return importlib.import_module(PEER_MODULES[name])


@pytest.fixture(scope="module")
def small_text():
    rng = np.random.default_rng(7)
    chars = np.array(list(W.SHAKESPEARE_CHARS))
    return W.SHAKESPEARE_CHARS + "".join(rng.choice(chars, 4000).tolist())


@pytest.fixture(scope="module")
def small_names():
    rng = np.random.default_rng(8)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(3, 9))) for _ in range(300)]
    return "abcdefghijklmnopqrstuvwxyz\n" + "\n".join(words)


# ---- workload definitions and data helpers
def test_param_counts_and_names():
    p = W.e6_init(65)
    assert W.n_params(p) == 46337
    assert p["h0.attn.qkv.w"].shape == (24, 72) and p["head.w"].shape == (24, 65) and p["wpe"].shape == (8, 24)
    assert all(v.dtype == np.float32 for v in p.values())
    assert np.all(p["h3.ln2.g"] == 1) and np.all(p["h5.mlp.fc.b"] == 0)
    assert abs(float(p["wte"].std()) - 0.02) < 0.003
    assert W.n_params(W.e5_init()) == 1079003


def test_reference_answers():
    assert W.e1(-41.0, 2.0) == 612.5
    v = W.e2_values()
    assert list(v) == list(W.E2_NODES) and abs(v["g"] - 24.7041) < 1e-4


def test_data_fallback_is_generated(monkeypatch, tmp_path):
    monkeypatch.setenv("BTJIT_DATA_DIR", str(tmp_path))
    text, src = W.load_text("tinyshakespeare.txt")
    assert src == "generated" and len(set(text)) == 65
    names, src = W.load_text("names.txt")
    assert src == "generated" and len(set(names.split("\n")[0])) == 26


def test_e5_dataset_left_padded():
    X, Y, itos, _ = W.e5_dataset("emma\nava\n")
    assert itos == ".aemv" and X.shape == (9, 16) and Y.tolist() == [2, 3, 3, 1, 0, 1, 4, 1, 0]
    assert X[0].tolist() == [0] * 16 and X[3].tolist() == [0] * 13 + [2, 3, 3]


def test_e6_batches(small_text):
    itos, train, val, src = W.e6_corpus(small_text)
    assert len(itos) == 65 and src == "given" and len(train) == int(0.9 * len(small_text))
    x, y = W.e6_batch(train, 64, 8, seed=3)
    x2, _ = W.e6_batch(train, 64, 8, seed=3)
    assert x.shape == y.shape == (64, 8) and np.array_equal(x, x2) and np.array_equal(x[:, 1:], y[:, :-1])


# ---- peers: the paper's answers
@pytest.mark.parametrize("name", ["torch", "jax", "micrograd", "autograd"])
@pytest.mark.parametrize("wid", ["E1", "E2"])
def test_scalar_answers(name, wid):
    check = peer(name).make(wid).check()
    want = W.E1_ANSWER if wid == "E1" else W.E2_ANSWER
    for k, v in want.items():
        assert check[k] == pytest.approx(v, abs=1e-4), (name, wid, k)


@pytest.mark.parametrize("name", ["torch", "micrograd"])
@pytest.mark.parametrize("wid", ["E3", "E4"])
def test_io_round_trip(name, wid):
    r = peer(name).make(wid)
    r.step()
    assert W.check_ok(wid, r.check())[0]


@pytest.mark.parametrize("name", ["jax", "autograd"])
def test_io_is_na(name):
    with pytest.raises(peers.NotApplicable):
        peer(name).make("E3")


# ---- peers: training runners
@pytest.mark.parametrize("name,wid", [("torch", "E6b1"), ("torch", "E6b64"), ("torch", "E5"), ("jax", "E5")])
def test_train_runner(name, wid, small_text, small_names):     # jax E6b1: in test_torch_and_jax_agree
    text = small_text if wid.startswith("E6") else small_names
    r = peer(name).make(wid, text=text)
    vocab = 65 if wid.startswith("E6") else 27
    loss0 = r.check()["loss"]
    assert abs(loss0 - math.log(vocab)) < 0.1
    p0 = r.params()
    assert abs(r.step() - loss0) < 1e-5                      # step returns the loss before its update
    p1 = r.params()
    assert set(p0) == set(p1) and max(float(np.abs(p1[k] - p0[k]).max()) for k in p0) > 0
    assert r.check()["loss"] != loss0


def test_torch_and_jax_agree(small_text):
    """Same names, init, batch and math: the GPT loss trajectories match (one jax E6 compile, ~5 s)."""
    j = peer("jax").make("E6b1", text=small_text)
    loss0, p0 = j.check()["loss"], j.params()
    assert abs(loss0 - math.log(65)) < 0.1
    lj = [j.step() for _ in range(3)]
    assert max(float(np.abs(j.params()[k] - p0[k]).max()) for k in p0) > 0
    t = peer("torch").make("E6b1", text=small_text)
    lt = [t.step() for _ in range(3)]
    assert np.allclose(lt, lj, atol=1e-4) and lj[0] == pytest.approx(loss0, abs=1e-5), (lt, lj)


def test_torch_paper_peer_is_the_same_model(small_text):
    """torch.paper (the paper's nn.Module GPT: a Linear per head for q, k, v) computes the SDPA peer's
    function: same loss and, after 3 SGD steps, the same params (its per-head weights joined back into
    attn.qkv.w, every Linear weight transposed back to (in, out))."""
    fused = peer("torch").make("E6b64", text=small_text)
    paper = peer("torch").make("E6b64", text=small_text, paper=True)
    p0 = paper.params()
    for k, v in W.setup_batch("E6b64", 0, small_text)[0].items():        # load and export are inverses
        np.testing.assert_array_equal(p0[k], v, err_msg=k)
    assert paper.check()["loss"] == pytest.approx(fused.check()["loss"], abs=1e-6)
    for _ in range(3):
        assert paper.step() == pytest.approx(fused.step(), abs=1e-5)
    pf, pp = fused.params(), paper.params()
    assert set(pf) == set(pp)
    for k in pf:
        assert np.abs(pp[k] - p0[k]).max() > 0, k                          # every param was trained
        np.testing.assert_allclose(pp[k], pf[k], rtol=1e-4, atol=1e-6, err_msg=k)


# ---- harness
ROW_KEYS = {"workload", "impl", "status", "time_s", "times_s", "iters", "reps", "threads", "peak_rss_mb",
            "compile_s", "setup_s", "first_step_s", "data", "check", "check_ok", "note", "version"}


def test_harness_subprocess_torch_e1():
    pytest.importorskip("torch")
    row = harness.measure("torch", "E1", reps=1, min_time=0.01, timeout=120)
    assert ROW_KEYS <= set(row), set(row) ^ ROW_KEYS
    assert row["status"] == "ok" and row["check_ok"] and row["time_s"] > 0 and row["peak_rss_mb"] > 0
    assert row["threads"] == 1 and len(row["times_s"]) == 1


def test_missing_peer_rows(tmp_path, monkeypatch):
    row = harness.measure("nosuchpeer", "E1", reps=1, min_time=0.01, timeout=60)
    assert row["status"] == "not installed"
    shim = tmp_path / "autograd"                      # a package whose import fails like an absent one
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'autograd'\", name='autograd')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    row = harness.measure("autograd", "E1", reps=1, min_time=0.01, timeout=60)
    assert row["status"] == "not installed" and "autograd" in row["note"]


def test_run_bench_na_rows_without_subprocess():
    rows = [r for r in harness.run_bench(only="E3", peers="jax,autograd", reps=1, min_time=0.01)
            if r["impl"] != "btjit"]
    assert [(r["impl"], r["status"]) for r in rows] == [("jax", "n/a"), ("autograd", "n/a")]


def test_ratios_and_table():
    rows = [dict(workload="E1", impl="btjit", status="ok", time_s=2e-7, peak_rss_mb=60.0, compile_s=0.4),
            dict(workload="E1", impl="torch", status="ok", time_s=1e-4, peak_rss_mb=220.0, compile_s=None),
            dict(workload="E5", impl="btjit", status="not available", time_s=None, note="no module"),
            dict(workload="E5", impl="jax", status="ok", time_s=3.5e-3, data="generated")]
    harness.add_ratios(rows)
    assert rows[1]["ratio_vs_btjit"] == pytest.approx(500) and rows[3]["ratio_vs_btjit"] is None
    table = harness.format_table(rows, machine=False)
    for s in ("200 ns", "100 µs", "3.5 ms", "500", "not available", "generated data"):
        assert s in table, s
    assert "machine: " in harness.format_table(rows)


def test_timeout_gives_error_row():
    row = harness.measure("micrograd", "E1", reps=1, min_time=0.01, timeout=0.01)
    assert row["status"].startswith("error: timeout") and row["time_s"] is None


def test_many_rows_calibrate_after_the_compile_on_a_cold_cache(tmp_path, monkeypatch):
    """btjit.many on an empty compile cache: f.many is compiled in make(), not inside the calibration, and
    at least one native chunk of rows is timed (a cold run once calibrated to 1-2 rows: "2.14 µs per row")."""
    from btjit.bench.btjit_scalar import CHUNK
    cache = tmp_path / "cache"
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(cache))
    for wid in ("E1", "E2"):
        row = harness.measure("btjit.many", wid, reps=1, min_time=0.01, timeout=600)
        assert row["status"] == "ok" and row["check_ok"], row
        assert row["iters"] >= CHUNK and row["loop"] == "runner.run(n)", row
    assert any(cache.rglob("*.nbi"))                  # the cache was cold: this test compiled into it
