"""btjit's cache dir: $BTJIT_CACHE_DIR, else $XDG_CACHE_HOME/btjit, else ~/.cache/btjit (the kernel library,
the generated scalar code, the BLAS choice)."""
import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("BTJIT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "btjit"
