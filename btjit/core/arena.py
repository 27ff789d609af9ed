"""A program's arena memory: the 64-byte aligned float arena at the start of an anonymous mapping that reserves
address space for the eval programs sharing it (`arena`), and the aligned row arrays it falls back to
(`aligned_rows`, also the scratch arena of Program.profile). The named views into it (prog.params, ...) are
btjit/export/runner.py's.
"""
from __future__ import annotations

import numpy as np

RESERVE = 1 << 30      # bytes of address space past a program's arena kept for its prog.eval programs


def arena(rows, n, dtype, share=None):
    """(the whole mapping, the (rows, n') arena): a program's arena at the start of an anonymous mapping that
    reserves address space (never touched, never committed) for the eval programs that share it; an eval
    program's (share=) is its parent's mapping, its own values past the parent's arena."""
    if share is not None:
        if n > share._full.size:
            raise MemoryError(f"prog.eval: the eval program needs {n * share.dtype.itemsize / 1e6:.1f} MB past the "
                              f"arena's start; {share._full.nbytes / 1e6:.1f} MB are reserved (btjit.core.arena.RESERVE)")
        return share._full, share._full[:n].reshape(1, n)
    import mmap
    itemsize, per, n = _padded(n, dtype)
    size = rows * n * itemsize + RESERVE
    try:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    except (OSError, ValueError):      # no lazy reservation here: the arena alone (prog.eval then refuses)
        A = aligned_rows(rows, n, dtype)
        return A.reshape(-1), A
    full = np.frombuffer(m, dtype)
    return full, full[:rows * n].reshape(rows, n)


def aligned_rows(rows, n, dtype):
    """A zeroed C-contiguous (rows, n') array, 64-byte aligned, n' = n rounded up to 64 bytes (so every row
    is aligned)."""
    itemsize, per, n = _padded(n, dtype)
    buf = np.zeros(rows * n + per, dtype)
    start = (-buf.ctypes.data % 64) // itemsize
    return buf[start:start + rows * n].reshape(rows, n)


def _padded(n, dtype):
    """(itemsize, elements per 64 bytes, n rounded up to a multiple of them)."""
    itemsize = np.dtype(dtype).itemsize
    per = 64 // itemsize
    return itemsize, per, -(-n // per) * per
