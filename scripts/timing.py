"""The timing loop of the scripts that put a btjit step beside torch's (makemore_vs_torch, as_written_vs_torch,
cnn_vs_torch): a warm-up, then the median over `reps` runs of `steps` calls, in ms per call; and `cycled`,
a training step over the batches in turn."""
import time

import numpy as np


def timed(fn, steps, reps):
    for _ in range(max(10, steps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - t0) / steps * 1000)
    return float(np.median(times))


def cycled(step, batches):
    """A zero-argument call of step(*batch) over the batches in turn (the same batches on both sides)."""
    i = [0]

    def call():
        i[0] += 1
        return step(*batches[i[0] % len(batches)])
    return call
