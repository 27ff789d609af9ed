"""How large a float32 product's B (K x N) may be for k_matmul_micro's register micro-kernels rather than BLAS,
and how large a B^T product on fewer than COPY_MIN_ROWS rows (btjit/graph/ops/matmul.py's micro_gemm):
measured once per machine, remembered in the cache dir.

The micro-kernels re-read B from cache for every 8 rows of C, so from some size of B the chosen BLAS (which
packs B into blocks) wins; where depends on the caches and on the BLAS. Measured here, for B of 128K floats
upwards: a forward product (512 rows, K 256) and a dW = X^T dY (256 rows, K 512), each library entry called
through its address, best of 5 interleaved calls (after a warm-up call); the limit is the largest size up
to which the micro-kernels take less time for the two, MIN_LIMIT if they lose at the first. (Zen 4, scipy's
OpenBLAS: 1.2-1.6x on a transformer's dW products of 98K-131K floats; the GPT at S1 and S3 7-8% faster with
the limit at 2M floats than at 128K.)
Remembered in `gemm.json` keyed by the CPU, the BLAS choice and the kernel library's version (kernels that
changed are measured again); $BTJIT_MICRO_B_MAX (floats) overrides.
The second, measured apart (k_matmul_micro against a direct sgemm call; only programs with such products
ask): B^T products of 8-32 rows (NT_PROBES, 65K-8M multiply-adds: an LSTM's dX on 32 rows is 5M), best of 20 interleaved
calls; the limit is the largest probe up to which gemm_micro_nt takes no longer than BLAS for the probes so
far together, linalg.NT_MACS if none (Zen 4, OpenBLAS, timed in a loop: 32 x 128 x 64 in 5.4 against
8.1 us, 8 x 128 x 64 1.4 against 1.9 us). Remembered in `gemm_nt.json`; $BTJIT_NT_MACS overrides.
The third (bf16_kernel): which entry bf16 products run on, AMX tiles or AVX512-BF16 vectors, remembered in
`bf16.json`. The fourth (ew_stream): whether the fused-chain interpreter prefetches all of the next block of a row
past fused.PF_STREAM bytes, or leaves it to the CPU's prefetchers, remembered in `ew_stream.json`.
"""
from __future__ import annotations

import ctypes
import json
import os
import time

import llvmlite.binding as llvm
import numpy as np

from btjit.kernels.elementwise import B_ADD, B_MUL, B_SUB
from btjit.kernels.fused import BIN, HEAD, MAX_OPERANDS, WIDTH
from btjit.kernels.linalg import MICRO_B_MAX as MIN_LIMIT   # floats of B: the micro-kernels' L2-resident range
from btjit.kernels.linalg import NT_MACS

SIZES = (131072, 262144, 524288, 1048576, 2097152)  # floats of B tried
REPS = 5
NT_PROBES = ((8, 128, 64), (32, 128, 64), (32, 256, 128), (32, 256, 512), (32, 512, 512))   # (M, N, K) tried
_VALUE: list = []
_NT: list = []


def micro_b_max() -> int:
    """The largest B (floats) a product runs on the micro-kernels with."""
    if not _VALUE:
        env = os.environ.get("BTJIT_MICRO_B_MAX")
        _VALUE.append(int(env) if env else _remembered("gemm.json", "micro_b_max", measure))
    return _VALUE[0]


def nt_macs() -> int:
    """The most multiply-adds a B^T product on fewer than COPY_MIN_ROWS rows runs on the micro-kernels with."""
    if not _NT:
        env = os.environ.get("BTJIT_NT_MACS")
        _NT.append(int(env) if env else _remembered("gemm_nt.json", "nt_macs", measure_nt))
    return _NT[0]


def _remembered(name, field, measure_fn) -> int:
    """The value `field` of the cache dir's `name`, measured once for this CPU and BLAS (measure_fn() ->
    (value, times)); the first process to measure sets the rule for all."""
    from btjit.host.cachedir import remembered
    from btjit.kernels import blas
    from btjit.kernels.library import LIBRARY
    key = json.dumps([llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten(), blas.CHOICE["name"],
                      LIBRARY.key])

    def measure():
        value, times = measure_fn()
        return {field: value, "us": times}
    return int(remembered(name, key, measure)[field])


def _entries(names=("k_matmul_micro", "k_matmul")):
    """Float32 library entries as ctypes functions, compiled together (by the library's workers) if missing,
    else loaded from the disk cache like every entry a program runs."""
    from btjit.kernels.library import LIBRARY
    LIBRARY.ensure("f32", [LIBRARY.opcode(n) for n in names])
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return [ctypes.CFUNCTYPE(ctypes.c_int32, p, i64, p, i64, p)(LIBRARY.loaded[(n, "f32", None)].address)
            for n in names]


def _row(name, **args):
    from btjit.kernels.common import ROW, ROWS
    from btjit.kernels.library import LIBRARY
    r = np.zeros(ROW, np.int64)
    r[0] = LIBRARY.opcode(name)
    r[1:1 + len(ROWS[name].args)] = [args[n] for n in ROWS[name].args]
    return r


def _race(calls, reps):
    """Best time of each zero-argument call over reps interleaved rounds (drifts hit all alike)."""
    best = [float("inf")] * len(calls)
    for _ in range(reps):
        for j, fn in enumerate(calls):
            t0 = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t0)
    return best


def _product(M, N, K, ta, tb):
    """(arena, oA, oB, oC, the row fields) of a product C = op(A) @ op(B) laid out from offset 32."""
    oA, oB = 32, 32 + M * K
    oC = oB + K * N
    a = np.random.default_rng(0).standard_normal(oC + M * N).astype(np.float32)
    a[16:18] = (1.0, 0.0)                                  # oconst: alpha, beta
    return a, oA, oB, oC, dict(oA=oA, oB=oB, oC=oC, nbatch=1, M=M, N=N, K=K, sA=0, sB=0, sC=0, ta=ta, tb=tb,
                               obias=0)


def _call(fn, a, r):
    """A zero-argument call of the library entry fn on arena a and row r (the pointers taken once: numpy's
    .ctypes costs ~1 us a time; the arrays are kept alive by the call, or the pointers would dangle)."""
    ia = np.zeros(64, np.int32)
    args = (a.ctypes.data, a.size, ia.ctypes.data, ia.size, r.ctypes.data)
    return lambda keep=(a, ia, r): fn(*args)


def measure() -> tuple:
    """(the B limit, {"size:ta": [micro us, blas us]}) -- see the module docstring."""
    micro, blas = _entries()
    limit, times = MIN_LIMIT, {}
    for size in SIZES:
        total = [0.0, 0.0]
        for ta, M, K in ((0, 512, 256), (1, 256, 512)):          # a forward product, a dW = X^T dY
            a, *_, f = _product(M, size // K, K, ta, 0)
            calls = [_call(micro, a, _row("k_matmul_micro", **f, osum=0, ores=0, relu=0, kc=f["K"], by=0)),
                     _call(blas, a, _row("k_matmul", **f, beta=0, osc=0, oconst=16, nparts=1))]
            best = _race(calls, REPS + (size == SIZES[0]))        # the first call of all warms up
            times[f"{size}:{ta}"] = [round(t * 1e6, 1) for t in best]
            total = [total[0] + best[0], total[1] + best[1]]
        if total[0] <= total[1]:
            limit = size
    return limit, times


def measure_nt() -> tuple:
    """(the B^T limit on few rows, {"MxNxK": [micro us, sgemm us]}) -- see the module docstring. The chosen
    BLAS's sgemm is called directly (column-major C^T = B A^T, as common.gemm issues it), so only
    k_matmul_micro, which such a program runs anyway, needs to be in the library; the entry's own call work
    is on the micro-kernels' side."""
    from btjit.kernels import blas
    (micro,) = _entries(("k_matmul_micro",))
    sgemm = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 13))(blas.CHOICE["sgemm"])
    nt, times, total = NT_MACS, {}, [0.0, 0.0]
    for M, N, K in NT_PROBES:
        a, oA, oB, oC, f = _product(M, N, K, 0, 1)
        keep = [ctypes.c_int(v) for v in (N, M, K, K, K, N)] + [ctypes.c_float(1.0), ctypes.c_float(0.0),
                                                                  ctypes.c_char(b"T"), ctypes.c_char(b"N")]
        n_, m_, k_, lda, ldb, ldc, one, zero, tr, no = (ctypes.addressof(x) for x in keep)
        p = a.ctypes.data
        args = (tr, no, n_, m_, k_, one, p + 4 * oB, lda, p + 4 * oA, ldb, zero, p + 4 * oC, ldc)
        best = _race([_call(micro, a, _row("k_matmul_micro", **f, osum=0, ores=0, relu=0, kc=f["K"], by=0)),
                      lambda args=args, keep=keep: sgemm(*args)], 4 * REPS)   # keep: the arguments' storage
        times[f"{M}x{N}x{K}"] = [round(t * 1e6, 2) for t in best]
        total = [total[0] + best[0], total[1] + best[1]]
        if total[0] <= total[1]:
            nt = M * N * K
    return nt, times


BF16_CHECK = (37, 70, 300, 0, 1)                                     # odd sizes: the tiles' edges and padding
BF16_PROBES = ((512, 768, 768, 0, 0), (768, 768, 512, 1, 0), (512, 768, 768, 0, 1))   # forward, dW, dX
_BF16: list = []


def bf16_kernel() -> str:
    """The library entry a bf16 product runs on: "k_matmul_amx" (btjit/kernels/amx.py) where the CPU has
    AMX-BF16, Linux grants this process the tile state, and the tiles' kernel computed k_matmul_bf16's products
    and took less time for BF16_PROBES (measured once per machine, `bf16.json`); else "k_matmul_bf16".
    $BTJIT_BF16_KERNEL = amx | avx512 chooses (amx where the CPU lacks it runs an emulation: for tests)."""
    if not _BF16:
        from btjit.host.cachedir import remembered
        from btjit.kernels import amx
        from btjit.kernels.library import LIBRARY
        env = os.environ.get("BTJIT_BF16_KERNEL")
        if env not in (None, "", "amx", "avx512"):
            raise ValueError(f"BTJIT_BF16_KERNEL must be amx or avx512, not {env!r}")
        if env:
            kernel = "k_matmul_amx" if env == "amx" else "k_matmul_bf16"
        else:
            key = json.dumps([llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten(), LIBRARY.key])
            kernel = remembered("bf16.json", key, measure_bf16)["kernel"]
        if kernel == "k_matmul_amx" and amx.has_amx() and not amx.request_tiles():
            if env:
                raise RuntimeError("BTJIT_BF16_KERNEL=amx: Linux refused this process the AMX tile state "
                                   "(arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)")
            kernel = "k_matmul_bf16"                   # measured in a process that held it; this one does not
        _BF16.append(kernel)
    return _BF16[0]


def measure_bf16() -> dict:
    """{"kernel", "why", "us": {"MxNxK:ta:tb": [tiles us, vectors us]}} -- see bf16_kernel."""
    from btjit.kernels import amx
    if not amx.has_amx():
        return {"kernel": "k_matmul_bf16", "why": "no AMX-BF16 on this CPU", "us": {}}
    if not amx.request_tiles():
        return {"kernel": "k_matmul_bf16", "why": "Linux refused the AMX tile state (arch_prctl)", "us": {}}
    names = ("k_matmul_amx", "k_matmul_bf16")
    fns, times, total = _entries(names), {}, [0.0, 0.0]
    for M, N, K, ta, tb in (BF16_CHECK,) + BF16_PROBES:
        a, *_, f = _product(M, N, K, ta, tb)
        outs = [a.copy(), a.copy()]
        calls = [_call(fn, b, _row(n, **f, ores=0, relu=0, by=0)) for fn, b, n in zip(fns, outs, names)]
        for call in calls:
            call()
        c0, c1 = (b[f["oC"]:f["oC"] + M * N] for b in outs)
        err = float(np.max(np.abs(c0 - c1)) / (np.max(np.abs(c1)) + 1))
        if not err <= 1e-4:
            return {"kernel": "k_matmul_bf16", "why": f"the tiles' products differed from k_matmul_bf16's by {err:.1e}"
                    f" at {M}x{N}x{K}", "us": times}
        if (M, N, K, ta, tb) != BF16_CHECK:
            best = _race(calls, REPS)
            times[f"{M}x{N}x{K}:{ta}:{tb}"] = [round(t * 1e6, 1) for t in best]
            total = [total[0] + best[0], total[1] + best[1]]
    faster = total[0] < total[1]
    return {"kernel": names[0] if faster else names[1], "us": times,
            "why": f"the tiles {'faster' if faster else 'slower'}: {total[0] * 1e6:.0f} vs {total[1] * 1e6:.0f} us"}


_STREAM: list = []


def ew_stream() -> int:
    """The field stream of a k_ew_program row reading more than fused.PF_STREAM bytes: 1 (the interpreter prefetches
    the rest of each next block, in shares before each instruction) where measured faster on this machine, else 0
    (its first lines only: the CPU's prefetchers do the rest). Measured once per machine (`ew_stream.json`):
    a Lion-like chain over three 4 MB arrays (two of them written, one in place) both ways, best of 7 interleaved
    calls; streaming is kept only if 5% faster. Zen 4 (znver4): 1.4x slower streaming (a user's Lion on 1M params
    1.48-1.58x AdamW's update streaming, 1.06-1.68x not); znver5: Lion's 1.3-1.45x -> 1.0-1.2x streaming.
    $BTJIT_EW_STREAM = 0 | 1 chooses."""
    if not _STREAM:
        env = os.environ.get("BTJIT_EW_STREAM")
        if env not in (None, "", "0", "1"):
            raise ValueError(f"BTJIT_EW_STREAM must be 0 or 1, not {env!r}")
        _STREAM.append(int(env) if env else _remembered("ew_stream.json", "stream", measure_stream))
    return _STREAM[0]


def settle_ew_stream(tape) -> None:
    """Set the field stream of the tape's k_ew_program rows lowered with -1 (chains past fused.PF_STREAM bytes) to
    ew_stream(), once the program's entries are loaded (measuring runs k_ew_program: asked while lowering, it
    compiled that entry alone before the program's others, ~3 s more for a CNN's first program on an empty cache)."""
    from btjit.kernels.common import ROWS
    from btjit.kernels.entries import OPCODE
    col = 1 + ROWS["k_ew_program"].args.index("stream")
    rows = (tape[:, 0] == OPCODE["k_ew_program"]) & (tape[:, col] == -1)
    if rows.any():
        tape[rows, col] = ew_stream()


def measure_stream() -> tuple:
    """(stream, [streaming us, not us]) -- see ew_stream."""
    (fn,) = _entries(("k_ew_program",))
    n, nops = 1 << 20, 3
    prog = [[BIN + B_MUL, 0, -1, -2, 0, 0],            # register 0 = x * g; y = r0 - x; x = x + g (in place)
            [BIN + B_SUB, -3, 0, -1, 0, 0], [BIN + B_ADD, -1, -1, -2, 0, 0]]
    ia = np.array([len(prog), nops, 1, 1, 1, n] + [0, 0, 0, 1] * nops + sum(prog, []), np.int32)
    assert len(ia) == HEAD + 4 * nops + WIDTH * len(prog)
    a = np.random.default_rng(0).standard_normal(64 + 3 * n).astype(np.float32) * np.float32(1e-3)
    ops = {f"o{k}": 64 + k * n for k in range(nops)}
    calls = []
    for stream in (1, 0):
        r = _row("k_ew_program", oprog=0, **ops, **{f"o{k}": 0 for k in range(nops, MAX_OPERANDS)}, okey=0, ebase=0,
                 esize=n, stream=stream)
        args = (a.ctypes.data, a.size, ia.ctypes.data, ia.size, r.ctypes.data)
        calls.append(lambda args=args, keep=(a, ia, r): fn(*args))
    best = _race(calls, 7)
    return int(best[0] < 0.95 * best[1]), [round(t * 1e6, 1) for t in best]
