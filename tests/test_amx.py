"""bf16 products on the matrix units (btjit/kernels/amx.py) and the rule that chooses them (gemm_rule.bf16_kernel).
Where the CPU has AMX-BF16 the kernel runs its tiles; elsewhere the same loops run on an emulation of the four
tile instructions, so the packing, the tiles' edges and the thread split are checked on every machine (the
products and splits beside the vector kernel's, in tests/test_bf16.py). The tile code itself is compiled for
an AMX CPU on every machine and read back; it runs only where the CPU has it."""
import llvmlite.binding as llvm
import numpy as np
import pytest
from llvmlite import ir
from test_bf16 import _mlp

import btjit
from btjit.kernels import amx, gemm_rule

AMX = pytest.mark.skipif(not amx.has_amx(), reason="this CPU has no AMX-BF16: the tiles run emulated here")


def test_the_tile_code_compiles_to_amx_instructions():
    """The micro-kernel's tile operations, compiled for an AMX CPU (sapphirerapids) on any machine: the tile
    configuration, loads with the packed strides, four TDPBF16PS (C += A B: destination, A, B), stores, release."""
    mod, i64 = ir.Module(), ir.IntType(64)
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.IntType(32).as_pointer(), i64, i64]), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    amx.configure(b)
    amx.product(b, amx._Tiles(b), fn.args[0], fn.args[1], fn.args[2], 32, 2)
    amx.release(b)
    b.ret_void()
    m = llvm.parse_assembly(str(mod))
    m.verify()
    tm = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(
        cpu="sapphirerapids", features="+amx-tile,+amx-bf16", opt=2)
    asm = [line.split() for line in tm.emit_assembly(m).splitlines()]
    ops = [x[0] for x in asm if x and (x[0].startswith("tile") or x[0] in ("ldtilecfg", "tdpbf16ps"))]
    assert ops == ["ldtilecfg"] + ["tilezero"] * 4 + ["tileloadd"] * 4 + ["tdpbf16ps"] * 4 + \
        ["tilestored"] * 4 + ["tilerelease"]
    dps = [x[1:] for x in asm if x and x[0] == "tdpbf16ps"]        # AT&T order: B, A, C
    assert dps == [["%tmm6,", "%tmm4,", "%tmm0"], ["%tmm7,", "%tmm4,", "%tmm1"], ["%tmm6,", "%tmm5,", "%tmm2"],
                   ["%tmm7,", "%tmm5,", "%tmm3"]]


@AMX
def test_this_process_holds_the_tile_state():
    assert amx.request_tiles()


def test_no_tile_state_where_the_cpu_has_no_tiles():
    if amx.has_amx():
        pytest.skip("this CPU has AMX: the refusal is tested by test_a_refused_tile_state_falls_back")
    assert not amx.request_tiles()
    assert gemm_rule.measure_bf16() == {"kernel": "k_matmul_bf16", "why": "no AMX-BF16 on this CPU", "us": {}}


def test_a_refused_tile_state_falls_back(monkeypatch):
    """Linux may refuse the tile state (a kernel without AMX support, a seccomp policy): the vectors' kernel,
    with the reason; forced tiles then raise instead of dying on the first tile instruction."""
    monkeypatch.setattr(amx, "has_amx", lambda: True)
    monkeypatch.setattr(amx, "request_tiles", lambda: False)
    rec = gemm_rule.measure_bf16()
    assert rec["kernel"] == "k_matmul_bf16" and "refused" in rec["why"]
    monkeypatch.setattr(gemm_rule, "_BF16", [])
    monkeypatch.setenv("BTJIT_BF16_KERNEL", "amx")
    with pytest.raises(RuntimeError, match="refused this process the AMX tile state"):
        gemm_rule.bf16_kernel()
    monkeypatch.setattr(gemm_rule, "_BF16", [])
    monkeypatch.setenv("BTJIT_BF16_KERNEL", "tiles")
    with pytest.raises(ValueError, match="BTJIT_BF16_KERNEL must be amx or avx512, not 'tiles'"):
        gemm_rule.bf16_kernel()


@AMX
def test_the_rule_checked_the_tiles_against_the_vectors():
    rec = gemm_rule.measure_bf16()
    assert rec["kernel"] in ("k_matmul_amx", "k_matmul_bf16") and "differed" not in rec["why"], rec
    assert len(rec["us"]) == len(gemm_rule.BF16_PROBES)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_program_on_the_tiles_trains_as_on_the_vectors(monkeypatch, threads):
    """The same bf16 program with its products on each entry: the same rounded products summed in another
    order, so a sum may round to another bf16 as the next product reads it: losses and parameters agree to a
    part in a thousand (bf16 keeps 8 bits), on one thread and on two."""
    rng = np.random.default_rng(3)
    p = {"w1": rng.standard_normal((40, 48)).astype(np.float32) * 0.2, "b1": np.zeros(48, np.float32),
         "w2": rng.standard_normal((48, 16)).astype(np.float32) * 0.2}
    x, y = rng.standard_normal((70, 40)).astype(np.float32), rng.standard_normal((70, 16)).astype(np.float32)
    runs = {}
    for kernel in ("amx", "avx512"):
        monkeypatch.setattr(gemm_rule, "_BF16", [])
        monkeypatch.setenv("BTJIT_BF16_KERNEL", kernel)
        prog = btjit.trace(_mlp, p, x, y, optimizer=btjit.optim.SGD(lr=0.05), precision="bf16", threads=threads)
        assert any(e.startswith("k_matmul_amx" if kernel == "amx" else "k_matmul_bf16") for e in prog.kernels.entries)
        assert ("AMX" in prog.precision) == (kernel == "amx")
        runs[kernel] = ([prog.step(x, y) for _ in range(5)], prog.params["w1"].copy())
    np.testing.assert_allclose(runs["amx"][0], runs["avx512"][0], rtol=1e-3)
    np.testing.assert_allclose(runs["amx"][1], runs["avx512"][1], rtol=1e-3, atol=1e-5)
    assert not np.array_equal(runs["amx"][1], p["w1"])          # trained


def test_an_export_on_the_tiles_runs_bitwise_and_asks_for_the_tile_state(tmp_path, monkeypatch):
    """A bf16 program on k_matmul_amx exported: the exported run repeats the traced one bit for bit; where the
    tiles are real the manifest names AMX and the program asks Linux for the tile state as it checks the CPU."""
    import json
    import subprocess

    from test_export import CFG, batches, gpt, run_fresh

    from btjit.export.build import _cpu_c
    monkeypatch.setattr(gemm_rule, "_BF16", [])
    monkeypatch.setenv("BTJIT_BF16_KERNEL", "amx")
    cfg = gpt.GPTConfig(vocab_size=CFG.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=4)
    data = batches(3, B=4)
    prog = btjit.trace(gpt.loss_fn(cfg), gpt.init_params(cfg, np.random.default_rng(1)), *data[0],
                       optimizer=btjit.optim.AdamW(lr=1e-2), precision="bf16")
    assert any(e.startswith("k_matmul_amx") for e in prog.kernels.entries)
    np.savez(tmp_path / "b.npz", **{f"x{i}": x for i, (x, _) in enumerate(data)},
             **{f"y{i}": y for i, (_, y) in enumerate(data)})
    prog.export(tmp_path / "tiles")
    want = [prog.step(x, y) for x, y in data]
    got = run_fresh({"tiles": {"kind": "tensor", "dir": str(tmp_path / "tiles"), "batches": str(tmp_path / "b.npz"),
                               "steps": 3}})
    assert got["tiles"]["losses"] == want
    flags = json.loads((tmp_path / "tiles" / "manifest.json").read_text())["cpu_flags"]
    assert ("amx_tile" in flags and "amx_bf16" in flags) == amx.has_amx()
    src = _cpu_c({"features": ["avx2", "amx-tile", "amx-bf16"]})
    assert "syscall(158, 0x1023, 18)" in src and '__builtin_cpu_supports("amx-bf16")' in src
    (tmp_path / "cpu.c").write_text(src)
    subprocess.run(["cc", "-c", "-Wall", "-Werror", str(tmp_path / "cpu.c"), "-o", str(tmp_path / "cpu.o")], check=True)
