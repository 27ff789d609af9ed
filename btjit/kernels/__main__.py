"""`python -m btjit.kernels kernel:f32|f64[:T:hs] ...`: a worker compiling kernel library entries."""
import sys

from btjit.kernels.library import main

main(sys.argv[1:])
