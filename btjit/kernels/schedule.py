"""How the library's missing entries compile: in groups that share helpers (`groups`), costliest first, in this
process (a thread) and in worker processes (`python -m btjit.kernels -`, btjit/kernels/__main__.py) over the
cores, each taking the next group when it finishes one. The library (btjit/kernels/library.py) asks for them;
what is compiled lands in its dir, from which it then loads every entry."""
from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

from btjit.host.cachedir import cache_dir
from btjit.kernels.entries import MODULE_OF, entry_name, entry_spec
from btjit.kernels.fastcompile import fast_compile


def workers(n) -> int:
    """Processes for n groups: as many, at most one per core this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(n, cores))


# rough compile costs (seconds on one machine; the rest ~0.3 s): the order the workers take groups in, and which
# sets compile in the asking process (HERE_MAX)
HEAVY = {"k_attn_bl_move": 1, "k_ew_program": 5, "k_attn_bwd_flash": 6, "k_attn_fwd_flash": 4, "k_attn_bwd_bl": 4,
         "k_attn_fwd_bl": 4, "k_matmul": 4, "k_matmul_micro": 3, "k_attn_bwd_kept": 3, "k_attn_fwd_kept": 3,
         "k_strided": 3, "k_binary": 3, "k_attn_bwd": 3, "k_reduce": 2, "k_unary": 2, "k_ce_fwd": 0.7,
         "k_layernorm_bwd": 0.5, "k_matmul_bf16": 3, "k_matmul_amx": 3, "k_conv": 3, "k_conv_dy": 3, "k_pool2d": 2.5,
         "k_wino": 7, "k_wino_dw": 5}


def _cost(entries) -> float:
    """The estimated compile seconds of these entries (HEAVY's, 0.3 s for the others)."""
    return sum(HEAVY.get(e[0], 0.3) for e in entries)


def groups(entries, n=1) -> list:
    """entries as lists that compile best in one process -- each kernel module's entries of one dtype (they
    compile shared helpers, which a process compiles once) -- costliest first; while there are fewer than n
    (the workers), the costliest group of two or more is halved, so no core waits (a new attention shape's
    forward and backward: 4.1 s in one process, ~2.2 s in two)."""
    out: dict = {}
    for e in entries:
        out.setdefault((MODULE_OF.get(e[0], "generated"), e[1], e[2]), []).append(e)
    todo = sorted(out.values(), key=_cost, reverse=True)
    while len(todo) < n and any(len(g) > 1 for g in todo):
        g = max((g for g in todo if len(g) > 1), key=_cost)
        todo.remove(g)
        todo += [g[::2], g[1::2]]
    return sorted(todo, key=_cost, reverse=True)


WORKER = [sys.executable, "-m", "btjit.kernels", "-"]
HERE_MAX = 1.0       # entries estimated (HEAVY) at most this many seconds in all compile in this process: a worker's
                     # start (python, numba and btjit imported again: ~0.65 s) costs more than it would save


def compile_entries(lib, entries, echo=None) -> None:
    """Compile `entries` into library lib's dir, each group (`groups`) in one process, costliest first: in this
    process (a thread taking groups as the workers do) and in worker processes (`python -m btjit.kernels -`),
    one per further core and at most one per group left, each fed one group at a time -- whoever finishes a group
    takes the next, so the cores stay busy to the end whatever the real costs. Entries estimated at HERE_MAX
    seconds or less in all compile here only (a worker's start, python, numba and btjit imported again, ~0.5 s,
    would cost more). echo(line) gets each entry's report ("entry  seconds"). A worker that dies loses only its
    group (a new one takes the groups left); an entry that fails here is left to `Library.load`, which compiles
    it again and reports the error."""
    todo = groups(entries, workers(len(entries)))
    if not todo:
        return
    # this process compiles too, unless the cache dir changed since its library was opened (the workers' is the new)
    here = lib.dir() == lib.home() and not os.environ.get("BTJIT_LIBRARY_WORKER")
    procs = 0 if here and _cost(entries) <= HERE_MAX else workers(len(todo)) - here
    lock = threading.Lock()

    def take():
        with lock:
            return todo.pop(0) if todo else None

    def build_here():
        with fast_compile():
            while (g := take()) is not None:
                for e in g:
                    t0 = time.perf_counter()
                    try:
                        lib.build(e)
                    except Exception:  # noqa: BLE001 -- Library.load compiles it again and reports the error
                        continue
                    if echo:
                        echo(f"{entry_name(*e):<40s} {time.perf_counter() - t0:6.2f} s  (here)")
    if not procs:                               # this process alone (procs is 0 only where it compiles)
        build_here()
        return
    builder = threading.Thread(target=build_here, daemon=True) if here else None
    if builder:
        builder.start()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, BTJIT_CACHE_DIR=str(cache_dir()), BTJIT_LIBRARY_WORKER="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    sel = selectors.DefaultSelector()
    left = {}                                   # worker -> entries of its group not reported yet

    def feed(p):
        try:
            g = take()
            if g:
                left[p] = len(g)
                p.stdin.write("".join(f"{entry_spec(e)}\n" for e in g).encode())
                p.stdin.flush()
            else:
                p.stdin.close()
        except OSError:                         # the worker died; the end of its stdout unregisters it
            pass

    def start():
        p = subprocess.Popen(WORKER, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        sel.register(p.stdout, selectors.EVENT_READ, p)
        feed(p)
    for _ in range(procs):
        start()
    partial = {}                                # worker -> bytes after its last newline
    while sel.get_map():
        for key, _ in sel.select():
            p = key.data
            chunk = os.read(key.fd, 65536)      # not readline(): lines it buffered would never wake select
            if not chunk:
                sel.unregister(key.fileobj)
                p.stdin.close()
                p.wait()
                if todo and p.returncode:       # it died: another worker takes the groups left
                    start()
                continue
            *lines, partial[p] = (partial.get(p, b"") + chunk).split(b"\n")
            for line in lines:
                if echo:
                    echo(line.decode().rstrip())
                left[p] -= 1
                if left[p] == 0:
                    feed(p)
    if builder:
        builder.join()
