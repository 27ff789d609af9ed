# btjit/train/config.py -- the TOML run configuration of `btjit train`: typed dataclasses for the sections
# [model] [data] [train] [optim] (with [optim.hp], [[optim.groups]]) [distributed], loading with tomllib, `--set
# section.key=value` overrides, validation with one readable message per error (ConfigError; the rules in
# btjit/train/config_rules.py), and to_dict()/from_dict() for the run dir and checkpoints. The makemore kinds take
# makemore's sizes (and data.format "words") for the [model] keys left out; kind = "python" (the user's model file)
# keeps the user's own [model] keys in ModelConfig.extra.
# It holds no training logic and imports nothing heavy (no numpy, no numba).
from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from btjit.train import files
from btjit.train.config_rules import MAKEMORE_KINDS, check


class ConfigError(Exception):
    """A bad config file, key, value or override; str(e) is one readable line."""


@dataclass
class ModelConfig:
    kind: str = "gpt"              # "gpt" (paper E6), "nanogpt" (nanoGPT's model.py), "mlp" (paper E5),
    #                                makemore.py's MAKEMORE_KINDS, "python"
    n_layer: int = 6               # gpt, nanogpt, transformer: transformer blocks
    n_head: int = 6                # gpt, nanogpt, transformer: attention heads (head size = n_embd // n_head)
    n_embd: int = 24               # gpt, nanogpt, makemore kinds: embedding width
    block_size: int = 8            # gpt, nanogpt: context length T; makemore kinds: T >= the longest word + 1
    activation: str = "relu"       # gpt: FFN activation, "relu" or "gelu"
    bias: bool = False             # nanogpt: biases in the Linears and LayerNorms (nanoGPT's train.py: False)
    dropout: float = 0.0           # gpt, nanogpt: dropout while training, at nanoGPT's four sites (0 = none)
    context: int = 16              # mlp: characters of context (left-padded with '.')
    n_emb: int = 64                # mlp: embedding width per character
    n_hidden: int = 1024           # mlp: hidden units (tanh)
    n_embd2: int = 64              # makemore kinds: the hidden width (MLP, RNN/GRU state, BoW MLP)
    file: typing.Optional[str] = None   # python: the model file (relative to the config file's dir)
    extra: dict = field(default_factory=dict)   # python: the user's own [model] keys (flat in the TOML)


MAKEMORE_DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 64, "n_embd2": 64, "block_size": 16}   # makemore.py's
FORMAT_OF_KIND = {"gpt": "text", "nanogpt": "text", "mlp": "lines",
                  **{k: "words" for k in MAKEMORE_KINDS}}   # python: any format


@dataclass
class DataConfig:
    path: typing.Optional[str] = None   # a UTF-8 file (an .npz for "arrays"), relative to the config file's dir;
    #                                     None = the corpus below
    corpus: typing.Optional[str] = None  # bundled "tinyshakespeare", "names", "digits" (images), or "pydoc" (CPython's
    #                                      pydoc topics); None = tinyshakespeare for "text", names for "lines",
    #                                      digits for "arrays"
    val_fraction: float = 0.1           # tail fraction held out for validation
    format: str = "text"                # "text" (one stream of chars), "lines" or "words" (one word per line),
    #                                     "arrays" (an .npz of x/y arrays, or corpus "digits"; model.kind "python")


@dataclass
class TrainConfig:
    steps: int = 3000                   # optimizer steps (updates) to train for
    batch_size: int = 64                # sequences (or examples) per micro-batch
    grad_accum: int = 1                 # micro-batches of batch_size per update (gradient accumulation)
    seed: int = 1337                    # drives everything: init, batches, sampling
    dtype: str = "float32"              # "float32" or "float64"
    eval_interval: int = 250            # 0 = never (still evaluated at start and end)
    eval_batches: int = 20              # val batches averaged per evaluation
    sample_interval: int = 1000         # 0 = never
    sample_chars: int = 200             # characters per sample
    log_interval: int = 100             # steps between progress lines (and train events in metrics.jsonl)
    checkpoint_interval: int = 500      # 0 = only at the end
    keep_checkpoints: int = 3           # newest checkpoints kept in the run dir (best.npz apart)
    on_nonfinite: str = "stop"          # "stop" or "skip"
    threads: int = 0                    # threads the step may use; 0 = $BTJIT_NUM_THREADS or every core
    precision: str = "fp32"             # "fp32", or "bf16": matrix products on bf16-rounded operands, float32 sums


@dataclass
class OptimConfig:
    name: str = "sgd"                   # btjit.optim's: sgd adam adamw adagrad adadelta rmsprop nadam radam adamax lion
    #                                     (not with file)
    file: typing.Optional[str] = None   # your own optimizer: a Python file defining one btjit.optim.Optimizer
    #                                     subclass, called with lr= and the [optim.hp] keys (docs/guide.md)
    lr: float = 3e-4                    # peak learning rate (the schedule scales it per step)
    momentum: float = 0.0               # sgd, rmsprop
    weight_decay: float = 0.0           # decoupled (adamw, lion) or L2 (the others) weight decay
    betas: typing.Tuple[float, float] = (0.9, 0.999)   # adam, adamw, nadam, radam, adamax
    eps: float = 1e-8                   # adam, adamw, nadam, radam, adamax, rmsprop
    decay: str = "all"                  # "matrices": weight decay only on params of >= 2 dims (nanoGPT's rule)
    hp: dict = field(default_factory=dict)    # [optim.hp]: more arguments of the optimizer (nesterov = true ...)
    groups: list = field(default_factory=list)   # [[optim.groups]]: params = regex or [names], and its own
    #                                              hyper-parameters (weight_decay, lr_scale, ...)
    clip_norm: float = 0.0              # global gradient-norm clip; 0 = off
    clip_value: float = 0.0             # elementwise gradient clip to [-clip_value, clip_value]; 0 = off
    schedule: str = "constant"          # "constant", "cosine", "linear" (nanoGPT's get_lr) or "step" (torch's StepLR)
    warmup_steps: int = 0               # linear warm-up over the first steps (any schedule)
    decay_steps: int = 0                # cosine/linear: lr reaches lr_min at this step; 0 = train.steps
    lr_min: float = 0.0                 # cosine/linear: the final learning rate
    step_size: int = 0                  # step: the lr is multiplied by gamma every step_size steps (required)
    gamma: float = 0.1                  # step: the factor (torch's StepLR gamma)


@dataclass
class DistributedConfig:
    """Data-parallel training over MPI (`mpiexec -n N btjit train`); ignored in a single process."""
    compressor: str = "none"            # "none" (dense Allreduce), "topk" or "randk" (with EF21 error feedback)
    ratio: float = 0.01                 # topk/randk: fraction of the gradient entries sent per step


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optim"]["betas"] = list(d["optim"]["betas"])
        for sec, k in (("data", "path"), ("data", "corpus"), ("model", "file"), ("optim", "file")):   # no null in TOML
            if d[sec][k] is None:
                del d[sec][k]
        d["model"].update(d["model"].pop("extra"))      # the user's own keys, flat in [model]
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "Config":
        return _build(d, source)

    def to_toml(self) -> str:
        lines = []
        for sec, vals in self.to_dict().items():
            lines.append(f"[{sec}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in vals.items()]
            lines.append("")
        return "\n".join(lines)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "optim": OptimConfig,
            "distributed": DistributedConfig}
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else ("nan" if v != v else
                                                                 ("inf" if v > 0 else "-inf"))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):                     # an inline table ([optim.hp], [[optim.groups]])
        return "{" + ", ".join(f"{k if k.replace('_', '').replace('-', '').isalnum() else _toml_value(k)} = "
                               f"{_toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _type_name(tp) -> str:
    return {int: "integer", float: "number", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(key: str, tp, value):
    """Check `value` (parsed TOML) against the annotated type `tp`; return the stored value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):          # Optional[X]
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _coerce(key, inner, value)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} numbers, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    ok = (isinstance(value, int) and not isinstance(value, bool)) if tp is int else \
        (isinstance(value, (int, float)) and not isinstance(value, bool)) if tp is float else \
        isinstance(value, tp)
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return float(value) if tp is float else value


def _build(d: dict, source: str) -> Config:
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a table of sections")
    for sec in d:
        if sec not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{sec}]; allowed: {', '.join(SECTIONS)}")
    parts = {}
    for sec, cls in SECTIONS.items():
        vals = d.get(sec, {})
        if not isinstance(vals, dict):
            raise ConfigError(f"{source}: [{sec}] must be a table, got {vals!r}")
        vals = _kind_defaults(d, sec, vals)
        hints = {k: t for k, t in typing.get_type_hints(cls).items() if (sec, k) != ("model", "extra")}
        kwargs, extra = {}, {}
        if sec == "optim" and isinstance(vals.get("groups"), dict):    # [optim.groups.<name>] tables, in order
            vals = {**vals, "groups": list(vals["groups"].values())}
        for k, v in vals.items():
            if k not in hints and sec == "model" and vals.get("kind") == "python":
                extra[k] = _own_value(f"model.{k}", v, source)
                continue
            if k not in hints:
                hint = ' (your own keys need model.kind = "python")' if sec == "model" else ""
                raise ConfigError(f"{source}: unknown key {sec}.{k}; allowed in [{sec}]: "
                                  f"{', '.join(hints)}{hint}")
            try:
                kwargs[k] = _coerce(f"{sec}.{k}", hints[k], v)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        parts[sec] = cls(**kwargs, **({"extra": extra} if sec == "model" else {}))
    cfg = Config(**parts)
    validate(cfg, source)
    return cfg


def _kind_defaults(d: dict, sec: str, vals: dict) -> dict:
    """A makemore kind: makemore's sizes for the [model] keys left out, and data.format "words" if left out."""
    kind = d.get("model", {}).get("kind") if isinstance(d.get("model"), dict) else None
    if kind not in MAKEMORE_KINDS:
        return vals
    if sec == "model":
        return {**MAKEMORE_DEFAULTS, **vals}
    return {"format": "words", **vals} if sec == "data" else vals


def _own_value(key: str, v, source: str):
    """A value of the user's own [model] key (kind = "python"): a number, string, boolean or list of them."""
    ok = lambda x: isinstance(x, (bool, int, float, str)) or isinstance(x, list) and all(map(ok, x))  # noqa: E731
    if not ok(v):
        raise ConfigError(f"{source}: {key} = {v!r}: your own [model] keys take numbers, strings, booleans or "
                          f"lists of them, not a {type(v).__name__}")
    return v


def validate(cfg: Config, source: str = "config") -> None:
    """The rules a config must keep (btjit/train/config_rules.py): ConfigError naming the key otherwise."""
    def bad(msg):
        raise ConfigError(f"{source}: {msg}")
    check(cfg, bad)


def _parse_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:        # message already carries "(at line L, column C)"
        raise ConfigError(f"{source}: malformed TOML: {e}") from None


def parse_override(item: str) -> tuple[str, str, object]:
    """'train.steps=100' -> ('train', 'steps', 100); 'optim.hp.beta2=0.95' -> ('optim', 'hp.beta2', 0.95), a key
    of a table in the section. The value is a TOML value; a bare word that is not valid TOML (e.g.
    data.path=names.txt) is taken as a string."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    lhs, rhs = item.split("=", 1)
    lhs = lhs.strip()
    if lhs.count(".") < 1 or not all(lhs.split(".")):
        raise ConfigError(f"--set {item!r}: the key must be section.key (or section.table.key), e.g. train.steps")
    sec, key = lhs.split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return sec, key, value


def load(path, overrides=()) -> Config:
    """Read a TOML config file, apply `--set` overrides, validate; ConfigError on any problem. A relative
    model.file, optim.file or data.path is taken relative to the config file's directory (and stored absolute;
    a data.path found only in the current directory, or given with --set, is the current directory's)."""
    p = Path(path)
    text = files.read_text(p, ConfigError, f"config file not found: {p}",
                           f"config path is a directory, not a file: {p}", f"{p}: not a UTF-8 text file",
                           f"cannot read config {p}")
    d = _parse_toml(text, str(p))
    for item in overrides:
        sec, key, value = parse_override(item)
        if sec not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section [{sec}]; allowed: {', '.join(SECTIONS)}")
        *inner, last = key.split(".")
        path, table = [sec], d.setdefault(sec, {})
        for name in inner:
            if not isinstance(table, dict):
                break
            path, table = path + [name], table.setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(path)} is not a table in {p}")
        table[last] = value
    cfg = _build(d, str(p))
    for sec in (cfg.model, cfg.optim):
        if sec.file is not None:
            f = Path(sec.file).expanduser()
            sec.file = str(f if f.is_absolute() else (p.parent / f).resolve())
    set_keys = {parse_override(item)[:2] for item in overrides}
    if cfg.data.path and ("data", "path") not in set_keys:     # the file's data.path: relative to its dir, as
        f = Path(cfg.data.path).expanduser()                   # model.file (a path only the current dir holds
        here = p.parent / f                                    # still works); a --set one: to the current dir
        if not f.is_absolute() and (here.exists() or not f.exists()):
            cfg.data.path = str(here.resolve())
    return cfg


def loads(text: str, source: str = "<string>") -> Config:
    return _build(_parse_toml(text, source), source)
