# btjit/rundir.py -- the run dir of `btjit train`: the checks before a run starts writing to it (a file in
# the way, --resume of a missing dir, a new run over old checkpoints), the lock that keeps it to one run at a
# time, and trimming metrics.jsonl on resume. The checkpoints themselves are btjit.train.checkpoint's.
#
# The lock: run_dir/train.lock, held with fcntl.flock(LOCK_EX | LOCK_NB) for the whole run and holding one
# JSON line {pid, host, started, argv} of the holder. A second run (or --resume) fails at once naming that
# process. The kernel drops a flock when its process dies however it dies (SIGKILL included), so a lock file
# left by a killed run is not held and the next run simply takes it over (saying whose it was). The file is
# not deleted (deleting it would let two runs lock two different files); a clean exit empties it. Only a run
# whose set-up fails in a dir it created itself removes the dir again (lock file and all: `abandon`).
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from btjit.train import checkpoint as ckpt_mod

LOCK_FILE = "train.lock"
CONFIG_FILE, CONFIG_HEADER = "config.toml", "# resolved config of this run, written by `btjit train`\n"


class RunDirError(Exception):
    """The run dir cannot be used; str(e) is one readable line. (btjit.train.trainer raises it as TrainError.)"""


class RunDirLock:
    """An exclusive lock on a run dir (see the module comment). acquire() raises RunDirError if another
    process holds it; `taken_over` is the holder record of a dead run whose lock this one took over."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd = None
        self.taken_over = None
        self.created = False            # prepare() made the run dir for this run

    def acquire(self) -> "RunDirLock":
        try:
            import fcntl
        except ImportError:             # not POSIX: no locking (documented in the README)
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot create the lock file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise RunDirError(f"run dir {self.path.parent} is in use by {holder}; lock file {self.path}. Wait "
                              f"for that run to end or stop it, or pass --out DIR for a new run") from None
        prev = _read(fd)
        if prev is not None and prev.get("pid") != os.getpid():
            self.taken_over = prev
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3),
                  "argv": _command()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)         # an empty lock file: nobody's
        except OSError:
            pass
        os.close(fd)                    # closing the only descriptor drops the flock

    def abandon(self) -> None:
        """Release after a failed set-up; a run dir this run created, holding nothing but the lock file, is
        removed (so a typo in a config leaves no empty run dir behind)."""
        d = self.path.parent
        if self.fd is not None and self.created and [p.name for p in d.iterdir()] == [LOCK_FILE]:
            self.path.unlink()          # while still held: a run that opened it meanwhile waits for the flock
            self.release()
            try:
                d.rmdir()
            except OSError:             # something appeared in it meanwhile: keep it
                pass
        self.release()

    def note(self) -> str | None:
        """A line for the log when this run took over a dead run's lock, else None."""
        if self.taken_over is None:
            return None
        return f"note: took over the run dir lock of {_describe(self.taken_over)}, which is no longer running"


def _command() -> list[str]:
    """This process's command line, with `python -m btjit.cli` (or the console script's path) as `btjit`."""
    argv = list(sys.argv) or ["?"]
    name = Path(argv[0]).name
    return ["btjit" if name in ("cli.py", "btjit", "__main__.py") else name] + argv[1:]


def _read(fd) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {}


def _describe(rec: dict | None) -> str:
    if not rec:
        return "another process (its lock file names none)"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["started"])) if "started" in rec else "?"
    cmd = " ".join(str(a) for a in rec.get("argv", []))
    cmd = cmd if len(cmd) <= 240 else cmd[:237] + "..."
    return f"process {rec.get('pid', '?')} on {rec.get('host', '?')} (started {when}" + \
        (f": {cmd})" if cmd else ")")


def prepare(run_dir: Path, resume: bool) -> RunDirLock:
    """Check the run dir, create it, and lock it for this run; returns the held lock."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--out {run_dir} is a file, not a directory")
    if resume and not run_dir.is_dir():
        raise RunDirError(f"--resume: run dir {run_dir} does not exist")
    own = run_dir / CONFIG_FILE               # a run writes its resolved config there: never over the user's file
    if own.is_file() and not own.read_text(encoding="utf-8", errors="replace").startswith(CONFIG_HEADER):
        raise RunDirError(f"run dir {run_dir} holds a {CONFIG_FILE} that btjit did not write, which a run would "
                          f"overwrite with its resolved config: give another --out DIR")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create run dir {run_dir}: {e.strerror}") from None
    lock = RunDirLock(run_dir).acquire()
    lock.created = created
    if not resume and ckpt_mod.list_checkpoints(run_dir):
        lock.release()
        last = ckpt_mod.list_checkpoints(run_dir)[-1]
        raise RunDirError(f"run dir {run_dir} already holds checkpoints (latest {last.name}); "
                          f"pass --resume to continue it, or --out DIR for a new run")
    return lock


def trim_metrics(path: Path, step: int) -> None:
    """On resume: drop log events after the checkpoint's step (they will be logged again). The trimmed log replaces
    the file by a rename: a crash meanwhile leaves it whole."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except (ValueError, AttributeError):
            pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)


def start_metrics(path: Path, resume_step: int | None, echo) -> None:
    """The metrics log as a run starts: with --resume, trimmed to the checkpoint's step (resume_step); a new run's
    starts empty, the log of an earlier run there (one that saved no checkpoint: prepare() refuses the others)
    moved aside to metrics.jsonl.N, not appended to."""
    if resume_step is not None:
        trim_metrics(path, resume_step)
    elif path.exists() and path.stat().st_size:
        n = 1
        while path.with_name(f"{path.name}.{n}").exists():
            n += 1
        os.replace(path, path.with_name(f"{path.name}.{n}"))
        echo(f"note: {path.parent} holds the log of an earlier run without checkpoints: moved it to {path.name}.{n}")
