"""The optimizer an [optim] config section describes (`btjit train`, `btjit export`): a built-in by name with
the section's keys it takes, or the one Optimizer subclass of the user's optimizer file, with [optim.hp] and
the param groups (decay = "matrices" or [[optim.groups]]). The section is read by attribute (btjit.config's
OptimConfig); nothing here imports the application.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from btjit.optim.base import Optimizer, OptimizerError, decay_matrices
from btjit.optim.builtin import SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, Lion, NAdam, RAdam, RMSprop

BUILTIN = {c.__name__.lower(): c for c in (SGD, Adam, AdamW, Adagrad, Adadelta, RMSprop, NAdam, RAdam, Adamax, Lion)}
# the [optim] keys each built-in takes besides lr (the others keep the optimizer's own defaults)
SECTION_KEYS = {"sgd": ("momentum", "weight_decay"), "adam": ("betas", "eps", "weight_decay"),
                "adamw": ("betas", "eps", "weight_decay"), "adagrad": ("weight_decay",),
                "adadelta": ("weight_decay",), "rmsprop": ("eps", "momentum", "weight_decay"),
                "nadam": ("betas", "eps", "weight_decay"), "radam": ("betas", "eps", "weight_decay"),
                "adamax": ("betas", "eps", "weight_decay"), "lion": ("weight_decay",)}


def optimizer_class(module) -> type:
    """The one btjit.optim.Optimizer subclass a user's optimizer file (an executed module) defines."""
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Optimizer) and
             c.__module__ == module.__name__]
    if len(found) != 1:
        names = f" ({', '.join(c.__name__ for c in found)})" if found else ""
        raise OptimizerError(f"{Path(module.__file__).name} must define one btjit.optim.Optimizer subclass, "
                             f"found {len(found)}{names}")
    return found[0]


def from_section(o, module=None, guard=contextlib.nullcontext) -> Optimizer:
    """The optimizer of section `o`: built-in o.name, or (module: the user's optimizer file) its class called
    with lr, weight_decay when not 0 and [optim.hp]. guard(): a context around the user's code. A bad argument
    is an OptimizerError."""
    if module is None:
        cls, kw = BUILTIN[o.name], {k: getattr(o, k) for k in SECTION_KEYS[o.name]}
    else:
        cls, kw = optimizer_class(module), ({"weight_decay": o.weight_decay} if o.weight_decay else {})
    kw = {"lr": o.lr, **kw, **{k: tuple(v) if isinstance(v, list) else v for k, v in o.hp.items()}}
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    groups = decay_matrices() if o.decay == "matrices" else [dict(g) for g in o.groups]
    if groups:
        kw["groups"] = groups
    try:
        with guard():
            return cls(**kw)
    except TypeError as e:
        import inspect
        try:
            takes = [n for n in inspect.signature(cls).parameters if n not in ("self", "groups", "kwargs")]
        except (TypeError, ValueError):
            takes = []
        bad = [k for k in o.hp if takes and k not in takes]
        if bad:
            raise OptimizerError(f"optim.hp.{bad[0]}: {cls.__name__} takes no argument {bad[0]!r} (its arguments: "
                                 f"{', '.join(takes)})") from None
        raise OptimizerError(f"{cls.__name__}: {e}") from None
