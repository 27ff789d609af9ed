"""`python -m btjit.kernels kernel:f32|f64[:T:hs] ...`: a worker compiling kernel library entries (`-`: one
entry per line of stdin, as btjit.kernels.library.compile_entries feeds them)."""
import sys

from btjit.kernels.library import main

main(sys.argv[1:])
