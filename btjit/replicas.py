"""The data-parallel step of `trace(..., replicas=R)`: R replica arenas (rows of one 2-D array, one plan)
run the forward and backward rows of the tape on the thread pool, one replica per thread, then replica 0
averages the grads and the loss and runs the update rows alone -- all in one native call.

The driver calls the program's executor through the address of its compiled `run` (numba's internal
calling convention), not as a linked function: linking would re-optimize every kernel of the executor
into the parallel driver (measured +12 s cold compile for E6), while this driver compiles once per arena
dtype for all executors and is cached with btjit's sources.
"""
from numba import njit, prange, types
from numba.extending import intrinsic


@intrinsic
def _call(typingctx, addr, a, ia, tape, start, stop):
    """run(a, ia, tape, start, stop) for the executor `run` compiled at address addr (an int)."""
    sig = types.void(addr, a, ia, tape, start, stop)

    def codegen(context, builder, sig, args):
        argtys = sig.args[1:]
        fnptr = builder.inttoptr(args[0], context.call_conv.get_function_type(types.void, argtys).as_pointer())
        context.call_conv.call_function(builder, fnptr, types.void, argtys, args[1:])
        return context.get_dummy_value()
    return sig, codegen


@njit(parallel=True, cache=True, boundscheck=False)
def step(addr, A, IA, tape, nsplit, stop, flag, p0, npar, g0, ngrad, oout, oinv):
    """Replica r takes replica 0's params (npar floats at p0) and runs tape rows [0, nsplit) on its own
    arena A[r], IA[r]; then replica 0 averages the grads (ngrad floats at g0) and the loss (at oout) with
    a[oinv] == 1/R and runs rows [nsplit, stop) (the update) alone. A failed index check in any replica
    (IA[r, flag] != 0) is copied to replica 0 and skips the rest."""
    R = A.shape[0]
    for r in prange(R):
        if r > 0:
            A[r, p0:p0 + npar] = A[0, p0:p0 + npar]
        _call(addr, A[r], IA[r], tape, 0, nsplit)
    for r in range(1, R):
        if IA[r, flag] != 0:
            IA[0, flag] = IA[r, flag]
    if IA[0, flag] != 0:
        return
    inv = A[0, oinv]
    g = A[0, g0:g0 + ngrad]
    loss = A[0, oout]
    for r in range(1, R):
        gr = A[r, g0:g0 + ngrad]
        for i in range(ngrad):
            g[i] += gr[i]
        loss += A[r, oout]
    for i in range(ngrad):
        g[i] *= inv
    A[0, oout] = loss * inv
    _call(addr, A[0], IA[0], tape, nsplit, stop)


def entry_address(run, a, ia, tape) -> int:
    """The address of the executor dispatcher `run` as compiled for these arguments (the executor compiled
    or loaded it for the arena's dtype already)."""
    import numba
    cres = run.overloads[tuple(numba.typeof(x) for x in (a, ia, tape)) + (types.int64, types.int64)]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
