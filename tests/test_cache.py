"""The kernel library on disk (btjit/kernels/library.py): a second process loads every entry (asserted through
numba's cache-hit counters, not a time); a program with another kernel set or new shapes compiles nothing
that is in the library; a corrupted entry or an unwritable cache dir degrades to compiling, with a warning and
the same result; the cache holds one entry per kernel and dtype, however many programs; rows are built by
name from each kernel's one declaration, which agrees with the kernel's source."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np, btjit
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = {"w": np.arange(6.0).reshape(2, 3)}
        prog = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(x @ p["w"])), p, np.ones((n, 2)), dtype="float64",
                           grad=True)
        v = prog.value_and_grad(np.ones((n, 2)))
    print(json.dumps({"value": v, "grad": prog.grads["w"].tolist(), "hit": prog.kernels.cache_hit,
                      "compiled": prog.kernels.compiled, "entries": prog.kernels.entries,
                      "warnings": [str(x.message) for x in w if "btjit" in str(x.message)]}))
""")


def _run(cache_dir, *args, numba_cache_dir=None):
    env = dict(os.environ, BTJIT_CACHE_DIR=str(cache_dir),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if numba_cache_dir:
        env["NUMBA_CACHE_DIR"] = str(numba_cache_dir)
    out = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _lib(cache_dir):
    (d,) = Path(cache_dir).glob("lib-*")
    return d


def test_second_process_loads_from_disk_new_shapes_compile_nothing_and_corruption_heals(tmp_path):
    first = _run(tmp_path)
    assert not first["hit"] and not first["warnings"] and set(first["compiled"]) == set(first["entries"])
    assert first["entries"] and all(e.endswith("_f64") for e in first["entries"])
    second = _run(tmp_path)
    assert second["hit"] and second["value"] == first["value"] and second["grad"] == first["grad"]
    bigger = _run(tmp_path, 9)                                # new shapes: the same entries, nothing compiled
    assert bigger["compiled"] == [] and abs(bigger["value"] - 9 / 4 * first["value"]) < 1e-9
    n_py = len(list(_lib(tmp_path).glob("*.py")))
    assert n_py == len(first["entries"])                     # one file per kernel and dtype, not per program
    for f in (_lib(tmp_path) / "__pycache__").iterdir():     # corrupt every cache file
        f.write_bytes(b"\x00garbage" * 7)
    third = _run(tmp_path)
    assert third["value"] == first["value"] and third["grad"] == first["grad"]
    assert any("unusable" in w for w in third["warnings"])
    fourth = _run(tmp_path)                                  # the corrupt entries were replaced
    assert fourth["hit"] and fourth["value"] == first["value"]


def test_unwritable_cache_dir_compiles_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = _run(blocker / "cache")
    assert not res["hit"] and any("not writable" in w for w in res["warnings"])
    assert abs(res["value"] - 11.9798491796) < 1e-9


def test_an_older_library_is_removed_when_a_new_one_is_made(tmp_path, monkeypatch):
    from btjit.kernels import library
    old = tmp_path / "lib-0123456789abcdef"
    (old / "__pycache__").mkdir(parents=True)
    (old / "k_unary_f32.py").write_text("# from an older btjit\n")
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    d = library.Library().dir()
    assert d == tmp_path / f"lib-{library.library_key()}" and d.is_dir() and not old.exists()


def test_the_library_key_covers_every_kernel_module_and_the_helpers_they_inline(monkeypatch):
    """An edit to any file of btjit/kernels -- a kernel's module or a helper module inlined into kernels, as
    winograd_tiles.py -- names a new library: no process runs entries compiled from the old source."""
    from btjit.kernels import entries
    key, read = entries.library_key(), Path.read_bytes
    for name in ("winograd_tiles.py", "micro.py", "conv.py"):
        monkeypatch.setattr(Path, "read_bytes", lambda f, n=name: read(f) + (b"#" if f.name == n else b""))
        assert entries.library_key() != key, name
    monkeypatch.setattr(Path, "read_bytes", read)
    assert entries.library_key() == key


def test_entries_kept_in_numba_cache_dir_load_without_compiling(tmp_path):
    """With $NUMBA_CACHE_DIR set numba keeps the compiled entries there, not in the library's __pycache__:
    a second process still finds them and compiles (and starts) nothing."""
    first = _run(tmp_path / "lib", numba_cache_dir=tmp_path / "numba")
    assert not first["hit"] and list((tmp_path / "numba").rglob("*.nbi"))
    assert not (_lib(tmp_path / "lib") / "__pycache__").exists()
    second = _run(tmp_path / "lib", numba_cache_dir=tmp_path / "numba")
    assert second["hit"] and second["compiled"] == [] and second["value"] == first["value"]


def test_precompiled_entries_are_what_a_new_program_loads(tmp_path, monkeypatch):
    """Entries compiled by worker processes (as `btjit precompile` runs them) are loaded by a program traced
    later in another process, which compiles nothing; `btjit cache` lists them and `cache clear` empties."""
    from click.testing import CliRunner
    from btjit.cli import cli
    from btjit.kernels import library
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    entries = [("k_binary", "f64", None), ("k_unary", "f64", None), ("k_matmul", "f64", None),
               ("k_reduce", "f64", None), ("k_strided", "f64", None), ("k_ew_program", "f64", None)]
    from btjit.kernels import schedule
    lib = library.Library()
    seen = []
    schedule.compile_entries(library.LIBRARY, entries, seen.append)
    assert sorted(ln.split()[0] for ln in seen) == sorted(library.entry_name(*e) for e in entries)
    assert all(lib.cached(*e) for e in entries)
    res = _run(tmp_path, 5)
    assert res["compiled"] == [] and res["hit"] and set(res["entries"]) <= {library.entry_name(*e) for e in entries}
    out = CliRunner().invoke(cli, ["cache"])
    assert out.exit_code == 0 and str(tmp_path) in out.output and "k_matmul_f64" in out.output, out.output
    out = CliRunner().invoke(cli, ["cache", "clear"])
    assert out.exit_code == 0 and "removed" in out.output and not list(tmp_path.iterdir())



def test_generated_entries_compile_here_load_from_disk_and_heal(tmp_path, monkeypatch):
    """A generated attention entry (llvmlite's object code, per (T, hs)) compiles in this process, is written
    to the library dir, is loaded from there by a later library (same code, not compiled), and a corrupt file
    is replaced with a warning; with no writable cache dir it compiles in memory."""
    from btjit.kernels import library
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    e = ("k_attn_fwd_lanes", "f32", (5, 3))
    first = library.Library()
    assert not first.cached(*e) and first.load(*e) and first.cached(*e)
    path = _lib(tmp_path) / f"{library.entry_name(*e)}.o"
    code = first.loaded[e].object_code
    second = library.Library()
    assert not second.load(*e) and second.loaded[e].object_code == code
    assert second.tables["f32"][second.opcode("k_attn_fwd_lanes", (5, 3))] == first.loaded[e].address
    path.write_bytes(path.read_bytes()[:100] + b"garbage")
    with pytest.warns(UserWarning, match="unusable"):
        assert library.Library().load(*e)
    assert library.Library().load(*e) is False and path.read_bytes().endswith(code)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="not writable"):
        lib = library.Library()
        assert lib.load(*e) and lib.loaded[e].object_code == code


def test_a_light_entry_compiles_in_this_process_and_loads_from_disk(tmp_path, monkeypatch):
    """Entries estimated under HERE_MAX seconds compile in the asking process (no worker to start), into the
    library dir only: a library then loads them from the disk (compiled 0 times there), as a worker's."""
    from btjit.kernels import library, schedule
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    asking = library.Library()
    e = ("k_opt_sgd", "f32", None)
    assert schedule.HEAVY.get(e[0], 0.3) <= schedule.HERE_MAX
    seen = []
    schedule.compile_entries(asking, [e], seen.append)
    assert len(seen) == 1 and seen[0].startswith(library.entry_name(*e)) and seen[0].endswith("(here)")
    assert asking.module_name(library.entry_name(*e)) not in sys.modules
    lib = library.Library()
    assert lib.cached(*e) and lib.load(*e) is False and lib.loaded[e].cache_hits == 1
    assert lib.loaded[e].native_name.startswith("cfunc._ZN") and lib.module_name(library.entry_name(*e)) in \
        lib.loaded[e].native_name                       # the name an export links the entry by


def test_entries_compile_into_the_cache_dir_of_the_moment(tmp_path, monkeypatch):
    """The process's library was opened in one cache dir and the cache dir is another now (a test, a notebook
    that set BTJIT_CACHE_DIR): compile_entries builds into the new one, as its workers do, not into the old."""
    from btjit.kernels import library, schedule
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path / "old"))
    opened = library.Library()
    assert opened.dir()
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path / "new"))
    e = ("k_opt_sgd", "f32", None)
    schedule.compile_entries(opened, [e])
    assert library.Library().cached(*e) and not opened.cached(*e)


def test_nothing_to_compile_starts_no_worker(monkeypatch):
    """A program whose entries are all on the disk asks compile_entries for none: no process starts (a worker
    started for nothing cost every cached start ~0.3 s)."""
    from btjit.kernels import library, schedule
    monkeypatch.setattr(schedule.subprocess, "Popen", lambda *a, **k: pytest.fail("a worker started"))
    schedule.compile_entries(library.LIBRARY, [])


FAKE_NAMES = ("k_unary", "k_binary", "k_matmul", "k_reduce", "k_clip_scale", "k_fill")


def _fake_workers(tmp_path, die_on_f64=False):
    """compile_entries over FAKE_NAMES' entries (float64 first) with a fake worker that reports each group it
    reads in one write (and exits 1 on a float64 group with die_on_f64), and a fake compile in this process that
    takes 0.3 s an entry: (entry names heard, entries, groups)."""
    fake = ("import os, sys\n"
            "while True:\n"
            "    got = os.read(0, 65536)\n"
            "    if not got: break\n"
            f"    if {die_on_f64} and b':f64' in got: sys.exit(1)\n"
            "    os.write(1, b''.join(b'_'.join(s.split(b':')) + b' 0.00 s\\n' for s in got.split()))\n")
    script = textwrap.dedent(f"""
        import sys, time
        from btjit.kernels import library, schedule
        schedule.WORKER = [sys.executable, "-c", {fake!r}]
        library.LIBRARY.build = lambda e: time.sleep(0.3)
        es = [(n, fd, None) for n in {FAKE_NAMES!r} for fd in ("f64", "f32")]
        seen = []
        schedule.compile_entries(library.LIBRARY, es, seen.append)
        print(len(es), len(schedule.groups(es)), *(ln.split()[0] for ln in seen))
    """)
    env = dict(os.environ, BTJIT_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n, ngroups, *seen = out.stdout.split()
    return seen, int(n), int(ngroups)


def test_workers_reporting_many_entries_at_once_are_all_heard(tmp_path):
    """A worker that reports a whole group in one write is fed its next group: compile_entries reads what the
    pipe holds, not a line at a time (a line read ahead into a buffer would never wake the selector again).
    This process compiles groups too, as the workers do: each entry is heard once, from one or the other."""
    seen, n, ngroups = _fake_workers(tmp_path)
    assert sorted(seen) == sorted(f"{name}_{fd}" for name in FAKE_NAMES for fd in ("f32", "f64"))
    assert n == 12 and ngroups > 2                          # more groups than workers: each fed several


def test_a_worker_that_dies_loses_only_its_group(tmp_path):
    """A worker dying on a group (an entry that does not compile) is replaced while groups are left: with
    every float64 group fatal in a worker, every float32 group is still compiled and heard (each entry once),
    whichever worker died first, and no entry is heard twice."""
    seen, _, _ = _fake_workers(tmp_path, die_on_f64=True)
    assert sorted(s for s in seen if s.endswith("_f32")) == sorted(f"{name}_f32" for name in FAKE_NAMES)
    assert len(set(seen)) == len(seen) and set(seen) <= {f"{name}_{fd}" for name in FAKE_NAMES for fd in ("f32", "f64")}


def test_the_whole_library_is_float32_only_where_its_kernels_are():
    from btjit.kernels.entries import F32_ONLY, all_entries
    entries = all_entries()
    assert ("k_matmul_amx", "f32", None) in entries and ("k_matmul_bf16", "f32", None) in entries
    assert not [e for e in entries if e[0] in F32_ONLY and e[1] == "f64"]
    assert ("k_matmul_micro", "f64", None) in entries


def test_groups_keep_modules_together_and_halve_for_idle_workers():
    """Entries of one module and dtype compile in one process; with fewer groups than workers the costliest
    group of two or more is halved (a new attention shape's forward and backward on two cores, not one)."""
    from btjit.kernels import schedule
    es = [("k_attn_fwd_kept", "f32", None), ("k_attn_bwd_kept", "f32", None), ("k_opt_sgd", "f32", None)]
    one = schedule.groups(es)
    assert sorted(map(len, one)) == [1, 2] and one[0] == es[:2]          # the attention module's pair, first
    three = schedule.groups(es, n=3)
    assert sorted(map(len, three)) == [1, 1, 1] and sorted(e for g in three for e in g) == sorted(es)
    assert schedule.groups(es[:1], n=4) == [es[:1]]                       # a single entry stays whole


def test_rows_are_built_by_name_and_checked():
    from btjit.graph.lower import RowError, make_row
    from btjit.kernels.common import ROWS
    from btjit.kernels.library import OPCODE
    r = make_row("k_fill", oout=16, n=3, oc=20)
    assert r[:4] == [OPCODE["k_fill"], 16, 3, 20] and len(r) == 32 and not any(r[4:])
    assert ROWS["k_fill"].args == ("oout", "n", "oc")
    with pytest.raises(RowError, match=r"row of k_fill: missing argument oc"):
        make_row("k_fill", oout=16, n=3)
    with pytest.raises(RowError, match=r"row of k_fill: unknown argument bias"):
        make_row("k_fill", oout=16, n=3, oc=20, bias=4)
    with pytest.raises(RowError, match="no kernel 'k_nope'"):
        make_row("k_nope")


def test_every_kernel_reads_its_row_as_declared(monkeypatch):
    from btjit.kernels import library, rowcheck
    from btjit.kernels.common import ROWS, RowDecl
    assert rowcheck.check_rows() == []
    assert set(library.KERNELS) == set(ROWS)
    monkeypatch.setitem(ROWS, "k_gather_rows", RowDecl(("oidx", "otable", "oout", "n", "C", "ints"), None))
    assert rowcheck.check_rows(["k_gather_rows"]) == [
        "k_gather_rows: k_gather_rows names r[1] 'otable', its row declares 'oidx'",
        "k_gather_rows: k_gather_rows names r[2] 'oidx', its row declares 'otable'"]
    monkeypatch.setitem(ROWS, "k_attn_fwd_bl", RowDecl(ROWS["k_attn_fwd_bl"].args[:-1], None))
    assert any("reads r[10], beyond its row" in p for p in rowcheck.check_rows(["k_attn_fwd_bl"]))


def test_the_executor_runs_library_entries_through_the_table(tmp_path, monkeypatch):
    """The fixed executor calls entries by address; a failed index check stops the tape after its row."""
    from btjit.core import executor
    from btjit.graph.lower import make_row
    from btjit.kernels import library
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    lib = library.Library()
    lib.ensure("f64", [library.OPCODE["k_fill"], library.OPCODE["k_check_index"]])
    a, ia = np.zeros(64), np.array([0, 1, 7, 0, 0, 0], np.int32)
    a[20] = 2.5
    tape = np.array([make_row("k_fill", oout=16, n=3, oc=20),
                     make_row("k_check_index", oidx=1, n=2, hi=5, oflag=4, ok=0),
                     make_row("k_fill", oout=30, n=2, oc=20)], np.int64)
    executor.run(a, ia, tape, lib.tables["f64"], 0, 3)
    assert list(a[16:19]) == [2.5] * 3 and ia[4] == 2 and not a[30:32].any()   # stopped: 7 is not in [0, 5)
    ia[2] = 3
    executor.run(a, ia, tape, lib.tables["f64"], 0, 3)
    assert ia[4] == 0 and list(a[30:32]) == [2.5, 2.5]


SCRIPT32 = textwrap.dedent("""
    import json
    import numpy as np, btjit
    from btjit.bench.btjit_impl import TrainRunner
    r = TrainRunner("E6b64")                      # the paper's GPT at batch 64: 14 float32 kernels
    losses = [r.step() for _ in range(20)]
    print(json.dumps({"losses": losses, "params": [float(v.astype(np.float64).sum()) for v in r.prog.params.values()],
                      "compiled": r.prog.kernels.compiled}))
""")




def test_a_first_run_computes_exactly_what_a_cached_run_does(tmp_path):
    """The E6 training step in float32: numba's code compiled in a process rounded differently from the same
    code reloaded from its cache (before: the params' sum after 20 steps 317.4925445016 cold, 317.4925444979
    cached), so a first run on a machine and its resumed run could not agree bit for bit. Kernels now always
    run as loaded from the cache (compiled in worker processes first)."""
    env = dict(os.environ, BTJIT_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", SCRIPT32], env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["compiled"] and not runs[1]["compiled"]
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["params"] == runs[1]["params"]


def test_an_entry_that_does_not_compile_never_starts_workers_from_a_worker(tmp_path, monkeypatch):
    """A kernel whose entry fails to compile: in a library worker (BTJIT_LIBRARY_WORKER) the error goes to the
    process that asked and no further worker starts (a worker starting workers had multiplied them without
    end); in the process that asked, it is retried once through a worker and then raised."""
    from btjit.kernels import library, schedule
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(library, "entry_source", lambda *a, **k: "raise RuntimeError('no such kernel code')\n")
    started = []
    monkeypatch.setattr(schedule, "compile_entries", lambda lib, entries, echo=None: started.append(entries))
    monkeypatch.setenv("BTJIT_LIBRARY_WORKER", "1")
    with pytest.raises(RuntimeError, match="no such kernel code"):
        library.Library().load("k_fill", "f64")
    assert started == []
    monkeypatch.delenv("BTJIT_LIBRARY_WORKER")
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="no such kernel code"):
        library.Library().load("k_fill", "f64")
    assert started == [[("k_fill", "f64", None)]]
