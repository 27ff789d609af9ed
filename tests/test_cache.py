"""The executor's on-disk cache: a second process loads it (asserted through numba's cache-hit counter, not a
time); a corrupted cache file or an unwritable cache dir degrades to compiling, with a warning and the same
result."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, warnings
    import numpy as np, btjit
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = {"w": np.arange(6.0).reshape(2, 3)}
        prog = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(x @ p["w"])), p, np.ones((4, 2)), dtype="float64",
                           grad=True)
        v = prog.value_and_grad(np.ones((4, 2)))
    print(json.dumps({"value": v, "grad": prog.grads["w"].tolist(), "hit": prog.executor.cache_hit,
                      "warnings": [str(x.message) for x in w if "btjit" in str(x.message)]}))
""")


def _run(cache_dir):
    env = dict(os.environ, BTJIT_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_from_disk_cache_and_survives_corruption(tmp_path):
    first = _run(tmp_path)
    assert not first["hit"] and not first["warnings"]
    assert any(f.name.endswith(".nbi") for f in (tmp_path / "__pycache__").iterdir())
    second = _run(tmp_path)
    assert second["hit"] and second["value"] == first["value"] and second["grad"] == first["grad"]
    for f in (tmp_path / "__pycache__").iterdir():          # corrupt every cache file
        f.write_bytes(b"\x00garbage" * 7)
    third = _run(tmp_path)
    assert third["value"] == first["value"] and third["grad"] == first["grad"]
    assert any("unusable" in w for w in third["warnings"])
    fourth = _run(tmp_path)                                  # the corrupt entry was replaced
    assert fourth["hit"] and fourth["value"] == first["value"]


def test_unwritable_cache_dir_compiles_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = _run(blocker / "cache")
    assert not res["hit"] and any("not writable" in w for w in res["warnings"])
    assert abs(res["value"] - 11.9798491796) < 1e-9
