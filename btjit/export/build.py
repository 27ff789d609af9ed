"""`prog.export(path)`, `f.export(path)`, `btjit export`: a traced program as a self-contained native library.

The export dir holds:
    libbtjit.so        the kernels the tape uses -- numba's machine code exactly as the program runs it
                       in-process (the library entries' cached object code) -- linked with the fixed C part
                       (btjit/native/runtime.c: the executor loop, btjit_open/btjit_step for C hosts) and
                       the generated program.c (the kernel table, the inputs, the CPU check, the BLAS shim)
    tape.bin           the kernel tape, int64 rows, opcodes renumbered to the library's table   (tensor only)
    arena.bin          the initial float arena: params, optimizer state, constants              (tensor only)
    iarena.bin         the initial int32 arena                                                  (tensor only)
    btjit_program.h    the C header: sizes, offsets, the btjit_* functions
    manifest.json      format version, kind, dtype; names, shapes and offsets of params, grads, buffers,
                       inputs and outputs; the optimizer and its hyper-parameter slots; the CPU it was built for; the
                       BLAS library it links (or none); every file's size and CRC-32
`btjit.runtime.load(path)` runs it with ctypes and numpy only; examples/c/train.c from C. A scalar export
(btjit/export_scalar.py) has the same files but the tape and arenas, plus a CPython call module.

A tape whose kernels call BLAS (the large-matrix GEMM) links the OpenBLAS the install already has (scipy's),
found here and recorded in the manifest. An export is one thread, like BurTorch's: a row split into parts for
the threads runs them one after another (the same results), and programs with data-parallel replicas are refused.
Building needs a C compiler (`cc`, or $CC).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import zlib
from pathlib import Path

import numpy as np

from btjit.export.runtime import FORMAT, manifest_checksum

NATIVE = Path(__file__).resolve().parent / "native"
# LLVM feature -> (/proc/cpuinfo flag, gcc __builtin_cpu_supports name) for the instruction sets that numba's
# code for this CPU may use; an export records those the build machine has and refuses a CPU without one
CPU_FEATURES = {"sse3": ("pni", "sse3"), "ssse3": ("ssse3", "ssse3"), "sse4.1": ("sse4_1", "sse4.1"),
                "sse4.2": ("sse4_2", "sse4.2"), "popcnt": ("popcnt", "popcnt"), "avx": ("avx", "avx"),
                "avx2": ("avx2", "avx2"), "fma": ("fma", "fma"), "bmi": ("bmi1", "bmi"), "bmi2": ("bmi2", "bmi2"),
                "avx512f": ("avx512f", "avx512f"), "avx512dq": ("avx512dq", "avx512dq"),
                "avx512cd": ("avx512cd", "avx512cd"), "avx512bw": ("avx512bw", "avx512bw"),
                "avx512vl": ("avx512vl", "avx512vl"), "avx512bf16": ("avx512_bf16", "avx512bf16")}
AMX_FEATURES = {"amx-tile": ("amx_tile", "amx-tile"), "amx-bf16": ("amx_bf16", "amx-bf16")}   # only where used
FEATURES = {**CPU_FEATURES, **AMX_FEATURES}


class ExportError(Exception):
    """A program that cannot be exported, or a failed build; str(e) says which and why."""


# ----------------------------------------------------------------------------- the pieces
def _object_code(fn, sig=None) -> bytes:
    """The machine code numba runs for a cfunc (or a dispatcher's overload `sig`): the object code in its
    disk cache (what every process runs, btjit/kernels/library.py), else emitted from the module now."""
    codegen = (fn._targetdescr.target_context if sig is None else fn.targetctx).codegen()
    try:
        data = fn._cache._cache_file.load(fn._cache._index_key(fn._sig if sig is None else sig, codegen))
        if data and data[0][1] == "object":          # (name, "object", (object code, shared bitcode)), ...
            return data[0][2][0]
    except Exception:  # noqa: BLE001 -- not cached (compiled in memory): emit it below
        pass
    lib = fn._library if sig is None else fn.overloads[sig].library
    return codegen._tm.emit_object(lib._final_module)


def _entry_symbol(obj: bytes, native_name: str) -> str:
    """The name of the entry function in the object code `obj`. The loaded function's own name may differ:
    numba's mangled names carry a per-process counter, and when two processes compiled one entry at once the
    cache may hold the other's object (the same code under another name)."""
    head = native_name.encode().split(b"5entry")[0] + b"5entry"
    found = re.search(re.escape(head) + rb"[^\x00]*", obj)
    return found.group().decode() if found else native_name


def _code(fn) -> tuple:
    """(object code, symbol) of a loaded library entry: a numba cfunc, or a generated entry (its own)."""
    if hasattr(fn, "object_code"):
        return fn.object_code, fn.symbol
    obj = _object_code(fn)
    return obj, _entry_symbol(obj, fn.native_name)


def cpu_info(tiles=False) -> dict:
    """The build machine's CPU as numba compiles for it: LLVM's name and the CPU_FEATURES it has; with `tiles`
    (the program runs AMX tile kernels) AMX_FEATURES too, and the program asks Linux for the tile state as it
    checks the CPU."""
    import llvmlite.binding as llvm
    feats = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    return {"machine": platform.machine(), "name": llvm.get_host_cpu_name(),
            "features": sorted(f for f in (FEATURES if tiles else CPU_FEATURES) if f in feats)}


def _blas(objects) -> dict | None:
    """The BLAS the tape's GEMMs call in this process (btjit/kernels/blas.py: OpenBLAS or MKL), if any object
    refers to it: {"path", "gemm": {btjit's symbol: the library's}, "init": [C function, int arg] or None}."""
    from btjit.kernels.blas import CHOICE
    shims = [s for s in ("btjit_sgemm", "btjit_dgemm") if any(s.encode() in o for o in objects)]
    if not shims:
        return None
    if not CHOICE["path"] or not CHOICE["symbols"]:
        raise ExportError(f"the tape calls BLAS (a large or float64 matrix product), but the {CHOICE['name']} "
                          "library this process uses was not found as a file to link")
    return {"path": CHOICE["path"], "gemm": {s: CHOICE["symbols"][s] for s in shims}, "init": CHOICE["init"]}


def _blas_c(blas) -> str:
    if not blas:
        return "void btjit_init(void) {}\n"
    out = ""
    for shim, gemm in blas["gemm"].items():
        t = "float" if shim == "btjit_sgemm" else "double"
        args = f"char *ta, char *tb, int *m, int *n, int *k, {t} *al, {t} *a, int *lda, {t} *b, int *ldb, " \
               f"{t} *be, {t} *c, int *ldc"
        out += f"void {gemm}({args});\nvoid {shim}({args}) {{ {gemm}(ta, tb, m, n, k, al, a, lda, b, ldb, be, c, " \
               "ldc); }\n"
    if not blas["init"]:                   # one thread (OpenBLAS) / the sequential layer (MKL)
        return out + "void btjit_init(void) {}\n"
    fn, arg = blas["init"]
    return out + f"int {fn}(int);\nvoid btjit_init(void) {{ {fn}({arg}); }}\n"


def _cpu_c(cpu) -> str:
    checks = "".join(f'    if (!__builtin_cpu_supports("{FEATURES[f][1]}")) return "{f}";\n' for f in cpu["features"])
    decl = ""
    if "amx-tile" in cpu["features"]:      # the process's tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
        checks += '    if (syscall(158, 0x1023, 18) != 0) return "amx-tile (Linux refused the tile state)";\n'
        decl = "long syscall(long, ...);\n"
    return decl + f"const char *btjit_check_cpu(void)\n{{\n    __builtin_cpu_init();\n{checks}    return 0;\n}}\n"


def _table_c(symbols) -> str:
    decl = "".join(f'int32_t btjit_k{i}(void *, int64_t, int32_t *, int64_t, int64_t *) __asm__("{s}");\n'
                   for i, s in enumerate(symbols))
    return decl + f"const btjit_entry btjit_table[] = {{{', '.join(f'btjit_k{i}' for i in range(len(symbols)))}}};\n" \
        f"const int64_t btjit_n_table = {len(symbols)};\n"


def _c_float(x, ctype) -> str:
    x = float(x)
    if np.isnan(x):
        return "NAN"
    if np.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    return x.hex() + ("f" if ctype == "float" else "")


def _buffers_c(buffers) -> str:
    rows = ", ".join(f'{{"{k}", {s["offset"]}, {int(np.prod(s["shape"]))}}}' for k, s in buffers.items())
    return f"const btjit_buffer btjit_buffers[] = {{{rows or '{0, 0, 0}'}}};\n" \
        f"const int64_t btjit_n_buffers = {len(buffers)};\n"


def _crc(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _header(kind, ctype, defines, decls) -> str:
    lines = ["/* generated by btjit.export.build: the C interface of this export's libbtjit.so. Do not edit. */",
             "#ifndef BTJIT_PROGRAM_H", "#define BTJIT_PROGRAM_H", "#include <stdint.h>", "",
             f"#define BTJIT_FORMAT {FORMAT}", f"#define BTJIT_FLOAT {ctype}",
             f"#define BTJIT_{kind.upper()} 1"]
    lines += [f"#define BTJIT_{k} {v}" for k, v in defines.items()]
    lines += ["", "const char *btjit_check_cpu(void);   /* NULL, or an instruction set this CPU lacks */",
              "void btjit_init(void);", *decls, "", "#endif", ""]
    return "\n".join(lines)


_TENSOR_DECLS = [
    "typedef struct { const char *name; int64_t offset, size; int32_t is_int, bound; } btjit_input;",
    "extern const btjit_input btjit_inputs[];     /* offsets into a (floats) or ia (int32, is_int) */",
    "extern const int64_t btjit_n_inputs;",
    "typedef struct { const char *name; int64_t offset, size; } btjit_buffer;",
    "extern const btjit_buffer btjit_buffers[];   /* offsets into a: what btjit.assign updates every step */",
    "extern const int64_t btjit_n_buffers;",
    "typedef struct { void *a; int64_t na; int32_t *ia; int64_t nia; int64_t *tape; int64_t rows, cols; } "
    "btjit_program;",
    "/* rows [start, stop) of the tape: 0, 1 (an index out of range stopped it) or 2 (a kernel failed) */",
    "int btjit_run(void *a, int64_t na, int32_t *ia, int64_t nia, int64_t *tape, int64_t cols, int64_t start, "
    "int64_t stop);",
    "const char *btjit_open(const char *dir, btjit_program *p);   /* NULL, or why the export cannot load */",
    "int btjit_step(btjit_program *p);                           /* forward, backward, update: btjit_run */",
    "int btjit_run_to(btjit_program *p, int64_t stop);          /* rows [0, stop) (Python's one-argument call) */",
    "void btjit_close(btjit_program *p);"]

STAND_IN = ("Py", "_Py", "NRT_", "numba_")      # prefixes of the symbols numba's code needs from its runtime
DEFINED = {"numba_attempt_nocopy_reshape"}      # ... of which runtime.c defines these for real


def _stand_ins(objs) -> str:
    """C stand-ins for the symbols the objects refer to from Python, NRT or numba's helpers (see runtime.c):
    data (PyExc_*, *_Type, _Py_*Struct) as pointers, functions as a call of kernel_failed()."""
    nm = shutil.which("nm")
    if not nm:
        raise ExportError("exporting needs `nm` (binutils), which is not installed")
    undef, defined = set(), set()
    for args, into in (("-u", undef), ("--defined-only", defined)):
        r = subprocess.run([nm, "-P", args, *objs], capture_output=True, text=True, check=True)
        into.update(ln.split()[0] for ln in r.stdout.splitlines() if ln.strip() and not ln.endswith(":"))
    out = ["void kernel_failed(void);"]
    for sym in sorted(undef - defined - DEFINED):
        if not sym.startswith(STAND_IN):
            continue
        if sym.startswith("PyExc_") or sym.endswith(("_Type", "Struct")):
            out.append(f"void *{sym};")
        else:
            out.append(f"void *{sym}(void) {{ kernel_failed(); return 0; }}")
    return "\n" + "\n".join(out) + "\n"


def _check_replaceable(out: Path) -> None:
    """An export replaces `out` whole: only a new or empty dir, or an earlier export (its manifest.json), never a dir
    of other files (a run dir, a project) or a file."""
    if out.is_dir():
        try:
            m = json.loads((out / "manifest.json").read_text())
            if isinstance(m, dict) and "format" in m and "kind" in m:
                return
        except (OSError, ValueError):
            pass
        held = sorted(p.name for p in out.iterdir())
        if held:
            raise ExportError(f"{out} is not an earlier export (no btjit manifest.json) and holds {len(held)} "
                              f"file(s) ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}), which an export "
                              f"would delete: give a new or empty dir")
    elif out.exists():
        raise ExportError(f"{out} is a file, not a dir: give a new or empty dir")


def _build(out: Path, program_c: str, header: str, objects: list, blas, files: dict, manifest: dict,
           after_link=None) -> Path:
    """Compile and link into a fresh dir beside `out` (then after_link(dir)), write the data files and the
    manifest, then put the dir in place of `out` (an interrupted export leaves `out` as it was)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise ExportError("exporting needs a C compiler: none of $CC, cc, gcc, clang was found")
    out = Path(out)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build = tmp / "build"
        build.mkdir()
        (tmp / "btjit_program.h").write_text(header)
        objs = []
        for i, o in enumerate(objects):
            objs.append(str(build / f"k{i}.o"))
            Path(objs[-1]).write_bytes(o)
        (build / "program.c").write_text(program_c + _stand_ins(objs))
        cmd = [cc, "-shared", "-O2", "-fPIC", "-I", str(tmp), "-o", str(tmp / "libbtjit.so"),
               str(build / "program.c"), str(NATIVE / "runtime.c"), *objs,
               f"-Wl,--version-script={NATIVE / 'exports.map'}", "-Wl,-soname,libbtjit.so", "-lm"]
        if blas:
            cmd += [blas["path"], f"-Wl,-rpath,{os.path.dirname(blas['path'])}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise ExportError(f"building {out}/libbtjit.so failed ({' '.join(cmd[:3])} ...):\n{r.stderr[-2000:]}")
        shutil.rmtree(build)
        if after_link:
            after_link(tmp)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        manifest["files"] = {p.name: {"bytes": p.stat().st_size, "crc32": _crc(p.read_bytes())}
                             for p in sorted(tmp.iterdir()) if p.name != "manifest.json"}
        manifest["checksum"] = manifest_checksum(manifest)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _base_manifest(kind, dtype, symbols, blas, cpu) -> dict:
    from btjit import __version__
    return {"format": FORMAT, "kind": kind, "btjit": __version__, "dtype": dtype, "kernels": symbols,
            "blas": blas and {"path": blas["path"], "gemm": blas["gemm"]}, "cpu": cpu,
            "cpu_flags": [FEATURES[f][0] for f in cpu["features"]]}


# ----------------------------------------------------------------------------- tensor programs
def export_program(prog, path, extra_files=None) -> Path:
    """Write `prog` (a btjit.Program) to the dir `path`; see the module docstring."""
    from btjit.kernels.library import LIBRARY
    if prog.replicas > 1:
        raise ExportError(f"this program runs {prog.replicas} replicas; an export is one thread: trace it with "
                          "replicas=1 to export it")
    fd = prog.graph.float_dtype
    tape = prog.tape.copy()                      # renumbered below: the program keeps its own
    ops = sorted(set(int(o) for o in tape[:, 0]))
    entries = [LIBRARY.entry_of(o) for o in ops]
    objects, symbols = zip(*(_code(LIBRARY.loaded[(n, fd, s)]) for n, s in entries))
    remap = np.zeros(max(ops) + 1, np.int64)
    remap[ops] = np.arange(len(ops))
    tape[:, 0] = remap[tape[:, 0]]
    blas, cpu = _blas(objects), cpu_info(tiles=any(n.startswith("k_matmul_amx") for n, _ in entries))
    ctype = "float" if fd == "f32" else "double"

    def off(view, base):
        return (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // view.itemsize

    def slot(v):
        is_int = v.dtype.kind == "i"
        return {"offset": int(off(v, prog.ia if is_int else prog.a)), "shape": list(v.shape),
                "dtype": "int32" if is_int else prog.dtype.name}
    inputs = []
    for i, (name, v) in enumerate(prog.inputs.items()):
        hi, ok = prog._bounds.get(i, (None, None))
        inputs.append({"name": name, **slot(v), "batch_shape": list(prog._in_types[i][0]),
                       "bound": None if hi is None else int(hi), "ignore": None if ok is None else int(ok)})
    man = _base_manifest("tensor", prog.dtype.name, symbols, blas, cpu)
    man.update({
        "arena": {"floats": int(prog.a.size), "ints": int(prog.ia.size)},
        "tape": {"rows": int(tape.shape[0]), "cols": int(tape.shape[1]), "n_fwd": prog.n_fwd,
                 "n_bwd": prog.n_bwd},
        "params": {k: slot(v) for k, v in prog.params.items()},
        "grads": {k: slot(v) for k, v in prog.grads.items()},
        "buffers": {k: slot(v) for k, v in prog.buffers.items()}, "assigns": prog.has_assigns,
        "inputs": inputs,
        "outputs": {k: slot(v) for k, v in prog.outputs.items()},
        "loss": "out" if prog.has_grad else None,
        "optimizer": prog.optimizer and {"type": type(prog.optimizer).__name__, **prog.optimizer.hyper()},
        "hyper": prog._hyper, "group_hyper": prog._group_hyper, "hp_untraced": list(prog._hp_untraced),
        "state": [[n, int(o)] for n, o in prog._state], "state_shapes": prog._state_shapes,
        "span": int(prog._span), "flag": int(prog._flag), "int_state": int(prog._int_state),
        "computed_checks": prog._computed_checks})
    files = {"tape.bin": tape.astype("<i8").tobytes(), "arena.bin": prog.a.tobytes(),
             "iarena.bin": prog.ia.tobytes(), **(extra_files or {})}
    out_slot = man["outputs"]["out"]
    defines = {"ARENA_FLOATS": prog.a.size, "ARENA_INTS": prog.ia.size, "TAPE_ROWS": tape.shape[0],
               "TAPE_COLS": tape.shape[1], "N_FWD": prog.n_fwd, "N_BWD": prog.n_bwd,
               "OUT_OFFSET": out_slot["offset"], "LR_OFFSET": prog._hyper.get("lr", 0), "FLAG_OFFSET": prog._flag,
               **{f"{k.upper()}_CRC": f"0x{_crc(v):08x}u" for k, v in
                  (("arena", files["arena.bin"]), ("iarena", files["iarena.bin"]), ("tape", files["tape.bin"]))}}
    header = _header("tensor", ctype, defines, _TENSOR_DECLS)
    ins = ", ".join(f'{{"{d["name"]}", {d["offset"]}, {int(np.prod(d["shape"]))}, {int(d["dtype"] == "int32")}, '
                    f'{d["bound"] or 0}}}' for d in inputs)
    program_c = "\n".join(["/* generated by btjit.export.build */", "#include <stdint.h>", "#include <math.h>",
                           '#include "btjit_program.h"',
                           "typedef int32_t (*btjit_entry)(void *, int64_t, int32_t *, int64_t, int64_t *);",
                           _table_c(symbols), f"const btjit_input btjit_inputs[] = {{{ins}}};",
                           f"const int64_t btjit_n_inputs = {len(inputs)};", _buffers_c(man["buffers"]), _cpu_c(cpu),
                           _blas_c(blas)])
    return _build(Path(path), program_c, header, objects, blas, files, man)
