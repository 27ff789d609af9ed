# tests/test_rundir.py -- what a run dir holds beside the last K checkpoints, and who may write it:
#   * best.npz tracks the lowest val loss (ties keep the older), is the checkpoint of that step bit for bit,
#     and a resumed run ends with the same best.npz as an uninterrupted one;
#   * the run dir lock (btjit/rundir.py): a second process is refused at once, naming the holder's PID and
#     host; a lock left by a SIGKILLed process is taken over; end to end with `btjit train`: a second run and
#     a --resume on a dir that a live run is training are refused, and after SIGKILL --resume takes over.
import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from btjit.train import checkpoint as K
from btjit.cli import cli
from btjit.train.rundir import LOCK_FILE, RunDirError, RunDirLock
from textdata import corpus, tiny_config, write_run_files

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def error_line(res):
    assert res.exit_code != 0, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert lines[-1].startswith("error: ") and sum(l.startswith("error: ") for l in lines) == 1, res.output
    return lines[-1]


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


# ---- best.npz ---------------------------------------------------------------------------------------------
FAKE_VAL = {0: 5.0, 5: 3.0, 10: 3.5, 15: 2.0, 20: 2.0, 25: 2.5, 30: 2.2}     # the minimum at 15 (tied at 20)


@pytest.fixture
def fake_val(monkeypatch):
    from btjit.train.trainer import Trainer
    monkeypatch.setattr(Trainer, "evaluate", lambda self: FAKE_VAL[self.step])


def test_best_checkpoint_tracks_the_minimum_val_loss(tmp_path, fake_val):
    cfg, data, tmp = write_run_files(tmp_path, tiny_config(eval_interval=5, checkpoint_interval=5,
                                                           keep_checkpoints=10), corpus())
    assert run("train", cfg, "--data", data, "--out", tmp / "a").exit_code == 0
    best = K.load(tmp / "a" / K.BEST)
    assert best.step == 15 and best.meta["best"] == {"step": 15, "val_loss": 2.0}
    assert [(e["step"], e["val_loss"]) for e in events(tmp / "a", "best")] == [(5, 3.0), (15, 2.0)]
    at15 = K.load(K.path_for(tmp / "a", 15))
    assert set(best.state) == set(at15.state)
    for k in best.state:
        assert np.array_equal(best.state[k], at15.state[k]), k
    assert K.load(K.path_for(tmp / "a", 30)).meta["best"] == {"step": 15, "val_loss": 2.0}
    assert K.BEST not in [p.name for p in K.list_checkpoints(tmp / "a")]          # never pruned or resumed
    # killed after its step-10 checkpoint, resumed: the same best.npz at the end
    shutil.copytree(tmp / "a", tmp / "b")
    for p in K.list_checkpoints(tmp / "b"):
        if K.load(p).step > 10:
            p.unlink()
    (tmp / "b" / K.BEST).unlink()
    res = run("train", cfg, "--data", data, "--out", tmp / "b", "--resume")
    assert res.exit_code == 0 and "resumed from ckpt_00000010.npz" in res.output, res.output
    again = K.load(tmp / "b" / K.BEST)
    assert again.meta["best"] == best.meta["best"]
    for k in best.state:
        assert np.array_equal(best.state[k], again.state[k]), k


# ---- the lock ---------------------------------------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import sys, time
    from btjit.train.rundir import RunDirLock
    RunDirLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


def hold(run_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_held_lock_refuses_a_second_process_naming_it(tmp_path):
    child = hold(tmp_path)
    try:
        with pytest.raises(RunDirError) as e:
            RunDirLock(tmp_path).acquire()
        msg = str(e.value)
        assert f"in use by process {child.pid} on {socket.gethostname()}" in msg, msg
        assert str(tmp_path / LOCK_FILE) in msg and "--out DIR" in msg
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == child.pid
    finally:
        child.kill()
        child.wait()


def test_a_sigkilled_holders_lock_is_taken_over_and_a_clean_release_leaves_none(tmp_path):
    child = hold(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    lock = RunDirLock(tmp_path).acquire()
    assert lock.taken_over["pid"] == child.pid
    assert f"took over the run dir lock of process {child.pid}" in lock.note()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    again = RunDirLock(tmp_path).acquire()
    assert again.taken_over is None and again.note() is None
    again.release()


def test_btjit_train_refuses_a_run_dir_in_use_and_resumes_after_sigkill(tmp_path):
    cfg, data, tmp = write_run_files(tmp_path, tiny_config(checkpoint_interval=5), corpus())
    out = tmp / "live"
    child = subprocess.Popen([sys.executable, "-m", "btjit.cli", "train", str(cfg), "--data", str(data), "--out",
                              str(out), "--set", "train.steps=10000000", "--set", "train.eval_interval=0"],
                             env=dict(ENV, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        seen = []
        for line in child.stdout:                           # training: past step 10, the step-5 checkpoint is written
            seen.append(line)
            m = re.match(r"step\s+(\d+)/", line)
            if m and int(m.group(1)) >= 10:
                break
        assert K.list_checkpoints(out), "".join(seen)      # (the loop ends early only if the run ended)
        for extra in ((), ("--resume",)):
            line = error_line(run("train", cfg, "--data", data, "--out", out, *extra))
            assert f"run dir {out} is in use by process {child.pid} on {socket.gethostname()}" in line, line
            assert f": btjit train {cfg} --data {data}" in line      # the holder's command line
        assert child.poll() is None                         # the live run was not disturbed
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    ck, _ = K.latest_valid(out)
    res = run("train", cfg, "--data", data, "--out", out, "--resume", "--set", f"train.steps={ck.step + 5}")
    assert res.exit_code == 0, res.output
    assert f"note: took over the run dir lock of process {child.pid}" in res.output
    assert f"resumed from {ck.path.name} at step {ck.step}" in res.output
    assert K.latest_valid(out)[0].step == ck.step + 5 and (out / LOCK_FILE).read_text() == ""


def test_a_failed_set_up_removes_the_run_dir_it_created_and_keeps_one_that_was_there(tmp_path):
    cfg, data, tmp = write_run_files(tmp_path, tiny_config(), corpus())
    bad = ["--set", "data.val_fraction=0.9999"]            # too little train text: set-up fails after the lock
    new = tmp / "new" / "run"
    line = error_line(run("train", cfg, "--data", data, "--out", new, *bad))
    assert not new.exists() and (tmp / "new").is_dir(), line    # only the dir the run made, not its parent
    old = tmp / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    error_line(run("train", cfg, "--data", data, "--out", old, *bad))
    assert (old / "notes.txt").read_text() == "mine" and (old / LOCK_FILE).read_text() == ""
    assert run("train", cfg, "--data", data, "--out", new, "--set", "train.steps=2").exit_code == 0
    assert (new / LOCK_FILE).read_text() == ""              # a good run afterwards
