"""Reading the files a run is given (the config, the user's model and optimizer files, data, checkpoints): one
readable error per problem -- missing, a directory, unreadable, not UTF-8 -- raised as the caller's error class
with the caller's words; an .npz's arrays (npz_arrays), for data files and checkpoints alike.
"""
from __future__ import annotations

from pathlib import Path


def check_file(p: Path, error, missing: str, directory: str) -> None:
    """error(missing) if p does not exist, error(directory) if it is a directory."""
    if not p.exists():
        raise error(missing)
    if p.is_dir():
        raise error(directory)


def read_bytes(p: Path, error, missing: str, directory: str, unreadable: str) -> bytes:
    """p's bytes, after check_file; error(f"{unreadable}: {strerror}") if reading fails."""
    check_file(p, error, missing, directory)
    try:
        return p.read_bytes()
    except OSError as e:
        raise error(f"{unreadable}: {e.strerror}") from None


def read_text(p: Path, error, missing: str, directory: str, not_utf8: str, unreadable: str) -> str:
    """p's UTF-8 text, after check_file; error(not_utf8) if it is not UTF-8, error(f"{unreadable}: {strerror}")
    if reading fails."""
    check_file(p, error, missing, directory)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(not_utf8) from None
    except OSError as e:
        raise error(f"{unreadable}: {e.strerror}") from None


def npz_arrays(p: Path) -> dict:
    """The arrays of the .npz at p (no pickled objects). ValueError for a file that is not a zip (np.load would read
    an .npy or pickled data instead: say what it is); numpy's and zipfile's errors for a damaged one."""
    import numpy as np
    with open(p, "rb") as f:
        if f.read(2) != b"PK":
            raise ValueError("not an .npz (zip) file")
    with np.load(p, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
