"""The rules a `btjit train` config must keep, beyond its keys' types (btjit/train/config.py reads the config and
calls `check`): the values each choice key takes (CHOICES), the keys that must be >= 1 or >= 0 and finite, and the
keys that go together (a model kind and its data format, bf16 and float32, the optimizer's tables, the LR
schedule). Each broken rule is one message naming the key. It imports nothing heavy."""
from __future__ import annotations

from pathlib import Path

MAKEMORE_KINDS = ("bigram", "makemore_mlp", "rnn", "gru", "bow", "transformer")   # btjit.models.makemore.KINDS

CHOICES = {
    ("model", "kind"): ("gpt", "nanogpt", "mlp", *MAKEMORE_KINDS, "python"), ("model", "activation"): ("relu", "gelu"),
    ("data", "format"): ("text", "lines", "words", "arrays"), ("train", "dtype"): ("float32", "float64"),
    ("train", "precision"): ("fp32", "bf16"),
    ("train", "on_nonfinite"): ("stop", "skip"),
    ("optim", "name"): ("sgd", "adam", "adamw", "adagrad", "adadelta", "rmsprop", "nadam", "radam", "adamax",
                        "lion"),   # btjit.optim.BUILTIN
    ("optim", "decay"): ("all", "matrices"),
    ("optim", "schedule"): ("constant", "cosine", "linear", "step"),   # btjit.train.schedule.SCHEDULES
    ("data", "corpus"): ("tinyshakespeare", "names", "pydoc", "digits"),  # btjit.train.data.CORPUS_NAMES; None allowed
    ("distributed", "compressor"): ("none", "topk", "randk"),
}
POSITIVE = {  # must be >= 1
    "model": ("n_layer", "n_head", "n_embd", "block_size", "context", "n_emb", "n_hidden", "n_embd2"),
    "train": ("steps", "batch_size", "grad_accum", "eval_batches", "sample_chars", "log_interval",
              "keep_checkpoints"),
}
NON_NEGATIVE = {"train": ("seed", "eval_interval", "sample_interval", "checkpoint_interval", "threads"),
                "optim": ("weight_decay", "clip_norm", "clip_value", "warmup_steps", "decay_steps", "lr_min",
                          "step_size")}


def check(cfg, bad) -> None:
    """Call bad(message) for the first rule cfg (a btjit.train.config.Config) breaks."""
    for (sec, key), allowed in CHOICES.items():
        v = getattr(getattr(cfg, sec), key)
        if v not in allowed and not (v is None and (sec, key) == ("data", "corpus")):
            bad(f"{sec}.{key} = {v!r} is not one of: {', '.join(allowed)}")
    for sec, keys in POSITIVE.items():
        for key in keys:
            if getattr(getattr(cfg, sec), key) < 1:
                bad(f"{sec}.{key} must be >= 1, got {getattr(getattr(cfg, sec), key)}")
    for sec, keys in NON_NEGATIVE.items():
        for key in keys:
            if not 0 <= (v := getattr(getattr(cfg, sec), key)) < float("inf"):     # NaN and inf too
                bad(f"{sec}.{key} must be >= 0{'' if v < 0 else ' and finite'}, got {v}")
    m, o = cfg.model, cfg.optim
    if m.kind in ("gpt", "nanogpt", "transformer") and m.n_embd % m.n_head != 0:
        bad(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    if cfg.train.precision == "bf16" and cfg.train.dtype != "float32":
        bad(f'train.precision = "bf16" needs train.dtype = "float32" (its products sum in float32), not '
            f'"{cfg.train.dtype}"')
    if not 0.0 <= cfg.model.dropout < 1.0:
        bad(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        bad(f"data.val_fraction must be between 0 and 1 (exclusive), got {cfg.data.val_fraction}")
    if cfg.data.format == "arrays" and m.kind != "python":
        bad(f'data.format = "arrays" needs model.kind = "python" (your model file), not "{m.kind}"')
    if m.kind == "mlp" and cfg.data.format != "lines":
        bad('model.kind = "mlp" needs data.format = "lines" (one word per line)')
    if m.kind in ("gpt", "nanogpt") and cfg.data.format != "text":
        bad(f'model.kind = "{m.kind}" needs data.format = "text"')
    for key, used, kinds in (("dropout", m.dropout != 0.0, ("gpt", "nanogpt", "python")),
                             ("bias", m.bias, ("nanogpt", "python"))):
        if used and m.kind not in kinds:
            which = " or ".join(f'"{k}"' for k in kinds[:-1])
            bad(f'model.{key} is only used with model.kind = {which} (this config has kind = "{m.kind}")')
    if m.kind in MAKEMORE_KINDS and cfg.data.format != "words":
        bad(f'model.kind = "{m.kind}" needs data.format = "words" (one word per line, makemore\'s (B, T) batches)')
    if m.kind == "python" and not m.file:
        bad('model.kind = "python" needs model.file, the path of your model file (e.g. file = "mymodel.py")')
    if m.kind != "python" and m.file is not None:
        bad(f'model.file is only used with model.kind = "python" (this config has kind = "{m.kind}")')
    if m.file and o.file and Path(m.file).name == Path(o.file).name:       # their copies in the run dir
        bad(f"model.file and optim.file are both named {Path(o.file).name}: their copies in the run dir would clash")
    if not o.lr > 0.0 or o.lr == float("inf"):
        bad(f"optim.lr must be a positive number, got {o.lr}")
    if not 0.0 <= o.momentum < 1.0:
        bad(f"optim.momentum must be in [0, 1), got {o.momentum}")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        bad(f"optim.betas must both be in [0, 1), got {list(o.betas)}")
    if not o.eps > 0.0:
        bad(f"optim.eps must be > 0, got {o.eps}")
    _validate_optim_tables(o, bad)
    _validate_schedule(cfg, bad)
    if not 0.0 < cfg.distributed.ratio <= 1.0:
        bad(f"distributed.ratio must be in (0, 1], got {cfg.distributed.ratio}")
    if cfg.data.path is not None and not cfg.data.path:
        bad("data.path is empty (leave it out to use data.corpus)")


def _validate_optim_tables(o, bad) -> None:
    """[optim.hp] takes numbers, booleans and lists of numbers; each [[optim.groups]] entry a params regex or
    list of names and numbers (the optimizer checks the names of both when it is built)."""
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    for k, v in o.hp.items():
        if not (num(v) or isinstance(v, bool) or isinstance(v, list) and all(map(num, v))):
            bad(f"optim.hp.{k} = {v!r}: takes a number, a boolean or a list of numbers")
    for i, g in enumerate(o.groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (str, list)):
            bad(f"optim.groups[{i}] needs params = a regex or a list of parameter names, got {g!r}")
        if isinstance(g["params"], list) and not all(isinstance(n, str) for n in g["params"]):
            bad(f"optim.groups[{i}].params: a list of parameter names (strings), got {g['params']!r}")
        for k, v in g.items():
            if k != "params" and not num(v):
                bad(f"optim.groups[{i}].{k} = {v!r}: must be a number")
    if o.groups and o.decay != "all":
        bad(f'optim.decay = "{o.decay}" and [[optim.groups]] both choose the groups: use one of them')


def _validate_schedule(cfg, bad) -> None:
    """The [optim] LR schedule must be possible (btjit.train.schedule.lr_at). A warm-up longer than the run is (a
    short run of a config, `--set train.steps=20`): the run ends within it, as nanoGPT's get_lr would."""
    o = cfg.optim
    if o.lr_min > o.lr:
        bad(f"optim.lr_min = {o.lr_min:g} must be <= optim.lr ({o.lr:g}): the schedule decays from lr to lr_min")
    if o.schedule != "constant" and o.decay_steps and o.decay_steps <= o.warmup_steps:
        bad(f"optim.decay_steps = {o.decay_steps} must be greater than optim.warmup_steps ({o.warmup_steps}) "
            f"(or 0 = train.steps): {o.schedule} decay starts after the warm-up")
    if o.schedule == "step" and o.step_size < 1:
        bad(f'optim.schedule = "step" needs optim.step_size >= 1 (the steps between two decays by gamma), got '
            f'{o.step_size}')
    if not o.gamma > 0:
        bad(f"optim.gamma = {o.gamma:g} must be > 0 (the step schedule's factor)")
