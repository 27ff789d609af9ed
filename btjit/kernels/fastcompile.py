"""Library entries compile sooner, to the same machine code, within `fast_compile()` (the workers, and the process that
asks for entries while it compiles some itself: btjit/kernels/library.py):

- The garbage collector skips the objects made before (numba's compile makes garbage by the million; in the asking
  process, with its own objects, the fused-chain interpreter compiled in 7.0 s, 6.2 s with this).
- numba's inliner (every `inline="always"` call, and each kernel inlined into its library entry) copies the callee's
IR block by block, each block with a fresh deepcopy memo, so every block copies the function's whole Scope (all its
  variables) again: quadratic in the callee's size. Here the blocks of one copy share a memo, so the scope is copied
  once per copy, as the blocks share one scope before. Measured: k_ew_program's entry 9.6 -> 7.6 s of CPU, the
  instructions compiled identical (znver4).
"""
import contextlib
import copy
import gc
import sys
import types

from numba.core import inline_closurecall, ir


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


@contextlib.contextmanager
def fast_compile():
    """Within the block: the collector skips the objects made before it, and numba's inliner copies a callee's
    blocks with one memo per copy (if this numba's inliner uses `copy`)."""
    old = getattr(inline_closurecall, "copy", None)
    if old is copy:
        inline_closurecall.copy = _BlockCopies()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if old is copy:
            inline_closurecall.copy = old
