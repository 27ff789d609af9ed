"""`python -m btjit.kernels kernel:f32|f64[:T:hs] ...`: a worker compiling kernel library entries (`-`: one
entry per line of stdin, as btjit.kernels.schedule.compile_entries feeds them), printing each entry's name and
seconds.

The worker compiles within `fast_compile()` (btjit/kernels/fastcompile.py): the same machine code, sooner.
"""
import os
import sys
import time

import btjit.kernels.linalg  # noqa: F401 -- registers the BLAS symbols before any cache load
from btjit.kernels.fastcompile import fast_compile
from btjit.kernels.entries import entry_name, parse_spec
from btjit.kernels.library import LIBRARY


def main(argv):
    """Compile (or load) each entry, printing its name and seconds."""
    with fast_compile():
        for s in (ln.strip() for ln in sys.stdin) if argv == ["-"] else argv:
            e = parse_spec(s)
            t0 = time.perf_counter()
            hit = not LIBRARY.load(*e)
            print(f"{entry_name(*e):<40s} {time.perf_counter() - t0:6.2f} s{'  (cached)' if hit else ''}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)         # every entry is on the disk: numba's and LLVM's teardown cost ~0.3 s the asker would wait for
