# btjit/checkpoint.py -- checkpoints of a training run: one .npz file per checkpoint holding the
# program's state_dict (params, buffers, optimizer state, step counter), the step, the batch RNG state, the
# resolved config, the vocabulary and a format version, sealed by a sha256 over the whole payload.
# Files are written atomically (temp file in the same dir, flush + fsync, os.replace, fsync of the dir),
# so a process killed mid-write leaves the previous checkpoint intact. Loading verifies the checksum;
# latest_valid() falls back past corrupt files and reports them. Beside the last K there is best.npz, the
# checkpoint of the lowest val loss so far (save_best; the same format, not pruned, never resumed from:
# `btjit sample RUN_DIR` reads it). No model or compiler knowledge here.
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from btjit.train import files

FORMAT_VERSION = 1
PREFIX = "ckpt_"
NAME_RE = re.compile(r"^ckpt_(\d+)\.npz$")
TMP_RE = re.compile(r"^\.(?:ckpt_\d+|best)\.npz\.(\d+)\.tmp$")
BEST = "best.npz"
META_KEY, SUM_KEY, STATE = "__meta__", "__sha256__", "state/"


class CheckpointError(Exception):
    """An unreadable, corrupt, incompatible or unwritable checkpoint; str(e) is one readable line."""


class CorruptCheckpoint(CheckpointError):
    """The file is truncated, damaged or fails its checksum (latest_valid skips these)."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict                       # name -> np.ndarray, as given to save() (prog.state_dict())
    meta: dict = field(default_factory=dict)   # step, rng_state, config, vocab, format_version, ...

    @property
    def params(self) -> dict:
        """The model parameters: state entries 'param/<name>' -> {name: array}."""
        return {k[len("param/"):]: v for k, v in self.state.items() if k.startswith("param/")}

    @property
    def buffers(self) -> dict:
        """The model's buffers (running statistics...): state entries 'buffer/<name>' -> {name: array}."""
        return {k[len("buffer/"):]: v for k, v in self.state.items() if k.startswith("buffer/")}


def rng_state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state          # plain dict of ints and str: JSON-safe, exact


def rng_from_state(state: dict) -> np.random.Generator:
    bitgen = getattr(np.random, state["bit_generator"])()
    bitgen.state = state
    return np.random.Generator(bitgen)


def path_for(run_dir, step: int) -> Path:
    return Path(run_dir) / f"{PREFIX}{step:08d}.npz"


def _digest(meta_bytes: bytes, state: dict) -> str:
    h = hashlib.sha256()
    h.update(meta_bytes)
    for k in sorted(state):
        a = np.ascontiguousarray(state[k])
        h.update(f"\0{k}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, arrays: dict) -> None:
    """np.savez to a temp file beside `path`, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError):
            why = e.strerror or str(e)
            if e.errno == errno.ENOSPC:
                why = "no space left on device"
            raise CheckpointError(f"cannot write checkpoint {path}: {why}") from None
        raise
    _fsync_dir(path.parent)


def save(run_dir, step: int, state: dict, meta: dict, keep: int | None = None) -> Path:
    """Write checkpoint `ckpt_<step>.npz` in run_dir atomically; then keep only the newest `keep`."""
    path = _write(path_for(run_dir, step), step, state, meta)
    if keep:
        prune(run_dir, keep)
    return path


def save_best(run_dir, step: int, state: dict, meta: dict) -> Path:
    """Write run_dir/best.npz atomically (meta should hold the val loss that made it the best)."""
    return _write(Path(run_dir) / BEST, step, state, meta)


def _write(path: Path, step: int, state: dict, meta: dict) -> Path:
    state = {k: np.asarray(v) for k, v in state.items()}
    meta = dict(meta, step=int(step), format_version=FORMAT_VERSION, saved_at=time.time())
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    arrays = {STATE + k: v for k, v in state.items()}
    arrays[META_KEY] = np.frombuffer(meta_bytes, dtype=np.uint8)
    arrays[SUM_KEY] = np.frombuffer(_digest(meta_bytes, state).encode(), dtype=np.uint8)
    write_atomic(path, arrays)
    return path


def load(path) -> Checkpoint:
    """Read and verify one checkpoint. CorruptCheckpoint if damaged; CheckpointError if unusable."""
    path = Path(path)
    files.check_file(path, CheckpointError, f"checkpoint not found: {path}",
                     f"checkpoint path is a directory: {path} (give a ckpt_*.npz file)")
    try:
        arrays = files.npz_arrays(path)
    except Exception as e:  # zipfile / numpy raise many types on damaged input
        raise CorruptCheckpoint(f"checkpoint {path} is truncated or damaged "
                                f"({type(e).__name__}: {e})") from None
    if META_KEY not in arrays or SUM_KEY not in arrays:
        raise CorruptCheckpoint(f"{path} is not a btjit checkpoint (no metadata/checksum)")
    meta_bytes = arrays.pop(META_KEY).tobytes()
    want = arrays.pop(SUM_KEY).tobytes().decode("ascii", "replace")
    state = {k[len(STATE):]: v for k, v in arrays.items() if k.startswith(STATE)}
    if _digest(meta_bytes, state) != want:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: sha256 checksum mismatch")
    meta = json.loads(meta_bytes)
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}, newer than this "
                              f"btjit reads ({FORMAT_VERSION}); upgrade btjit")
    return Checkpoint(path, int(meta["step"]), state, meta)


def list_checkpoints(run_dir) -> list[Path]:
    """Checkpoint files of a run dir, oldest step first."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := NAME_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def prune(run_dir, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and temp files left by dead writers."""
    for p in list_checkpoints(run_dir)[:-keep]:
        try:
            p.unlink()
        except OSError:
            pass
    for p in Path(run_dir).iterdir():
        m = TMP_RE.match(p.name)
        if m and not _alive(int(m.group(1))):
            try:
                p.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def latest_valid(run_dir) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint that loads and verifies, plus (path, reason) of each newer one skipped.
    A checkpoint of a newer format version is an error, not skipped (falling back would lose work)."""
    skipped = []
    for p in reversed(list_checkpoints(run_dir)):
        try:
            return load(p), skipped
        except CorruptCheckpoint as e:
            skipped.append((p, str(e)))
    return None, skipped


def check_compatible(ckpt: Checkpoint, expected: dict, prefix: str = "") -> None:
    """Raise CheckpointError unless ckpt.state has exactly the names and shapes of `expected`
    (name -> shape or array), e.g. the state_dict of the program it is to be loaded into.
    With `prefix` (e.g. "param/"), only the entries whose names start with it are compared."""
    want = {k: tuple(np.shape(v)) for k, v in expected.items() if k.startswith(prefix)}
    have = {k: tuple(v.shape) for k, v in ckpt.state.items() if k.startswith(prefix)}
    if want == have:
        return
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    shape = [k for k in sorted(set(want) & set(have)) if want[k] != have[k]]
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
    if extra:
        parts.append(f"unexpected {', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else ""))
    if shape:
        k = shape[0]
        parts.append(f"{k} has shape {have[k]} but the model needs {want[k]}"
                     + (f" (+{len(shape) - 1} more)" if len(shape) > 1 else ""))
    raise CheckpointError(f"checkpoint {ckpt.path} is from another model: {'; '.join(parts)}")
