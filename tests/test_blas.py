"""btjit/kernels/blas.py: the BLAS the GEMM kernels call -- OpenBLAS always, MKL where installed and measured
faster (or forced by $BTJIT_BLAS) -- computes the same products, and the choice is remembered."""
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_MKL = bool(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))

CHILD = r"""
import json, numpy as np, btjit
from btjit.kernels import blas
rng = np.random.default_rng(0)
out = {"choice": blas.CHOICE["name"]}
for dt in ("float32", "float64"):
    p = {"w": rng.normal(size=(96, 80)).astype(dt)}
    x = rng.normal(size=(200, 96)).astype(dt)                  # large enough for sgemm, not the micro-kernels
    f = btjit.trace(lambda p, x: btjit.sum(btjit.tanh(x @ p["w"])), p, x, grad=True, dtype=dt)
    v = f.value_and_grad(x)
    ref = np.tanh(x.astype(np.float64) @ p["w"].astype(np.float64))
    out[dt] = [abs(v - ref.sum()) / abs(ref.sum()),
               float(np.abs(f.grads["w"] - x.T.astype(np.float64) @ (1 - ref ** 2)).max())]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache dir for the module: the kernels compile once (they call whichever BLAS is bound, so they are
    the same for every choice); each test starts without a remembered choice (blas.json)."""
    return tmp_path_factory.mktemp("blas") / "cache"


def run(cache, blas=None, fresh=True):
    if fresh:
        (cache / "blas.json").unlink(missing_ok=True)
    env = dict(os.environ, BTJIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("BTJIT_BLAS", None)
    if blas:
        env["BTJIT_BLAS"] = blas
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("blas", ["openblas", pytest.param("mkl", marks=pytest.mark.skipif(
    not HAS_MKL, reason="the mkl wheel is not installed (pip install 'btjit[mkl]')"))])
def test_each_blas_computes_the_products(cache, blas):
    got, _ = run(cache, blas)
    assert got["choice"] == blas
    assert got["float32"][0] < 1e-5 and got["float32"][1] < 1e-3
    assert got["float64"][0] < 1e-12 and got["float64"][1] < 1e-10


def test_the_measured_choice_is_remembered(cache):
    got, _ = run(cache)
    saved = json.loads((cache / "blas.json").read_text()) if HAS_MKL else None
    if HAS_MKL:                             # measured once, then read back
        assert saved["choice"] == got["choice"] and sorted(saved["measured"]) == ["mkl", "openblas"]   # both tried
        (cache / "blas.json").write_text(json.dumps(dict(saved, choice="openblas")))
        assert run(cache, fresh=False)[0]["choice"] == "openblas"
    else:
        assert got["choice"] == "openblas"


def test_asking_for_a_missing_blas_warns_and_uses_openblas(cache):
    got, err = run(cache, "essl")
    assert got["choice"] == "openblas" and "BTJIT_BLAS='essl' is not installed here" in err


def test_a_measured_rule_is_set_by_the_first_process_to_write_it(tmp_path, monkeypatch):
    """Processes measuring at once on an empty cache all use the record the first one wrote (a process that
    kept its own choice of library computed other last bits than one loading the cache); a record made under
    another key (another CPU, other libraries) or an unreadable file is replaced."""
    from btjit.host.cachedir import remembered
    monkeypatch.setenv("BTJIT_CACHE_DIR", str(tmp_path))
    path = tmp_path / "rule.json"

    def other_process_writes_first():          # it finishes its measurement while this one measures
        path.write_text(json.dumps({"key": "k", "choice": "theirs"}))
        return {"choice": "mine"}
    assert remembered("rule.json", "k", other_process_writes_first)["choice"] == "theirs"
    assert remembered("rule.json", "k", lambda: {"choice": "later"})["choice"] == "theirs"
    assert remembered("rule.json", "k2", lambda: {"choice": "new cpu"})["choice"] == "new cpu"
    path.write_text("{not json")
    assert remembered("rule.json", "k2", lambda: {"choice": "again"})["choice"] == "again"
    assert json.loads(path.read_text()) == {"choice": "again", "key": "k2"}
    assert not list(tmp_path.glob("*.tmp*"))
