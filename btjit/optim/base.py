"""The optimizer API: `Optimizer` (hyper-parameters, `init`, `update`) and param groups.

An optimizer is a pair of functions written with btjit's tensor ops (optax's shape, torch.optim's names):
    init(name, param)                       -> {state name: initial numpy array}
    update(param, grad, state, hp, step)    -> (new_param, {state name: new value})
`update` is traced into the program after the backward and computes one param's step: param and grad are traced
values of the param's shape, each state value has the shape init gave it (the param's, or any other of at most
its size: Adafactor's row and column statistics; a number is one number, unless update makes it an array of the
param's shape; init runs with self.hp its param's group's values); `hp` maps each hyper-parameter to a traced
scalar read from the arena (so `prog.hp["beta1"] = 0.95` takes effect at the next step without recompiling) and
`step` is the traced step number (1 at the first step). Any op btjit traces
may be used -- reductions (LARS / LAMB trust ratios), matmuls and transposes (Muon), `if p.ndim == 2:` on the
shape -- and params may have states of other names. An elementwise rule that does not depend on the param's
shape runs as one fused pass per param group (btjit/optim/build.py, which does the tracing; this file holds no
graph code).
"""
from __future__ import annotations

import contextlib
import os
import re

import numpy as np

from btjit.graph.tracer import user_src

GROUP_KEYS = ("params", "lr_scale")      # a group's keys besides the optimizer's hyper-parameters
RESERVED = GROUP_KEYS + ("clip_norm", "clip_scale", "clip_value", "step")   # btjit's own slots (build.GLOBAL)


class OptimizerError(ValueError):
    """A bad optimizer definition, hyper-parameter or param group; str(e) names the problem."""


class UnknownHyperParameter(OptimizerError, KeyError):
    """`update` read hp[k] for a k the optimizer was not given (a KeyError too, as a dict's)."""
    __str__ = Exception.__str__


class HyperParams(dict):
    """The `hp` an update reads: a dict whose missing key is an error naming the optimizer and its keys."""

    def __init__(self, who, values):
        super().__init__(values)
        self.who = who

    def __missing__(self, k):
        raise UnknownHyperParameter(f"{self.who}.update reads hp[{k!r}], which is not a hyper-parameter of this "
                                    f"optimizer (it has {', '.join(sorted(self))}): pass it to "
                                    f"super().__init__({k}=...) — {user_src()}")


def defined_at(fn) -> str:
    """"file.py:line" where function fn is defined ("" for one without Python code)."""
    code = getattr(fn, "__code__", None)
    return "" if code is None else f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


class Optimizer:
    """Base of every optimizer. A subclass calls `super().__init__(lr=lr, beta=beta, ..., groups=groups)`
    with its hyper-parameters as numbers, and defines `init` (default: no state) and `update`.

    groups: None (one group of every param) or a list of dicts: "params" is a predicate on (name, shape), a
    list of names or a regex (matched against the whole name); the other keys override hyper-parameters
    for the group, plus "lr_scale" (the group's lr is lr * lr_scale). Every param must be in exactly one."""

    def __init__(self, groups=None, **hp):
        if "lr" not in hp:
            raise OptimizerError(f"{type(self).__name__}: an optimizer needs a learning rate, lr=...")
        for k in hp:
            if k in RESERVED:
                raise OptimizerError(f"{type(self).__name__}: {k!r} is reserved (param groups, clipping, the step "
                                     f"counter): name the hyper-parameter otherwise")
        self.hp = {k: hp_value(type(self).__name__, k, v) for k, v in hp.items()}
        if isinstance(self.hp["lr"], tuple):
            raise OptimizerError(f"{type(self).__name__}: lr must be one number, got {hp['lr']!r}")
        self.groups = _check_groups(type(self).__name__, groups, self.hp)

    def init(self, name: str, param: np.ndarray) -> dict:
        return {}

    def update(self, param, grad, state, hp, step):
        raise NotImplementedError(f"{type(self).__name__} must define update(param, grad, state, hp, step)")

    def hyper(self) -> dict:
        return dict(self.hp)

    def nonzero(self, name) -> bool:
        """Whether hyper-parameter `name` is non-zero for some group: the terms it scales are traced at all.
        While a program is traced, a False answer is recorded: prog.hp then refuses a non-zero value for it."""
        hp = self.hp if self._own_hp is None else self._own_hp
        on = bool(hp.get(name)) or any(g.get(name) for g in self.groups or ())
        if not on and getattr(self, "_zeros_asked", None) is not None:
            self._zeros_asked.add(name)
        return on

    _own_hp = None          # the optimizer's hyper-parameters while self.hp is a group's (in init)

    @contextlib.contextmanager
    def group_hp(self, hp: dict):
        """Inside (init is called so): self.hp is a param group's hyper-parameters as update's hp has them (the
        group's values, lr times lr_scale), as torch's state starts from group["lr"] (Rprop's step sizes)."""
        self._own_hp, self.hp = self.hp, {**{k: v for k, v in hp.items() if k != "lr_scale"},
                                          "lr": hp["lr"] * hp["lr_scale"]}
        try:
            yield
        finally:
            self.hp, self._own_hp = self._own_hp, None

    @contextlib.contextmanager
    def recording_zeros(self, into: set):
        """Inside: every hyper-parameter nonzero() answers False for is added to `into` (its terms are not traced)."""
        before, self._zeros_asked = getattr(self, "_zeros_asked", None), into
        try:
            yield into
        finally:
            self._zeros_asked = before

    def __repr__(self):
        hp = ", ".join(f"{k}={fmt(v)}" for k, v in self.hp.items())
        return f"{type(self).__name__}({hp}{f', {len(self.groups)} groups' if self.groups else ''})"


def hp_value(who, k, v):
    """A hyper-parameter's value: a float, or a tuple of floats (torch's betas=(0.9, 0.999)); else an error."""
    num = lambda x: not isinstance(x, bool) and isinstance(x, (int, float, np.floating, np.integer))  # noqa: E731
    if num(v):
        return float(v)
    if isinstance(v, (tuple, list)) and v and all(map(num, v)):
        return tuple(float(x) for x in v)
    raise OptimizerError(f"{who}: {k}={v!r} must be a number or a tuple of numbers (options that "
                         f"change the update's structure are attributes, not hp)")


def fmt(v) -> str:
    """A hyper-parameter's value as text: 0.001, or (0.9, 0.95) for a tuple."""
    return "(" + ", ".join(f"{x:g}" for x in v) + ")" if isinstance(v, tuple) else f"{v:g}"


def flat_hp(hp: dict) -> dict:
    """{slot name: value}: a tuple hyper-parameter k as slots k[0], k[1], ..."""
    out = {}
    for k, v in hp.items():
        out.update({f"{k}[{i}]": x for i, x in enumerate(v)} if isinstance(v, tuple) else {k: v})
    return out


def _check_groups(who, groups, hp):
    if groups is None:
        return None
    if not isinstance(groups, (list, tuple)) or not groups:
        raise OptimizerError(f"{who}: groups must be a non-empty list of dicts, got {groups!r}")
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise OptimizerError(f"{who}: group {i} must be a dict with a 'params' key, got {g!r}")
        if "lr" in g:
            raise OptimizerError(f"{who}: group {i} sets lr; a group scales the optimizer's: lr_scale = ...")
        bad = [k for k in g if k not in GROUP_KEYS and k not in hp]
        if bad:
            raise OptimizerError(f"{who}: group {i} has unknown key {bad[0]!r} (allowed: params, lr_scale, "
                                 f"{', '.join(k for k in hp if k != 'lr')})")
        for k, v in g.items():
            if k == "params":
                continue
            v = hp_value(f"{who}: group {i}", k, v)
            if k in hp and isinstance(v, tuple) != isinstance(hp[k], tuple) or \
                    isinstance(v, tuple) and len(v) != len(hp[k]):
                raise OptimizerError(f"{who}: group {i}: {k}={g[k]!r} must be of the form of the optimizer's "
                                     f"{k}={hp[k]!r}")
        out.append(dict(g))
    return out


def _matcher(i, sel):
    if callable(sel):
        return lambda name, shape: bool(sel(name, shape))
    if isinstance(sel, str):
        try:
            rx = re.compile(sel)
        except re.error as e:
            raise OptimizerError(f"group {i}: params regex {sel!r} is invalid: {e}") from None
        return lambda name, shape: rx.fullmatch(name) is not None
    if isinstance(sel, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in sel):
        names = set(sel)
        return lambda name, shape: name in names
    raise OptimizerError(f"group {i}: params must be a predicate on (name, shape), a list of names or a regex, "
                         f"got {sel!r}")


def resolve_groups(opt: Optimizer, params: dict, keep_empty=False) -> list:
    """[(names, hp)] per group, in group order: names in the params' order, hp the group's hyper-parameters
    (the optimizer's, overridden by the group's keys, with lr_scale). An error names a param that is in no
    group or in two, and a listed name that is not a param. A group matching no param is left out unless
    keep_empty (then its names are [], so entry i is the user's group i)."""
    shapes = {k: tuple(np.shape(v)) for k, v in params.items()}
    specs = opt.groups or [{"params": lambda n, s: True}]
    found = {}
    for i, g in enumerate(specs):
        sel = g["params"]
        if isinstance(sel, (list, tuple, set, frozenset)):
            missing = sorted(n for n in sel if isinstance(n, str) and n not in shapes)
            if missing:
                raise OptimizerError(f"group {i} lists {missing[0]!r}, which is not a parameter "
                                     f"(parameters: {', '.join(shapes)})")
        m = _matcher(i, sel)
        for name, shape in shapes.items():
            if m(name, shape):
                if name in found:
                    raise OptimizerError(f"parameter {name!r} is in two param groups ({found[name]} and {i}); "
                                         f"every parameter must be in exactly one")
                found[name] = i
        if isinstance(sel, str) and i not in found.values():
            raise OptimizerError(f"group {i}: params regex {sel!r} matches no parameter (it must match a whole "
                                 f"name; parameters: {', '.join(shapes)})")
    none = [n for n in shapes if n not in found]
    if none:
        raise OptimizerError(f"parameter {none[0]!r} (shape {shapes[none[0]]}) is in no param group"
                             + (f" (nor {len(none) - 1} more)" if len(none) > 1 else "") +
                             "; every parameter must be in exactly one")
    out = []
    for i, g in enumerate(specs):
        names = [n for n in shapes if found[n] == i]
        hp = {**opt.hp, **{k: hp_value("", k, v) for k, v in g.items() if k != "params"}}
        hp.setdefault("lr_scale", 1.0)
        if names or keep_empty:
            out.append((names, hp))
    return out


def decay_matrices(weight_decay=None) -> list:
    """nanoGPT's rule as groups: weight decay on params of >= 2 dims (matrices, embeddings), none on the
    others (biases, norm gains). weight_decay: the matrices' decay (default: the optimizer's)."""
    mats = {"params": lambda name, shape: len(shape) >= 2}
    if weight_decay is not None:
        mats["weight_decay"] = weight_decay
    return [mats, {"params": lambda name, shape: len(shape) < 2, "weight_decay": 0.0}]
