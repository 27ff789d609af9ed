"""Compile time of the scalar straight-line entry points vs program size, and run time of both backends (the
measurement behind btjit/scalar/lower.py STRAIGHT_LINE_MAX). Run: python scripts/scalar_size_bound.py [sizes...]"""
import sys
import time

import numpy as np


def _measure(sizes=(50, 100, 200, 400, 800), dtype="float64", seed=0):   # pragma: no cover — a manual tool
    """Compile time of the straight-line entry points vs program size, and run time of both backends."""
    import random
    import timeit

    import btjit
    from btjit.scalar.front import trace_scalar

    for n in sizes:
        rnd = random.Random(seed + n)

        def fn(a, b, c, d):
            vals = [a, b, c, d]
            k = 0
            while k < n // 3:      # ~3 instructions per forward op after autodiff
                x, y = vals[rnd.randrange(len(vals))], vals[-1 - rnd.randrange(min(4, len(vals)))]
                r = rnd.random()
                v = x * y if r < 0.3 else x + y if r < 0.55 else x - y * 0.5 if r < 0.7 else \
                    btjit.tanh(x) if r < 0.8 else btjit.relu(x) + y if r < 0.9 else x / (y * y + 1.0)
                vals.append(v)
                k += 1
            return sum(vals[-8:], vals[0])

        t0 = time.perf_counter()
        f = trace_scalar(fn, dtype=dtype, lowering="straight", compile=False)
        tt = time.perf_counter() - t0
        ninstr = len(f.program.instrs)
        sl = f._straight
        t0 = time.perf_counter()
        sl.get("one")
        c1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        sl.get("many")
        c2 = time.perf_counter() - t0
        ft = trace_scalar(fn, dtype=dtype, lowering="tape")
        X = np.random.default_rng(0).uniform(0.5, 1.5, (2000, 4))
        f.many(X)
        ft.many(X)
        r1 = min(timeit.repeat(lambda: f.many(X), number=5, repeat=3)) / 5 / len(X)
        r2 = min(timeit.repeat(lambda: ft.many(X), number=5, repeat=3)) / 5 / len(X)
        print(f"{ninstr:6d} instr  trace {tt:5.2f}s  compile one {c1:5.2f}s many {c2:5.2f}s (cache hit "
              f"{sl.cache_hit('one')})  run straight {r1 / ninstr * 1e9:5.2f} ns/instr  tape {r2 / ninstr * 1e9:5.2f}"
              f" ns/instr", flush=True)


if __name__ == "__main__":   # pragma: no cover
    _measure(tuple(int(s) for s in sys.argv[1:]) or (50, 100, 200, 400, 800))
