"""Gradient checking: compiled gradients against central finite differences, in float64.

    err = btjit.testing.check_grads(loss_fn, params, *batch)   # raises AssertionError on a mismatch
"""
from __future__ import annotations

import numpy as np

from btjit.core.tracing import trace


def check_grads(fn, params, *batch, eps=1e-6, rtol=1e-6, atol=1e-9, directions=2, seed=0):
    """For each parameter: compare <grad, d> with (f(p + eps d) - f(p - eps d)) / 2 eps along random unit
    directions d. Returns the largest relative error; raises AssertionError naming the parameter."""
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    batch = tuple(np.asarray(b, np.float64) if np.asarray(b).dtype.kind == "f" else b for b in batch)   # float32 x
    prog = trace(fn, params, *batch, dtype="float64", grad=True)
    prog.value_and_grad(*batch)
    prog.step_count = 0        # every evaluation at step 0: the same random numbers (a dropout's mask)
    grads = {k: v.copy() for k, v in prog.grads.items()}
    rng = np.random.default_rng(seed)
    worst = 0.0
    for name, p0 in params.items():
        for _ in range(directions):
            d = rng.normal(size=p0.shape)
            d /= np.linalg.norm(d) or 1.0
            prog.params[name][...] = p0 + eps * d
            fp = prog.forward(*batch)
            prog.params[name][...] = p0 - eps * d
            prog.step_count = 0
            fm = prog.forward(*batch)
            prog.step_count = 0
            prog.params[name][...] = p0
            fd = (fp - fm) / (2 * eps)
            an = float(np.sum(grads[name] * d))
            err = abs(fd - an) / max(abs(fd), abs(an), 1e-12)
            noise = 4 * np.finfo(np.float64).eps * max(abs(fp), abs(fm)) / eps   # the difference's own rounding
            if abs(fd - an) > atol + noise + rtol * max(abs(fd), abs(an)):
                raise AssertionError(f"gradient of {name!r}: analytic {an:.10g} vs finite difference {fd:.10g} "
                                     f"(rel err {err:.2e})")
            worst = max(worst, err if abs(fd - an) > atol + noise else 0.0)
    return worst


def split_kernels(prog) -> dict:
    """{kernel name: parts} of the program's rows split over the threads (btjit.kernels.common.part_of)."""
    from btjit.kernels.common import SPLIT
    from btjit.kernels.library import LIBRARY
    return {LIBRARY.entry_of(int(r[0]))[0]: int(r[SPLIT]) for r in prog.tape if r[SPLIT] > 1}


def run_parts(kernel, a, ia, row, n):
    """Call the @njit tape kernel on row (a 1-D int64 array) split into n parts, one after another, as the
    executor's threads would run them."""
    from btjit.kernels.common import PART, SPLIT
    for j in range(n):
        r = row.copy()
        r[PART], r[SPLIT] = j, n if n > 1 else 0
        kernel(a, ia, r)
