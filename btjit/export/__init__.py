"""Exports: a traced program as a self-contained native library (build.py, with the C part in native/), the
numba-free loader that runs one (runtime.py, public as `btjit.runtime`), and the per-step Python path that a
Program and a loaded export share (runner.py). Importing this package loads no compiler."""
