"""The generated kernel library entries' machine code (btjit/kernels/attn_lanes.py builds their LLVM IR):
compiled by llvmlite for numba's own target machine, stored with a checksum, and loaded into an MCJIT engine
per object -- btjit/kernels/library.py caches the files, btjit/export.py links the same object code."""
from __future__ import annotations

import hashlib

import llvmlite.binding as llvm

from btjit.kernels import attn_lanes


class Generated:
    """A loaded generated entry: its address, object code and symbol (btjit/export.py links the same code)."""

    def __init__(self, address, object_code, symbol):
        self.address, self.object_code, self.symbol = address, object_code, symbol


MAGIC = b"btjit-entry-1\n"
_LOADED: dict = {}         # sha256 of object code -> (address, its MCJIT engine, kept alive)


def target_machine(opt=3):
    """A target machine as numba's own (CPU, features, relocation, code model), so generated code runs and
    exports like the numba-compiled entries; `opt` its code generator's level."""
    from numba.core.registry import cpu_target
    cg = cpu_target.target_context.codegen()
    return llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(
        cpu=cg._get_host_cpu_name(), features=cg._tm_features, opt=opt, reloc="static", codemodel="jitdefault",
        jit=True)


def compile_entry(name, shape) -> bytes:
    """A generated entry's object code, with its header: magic, sha256 of the code. The largest bodies get the
    code generator's level 1 (attn_lanes.FAST_CODEGEN_OPS)."""
    big = attn_lanes.body_ops(*shape) > attn_lanes.FAST_CODEGEN_OPS
    obj = attn_lanes.compile_entry(name, *shape, target_machine(1 if big else 3))
    return MAGIC + hashlib.sha256(obj).digest() + obj


def object_of(blob: bytes) -> bytes:
    """The object code of a cached generated entry; ValueError if the file is not one (corrupt, truncated)."""
    head, digest, obj = blob[:len(MAGIC)], blob[len(MAGIC):len(MAGIC) + 32], blob[len(MAGIC) + 32:]
    if head != MAGIC or hashlib.sha256(obj).digest() != digest:
        raise ValueError("not a btjit generated entry (bad header or checksum)")
    return obj


def load_object(obj: bytes, symbol: str) -> int:
    """The address of `symbol` in object code loaded into an MCJIT engine of its own (no two objects share an
    engine, so their symbols never clash); the same code is loaded once per process."""
    key = hashlib.sha256(obj).digest()
    if key not in _LOADED:
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), target_machine())
        engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        engine.finalize_object()
        addr = engine.get_function_address(symbol)
        if not addr:
            raise ValueError(f"symbol {symbol} not in the object code")
        _LOADED[key] = (addr, engine)
    return _LOADED[key][0]
