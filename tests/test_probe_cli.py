# tests/test_probe_cli.py -- `btjit train` and `btjit bench` as a user runs them, on ground the other CLI tests
# leave: a resumed run prints the samples an uninterrupted one prints (the samples' RNG is in the checkpoint); an
# .npz whose integer targets hold an id far beyond its samples (a stray label) is one error naming the key, not a
# model of a billion outputs; `btjit bench` refuses --reps 0, negative --threads and an unknown --only before it
# measures anything; NaN or inf in a key that must be >= 0 is a config error; a run whose params diverge before
# a sample stops with one line, as at a checkpoint; `btjit export RUN` reads the file the run was trained on; the
# resume hint keeps --threads, and a resume as another number of data-parallel replicas is noted; NaN float
# targets in an .npz are named; a --resume that reads another data file than the checkpoint's is noted; a model
# file and an optimizer file of one name are refused; `btjit sample --seed -1` is an error naming the option; an
# export refuses to replace a dir that is not an earlier export (a run dir, a project); a new run over one that
# saved no checkpoint starts its own metrics log; a file that is not an .npz is named as such; a run never
# overwrites a config.toml it did not write, or a model file of the user's own.
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from btjit.cli import cli
from btjit.train import arrays as A
from btjit.train import checkpoint as K
from btjit.train import config as C
from btjit.train.data import DataError
from btjit.train.sampling import SampleError, pick
from test_cli import assert_error
from textdata import words

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


BIGRAM = ('[model]\nkind = "bigram"\nblock_size = 8\n[train]\nsteps = 4\nbatch_size = 16\nseed = 5\n'
          "eval_interval = 2\neval_batches = 2\nlog_interval = 1\nsample_interval = 2\nsample_chars = 60\n"
          'checkpoint_interval = 2\nkeep_checkpoints = 5\n[optim]\nname = "adamw"\nlr = 0.05\n')


def samples(output: str) -> dict:
    """step -> the text of its sample block in a run's output."""
    out, lines = {}, output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("--- sample at step "):
            end = lines.index("---", i + 1)
            out[int(line.split()[-2])] = "\n".join(lines[i + 1:end])
    return out


def test_a_resumed_run_prints_the_samples_of_an_uninterrupted_one(tmp_path):
    (tmp_path / "c.toml").write_text(BIGRAM)
    (tmp_path / "w.txt").write_text(words())
    args = ("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--threads", "1")
    whole = run(*args, "--out", tmp_path / "a")
    assert whole.exit_code == 0, whole.output
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "ckpt_00000004.npz").unlink()               # as if stopped after the step-2 checkpoint
    resumed = run(*args, "--out", tmp_path / "b", "--resume")
    assert resumed.exit_code == 0 and "resumed from ckpt_00000002.npz at step 2" in resumed.output, resumed.output
    a, b = samples(whole.output), samples(resumed.output)
    assert sorted(a) == [2, 4] and sorted(b) == [4] and a[2] != a[4]
    assert b[4] == a[4]


def write_npz(tmp_path, y_train, y_val=None):
    rng = np.random.default_rng(0)
    n = len(y_train)
    f = tmp_path / "d.npz"
    np.savez(f, x_train=rng.random((n, 4), np.float32), y_train=np.asarray(y_train),
             x_val=rng.random((3, 4), np.float32), y_val=np.asarray([0, 1, 2] if y_val is None else y_val))
    cfg = C.loads(f'[model]\nkind = "python"\nfile = "m.py"\n[data]\nformat = "arrays"\npath = "{f}"\n')
    return f, cfg


@pytest.mark.parametrize("y_train,y_val,key,top", [
    ([0, 1, 10**9, 2], None, "y_train", "1,000,000,000"),          # would build a billion class labels
    ([0, 1, 2, 1], [0, 2**40, 1], "y_val", "1,099,511,627,776"),    # would wrap to class 0 as int32
    ([0, 1, 2, 70000], None, "y_train", "70,000"),
])
def test_a_class_id_far_beyond_the_samples_is_named(tmp_path, y_train, y_val, key, top):
    f, cfg = write_npz(tmp_path, np.asarray(y_train, np.int64), y_val if y_val is None else np.asarray(y_val))
    with pytest.raises(DataError) as e:
        A.load(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{f}: {key} holds class id {top}") and "class ids 0..K-1" in msg and "\n" not in msg


def test_class_ids_up_to_the_sample_count_or_the_cap_still_load(tmp_path):
    f, cfg = write_npz(tmp_path, np.asarray([0, 5, 6, 1]))           # 7 classes for 7 samples
    assert A.load(cfg).classes == 7
    f, cfg = write_npz(tmp_path, np.asarray([0, A.MAX_CLASSES - 1, 2, 1], np.uint32))
    assert A.load(cfg).classes == A.MAX_CLASSES


@pytest.fixture
def no_measuring(monkeypatch):
    """Any measurement fails the test: the checks must come first."""
    from btjit.bench import footprint, harness, scale_suite

    def measured(*a, **k):
        raise AssertionError("a benchmark ran")
    monkeypatch.setattr(scale_suite, "sgemm_peak_gflops", measured)
    monkeypatch.setattr(harness, "measure", measured)
    monkeypatch.setattr(footprint, "measure_export", measured)


@pytest.mark.parametrize("args,needles", [
    (["--reps", "0"], ["--reps must be >= 1, got 0"]),
    (["--threads", "-2"], ["--threads must be >= 0, got -2"]),
    (["--suite", "scale", "--only", "S1,S9"], ["unknown size(s) S9", "E6, S1, S2, S3, S4"]),
    (["--suite", "footprint", "--only", "E6b1"], ["unknown workload(s) E6b1", "E1, E6b64"]),
    (["--only", "E9", "--peers", "none"], ["unknown workload(s) ['E9']"]),
])
def test_bench_refuses_bad_options_before_measuring(no_measuring, args, needles):
    assert_error(run("bench", *args), *needles)


@pytest.mark.parametrize("key,value,needle", [
    ("weight_decay", "nan", "optim.weight_decay must be >= 0 and finite, got nan"),    # was: NaN params
    ("clip_value", "nan", "optim.clip_value must be >= 0 and finite, got nan"),        # was: a model-file error
    ("clip_norm", "inf", "optim.clip_norm must be >= 0 and finite, got inf"),
    ("lr_min", "-1e-4", "optim.lr_min must be >= 0, got -0.0001"),
])
def test_nan_or_inf_in_a_non_negative_key_is_named(key, value, needle):
    with pytest.raises(C.ConfigError) as e:
        C.loads(f"[optim]\n{key} = {value}\n")
    assert needle in str(e.value)


def test_logits_that_cannot_be_sampled_are_a_sample_error():
    rng = np.random.default_rng(0)
    assert pick(np.array([-np.inf, 0.0, -np.inf]), rng) == 1
    for bad in ([np.nan, 0.0], [np.inf, 0.0], [-np.inf, -np.inf]):
        with pytest.raises(SampleError, match="logits are not finite"):
            pick(np.array(bad), rng)


def test_a_run_that_diverges_before_a_sample_stops_with_one_line(tmp_path):
    res = run("train", ROOT / "examples" / "mymodel.toml", "--threads", "1", "--out", tmp_path / "r",
              "--set", "train.steps=3", "--set", "train.sample_interval=1", "--set", "optim.lr=1e30")
    assert_error(res, "cannot sample at step 1: the model's logits are not finite (NaN)",
                 "No checkpoint was saved yet")
    assert not list((tmp_path / "r").glob("*.npz"))


def test_export_of_a_run_trained_on_its_own_file_reads_that_file(tmp_path, monkeypatch):
    """`btjit export RUN OUT` without --data shapes the program by the file the run read (its --data), from any
    dir; it was the bundled corpus, whose characters are not in the run's vocabulary."""
    (tmp_path / "c.toml").write_text(BIGRAM)
    (tmp_path / "w.txt").write_text(words())
    res = run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--threads", "1", "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    res = run("export", tmp_path / "r", tmp_path / "e")
    assert res.exit_code == 0 and "exported makemore bigram" in res.output, res.output
    assert json.loads((tmp_path / "e" / "vocab.json").read_text()) == K.load(tmp_path / "r" / "best.npz").meta["vocab"]


def test_the_resume_hint_keeps_threads_and_another_replica_count_is_noted(tmp_path, monkeypatch):
    """Two threads train 64 sequences as two data-parallel replicas, whose sums one thread does not reproduce: the
    line an interrupted run prints to continue it keeps --threads, and a resume on another count says so."""
    from btjit.train.trainer import Trainer
    from textdata import corpus, tiny_config, write_run_files
    cfg, data, _ = write_run_files(tmp_path, tiny_config(steps=6, batch_size=64), corpus())
    monkeypatch.setattr(Trainer, "_stop_requested", lambda self, stop: self.step == 3)     # as a Ctrl+C there
    res = run("train", cfg, "--data", data, "--threads", "2", "--out", tmp_path / "r")
    assert res.exit_code == 0 and "(2 data-parallel replicas)" in res.output, res.output
    hint = [line for line in res.output.splitlines() if line.startswith("interrupted at step 3")]
    assert hint and "--threads 2" in hint[0] and hint[0].endswith("--resume"), res.output
    monkeypatch.undo()
    res = run("train", cfg, "--data", data, "--threads", "1", "--out", tmp_path / "r", "--resume")
    assert res.exit_code == 0, res.output
    assert ("note: ckpt_00000003.npz was trained with 2 data-parallel replica(s), this run continues in 1 (see "
            "--threads): it will not be bit-identical to an uninterrupted run") in res.output
    res = run("train", cfg, "--data", data, "--threads", "1", "--out", tmp_path / "r", "--resume",
              "--set", "train.steps=8")                          # ckpt_00000006.npz: one replica
    assert res.exit_code == 0 and "note:" not in res.output, res.output


def test_non_finite_float_targets_are_named(tmp_path):
    y = np.ones((6, 2))
    y[4, 1] = np.nan
    f, cfg = write_npz(tmp_path, y, np.ones((3, 2)))
    with pytest.raises(DataError) as e:
        A.load(cfg)
    assert str(e.value) == f"{f}: y_train holds non-finite targets (first at sample 4)"


def test_a_resume_on_another_data_file_is_noted(tmp_path, monkeypatch):
    (tmp_path / "c.toml").write_text(BIGRAM)
    (tmp_path / "w.txt").write_text(words())
    (tmp_path / "copy.txt").write_text(words())
    args = ("train", tmp_path / "c.toml", "--threads", "1", "--out", tmp_path / "r")
    assert run(*args, "--data", tmp_path / "w.txt", "--set", "train.steps=2").exit_code == 0
    monkeypatch.chdir(tmp_path)                                 # the same file by another name: no note
    res = run(*args, "--data", "w.txt", "--resume", "--set", "train.steps=3")
    assert res.exit_code == 0 and "note:" not in res.output, res.output
    res = run(*args, "--data", tmp_path / "copy.txt", "--resume")
    assert res.exit_code == 0, res.output
    assert f"note: ckpt_00000003.npz was trained on {tmp_path / 'w.txt'}; this run reads {tmp_path / 'copy.txt'}" \
        in res.output
    res = run(*args, "--resume", "--set", "train.steps=5")      # no --data: the file the run read
    assert res.exit_code == 0 and f"note: --resume reads {tmp_path / 'copy.txt'}, the --data file" in res.output, \
        res.output


def test_a_model_file_and_an_optimizer_file_of_one_name_are_a_config_error(tmp_path):
    """Both are copied into the run dir by their names: the second overwrote the first, and --resume then read
    the optimizer as the model."""
    (tmp_path / "c.toml").write_text('[model]\nkind = "python"\nfile = "a/net.py"\n[optim]\nfile = "b/net.py"\n')
    with pytest.raises(C.ConfigError, match="model.file and optim.file are both named net.py: their copies in the "
                                            "run dir would clash"):
        C.load(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text('[model]\nkind = "python"\nfile = "a/net.py"\n[optim]\nfile = "b/opt.py"\n')
    assert C.load(tmp_path / "c.toml").optim.file.endswith("opt.py")


def test_sample_refuses_a_negative_seed_by_name(tmp_path):
    assert_error(run("sample", tmp_path / "none.npz", "--seed", "-1"), "--seed must be >= 0, got -1")


def tiny_program():
    import btjit
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    x, y = rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    return btjit.trace(lambda p, x, y: btjit.cross_entropy(x @ p["w"], y), p, x, y,
                       optimizer=btjit.optim.SGD(lr=0.1), threads=1)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_an_export_never_replaces_a_dir_of_other_files(tmp_path):
    """An export replaces its dir whole: into a run dir (`btjit export RUN RUN`) or a project dir it deleted
    everything there; it replaces only a new or empty dir or an earlier export."""
    from btjit.export.build import ExportError
    prog = tiny_program()
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"proj is not an earlier export \(no btjit manifest.json\) and holds 1 "
                                          r"file\(s\) \(notes.txt\), which an export would delete"):
        prog.export(tmp_path / "proj")
    assert [p.name for p in (tmp_path / "proj").iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file, not a dir"):
        prog.export(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    prog.export(tmp_path / "empty")
    prog.export(tmp_path / "empty")                                  # an earlier export: replaced
    assert (tmp_path / "empty" / "manifest.json").exists()
    (tmp_path / "c.toml").write_text(BIGRAM)
    (tmp_path / "w.txt").write_text(words())
    res = run("train", tmp_path / "c.toml", "--data", tmp_path / "w.txt", "--threads", "1", "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert_error(run("export", tmp_path / "r", tmp_path / "r"), "is not an earlier export",
                 "(best.npz, ckpt_00000002.npz, ckpt_00000004.npz, ...)")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before


def test_a_new_run_over_a_failed_one_starts_its_own_metrics_log(tmp_path):
    """A run that stopped before its first checkpoint leaves its metrics.jsonl; the same command run again (a new
    run: there is nothing to resume) appended to it, so the log held both runs' steps. Now it is moved aside."""
    args = ("train", ROOT / "examples" / "mymodel.toml", "--threads", "1", "--out", tmp_path / "r",
            "--set", "train.steps=3", "--set", "train.log_interval=1")
    assert_error(run(*args, "--set", "optim.lr=1e38"), "loss is nan at step 2", "No checkpoint was saved yet")
    failed = (tmp_path / "r" / "metrics.jsonl").read_text()
    res = run(*args)
    assert res.exit_code == 0 and "moved it to metrics.jsonl.1" in res.output, res.output
    assert (tmp_path / "r" / "metrics.jsonl.1").read_text() == failed
    events = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("val", "train")] == \
        [("val", 0), ("train", 1), ("train", 2), ("train", 3), ("val", 3)]


def test_trimming_the_metrics_log_skips_lines_that_are_not_events(tmp_path):
    from btjit.train.rundir import trim_metrics
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"event": "train", "step": 1}\n[1, 2]\n{"event": "train", "step": 3}\n{"event": "tr')
    trim_metrics(log, 2)
    assert log.read_text() == '{"event": "train", "step": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


@pytest.mark.parametrize("content", ["npy", "text"])
def test_a_file_that_is_not_an_npz_is_named_as_such(tmp_path, content):
    """An .npy file (np.load returns an array) was a TypeError about context managers; a text file, numpy's words
    about pickled data."""
    f = tmp_path / "d.npz"
    if content == "npy":
        with open(f, "wb") as fh:
            np.save(fh, np.zeros(3))
    else:
        f.write_text("x,y\n1,2\n")
    cfg = C.loads(f'[model]\nkind = "python"\nfile = "m.py"\n[data]\nformat = "arrays"\npath = "{f}"\n')
    with pytest.raises(DataError, match=r"d.npz: not a readable .npz file \(ValueError: not an .npz \(zip\) file\)"):
        A.load(cfg)
    with pytest.raises(K.CorruptCheckpoint, match=r"is truncated or damaged \(ValueError: not an .npz \(zip\) file\)"):
        K.load(f)


def test_a_run_never_overwrites_a_config_toml_it_did_not_write(tmp_path, monkeypatch):
    """`btjit train config.toml --out .` replaced the user's config (comments and all) with the resolved one."""
    (tmp_path / "config.toml").write_text("# mine\n" + BIGRAM)
    (tmp_path / "w.txt").write_text(words())
    monkeypatch.chdir(tmp_path)
    assert_error(run("train", "config.toml", "--data", "w.txt", "--out", "."),
                 "run dir . holds a config.toml that btjit did not write")
    assert (tmp_path / "config.toml").read_text() == "# mine\n" + BIGRAM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", "w.txt"]       # no lock file left
    assert run("train", "config.toml", "--data", "w.txt", "--out", "r", "--threads", "1").exit_code == 0
    res = run("train", "r/config.toml", "--data", "w.txt", "--out", "r", "--resume", "--set", "train.steps=5")
    assert res.exit_code == 0 and "resumed from ckpt_00000004.npz" in res.output, res.output


def test_a_run_never_overwrites_a_model_file_of_the_users_own(tmp_path):
    """The run's copy of the model file goes into --out: over a different file of that name in a dir of the user's
    own files (no config.toml of a run) it is refused; an earlier run's copy is replaced."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "mymodel.py").write_text("# my other model\n")
    args = ("train", ROOT / "examples" / "mymodel.toml", "--threads", "1", "--set", "train.steps=2")
    assert_error(run(*args, "--out", tmp_path / "proj"), "mymodel.py is another file than", "give another --out DIR")
    assert (tmp_path / "proj" / "mymodel.py").read_text() == "# my other model\n"
    assert run(*args, "--out", tmp_path / "r", "--set", "optim.lr=1e38", "--set", "train.steps=3").exit_code != 0
    (tmp_path / "r" / "mymodel.py").write_text("# the failed run's copy, edited\n")
    assert run(*args, "--out", tmp_path / "r").exit_code == 0
    assert (tmp_path / "r" / "mymodel.py").read_text() == (ROOT / "examples" / "mymodel.py").read_text()
