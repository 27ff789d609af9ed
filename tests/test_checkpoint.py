# tests/test_checkpoint.py -- checkpoints (btjit/checkpoint.py): exact round trip of arrays, metadata and
# RNG state; keep-last-K; corruption and truncation caught by the checksum; latest_valid() falling back;
# newer format versions and other models refused; a real child process SIGKILLed mid-write, repeatedly,
# never leaves a broken checkpoint; a failed write (disk full) leaves the previous one intact.
import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from btjit.train import checkpoint as K
from btjit.train.checkpoint import CheckpointError, CorruptCheckpoint

ROOT = Path(__file__).resolve().parent.parent


def state(seed=0, n=1000):
    r = np.random.default_rng(seed)
    return {"param/wte": r.standard_normal((n // 10, 10)).astype(np.float32),
            "param/b": r.standard_normal(7).astype(np.float32),
            "opt/m/wte": r.standard_normal((n // 10, 10)).astype(np.float32),
            "step": np.array(seed, dtype=np.int64)}


def meta(rng=None):
    rng = rng or np.random.default_rng(1)
    return {"rng_state": K.rng_state(rng), "vocab": list("\n !abc\u00e9"), "config": {"train": {"steps": 3}}}


def test_round_trip_exact(tmp_path):
    rng = np.random.default_rng(123)
    rng.integers(0, 100, 17)
    st = state(5)
    p = K.save(tmp_path, 40, st, meta(rng))
    assert p.name == "ckpt_00000040.npz"
    ck = K.load(p)
    assert ck.step == 40 and ck.meta["format_version"] == K.FORMAT_VERSION
    assert set(ck.state) == set(st)
    for k in st:
        assert ck.state[k].dtype == st[k].dtype and np.array_equal(ck.state[k], st[k])
    assert set(ck.params) == {"wte", "b"}
    assert ck.meta["vocab"] == list("\n !abc\u00e9")
    r2 = K.rng_from_state(ck.meta["rng_state"])
    assert np.array_equal(r2.integers(0, 10**9, 50), rng.integers(0, 10**9, 50))


def test_keep_last_k(tmp_path):
    for s in range(1, 8):
        K.save(tmp_path, s * 10, state(s), meta(), keep=3)
    assert [p.name for p in K.list_checkpoints(tmp_path)] == \
        ["ckpt_00000050.npz", "ckpt_00000060.npz", "ckpt_00000070.npz"]
    assert not list(tmp_path.glob("*.tmp"))


def test_truncated_file_detected(tmp_path):
    p = K.save(tmp_path, 1, state(), meta())
    data = p.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        p.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpoint, match="truncated or damaged"):
            K.load(p)


def test_flipped_bytes_detected_or_harmless(tmp_path):
    """Any flipped byte either is caught, or hit zip bookkeeping (e.g. a timestamp) that leaves every
    value intact: a checkpoint never loads with different contents."""
    st = state()
    p = K.save(tmp_path, 1, st, meta())
    data = p.read_bytes()
    caught = 0
    for pos in random.Random(0).sample(range(len(data)), 60):
        b = bytearray(data)
        b[pos] ^= 0x40
        p.write_bytes(bytes(b))
        try:
            ck = K.load(p)
        except CorruptCheckpoint:
            caught += 1
            continue
        assert all(np.array_equal(ck.state[k], st[k]) for k in st) and ck.step == 1
    assert caught >= 40


def test_checksum_catches_a_consistent_zip_with_changed_values(tmp_path):
    p = K.save(tmp_path, 1, state(), meta())
    with np.load(p) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["state/param/b"][3] += 1.0          # a well-formed file whose payload changed
    np.savez(p, **arrays)
    with pytest.raises(CorruptCheckpoint, match="sha256 checksum mismatch"):
        K.load(p)


def test_latest_valid_falls_back_and_reports(tmp_path):
    for s in (10, 20, 30):
        K.save(tmp_path, s, state(s), meta())
    p30 = K.path_for(tmp_path, 30)
    p30.write_bytes(p30.read_bytes()[:100])
    p20 = K.path_for(tmp_path, 20)
    b = bytearray(p20.read_bytes())
    b[len(b) // 3] ^= 1
    p20.write_bytes(bytes(b))
    ck, skipped = K.latest_valid(tmp_path)
    assert ck.step == 10 and np.array_equal(ck.state["param/wte"], state(10)["param/wte"])
    assert [p for p, _ in skipped] == [p30, p20]
    assert all("ckpt_000000" in why for _, why in skipped)
    assert K.latest_valid(tmp_path / "empty") == (None, [])


def test_newer_format_version_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    K.save(tmp_path, 1, state(), meta())
    monkeypatch.setattr(K, "FORMAT_VERSION", K.FORMAT_VERSION + 1)
    K.save(tmp_path, 2, state(), meta())
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"format version 2, newer than this btjit reads \(1\)"):
        K.latest_valid(tmp_path)


def test_other_model_is_a_clear_error(tmp_path):
    ck = K.load(K.save(tmp_path, 1, state(n=1000), meta()))
    K.check_compatible(ck, state(n=1000))
    with pytest.raises(CheckpointError, match=r"another model: opt/m/wte has shape \(100, 10\) but the "
                                              r"model needs \(50, 10\) \(\+1 more\)"):
        K.check_compatible(ck, state(n=500))
    other = dict(state(), **{"param/lm_head": np.zeros(3)})
    with pytest.raises(CheckpointError, match="missing param/lm_head"):
        K.check_compatible(ck, other)
    with pytest.raises(CheckpointError, match="unexpected opt/m/wte"):
        K.check_compatible(ck, {k: v for k, v in state().items() if k != "opt/m/wte"})
    K.check_compatible(ck, {"param/wte": np.zeros((100, 10)), "param/b": np.zeros(7)}, prefix="param/")


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        K.load(tmp_path / "ckpt_00000001.npz")
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    with pytest.raises(CorruptCheckpoint, match="not a btjit checkpoint"):
        K.load(tmp_path / "plain.npz")


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    K.save(tmp_path, 10, state(10), meta(), keep=1)

    def disk_full(f, **arrays):
        f.write(b"PK partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*ckpt_00000020.npz: no space left"):
        K.save(tmp_path, 20, state(20), meta(), keep=1)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt_00000010.npz"]
    assert K.load(K.path_for(tmp_path, 10)).step == 10


WRITER = """
import sys, numpy as np
from btjit.train import checkpoint as K
run_dir, start = sys.argv[1], int(sys.argv[2])
big = {"param/w": np.random.default_rng(0).standard_normal((2_000_000,)).astype(np.float32),
       "opt/v": np.ones((1_000_000,), np.float32), "step": np.array(0)}
print("ready", flush=True)
s = start
while True:
    s += 1
    big["step"] = np.array(s)
    K.save(run_dir, s, big, {"rng_state": None, "vocab": []}, keep=2)
"""


def test_sigkill_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    """Kill a real writer process at random moments (several times); every checkpoint left behind
    must load and verify, and the newest valid one is never older than the one before the kill."""
    K.save(tmp_path, 1, state(1), meta())
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rnd = random.Random(42)
    newest = 1
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(newest)],
                                 stdout=subprocess.PIPE, env=env, cwd=str(tmp_path))
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rnd.uniform(0.05, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        ck, skipped = K.latest_valid(tmp_path)
        assert skipped == [] and ck is not None and ck.step >= newest
        for p in K.list_checkpoints(tmp_path):          # nothing half-written under a final name
            assert K.load(p).step == int(p.name[5:13])
        newest = ck.step
    assert newest > 1                                   # the writer did get checkpoints out
    leftovers = list(tmp_path.glob(".ckpt_*.tmp"))
    K.save(tmp_path, newest + 1, state(2), meta(), keep=2)   # a later save clears dead writers' temps
    assert all(not p.exists() for p in leftovers)
    assert not list(tmp_path.glob(".ckpt_*.tmp"))
