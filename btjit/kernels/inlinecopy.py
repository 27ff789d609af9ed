"""A faster copy of numba's IR inliner, with the same machine code: `fast_inlining()` around a compile.

numba's inliner (every `inline="always"` call, and each kernel inlined into its library entry) copies the callee's
IR block by block, each block with a fresh deepcopy memo, so every block copies the function's whole Scope (all its
variables) again: quadratic in the callee's size. Within `fast_inlining()` the blocks of one copy share a memo, so
the scope is copied once per copy, as the blocks share one scope before. Measured: k_ew_program's entry 9.6 -> 7.6 s
of CPU, the instructions compiled identical (znver4). Used by the library's workers and by the process that asks
for entries while it compiles them itself (btjit/kernels/library.py).
"""
import contextlib
import copy
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
def fast_inlining():
    """numba's inliner copies blocks with a shared memo inside the block (if this numba's inliner uses `copy`)."""
    old = getattr(inline_closurecall, "copy", None)
    if old is copy:
        inline_closurecall.copy = _BlockCopies()
    try:
        yield
    finally:
        if old is copy:
            inline_closurecall.copy = old
