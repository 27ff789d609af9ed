"""The kernel library: every tape kernel compiled once per machine, on its own, as a C-ABI function.

An entry is (kernel, arena dtype[, (T, hs)]): a generated file in the library dir (the cache dir's
`lib-<key>/`, key = a hash of every kernel module's source and the numba/numpy/llvmlite versions, so an edit
makes a new library and the old one is removed) holding ONE `numba.cfunc(cache=True)`:
`int32 entry(float *a, int64 na, int32 *ia, int64 nia, int64 *row)`, which calls the `@njit` kernel on the
arenas and the row. The one fixed executor (btjit/executor.py) calls entries by address through a table per
dtype, so a new program, optimizer or shape loads the entries it needs (ms each) and compiles none that
another program compiled before. Entries an `ensure` call finds missing compile first (btjit/kernels/schedule.py:
in this process and in worker processes over the cores), then load from the disk cache like every other entry
(so a first run computes exactly what later ones do). Only the generated attention kernels
(btjit/kernels/attn_lanes.py) are entries per (T, hs): LLVM IR compiled by llvmlite in this process (~0.3 s each),
their object code cached as `<entry>.o` in the library dir and loaded into MCJIT engines (btjit/kernels/objcode.py).

Faults: a corrupt or stale cache entry is discarded and compiled again, an unwritable cache dir compiles in
memory -- each with a warning, never a wrong result. `python -m btjit.kernels ENTRY...` compiles entries
(the workers; `btjit precompile` runs them over the whole library).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from btjit.host.cachedir import cache_dir
from btjit.kernels import attn_lanes, objcode, schedule
from btjit.kernels.entries import (DTYPES, GENERATED, KERNELS, OPCODE, all_entries, entry_name, entry_source,
                                   import_file, index_dir, library_key)


class Library:
    """The entries loaded in this process: addresses in one table per dtype (int64, indexed by opcode)."""

    def __init__(self):
        self.key = library_key()
        self.tables = {fd: np.zeros(len(KERNELS) + 64, np.int64) for fd in DTYPES}
        self.variants: dict = {}                 # (name, (T, hs)) -> opcode
        self.loaded: dict = {}                   # (name, fd, shape) -> cfunc
        self._dir = None

    # ------------------------------------------------------------------ opcodes
    def opcode(self, name, shape=None) -> int:
        if shape is None:
            return OPCODE[name]
        key = (name, tuple(shape))
        if key not in self.variants:
            self.variants[key] = len(KERNELS) + len(self.variants)
        return self.variants[key]

    def entry_of(self, opcode) -> tuple:
        """(name, shape or None) of an opcode."""
        if opcode < len(KERNELS):
            return KERNELS[opcode], None
        return next(k for k, v in self.variants.items() if v == opcode)

    def module_name(self, stem) -> str:
        """The module an entry's source is imported as: its symbols carry this name, which exports link by."""
        return f"btjit_lib_{self.key}_{stem}"

    # ------------------------------------------------------------------ the library dir
    def home(self) -> Path:
        """Where this library's dir is under the cache dir of the moment ($BTJIT_CACHE_DIR, read again)."""
        return cache_dir() / f"lib-{self.key}"

    def dir(self):
        """The library dir, created (and older libraries removed); None if the cache dir is not writable."""
        if self._dir is None:
            d = self.home()
            try:
                d.mkdir(parents=True, exist_ok=True)
                if not os.access(d, os.W_OK):
                    raise PermissionError(f"{d} is not writable")
                for old in cache_dir().glob("lib-*"):
                    if old.name != d.name:
                        shutil.rmtree(old, ignore_errors=True)
                self._dir = d
            except OSError as e:
                warnings.warn(f"btjit: cache dir {cache_dir()} not writable ({e}); compiling kernels in memory")
                self._dir = False
        return self._dir or None

    def _write(self, d, stem, src):
        d.mkdir(parents=True, exist_ok=True)         # again: a newer btjit may have removed this library meanwhile
        path = d / f"{stem}.py"
        if not path.exists() or path.read_text() != src:
            tmp = d / f"{stem}.py.tmp{os.getpid()}"
            tmp.write_text(src)
            # numba keys its cache index on the file's (mtime, size): every writer of this content gives it the
            # same mtime, so processes compiling at once all save an index that later processes can use
            stamp = int(hashlib.sha256(src.encode()).hexdigest()[:8], 16) % 2 ** 31 * 10 ** 9
            os.utime(tmp, ns=(stamp, stamp))
            os.replace(tmp, path)
        return path

    def cached(self, name, fd, shape=None) -> bool:
        """Whether the entry has a compiled index on disk (it may still turn out unusable)."""
        d = self.dir()
        if name in GENERATED:
            return bool(d) and (d / f"{entry_name(name, fd, shape)}.o").exists()
        return bool(d) and any(index_dir(d).glob(f"{entry_name(name, fd, shape)}.*.nbi"))

    # ------------------------------------------------------------------ loading
    def load(self, name, fd, shape=None) -> bool:
        """Load (or compile) one entry into the table; True if it was compiled in this process."""
        k = (name, fd, shape)
        if k in self.loaded:
            return False
        if name in GENERATED:
            return self._load_generated(k)
        stem = entry_name(name, fd, shape)
        modname = self.module_name(stem)
        d = self.dir()
        fn = None
        if d:
            for attempt in range(2):
                try:
                    path = self._write(d, stem, entry_source(name, fd, shape))
                    fn = import_file(modname, path).entry
                    break
                except Exception as e:  # noqa: BLE001 -- a broken cache entry must never stop training
                    if os.environ.get("BTJIT_LIBRARY_WORKER"):
                        raise       # a worker never starts workers: the process that asked sees the error
                    if attempt:
                        warnings.warn(f"btjit: kernel {stem} does not compile in {d} ({type(e).__name__}: "
                                      f"{e}); compiling it in memory")
                        break
                    warnings.warn(f"btjit: kernel cache entry {stem} in {d} unusable ({type(e).__name__}: {e}); "
                                  "discarding it and compiling")
                    for f in index_dir(d).glob(f"{stem}.*"):
                        f.unlink(missing_ok=True)
                    schedule.compile_entries(self, [k])
        if fn is None:
            path = Path(tempfile.mkdtemp(prefix="btjit_")) / f"{stem}.py"
            path.write_text(entry_source(name, fd, shape, cache=False))
            fn = import_file(modname, path).entry
        self._put(k, fn)
        return fn.cache_hits == 0

    def build(self, k) -> None:
        """Compile entry k into the library dir without loading it (the program then loads it from the disk, as
        every entry: imported again under the same module name, which its symbols carry); a generated entry is
        compiled and loaded (its object code is what the disk holds)."""
        name, fd, shape = k
        if name in GENERATED:
            self.load(*k)
            return
        stem = entry_name(*k)
        modname = self.module_name(stem)
        try:
            import_file(modname, self._write(self.dir(), stem, entry_source(name, fd, shape)))
        finally:
            sys.modules.pop(modname, None)

    def _put(self, k, fn):
        self.loaded[k] = fn
        op = self.opcode(k[0], k[2])
        if op >= len(self.tables[k[1]]):
            for f in DTYPES:                     # grow; programs keep the old arrays, whose entries stay valid
                self.tables[f] = np.concatenate([self.tables[f], np.zeros(len(self.tables[f]), np.int64)])
        self.tables[k[1]][op] = fn.address

    def _load_generated(self, k) -> bool:
        """Load a generated entry's object code from the library dir, or compile it here (and write it
        atomically); an unusable file is replaced, with a warning. True if compiled."""
        name, fd, shape = k
        stem, symbol = entry_name(*k), attn_lanes.symbol(name, *shape)
        d = self.dir()
        path = d / f"{stem}.o" if d else None
        if path and path.exists():
            try:
                obj = objcode.object_of(path.read_bytes())
                self._put(k, objcode.Generated(objcode.load_object(obj, symbol), obj, symbol))
                return False
            except (OSError, ValueError, RuntimeError) as e:
                warnings.warn(f"btjit: kernel cache entry {path.name} in {d} unusable ({e}); compiling it again")
        blob = objcode.compile_entry(name, shape)
        if path:
            try:
                tmp = d / f"{stem}.o.tmp{os.getpid()}"
                tmp.write_bytes(blob)
                os.replace(tmp, path)
            except OSError as e:
                warnings.warn(f"btjit: cannot write {path} ({e}); {stem} stays in memory")
        obj = objcode.object_of(blob)
        self._put(k, objcode.Generated(objcode.load_object(obj, symbol), obj, symbol))
        return True

    def ensure(self, fd, opcodes) -> "Report":
        """Load the entries of these opcodes; entries missing on disk compile in parallel worker processes
        first. Every entry then runs as loaded from the disk cache: code numba compiled in this process rounds
        differently from the same code reloaded from its cache (measured: E6's params after 20 steps differ in
        the 9th digit), and a run resumed in a later process must compute exactly what the first one did."""
        t0 = time.perf_counter()
        uses = [(n, fd, s) for n, s in (self.entry_of(op) for op in sorted(set(int(o) for o in opcodes)))]
        want = [w for w in uses if w not in self.loaded]
        missing = [w for w in want if not self.cached(*w)] if self.dir() else []
        schedule.compile_entries(self, missing)
        compiled = [w for w in want if self.load(*w) or w in missing]
        return Report([entry_name(*w) for w in uses], [entry_name(*w) for w in compiled],
                      time.perf_counter() - t0)


class Report:
    """What `Library.ensure` did for a program: the entries it needed, those compiled (not loaded from disk)
    in this process, and the seconds spent."""

    def __init__(self, entries, compiled, seconds):
        self.entries, self.compiled, self.seconds = entries, compiled, seconds

    @property
    def cache_hit(self) -> bool:
        return not self.compiled


def precompile(echo=print) -> float:
    """Compile the whole library (all_entries) in parallel processes over the cores, echoing each entry and
    its seconds as the workers report them; returns the wall seconds."""
    t0 = time.perf_counter()
    todo = [e for e in all_entries() if not LIBRARY.cached(*e)]
    echo(f"btjit precompile: {len(todo)} of {len(all_entries())} library entries to compile, "
         f"{schedule.workers(len(todo))} processes, into {LIBRARY.dir() or 'memory (cache dir not writable)'}")
    schedule.compile_entries(LIBRARY, todo, echo)
    return time.perf_counter() - t0


def cache_entries() -> list:
    """(path, bytes) of every file in the cache dir."""
    d = cache_dir()
    return sorted((f, f.stat().st_size) for f in d.rglob("*") if f.is_file()) if d.is_dir() else []


def clear_cache() -> int:
    """Empty the cache dir; returns the number of files removed."""
    n = len(cache_entries())
    d = cache_dir()
    for child in d.iterdir() if d.is_dir() else ():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    return n


LIBRARY = Library()
