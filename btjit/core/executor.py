"""The one executor: it runs rows of a kernel tape by calling each row's library entry through a table of
addresses (btjit/kernels/library.py), so it never changes with the program and compiles once per arena
dtype (cached on disk like any `cache=True` function). Per row: one indirect call, `entry(a, len(a), ia,
len(ia), &tape[i, 0])`; a nonzero return (a failed index check) stops the tape.

`step` is the data-parallel step of `trace(..., replicas=R)`: R replica arenas (rows of one 2-D array, one
plan) run the forward and backward rows on the thread pool, one replica per thread, then replica 0 averages
the grads and the loss and runs the update rows alone -- all in one native call.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from btjit.kernels.common import PART, SPLIT


@intrinsic
def _ccall(typingctx, addr, a, ia, tape, i):
    """int32 (*addr)(a.data, a.size, ia.data, ia.size, &tape[i, 0]) for the entry at address addr."""
    def codegen(context, builder, sig, args):
        addr, a, ia, tape, i = args
        A, IA, TP = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[1:4], (a, ia, tape)))
        row = builder.gep(TP.data, [builder.mul(i, builder.extract_value(TP.shape, 1))])
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.IntType(32), [A.data.type, i64, IA.data.type, i64, row.type])
        fn = builder.inttoptr(addr, fnty.as_pointer())
        return builder.call(fn, [A.data, A.nitems, IA.data, IA.nitems, row])
    return types.int32(types.int64, a, ia, tape, types.int64), codegen


@njit(cache=True, boundscheck=False)
def run(a, ia, tape, table, start, stop):
    """Rows [start, stop) of `tape` on the arenas a (float) and ia (int32); table[opcode] = entry address. A row
    split in parts (tape[i, SPLIT] > 1) runs them on the thread pool."""
    for i in range(start, stop):
        if tape[i, SPLIT] > 1:
            if run_parts(a, ia, tape, table, i) != 0:
                return
        elif _ccall(table[tape[i, 0]], a, ia, tape, i) != 0:
            return


@njit(parallel=True, cache=True, boundscheck=False)
def run_parts(a, ia, tape, table, i):
    """Row i in its n = tape[i, SPLIT] parts on the thread pool: the entry called once per part j on a copy of the
    row with PART = j. The one parallel loop of every threaded kernel: a kernel computes part j of n as one thread
    computes those elements (btjit.kernels.common.part_of), so a split row gives one thread's bits."""
    n, w = tape[i, SPLIT], tape.shape[1]
    rows = np.empty((n, w), np.int64)       # element loops, np.empty: numba makes array expressions, np.zeros and
    fail = np.empty(n, np.int32)            # reductions parallel regions of their own (~5 us a launch)
    for j in range(n):
        for k in range(w):
            rows[j, k] = tape[i, k]
        rows[j, PART] = j
    for j in prange(n):
        fail[j] = _ccall(table[rows[j, 0]], a, ia, rows, j)
    bad = np.int32(0)
    for j in range(n):
        bad = fail[j] if fail[j] != 0 else bad
    return bad


PAR_AVERAGE = 65536     # grads from which the replicas' average is split over the threads (a launch ~2-4 us)


@njit(parallel=True, cache=True, boundscheck=False)
def step(A, IA, tape, table, nsplit, stop, flag, p0, npar, g0, ngrad, oout, oinv):
    """Replica r takes replica 0's params (npar floats at p0) and runs tape rows [0, nsplit) on its own
    arena A[r], IA[r]; then replica 0 averages the grads (ngrad floats at g0) and the loss (at oout) with
    a[oinv] == 1/R and runs rows [nsplit, stop) (the update) alone. A failed index check in any replica
    (IA[r, flag] != 0) is copied to replica 0 and skips the rest. The step count (IA[r, flag - 1], which
    replica 0's update counts) is copied too: the random numbers' key (btjit/kernels/rng.py)."""
    R = A.shape[0]
    for r in prange(R):
        if r > 0:
            A[r, p0:p0 + npar] = A[0, p0:p0 + npar]
            IA[r, flag - 1] = IA[0, flag - 1]
        run(A[r], IA[r], tape, table, 0, nsplit)
    for r in range(1, R):
        if IA[r, flag] != 0:
            IA[0, flag] = IA[r, flag]
    if IA[0, flag] != 0:
        return
    inv = A[0, oinv]
    loss = A[0, oout]
    for r in range(1, R):
        loss += A[r, oout]
    runs = R if ngrad >= PAR_AVERAGE else 1
    for c in prange(runs):              # the grads' average, in runs on the threads when large (each element
        lo, hi = g0 + c * ngrad // runs, g0 + (c + 1) * ngrad // runs    # summed in replica order either way)
        g = A[0, lo:hi]
        for r in range(1, R):
            gr = A[r, lo:hi]
            for i in range(hi - lo):
                g[i] += gr[i]
        for i in range(hi - lo):
            g[i] *= inv
    A[0, oout] = loss * inv
    run(A[0], IA[0], tape, table, nsplit, stop)
