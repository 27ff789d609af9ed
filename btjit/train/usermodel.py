# btjit/usermodel.py -- the user's own model for `btjit train` ([model] kind = "python", file = "mymodel.py"),
# and the same handling for the user's own optimizer file ([optim] file = "myopt.py", kind "optimizer"):
# reading the model file (a self-contained Python file defining init_params(cfg, rng) -> dict, loss(p, x, y) and
# logits(p, x); loss and logits may take cfg as a last argument; optionally init_buffers(cfg) -> dict of
# buffers, which loss and logits see in p beside the params and update with btjit.assign), executing it as a
# module, checking the functions, the cfg namespace it is given, copying it into the run dir (--resume and
# `btjit sample` use that copy, or the source kept in each checkpoint), and turning an error raised in the user's code while building or
# tracing into ModelFileError: one line naming the file and line. The training itself is btjit.train.trainer's.
from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import linecache
import sys
import traceback
import types
from dataclasses import dataclass, fields
from pathlib import Path

from btjit.train import files

FUNCTIONS = ("init_params(cfg, rng)", "loss(p, x, y)", "logits(p, x)")
_COUNTER = itertools.count()


class ModelFileError(Exception):
    """A missing or broken model file, or an error in its code; str(e) is one readable line."""


@dataclass
class ModelFile:
    name: str                   # the file name, e.g. "mymodel.py" (its copy in the run dir has this name)
    source: str
    path: Path                  # where this source was read from (the user's file or the run dir's copy)
    module: types.ModuleType

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    def meta(self) -> dict:
        """What a checkpoint keeps of the model file: enough to sample from it anywhere."""
        return {"name": self.name, "sha256": self.sha256, "source": self.source}

    def copy_into(self, run_dir) -> Path:
        """Copy the source into the run dir; another file of its name is replaced only in a run dir (an earlier
        run's copy, its config.toml beside it), never in a dir of the user's own files."""
        dst = Path(run_dir) / self.name
        if not dst.exists() or dst.read_text(encoding="utf-8", errors="replace") != self.source:
            if dst.exists() and not (Path(run_dir) / "config.toml").is_file():
                raise ModelFileError(f"{dst} is another file than {self.path}, and a run keeps its copy of "
                                     f"{self.name} there: give another --out DIR")
            dst.write_text(self.source, encoding="utf-8")
        return dst


KEY = {"model": "model.file", "optimizer": "optim.file"}    # kind of user file -> its config key


def read(path, kind="model") -> ModelFile:
    """Read, execute and check the model file (or, kind "optimizer", the optimizer file: [optim] file) at
    `path`; ModelFileError names the problem."""
    p = Path(path)
    source = files.read_text(p, ModelFileError,
                             f"{kind} file not found: {p} ({KEY[kind]}, relative to the config file's dir)",
                             f"{KEY[kind]} is a directory, not a Python file: {p}",
                             f"{kind} file {p} is not UTF-8 text", f"cannot read {kind} file {p}")
    return from_source(p.name, source, p, kind)


def from_source(name: str, source: str, path, kind="model") -> ModelFile:
    """Execute `source` as the module of model file `name` (tracebacks and TraceErrors show `name:line`)."""
    path = Path(path)
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as e:
        raise ModelFileError(f"{name}:{e.lineno}: syntax error in the {kind} file: {e.msg} ({path})") from None
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    mod = types.ModuleType(f"btjit_user_{kind}_{next(_COUNTER)}")
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod            # dataclasses and pickling look the module up here
    with guard(name, str(path), f"executing the {kind} file"):
        exec(code, mod.__dict__)
    if kind != "model":
        return ModelFile(name, source, path, mod)
    missing = [f for f in FUNCTIONS if not callable(getattr(mod, f.split("(")[0], None))]
    if missing:
        raise ModelFileError(f"{name} does not define {' or '.join(missing)} ({path}); a model file defines "
                             f"{', '.join(FUNCTIONS)}")
    return ModelFile(name, source, path, mod)


def for_run(model_cfg, run_dir, resumed, echo) -> ModelFile | None:
    """The model file of a kind "python" run (else None): model.file for a new run; with `resumed` (the
    checkpoint --resume continues) the run dir's copy, saying so when model.file differs from it."""
    if model_cfg.kind != "python":
        return None
    return file_for_run(model_cfg.file, run_dir, resumed, echo)


def file_for_run(file, run_dir, resumed, echo, kind="model") -> ModelFile:
    """A user file of a run (the model's, or kind "optimizer": [optim] file): `file` for a new run, the run dir's
    copy (kept in checkpoints' meta as "<kind>_file") with --resume."""
    if resumed is None:
        return read(file, kind)
    saved = resumed.meta.get(f"{kind}_file") or {}
    copy = Path(run_dir) / saved.get("name", Path(file).name)
    if not copy.is_file():
        raise ModelFileError(f"--resume: the run's copy of the {kind} file, {copy}, is missing (the run uses it, "
                             f"not {file})")
    mf = read(copy, kind)
    if saved.get("sha256") not in (None, mf.sha256):
        echo(f"warning: {copy} was edited after {resumed.path.name} was written; resuming with it")
    try:
        edited = Path(file).read_text(encoding="utf-8") != mf.source
    except (OSError, UnicodeDecodeError):
        edited = True
    if edited:
        echo(f"note: resuming with the run's copy of the {kind} file, {copy} ({file} differs or is gone)")
    return mf


def from_checkpoint(ck, kind="model") -> ModelFile:
    """The model (or optimizer) file kept in a checkpoint's metadata (the source it was trained with)."""
    saved = ck.meta.get(f"{kind}_file")
    if not isinstance(saved, dict) or "source" not in saved or "name" not in saved:
        raise ModelFileError(f"checkpoint {ck.path} of a run with {KEY[kind]} has no {kind}_file entry")
    return from_source(saved["name"], saved["source"], Path(ck.path).parent / saved["name"], kind)


@contextlib.contextmanager
def guard(name: str, filename: str, what: str, own_only=False):
    """An exception raised while running the user's code becomes ModelFileError naming name:line; a TraceError
    already names the user's line. own_only: only an exception raised in this file's code (or naming its line)."""
    from btjit.graph.trace import TraceError
    try:
        yield
    except ModelFileError:
        raise
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
        if own_only and not frames and f" — {name}:" not in str(e):
            raise
        if isinstance(e, TraceError):
            raise ModelFileError(f"{name}: {what}: {e}") from None
        where = f"{name}:{frames[-1].lineno}" if frames else name
        raise ModelFileError(f"{where}: {what} raised {type(e).__name__}: {e}") from None


class ModelCfg(types.SimpleNamespace):
    """The cfg given to the user's functions: vocab_size, every [model] key (the built-in ones with their
    defaults, e.g. cfg.block_size, cfg.n_embd) and the user's own keys (cfg.my_key)."""

    def __getattr__(self, name):
        raise AttributeError(f"cfg has no key {name!r}: add it to [model] (cfg has {', '.join(vars(self))})")


def namespace(model_cfg, vocab_size: int) -> ModelCfg:
    d = {f.name: getattr(model_cfg, f.name) for f in fields(model_cfg) if f.name != "extra"}
    return ModelCfg(**d, **model_cfg.extra, vocab_size=vocab_size)


def _with_cfg(fn, n_args: int, cfg):
    """fn itself, or fn with cfg as its last argument when it takes one more than n_args."""
    try:
        params = inspect.signature(fn).parameters.values()
        n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    except (TypeError, ValueError):
        return fn
    if n != n_args + 1:
        return fn
    if n_args == 3:
        return lambda p, x, y: fn(p, x, y, cfg)
    return lambda p, x: fn(p, x, cfg)


def buffers_fn(mf: ModelFile, cfg):
    """The model file's init_buffers(cfg) as a () -> dict (checked as init_params' result), or None."""
    import numpy as np
    fn = getattr(mf.module, "init_buffers", None)
    if fn is None:
        return None

    def init_buffers():
        with guard(mf.name, str(mf.path), "init_buffers(cfg)"):
            bufs = fn(cfg)
        if not isinstance(bufs, dict) or not all(isinstance(k, str) and isinstance(v, np.ndarray) and
                                                 v.dtype.kind == "f" for k, v in bufs.items()):
            raise ModelFileError(f"{mf.name}: init_buffers(cfg) must return a dict of name -> numpy float array")
        return bufs
    return init_buffers


def functions(mf: ModelFile, cfg):
    """(init_params(rng) -> dict, loss(p, x, y), logits(p, x)) of the model file, its errors ModelFileError."""
    import numpy as np
    m = mf.module

    def init_params(rng):
        with guard(mf.name, str(mf.path), "init_params(cfg, rng)"):
            params = m.init_params(cfg, rng)
        if not isinstance(params, dict) or not params:
            raise ModelFileError(f"{mf.name}: init_params(cfg, rng) must return a non-empty dict of name -> numpy "
                                 f"float array, got {type(params).__name__}")
        for k, v in params.items():
            if not isinstance(k, str) or not isinstance(v, np.ndarray) or v.dtype.kind != "f":
                what = f"{type(v).__name__}" + (f" of {v.dtype}" if isinstance(v, np.ndarray) else "")
                raise ModelFileError(f"{mf.name}: init_params(cfg, rng) must return a dict of name -> numpy float "
                                     f"array; {k!r} is a {what}")
            if not np.isfinite(v).all():
                raise ModelFileError(f"{mf.name}: init_params(cfg, rng) returned {k!r} with non-finite values "
                                     f"(first at index {tuple(map(int, np.argwhere(~np.isfinite(v))[0]))})")
        return params
    return init_params, _with_cfg(m.loss, 3, cfg), _with_cfg(m.logits, 2, cfg)
