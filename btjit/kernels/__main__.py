"""`python -m btjit.kernels kernel:f32|f64[:T:hs] ...`: a worker compiling kernel library entries (`-`: one
entry per line of stdin, as btjit.kernels.library.compile_entries feeds them), printing each entry's name and
seconds.

The worker speeds up one step of numba's compile, with the same machine code: numba's inliner (every
`inline="always"` call, and each kernel inlined into its entry) copies the callee's IR block by block, each
block with a fresh deepcopy memo, so every block copies the function's whole Scope (all its variables) again:
quadratic in the callee's size. Here the blocks of one copy share a memo, so the scope is copied once per copy,
as the blocks share one scope before. Measured: k_ew_program's entry 9.6 -> 7.6 s of CPU, the instructions
compiled identical (znver4).
"""
import copy
import sys
import time
import types

from numba.core import inline_closurecall, ir

import btjit.kernels.linalg  # noqa: F401 -- registers the BLAS symbols before any cache load
from btjit.kernels.library import LIBRARY, _parse, entry_name


class _BlockCopies(types.ModuleType):
    """The `copy` module as numba's inline_closurecall sees it: deepcopy(block) called from its copy_ir (whose
    local `kernel_copy` is the IR being built) reuses one memo per kernel_copy; everything else is copy's."""

    def __init__(self):
        super().__init__("copy")
        self._owner, self._memo = None, None     # the owner is held, so its id is never reused meanwhile

    def deepcopy(self, x, memo=None):
        if memo is None and isinstance(x, ir.Block):
            owner = sys._getframe(1).f_locals.get("kernel_copy")
            if owner is not None:
                if owner is not self._owner:
                    self._owner, self._memo = owner, {}
                return copy.deepcopy(x, self._memo)
        return copy.deepcopy(x, memo)

    def __getattr__(self, k):
        return getattr(copy, k)


def main(argv):
    """Compile (or load) each entry, printing its name and seconds."""
    if getattr(inline_closurecall, "copy", None) is copy:
        inline_closurecall.copy = _BlockCopies()
    for s in (ln.strip() for ln in sys.stdin) if argv == ["-"] else argv:
        e = _parse(s)
        t0 = time.perf_counter()
        hit = not LIBRARY.load(*e)
        print(f"{entry_name(*e):<40s} {time.perf_counter() - t0:6.2f} s{'  (cached)' if hit else ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
