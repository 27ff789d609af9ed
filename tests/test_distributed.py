# tests/test_distributed.py -- data-parallel training over MPI (btjit/distributed.py, btjit/compress.py).
# Without MPI: the install hint of --distributed, launch detection, per-rank generators, TopK/RandK
# selection, config validation, and the refusal to resume an N-process checkpoint in one process.
# With mpi4py and mpiexec (pip install -e '.[mpi]'), real 2-rank jobs (`mpiexec -n 2 python ...`):
#   - equivalence: 2 ranks x batch B/2 give the parameters of one process with batch B (AdamW, SGD+clip),
#     and the ranks' parameters are bit-identical (tests/mpi_worker.py; DataParallel broadcasts rank 0's init)
#   - `mpiexec -n 2 btjit train`: rank 0 alone logs and checkpoints; resume with the same N is bit-exact
#     (dense and TopK+EF21); the launch() API from Python; a non-finite loss stops every rank cleanly
#   - compression: with TopK and RandK (EF21) the loss falls and fewer bytes are sent
# The tiny GPT (n_layer 1, n_embd 8, block 4) keeps each job to a couple of seconds.
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from btjit.train import checkpoint as K
from btjit.train import compress, distributed, mpilaunch
from btjit.cli import cli
from btjit.train.config import ConfigError, loads
from textdata import corpus, tiny_config, write_run_files

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "mpi_worker.py"

TINY = tiny_config(steps=20, batch_size=8, eval_batches=4, sample_interval=10, sample_chars=20)


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if mpilaunch.find_mpiexec() is None:
        return "no mpiexec found (pip install -e '.[mpi]' brings MPICH's)"
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None and not os.environ.get("BTJIT_REQUIRE_MPI"),
                               reason=str(_mpi_missing()))


def test_mpi_is_there_when_required():
    """CI sets BTJIT_REQUIRE_MPI=1 after installing btjit[mpi]: then the 2-rank tests must not skip."""
    if not os.environ.get("BTJIT_REQUIRE_MPI"):
        pytest.skip("BTJIT_REQUIRE_MPI is not set")
    assert _mpi_missing() is None, _mpi_missing()




@pytest.fixture
def setup(tmp_path):
    return write_run_files(tmp_path, TINY, corpus())


def mpirun(n, args, timeout=240, cwd=None):
    """Run `mpiexec -n n <args>` (args: the program and its arguments); Open MPI's as-root and
    oversubscription switches come from btjit.train.mpilaunch.mpiexec_command."""
    argv, env = mpilaunch.mpiexec_command(n)
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run(argv + [str(a) for a in args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


def btjit_train(n, cfg, data, out, *extra):
    return mpirun(n, [sys.executable, "-m", "btjit.cli", "train", cfg, "--data", data, "--out", out, *extra])


def worker(*args):
    p = mpirun(2, [sys.executable, "-m", "mpi4py", WORKER, *args])     # -m mpi4py: an exception aborts all
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 1, p.stdout           # rank 0 alone reports
    return json.loads(lines[0])


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e.get("event") == kind]


# ---- without MPI ------------------------------------------------------------------------------------------
def test_distributed_without_mpi4py_says_what_to_install(setup, monkeypatch):
    cfg, data, tmp = setup
    monkeypatch.setitem(sys.modules, "mpi4py", None)              # import mpi4py -> ImportError
    for k in [k for pair in distributed.LAUNCH_ENV for k in pair]:
        monkeypatch.delenv(k, raising=False)
    r = CliRunner().invoke(cli, ["train", str(cfg), "--data", str(data), "--out", str(tmp / "r"), "--distributed"])
    assert r.exit_code == 1
    assert "mpi4py" in r.output and "pip install 'btjit[mpi]'" in r.output, r.output
    # started by an MPI launcher as one of 2 processes, but no mpi4py: refuse rather than train 2 copies
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "0")
    r = CliRunner().invoke(cli, ["train", str(cfg), "--data", str(data), "--out", str(tmp / "r2")])
    assert r.exit_code == 1 and "one of 2" in r.output and "btjit[mpi]" in r.output, r.output
    assert not (tmp / "r2").exists()


def test_launch_detection(monkeypatch):
    for k in [k for pair in distributed.LAUNCH_ENV for k in pair]:
        monkeypatch.delenv(k, raising=False)
    assert distributed.launched() == (1, 0)
    assert not distributed.wanted(None) and distributed.wanted(True) and not distributed.wanted(False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert distributed.launched() == (4, 3) and distributed.wanted(None) and not distributed.wanted(False)


def test_rank_generators_are_reproducible_and_distinct():
    one = distributed.rank_rng(5, 0, 1).integers(0, 1 << 30, 8)
    from btjit.train.trainer import seeds
    assert np.array_equal(one, seeds(5)[1].integers(0, 1 << 30, 8))     # 1 process: the usual stream
    a = [distributed.rank_rng(5, r, 2).integers(0, 1 << 30, 8) for r in range(2)]
    b = [distributed.rank_rng(5, r, 2).integers(0, 1 << 30, 8) for r in range(2)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[0], one)


def test_topk_randk_selection():
    d = np.array([0.1, -5.0, 0.0, 3.0, -0.2, 4.0], np.float32)
    assert compress.topk_indices(d, 3).tolist() == [1, 3, 5]
    rng = np.random.default_rng(1)
    for trial in range(60):                      # the sampled-threshold shortcut is exact (ties aside)
        n = int(rng.integers(10, 60000))
        k = int(rng.integers(1, max(2, n // 20)))
        d = rng.standard_normal(n).astype(np.float32)
        if trial % 3 == 1:
            d[rng.random(n) < 0.95] = 0.0
        if trial % 3 == 2:
            d = np.round(d, 1)
        got = compress.topk_indices(d, k)
        ref = np.argpartition(np.abs(d), n - k)[n - k:]
        assert len(set(got.tolist())) == k and np.all(np.diff(got) > 0)
        assert np.array_equal(np.sort(np.abs(d[got])), np.sort(np.abs(d[ref])))
    assert compress.n_selected(0.01, 1000) == 10 and compress.n_selected(1e-9, 1000) == 1
    valid = np.array([0, 1, 2, 5, 6, 7, 9])
    i1, i2 = compress.randk_indices(valid, 4, 3, 10), compress.randk_indices(valid, 4, 3, 10)
    assert np.array_equal(i1, i2) and len(set(i1.tolist())) == 4 and set(i1.tolist()) <= set(valid.tolist())
    assert any(not np.array_equal(i1, compress.randk_indices(valid, 4, 3, t)) for t in range(11, 20))


def test_distributed_config_section():
    cfg = loads('[distributed]\ncompressor = "topk"\nratio = 0.05\n')
    assert cfg.distributed.compressor == "topk" and cfg.distributed.ratio == 0.05
    assert loads("").distributed.compressor == "none"
    with pytest.raises(ConfigError, match="distributed.compressor"):
        loads('[distributed]\ncompressor = "zip"\n')
    with pytest.raises(ConfigError, match="distributed.ratio"):
        loads('[distributed]\nratio = 0.0\n')


# ---- real 2-rank jobs -------------------------------------------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("opt", ["adamw", "sgd_clip"])
def test_two_ranks_match_one_process_with_the_global_batch(opt):
    args = ["equiv", "--steps", "6"] + (["--opt", "adamw"] if opt == "adamw" else ["--opt", "sgd", "--clip", "0.5"])
    r = worker(*args)
    assert r["size"] == 2
    assert r["init_differs"] and r["identical"] and r["in_sync"]     # rank 0's init broadcast, then in lockstep
    assert r["moved"] > 1e-3                                          # the steps did something
    assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["max_abs_param"]), r
    np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=1e-5)
    assert r["bytes"][-1] == r["dense_bytes"] + 16                    # the grads region + [loss, stop]


@needs_mpi
@pytest.mark.parametrize("comp,ratio", [("topk", 0.05), ("randk", 0.1)])
def test_compressed_loss_still_falls(comp, ratio):
    r = worker("compress", "--compressor", comp, "--ratio", str(ratio), "--steps", "60")
    losses = r["losses"]
    assert r["identical"] and r["in_sync"]
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.3, losses
    assert r["bytes"][0] == r["dense_bytes"] + 16                     # EF21's dense first step
    assert max(r["bytes"][1:]) < 0.2 * r["dense_bytes"]               # then k values (+ k indices for TopK)


@needs_mpi
def test_cli_two_ranks_log_checkpoint_and_resume_bit_exact(setup):
    cfg, data, tmp = setup
    full = btjit_train(2, cfg, data, tmp / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    assert full.stdout.count("btjit 0.") == 1 and "distributed: 2 processes" in full.stdout   # rank 0 prints
    assert full.stdout.count("--- sample at step 10 ---") == 1
    trains = events(tmp / "full", "train")
    assert [e["step"] for e in trains] == [5, 10, 15, 20]                        # one line per event
    assert all(e["ranks"] == 2 and e["comm_bytes_per_step"] > 0 for e in trains)
    ck = K.load(tmp / "full" / "ckpt_00000020.npz")
    assert ck.meta["distributed"]["world_size"] == 2 and len(ck.meta["distributed"]["rng_states"]) == 2
    vals = [e["val_loss"] for e in events(tmp / "full", "val")]
    assert vals[-1] < vals[0]

    half = btjit_train(2, cfg, data, tmp / "half", "--set", "train.steps=10")
    assert half.returncode == 0, half.stderr[-3000:]
    again = btjit_train(2, cfg, data, tmp / "half", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from ckpt_00000010.npz" in again.stdout
    a, b = K.load(tmp / "full" / "ckpt_00000020.npz"), K.load(tmp / "half" / "ckpt_00000020.npz")
    assert sorted(a.state) == sorted(b.state)
    for k in a.state:
        assert np.array_equal(a.state[k], b.state[k]), k
    assert [e["step"] for e in events(tmp / "half", "train")] == [5, 10, 15, 20]

    # another N: refused with the N that wrote it (here: one process)
    r = CliRunner().invoke(cli, ["train", str(cfg), "--data", str(data), "--out", str(tmp / "full"),
                                 "--resume", "--set", "train.steps=30", "--no-distributed"])
    assert r.exit_code == 1 and "2 process(es)" in r.output and "mpiexec -n 2" in r.output, r.output


@needs_mpi
def test_one_rank_is_the_single_process_run(setup):
    """mpiexec -n 1 ... --distributed (value_and_grad, Allreduce, apply_update) == the plain one-process run."""
    cfg, data, tmp = setup
    p = btjit_train(1, cfg, data, tmp / "mpi1", "--distributed", "--set", "train.sample_interval=0")
    assert p.returncode == 0, p.stderr[-3000:]
    r = CliRunner().invoke(cli, ["train", str(cfg), "--data", str(data), "--out", str(tmp / "plain"),
                                 "--set", "train.sample_interval=0"])
    assert r.exit_code == 0, r.output
    a, b = K.load(tmp / "mpi1" / "ckpt_00000020.npz"), K.load(tmp / "plain" / "ckpt_00000020.npz")
    for k in b.state:
        assert np.array_equal(a.state[k], b.state[k]), k
    assert a.meta["rng_state"] == b.meta["rng_state"]


@needs_mpi
@pytest.mark.slow        # the dense-average run's resume is test_cli_two_ranks_log_checkpoint_and_resume_bit_exact
def test_cli_topk_resume_bit_exact_with_error_feedback_state(setup):
    cfg, data, tmp = setup
    comp = ["--set", 'distributed.compressor="topk"', "--set", "distributed.ratio=0.05",
            "--set", "train.sample_interval=0"]
    full = btjit_train(2, cfg, data, tmp / "full", *comp)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "topk ratio 0.05 + EF21" in full.stdout
    trains = events(tmp / "full", "train")
    dense = K.load(tmp / "full" / "ckpt_00000020.npz").state["dist/ef_g"].nbytes
    assert trains[-1]["comm_bytes_per_step"] < 0.2 * dense
    half = btjit_train(2, cfg, data, tmp / "half", *comp, "--set", "train.steps=10")
    assert half.returncode == 0, half.stderr[-3000:]
    again = btjit_train(2, cfg, data, tmp / "half", *comp, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = K.load(tmp / "full" / "ckpt_00000020.npz"), K.load(tmp / "half" / "ckpt_00000020.npz")
    assert {"dist/ef_g", "dist/ef_local/0", "dist/ef_local/1"} <= set(a.state)
    for k in a.state:
        assert np.array_equal(a.state[k], b.state[k]), k


@needs_mpi
def test_nonfinite_loss_stops_every_rank_with_one_message(setup):
    cfg, data, tmp = setup
    p = btjit_train(2, cfg, data, tmp / "nan", "--set", 'optim.name="sgd"', "--set", "optim.lr=1e30")
    assert p.returncode == 1
    errs = [l for l in p.stderr.splitlines() if l.startswith("error")]     # btjit's lines (not the launcher's)
    assert len(errs) == 1 and "loss is nan at step" in errs[0], p.stderr
    assert "MPI_Abort" not in p.stderr                   # every rank saw it: no abort needed


@needs_mpi
def test_launch_from_python(setup):
    cfg, data, tmp = setup
    lines = []
    res = mpilaunch.launch(cfg, n=2, out=tmp / "nb", data=data, echo=lines.append,
                             overrides=["train.steps=10", "train.sample_interval=0"])
    assert res.step == 10 and res.checkpoint.name == "ckpt_00000010.npz" and res.val_loss is not None
    assert any("distributed: 2 processes" in l for l in lines)
