"""The fused-chain interpreter's prefetch rule (gemm_rule.ew_stream): measured once per machine, carried in the row of
every chain reading more than fused.PF_STREAM bytes, never changing a result."""
import numpy as np
import pytest

import btjit
from btjit.kernels import gemm_rule
from btjit.kernels.common import ROWS
from btjit.kernels.entries import OPCODE

STREAM = 1 + ROWS["k_ew_program"].args.index("stream")


def test_the_measurement_picks_the_faster_way():
    stream, (streaming, not_streaming) = gemm_rule.measure_stream()
    assert streaming > 0 and not_streaming > 0
    assert stream == int(streaming < 0.95 * not_streaming)


def _program(n):
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=n).astype(np.float32)}
    x = rng.normal(size=n).astype(np.float32)
    return btjit.trace(lambda p, x: btjit.sum(p["w"] * x) ** 2, p, x, optimizer=btjit.optim.Lion(lr=1e-3), threads=1), x


def test_big_chains_carry_the_rule_and_compute_the_same_bits(monkeypatch):
    runs = []
    for rule in (1, 0):
        monkeypatch.setattr(gemm_rule, "_STREAM", [rule])
        prog, x = _program(1 << 20)             # Lion's update: w, its gradient and its moment, 12 MB
        rows = [r for r in prog.tape if r[0] == OPCODE["k_ew_program"]]
        assert max(r[STREAM] for r in rows) == rule and min(r[STREAM] for r in rows) == 0      # small chains: never
        for _ in range(3):
            prog.step(x)
        runs.append(prog.params["w"].copy())
    assert np.array_equal(*runs)
    prog = btjit.trace(lambda p, x: btjit.sum(p["w"] * x) ** 2, {"w": x}, x, optimizer=btjit.optim.Lion(lr=1e-3),
                       threads=1, _defer_kernels=True)     # btjit train's way: the entries loaded together, later
    assert min(r[STREAM] for r in prog.tape if r[0] == OPCODE["k_ew_program"]) == -1          # not set yet
    from btjit.kernels.library import LIBRARY
    prog.load_kernels(LIBRARY.ensure("f32", prog.tape[:, 0]))
    assert {r[STREAM] for r in prog.tape if r[0] == OPCODE["k_ew_program"]} == {0}            # the rule (patched: 0)
    monkeypatch.setattr(gemm_rule, "_STREAM", [])      # a small program never asks (nor measures)
    monkeypatch.setattr(gemm_rule, "measure_stream", lambda: pytest.fail("measured for a small program"))
    monkeypatch.setenv("BTJIT_EW_STREAM", "")
    prog, _ = _program(1000)
    assert all(r[STREAM] == 0 for r in prog.tape if r[0] == OPCODE["k_ew_program"]) and gemm_rule._STREAM == []


def test_the_environment_chooses(monkeypatch):
    for env, want in (("1", 1), ("0", 0)):
        monkeypatch.setattr(gemm_rule, "_STREAM", [])
        monkeypatch.setenv("BTJIT_EW_STREAM", env)
        assert gemm_rule.ew_stream() == want
    monkeypatch.setattr(gemm_rule, "_STREAM", [])
    monkeypatch.setenv("BTJIT_EW_STREAM", "2")
    with pytest.raises(ValueError, match="BTJIT_EW_STREAM must be 0 or 1"):
        gemm_rule.ew_stream()
