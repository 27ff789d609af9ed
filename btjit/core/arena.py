"""A program's arena memory: the 64-byte aligned float arena at the start of an anonymous mapping that reserves
address space for the eval programs sharing it (`arena`), and the aligned row arrays it falls back to
(`aligned_rows`, also the scratch arena of Program.profile); and the named views into it (`Named`, a dict whose
missing key is an error naming the known ones; `Views`, what prog.params, buffers, grads, outputs and opt_state[s]
are: assigning an entry copies into the arena), a traced program's and btjit.runtime's alike. numpy only.
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


class Named(dict):
    """A dict whose missing key is a KeyError naming it and the known keys: `where` is how the user wrote the dict
    (prog.grads, p), `noun` what its entries are (param, buffer, state)."""

    def __init__(self, entries, noun, where=None):
        super().__init__(entries)
        self._noun, self._where = noun, where or f"prog.{noun}s"

    def __missing__(self, name):
        known = ", ".join(map(str, self)) or "none"
        raise UnknownName(f"{self._where}[{name!r}]: no such {self._noun} (known: {known})")


class UnknownName(KeyError):
    """A missing key of a Named dict (a KeyError whose str is its message, not the message's repr)."""
    __str__ = Exception.__str__


class Views(Named):
    """A program's named arena views (prog.params, buffers, grads, outputs, opt_state[s]). `views[name] = array`
    (and views.update) copies the array's values into the arena, as torch's load_state_dict does (replacing the
    dict's entry would leave the program reading the old values); an unknown name or another shape is an error
    naming both; the names are the program's: deleting one is an error."""

    def __setitem__(self, name, value):
        if np.shape(value) != self[name].shape:      # self[name]: an unknown name is Named's error
            raise ValueError(f"{self._where}[{name!r}] = an array of shape {np.shape(value)}: the {self._noun} "
                             f"has shape {self[name].shape}")
        self[name][...] = value

    def update(self, other=(), **kw):
        for k, v in (other.items() if hasattr(other, "items") else other):
            self[k] = v
        for k, v in kw.items():
            self[k] = v

    def _fixed(self, *_):
        raise TypeError(f"{self._where} holds the program's {self._noun}s (views into its arena): none can be "
                        f"removed or added; assign values with {self._where}[name] = array")

    __delitem__ = pop = popitem = clear = setdefault = _fixed
