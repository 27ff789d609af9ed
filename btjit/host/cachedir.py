"""btjit's cache dir: $BTJIT_CACHE_DIR, else $XDG_CACHE_HOME/btjit, else ~/.cache/btjit (the kernel library,
the generated scalar code, the measured rules), and `remembered`, the one way a measured choice is kept there."""
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("BTJIT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "btjit"


def remembered(name: str, key: str, measure) -> dict:
    """The record in the cache dir's file `name` if it was made under `key` (the CPU, the libraries...);
    else measure() -> a dict, written there. The first process to write a record for a key sets it for all:
    a process that measured at the same time as another adopts the record on disk, so processes racing
    on an empty cache compute alike (a choice of kernel or library changes the last bits of results)."""
    path = cache_dir() / name
    saved = _read(path)
    if saved is not None and saved.get("key") == key:
        return saved
    record = dict(measure(), key=key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        try:
            if saved is not None:                  # a stale record (another key): replaced
                os.replace(tmp, path)
            else:
                os.link(tmp, path)                 # fails if another process wrote first
        except FileExistsError:
            won = _read(path)
            record = won if won is not None and won.get("key") == key else record
        finally:
            if tmp.exists():
                tmp.unlink()
    except OSError:
        pass
    return record


def _read(path):
    try:
        saved = json.loads(path.read_text())
        return saved if isinstance(saved, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
