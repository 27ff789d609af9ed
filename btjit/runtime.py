"""btjit.runtime: run an exported program with ctypes and numpy only (no numba, llvmlite or scipy).

    prog = btjit.runtime.load("out/gpt")      # what prog.export("out/gpt") wrote
    loss = prog.step(x, y)

The loader lives in btjit/export/runtime.py; this module is its public name.
"""
from btjit.export.runtime import FORMAT, Exported, ExportedScalar, LoadError, load, manifest_checksum  # noqa: F401

__all__ = ["FORMAT", "Exported", "ExportedScalar", "LoadError", "load", "manifest_checksum"]
