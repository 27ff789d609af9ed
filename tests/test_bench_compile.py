"""`btjit bench --suite compile` (btjit/bench/compile_suite.py): the child of the cheapest program (P6, the
tanh RNN) on an empty cache dir compiles kernel entries, the same child again compiles none and returns
the same first-step loss, and the table names the program. No timing assertions."""
import math

import pytest

from btjit.bench import compile_suite as C


@pytest.mark.slow        # two cold compiles of P6 (~45 s); the cache's cold/cached paths are in test_cache.py
def test_p6_cold_then_cached(tmp_path):
    cold = C.measure("P6", tmp_path / "cache")
    assert cold["status"] == "ok", cold["status"]
    assert len(cold["compiled"]) > 0
    assert cold["cache_dir"] == str(tmp_path / "cache")
    assert abs(cold["loss"] - math.log(27)) < 0.2             # ~ln(vocab) at init
    cached = C.measure("P6", tmp_path / "cache")
    assert cached["status"] == "ok", cached["status"]
    assert cached["compiled"] == []
    assert cached["loss"] == cold["loss"]
    assert cached["entries"] == cold["entries"]
    row = dict(program="P6", title=C.PROGRAMS["P6"][0], cold=cold, cached=cached, warm=None,
               jax=dict(status="n/a (jax not installed)"))
    table = C.format_table([row], machine=False)
    assert "P6" in table and C.PROGRAMS["P6"][0] in table
    assert f"({len(cold['compiled'])})" in table and "(0)" in table


def test_format_table_errors_and_cli_row():
    rows = [dict(program="P2", title="x", cold=dict(status="error: rc 1: boom"), cached=None, warm=None, jax=None),
            dict(program="CLI", title="train", cold=dict(status="ok", wall_s=3.0, compile_s=1.5),
                 cached=dict(status="ok", wall_s=1.0, compile_s=None), warm=None, jax=None)]
    table = C.format_table(rows, machine=False)
    assert "error: rc 1: boom" in table and "3.00 (compile 1.50)" in table
