"""prog.export / f.export / btjit export, btjit.runtime and the C host (btjit/export.py, btjit/runtime.py,
examples/c/train.c): an export reproduces the in-process program bit for bit, in a process without numba,
and a damaged export is refused with the file and the reason."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import btjit
import btjit.runtime as R
from btjit.export.build import ExportError
from btjit.models import gpt

ROOT = Path(__file__).resolve().parents[1]
CC = shutil.which("cc") or shutil.which("gcc")
CFG = gpt.GPTConfig(vocab_size=11, n_layer=2, n_head=2, n_embd=8, block_size=4)

# runs in a fresh interpreter: loads the exports, asserts no compiler was imported, prints the results
RUNNER = r"""
import json, sys
import numpy as np
import btjit.runtime as R
jobs = json.loads(sys.argv[1])
out = {}
for name, job in jobs.items():
    p = R.load(job["dir"])
    if job["kind"] == "tensor":
        d = np.load(job["batches"])
        losses = [p.step(d[f"x{i}"], d[f"y{i}"]) for i in range(job["steps"])]
        out[name] = {"losses": losses, "params": {k: v.tolist() for k, v in p.params.items()}}
    else:
        X = np.load(job["X"])
        out[name] = {"one": [[p(*row)[0], list(p(*row)[1])] for row in X[:5].tolist()],
                     "many": [a.tolist() for a in p.many(X)]}
out["imported"] = [m for m in ("numba", "llvmlite", "scipy") if m in sys.modules]
print(json.dumps(out))
"""


def run_fresh(jobs):
    r = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def batches(n, B=3, seed=0, vocab=CFG.vocab_size):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (B, CFG.block_size)).astype(np.int32),
             rng.integers(0, vocab, (B, CFG.block_size)).astype(np.int32)) for _ in range(n)]


def gpt_program(opt, dtype="float32", B=3):
    p = gpt.init_params(CFG, np.random.default_rng(1))
    x, y = batches(1, B)[0]
    return btjit.trace(gpt.loss_fn(CFG), p, x, y, optimizer=opt, dtype=dtype)


def test_tensor_exports_reproduce_the_trajectory_bitwise_without_numba(tmp_path):
    data = batches(6)
    np.savez(tmp_path / "b.npz", **{f"x{i}": x for i, (x, _) in enumerate(data)},
             **{f"y{i}": y for i, (_, y) in enumerate(data)})
    jobs, expect = {}, {}
    for opt in ("sgd", "adamw"):
        for dtype in ("float32", "float64"):
            o = btjit.optim.SGD(lr=0.1, momentum=0.9) if opt == "sgd" else btjit.optim.AdamW(lr=1e-2)
            prog = gpt_program(o, dtype)
            name = f"{opt}_{dtype}"
            prog.export(tmp_path / name)
            losses = [prog.step(x, y) for x, y in data]
            expect[name] = (losses, {k: v.tolist() for k, v in prog.params.items()})
            jobs[name] = {"kind": "tensor", "dir": str(tmp_path / name), "batches": str(tmp_path / "b.npz"),
                          "steps": len(data)}
    got = run_fresh(jobs)
    assert got.pop("imported") == []
    for name, (losses, params) in expect.items():
        assert got[name]["losses"] == losses, name                  # bitwise: the same machine code
        assert got[name]["params"] == params, name
    man = json.loads((tmp_path / "sgd_float64" / "manifest.json").read_text())
    assert man["blas"] is not None and Path(man["blas"]["path"]).is_file()   # float64 GEMMs call OpenBLAS
    assert json.loads((tmp_path / "sgd_float32" / "manifest.json").read_text())["blas"] is None



def _exports_run_bitwise(tmp_path, cases):
    """cases: (name, program, its batches, an entry it must run): each exported, then stepped on its batches
    in a fresh interpreter from the export; the losses must equal the in-process ones bit for bit."""
    jobs, expect = {}, {}
    for name, prog, data, kernel in cases:
        assert any(e.startswith(kernel) for e in prog.kernels.entries)
        np.savez(tmp_path / f"{name}.npz", **{f"x{i}": x for i, (x, _) in enumerate(data)},
                 **{f"y{i}": y for i, (_, y) in enumerate(data)})
        prog.export(tmp_path / name)
        expect[name] = [prog.step(x, y) for x, y in data]
        jobs[name] = {"kind": "tensor", "dir": str(tmp_path / name), "batches": str(tmp_path / f"{name}.npz"),
                      "steps": len(data)}
    got = run_fresh(jobs)
    for name, losses in expect.items():
        assert got[name]["losses"] == losses, name


def test_exports_link_the_generated_attention_entries(tmp_path):
    """Batch 16 (the lanes kernels) and 1 (the pairs kernels moving one sequence themselves): entries that are
    llvmlite's object code, not numba's, linked into the export and run bitwise as in-process."""
    _exports_run_bitwise(tmp_path, [(f"B{B}", gpt_program(btjit.optim.AdamW(lr=1e-2), B=B), batches(3, B, seed=B),
                                     kernel) for B, kernel in ((16, "k_attn_fwd_lanes"), (1, "k_attn_fwd_pairs"))])


def test_exports_of_the_kept_and_flash_attention(tmp_path):
    """A GPT whose attention runs the kept kernels (T 16, head size 8) and one on the flash kernels (T 64, head
    size 4): exported, run bitwise as in-process."""
    cases = []
    for T, C, kernel in ((16, 16, "k_attn_fwd_kept"), (64, 8, "k_attn_fwd_flash")):
        cfg = gpt.GPTConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=C, block_size=T)
        rng = np.random.default_rng(T)
        data = [tuple(rng.integers(0, 11, (2, T)).astype(np.int32) for _ in "xy") for _ in range(3)]
        prog = btjit.trace(gpt.loss_fn(cfg), gpt.init_params(cfg, np.random.default_rng(1)), *data[0],
                           optimizer=btjit.optim.AdamW(lr=1e-2))
        cases.append((f"T{T}", prog, data, kernel))
    _exports_run_bitwise(tmp_path, cases)


def test_a_program_split_over_threads_exports_and_runs_its_parts_in_turn(tmp_path):
    """Traced on two threads, a GPT's products, attention and update rows are split; the export runs each row's
    parts one after another on one thread: the same losses bit for bit."""
    from btjit.testing import split_kernels
    cfg = gpt.GPTConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=64, block_size=16)
    rng = np.random.default_rng(3)
    data = [tuple(rng.integers(0, 11, (32, 16)).astype(np.int32) for _ in "xy") for _ in range(3)]
    prog = btjit.trace(gpt.loss_fn(cfg), gpt.init_params(cfg, np.random.default_rng(1)), *data[0],
                       optimizer=btjit.optim.AdamW(lr=1e-2), threads=2, replicas=1)
    assert len(split_kernels(prog)) >= 2, split_kernels(prog)
    _exports_run_bitwise(tmp_path, [("split", prog, data, "k_matmul")])


def scalar_fn(lowering, dtype):
    return btjit.trace_scalar(lambda a, b, c: (btjit.tanh(a * b + b ** 3) / 2 + btjit.where(a > c, a * c, b)
                                               + btjit.exp(-c * c) - btjit.relu(a - b)),
                              dtype=dtype, lowering=lowering)


def test_scalar_exports_compute_what_the_function_does(tmp_path):
    X = np.random.default_rng(0).normal(size=(37, 3))
    np.save(tmp_path / "X.npy", X)
    jobs, fns = {}, {}
    for lowering in ("straight", "tape"):
        for dtype in ("float64", "float32"):
            name = f"{lowering}_{dtype}"
            fns[name] = f = scalar_fn(lowering, dtype)
            f.export(tmp_path / name)
            jobs[name] = {"kind": "scalar", "dir": str(tmp_path / name), "X": str(tmp_path / "X.npy")}
    got = run_fresh(jobs)
    assert got.pop("imported") == []
    for name, f in fns.items():
        for row, (v, g) in zip(X[:5].tolist(), got[name]["one"]):
            fv, fg = f(*row)
            assert v == fv and tuple(g) == fg, name                  # bitwise: the same machine code
        values, grads = f.many(X)
        assert got[name]["many"][0] == values.tolist() and got[name]["many"][1] == grads.tolist(), name
    g = R.load(tmp_path / "straight_float64")
    OV, OG = np.empty((len(X), 1)), np.empty((len(X), 3))
    v, gr = g.many(X, out=(OV, OG))
    assert v.base is OV and gr is OG and v.tolist() == got["straight_float64"]["many"][0]
    with pytest.raises(TypeError, match=r"expected 3 arguments \(a, b, c\), got 2"):
        g(1.0, 2.0)
    with pytest.raises(ValueError, match=r"inputs must have shape \(N, 3\)"):
        g.many(np.zeros((4, 2)))


def test_the_runtime_is_a_program(tmp_path):
    """Same views, value_and_grad, forward, lr, state_dict and batch errors as the Program it came from."""
    prog = gpt_program(btjit.optim.AdamW(lr=1e-2))
    prog.export(tmp_path / "e")
    rt = R.load(tmp_path / "e")
    (x, y), (x2, y2) = batches(2, seed=5)
    assert rt.value_and_grad(x, y) == prog.value_and_grad(x, y)
    for k in prog.grads:
        assert (rt.grads[k] == prog.grads[k]).all()
    assert rt.forward(x, y) == prog.forward(x, y)
    rt.lr = prog.lr = 0.05
    assert rt.step(x, y) == prog.step(x, y) and rt.lr == prog.lr and rt.step_count == prog.step_count == 1
    sd = rt.state_dict()
    assert sd.keys() == prog.state_dict().keys()
    assert all((sd[k] == v).all() for k, v in prog.state_dict().items())
    rt.step(x2, y2)
    rt.load_state_dict(sd)                                           # back to after step 1
    assert rt.step(x2, y2) == prog.step(x2, y2)
    bad = x.copy()
    bad[0, 0] = CFG.vocab_size
    for p in (prog, rt):
        with pytest.raises(ValueError, match=r"batch argument 0 \(idx\): index values must be in \[0, 11\), "
                                             r"got min \d+ max 11"):
            p.step(bad, y)
        with pytest.raises(ValueError, match=r"expected int array of shape \(3, 4\), got int32 \(2, 4\)"):
            p.step(x[:2], y)
    assert rt.step(x, y) == prog.step(x, y)                          # the failed checks changed nothing
    for p in (prog, rt):                  # traced without clipping: a clip_norm would be ignored, so it is refused
        with pytest.raises(ValueError, match="traced without clip_norm"):
            p.hp["clip_norm"] = 1.0


def test_programs_that_cannot_be_exported_say_why(tmp_path):
    p = gpt.init_params(CFG, np.random.default_rng(1))
    x, y = batches(1, B=4)[0]
    prog = btjit.trace(gpt.loss_fn(CFG), p, x, y, optimizer=btjit.optim.SGD(lr=0.1), replicas=2)
    with pytest.raises(ExportError, match="runs 2 replicas; an export is one thread"):
        prog.export(tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def good_export(tmp_path_factory):
    d = tmp_path_factory.mktemp("exp") / "good"
    gpt_program(btjit.optim.SGD(lr=0.1)).export(d)
    return d


def damaged(good, tmp_path, how):
    d = tmp_path / "bad"
    shutil.copytree(good, d)
    how(d)
    return d


def rewrite_manifest(d, change):
    m = json.loads((d / "manifest.json").read_text())
    change(m)
    m["checksum"] = R.manifest_checksum(m)
    (d / "manifest.json").write_text(json.dumps(m))


def flip_byte(path, at):
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("case, how, message", [
    ("truncated arena", lambda d: (d / "arena.bin").write_bytes((d / "arena.bin").read_bytes()[:-8]),
     r"arena.bin: \d+ bytes, the manifest says \d+ \(truncated"),
    ("corrupt library", lambda d: flip_byte(d / "libbtjit.so", 5000), r"libbtjit.so: checksum mismatch \(corrupt\)"),
    ("corrupt tape", lambda d: flip_byte(d / "tape.bin", 3), r"tape.bin: checksum mismatch"),
    ("missing file", lambda d: (d / "iarena.bin").unlink(), r"iarena.bin: missing"),
    ("not an export", lambda d: (d / "manifest.json").unlink(), r"manifest.json: missing .* not a btjit export"),
    ("garbled manifest", lambda d: (d / "manifest.json").write_text("{\"format\": 1,"), r"not valid JSON"),
    ("edited manifest", lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"span": ', '"span": 1')), r"manifest.json: checksum mismatch"),
    ("other version", lambda d: rewrite_manifest(d, lambda m: m.update(format=99)),
     r"export format 99, this btjit reads format 1"),
    ("other CPU", lambda d: rewrite_manifest(d, lambda m: m.update(cpu_flags=m["cpu_flags"] + ["avx512_fp99"])),
     r"libbtjit.so: built for a CPU with avx512_fp99 .* this CPU lacks"),
    ("other machine", lambda d: rewrite_manifest(d, lambda m: m["cpu"].update(machine="riscv64")),
     r"built for riscv64"),
    ("missing BLAS", lambda d: rewrite_manifest(d, lambda m: m.update(blas={"path": "/nonexistent/libopenblas.so",
                                                                           "gemm": "sgemm_"})),
     r"links the BLAS library /nonexistent/libopenblas.so .* missing"),
])
def test_a_damaged_export_is_refused_with_the_file_and_the_reason(good_export, tmp_path, case, how, message):
    d = damaged(good_export, tmp_path, how)
    with pytest.raises(R.LoadError, match=message):
        R.load(d)


def test_reexport_replaces_the_dir_whole(tmp_path):
    d = tmp_path / "e"
    gpt_program(btjit.optim.SGD(lr=0.1)).export(d)
    (d / "stray").write_text("x")
    gpt_program(btjit.optim.AdamW(lr=0.1)).export(d)
    assert not (d / "stray").exists() and R.load(d).optimizer["type"] == "AdamW"
    assert [p.name for p in tmp_path.iterdir()] == ["e"]           # no temp dirs left


def cc_build(export_dir, exe):
    r = subprocess.run([CC, "-O2", "-I", str(export_dir), "-o", str(exe), str(ROOT / "examples/c/train.c"),
                        str(export_dir / "libbtjit.so"), f"-Wl,-rpath,{export_dir}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def c_host_train(tmp_path, data, steps):
    """The C host built at tmp_path/train and run `steps` steps of the export tmp_path/e on data's (x, y) batches
    (written to tmp_path/batches.bin): the CompletedProcess (stdout: a loss a line)."""
    with open(tmp_path / "batches.bin", "wb") as f:
        for x, y in data:
            f.write(x.tobytes() + y.tobytes())
    cc_build(tmp_path / "e", tmp_path / "train")
    return c_host_run(tmp_path, steps)


def c_host_run(tmp_path, steps):
    """The C host built by c_host_train run again for `steps` steps on its batches.bin."""
    return subprocess.run([str(tmp_path / "train"), str(tmp_path / "e"), str(steps), str(tmp_path / "batches.bin")],
                          capture_output=True, text=True)


@pytest.mark.skipif(CC is None, reason="no C compiler (cc/gcc) on this machine")
def test_the_c_host_trains_what_python_trains(tmp_path):
    prog = gpt_program(btjit.optim.AdamW(lr=1e-2))
    prog.export(tmp_path / "e")
    data = batches(5)
    r = c_host_train(tmp_path, data, 5)
    assert r.returncode == 0, r.stderr
    got = [np.float32(ln.split()[-1]) for ln in r.stdout.splitlines()]
    assert got == [np.float32(prog.step(x, y)) for x, y in data]    # %.9g round-trips a float32
    r = c_host_run(tmp_path, 9)
    assert r.returncode == 1 and "no batch for step 5" in r.stderr
    flip_byte(tmp_path / "e" / "arena.bin", 100)
    r = subprocess.run([str(tmp_path / "train"), str(tmp_path / "e"), "1"], capture_output=True, text=True)
    assert r.returncode == 1 and "arena.bin: checksum mismatch" in r.stderr


@pytest.mark.skipif(CC is None, reason="no C compiler (cc/gcc) on this machine")
def test_the_c_host_evaluates_a_scalar_export(tmp_path):
    f = scalar_fn("straight", "float64")
    f.export(tmp_path / "s")
    cc_build(tmp_path / "s", tmp_path / "run")
    r = subprocess.run([str(tmp_path / "run"), str(tmp_path / "s"), "1000"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    vals = {" ".join(ln.split()[:-1]): float(ln.split()[-1]) for ln in r.stdout.splitlines()}
    v, g = f(vals["x 0"], vals["x 1"], vals["x 2"])                 # the C host calls f(...)'s code
    assert vals["value"] == v and [vals[f"grad {i}"] for i in range(3)] == list(g)


def test_btjit_export_writes_a_trained_run(tmp_path):
    from btjit.train import checkpoint
    from btjit.cli import main
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(open(ROOT / "configs/gpt3_tiny.toml").read())
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", str(cfg), "--out", str(run), "--set", "train.steps=3", "--set", "train.eval_interval=3",
              "--set", "train.checkpoint_interval=3", "--set", "model.n_layer=1", "--set", "train.batch_size=4", "--set", "optim.warmup_steps=1",
              "--set", "train.sample_interval=0"])
    assert e.value.code in (0, None)
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), str(tmp_path / "ex")])
    assert e.value.code in (0, None)
    rt = R.load(tmp_path / "ex")
    ck, _ = checkpoint.latest_valid(run)
    for k, v in ck.params.items():
        assert (rt.params[k] == v).all()
    assert rt.step_count == 3 and rt.inputs["idx"].shape == (4, 8)
    assert len(json.loads((tmp_path / "ex" / "vocab.json").read_text())) == rt.params["wte"].shape[0]


def test_forward_only_and_grad_only_programs_export(tmp_path):
    p = gpt.init_params(CFG, np.random.default_rng(1))
    (x, y), (x2, _) = batches(2)
    logits = btjit.trace(lambda p, idx: gpt.logits_fn(CFG)(p, idx), p, x)
    logits.export(tmp_path / "fwd")
    rt = R.load(tmp_path / "fwd")
    out = rt.forward(x2)
    assert out.shape == (3, CFG.block_size, CFG.vocab_size) and (out == logits.forward(x2)).all()
    with pytest.raises(RuntimeError, match="without an optimizer"):
        rt.step(x2)
    with pytest.raises(RuntimeError, match="no gradient"):
        rt.value_and_grad(x2)
    vg = btjit.trace(gpt.loss_fn(CFG), p, x, y, grad=True)
    vg.export(tmp_path / "vg")
    rt = R.load(tmp_path / "vg")
    assert rt.value_and_grad(x, y) == vg.value_and_grad(x, y)
    assert all((rt.grads[k] == vg.grads[k]).all() for k in vg.grads)


def test_a_scalar_export_without_its_python_call_module_calls_through_ctypes(tmp_path):
    f = scalar_fn("straight", "float64")
    f.export(tmp_path / "s")
    fast = R.load(tmp_path / "s")
    built = bool(json.loads((tmp_path / "s" / "manifest.json").read_text())["pycall"])   # where Python.h exists
    rewrite_manifest(tmp_path / "s", lambda m: m.update(pycall=None))
    slow = R.load(tmp_path / "s")
    assert type(slow) is R.ExportedScalar and (type(fast) is not R.ExportedScalar) == built
    for row in np.random.default_rng(3).normal(size=(4, 3)).tolist():
        assert fast(*row) == slow(*row) == f(*row)
    for g in (fast, slow):
        with pytest.raises(TypeError, match=r"expected 3 arguments \(a, b, c\), got 1"):
            g(1.0)
