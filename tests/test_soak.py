"""The soak (issue 5): scripts/soak.py trains the paper's GPT at batch size 1 through the real training loop
and fails if the resident set size grows after warm-up. CI runs the short form (3,000 steps); the long form
is `python scripts/soak.py` (20,000 steps, RSS every 1,000). Also checks that the check itself catches a
leak (a hidden option that leaks 2 KB per step). No timing assertions."""
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def soak(tmp_path, *args):
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--steps", "3000", "--every", "500",
                        "--warmup", "1000", "--quiet", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=900, env=env)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_short_soak_rss_does_not_grow(tmp_path):
    r, res = soak(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert res["ok"] and res["steps"] == 3000
    assert [s for s, _ in res["samples"]] == [500, 1000, 1500, 2000, 2500, 3000]
    assert res["growth_mb"] <= res["max_growth_mb"]
    assert r.stdout.strip().splitlines()[-1].startswith("soak: OK: 3000 steps at batch 1")


def test_soak_detects_a_leak(tmp_path):
    r, res = soak(tmp_path, "--leak-bytes-per-step", "2048")
    assert r.returncode == 1, r.stdout + r.stderr
    assert not res["ok"] and res["growth_mb"] > 2.0
    assert r.stdout.strip().splitlines()[-1].startswith("soak: FAIL:")
