"""`prog.hp`: a program's hyper-parameters as arena slots (btjit/export/runner.py's Runner.hp), by name for every
param group at once or per group (hp.groups[i]), with torch's tuple names (betas) and 1 - x slots kept in step;
changing one needs no recompiling. numpy only (btjit.runtime uses it)."""
from __future__ import annotations

import numpy as np


class HyperParameterError(ValueError):
    """A hyper-parameter that prog.hp cannot set (its terms are not in the traced step); str(e) says why."""


class HyperParams:
    """prog.hp: the global slots (lr, clip_norm, clip_value) and each group's (the optimizer's hyper-parameters,
    lr_scale). hp[name] reads a global slot, or a group slot equal in every group; hp[name] = v writes it
    (in every group); hp.groups[i] is the view of the user's group i ({name: value}). A hyper-parameter whose
    terms were not traced (0 in every group, or clipping not asked for) reads 0 and takes only 0."""

    def __init__(self, prog):
        self._a, self._g = prog.a, prog._hyper
        untraced = frozenset(prog._hp_untraced)
        self.groups = _Groups(_Slots(prog.a, s, i, untraced) for i, s in enumerate(prog._group_hyper))
        self._untraced = untraced

    def _slots(self, name):
        if name in self._g and name not in ("clip_scale", "step"):
            return [self._g[name]]
        got = [s._s[name] for s in self.groups if name in s._s]
        if not got:
            raise KeyError(f"no hyper-parameter {name!r} (this program has: {', '.join(self.keys())})")
        return got

    def keys(self):
        first = next((s._s for s in self.groups if s._s), {})
        return [k for k in self._g if k not in ("clip_scale", "step")] + \
            [k for k in first if k not in self._g and not k.startswith("1-")]

    def __getitem__(self, name):
        parts = _parts(name, self.keys())
        if parts:
            return tuple(self[k] for k in parts)
        vals = {float(self._a[o]) for o in self._slots(name)}
        if len(vals) > 1:
            raise KeyError(f"hyper-parameter {name!r} differs between param groups ({sorted(vals)}): "
                           f"read it as hp.groups[i][{name!r}]")
        return vals.pop()

    def __setitem__(self, name, value):
        if _set_parts(self, name, value, self.keys()):
            return
        self._slots(name)                          # a KeyError naming what there is
        _check_traced(name, value, self._untraced)
        if name in self._g:
            self._a[self._g[name]] = value
        for s in self.groups:
            if name in s._s:
                s[name] = value

    def __contains__(self, name):
        return name in self.keys()

    def __repr__(self):
        return "{" + ", ".join(f"{k!r}: {self._a[self._slots(k)[0]]:g}" for k in self.keys()) + "}"


class _Groups(list):
    """hp.groups: indexed as the user declared the param groups; an index past them is an IndexError naming how
    many there are."""

    def __getitem__(self, i):
        try:
            return super().__getitem__(i)
        except IndexError:
            raise IndexError(f"hp.groups[{i}]: this program has {len(self)} param group"
                             f"{'' if len(self) == 1 else 's'} (indices 0 to {len(self) - 1})") from None


def _check_traced(name, value, untraced):
    """An error if `name`'s terms are not in the step (it was 0 when traced, or clipping was not asked for) and
    value is not 0: the step would ignore it."""
    if name not in untraced or not np.any(np.asarray(value, np.float64)):
        return
    if name in ("clip_norm", "clip_value"):
        raise HyperParameterError(f"prog.hp[{name!r}] = {value!r}: the program was traced without {name}, so the "
                                  f"step does no such clipping and the value would be ignored; pass {name}= to "
                                  f"btjit.trace (it can then be changed here)")
    raise HyperParameterError(f"prog.hp[{name!r}] = {value!r}: the program was traced with {name} = 0 (in every "
                              f"param group), so its term is not in the step and the value would be ignored; "
                              f"trace the optimizer with a nonzero {name} (e.g. {name}=1e-12) to change it later")


class _Slots:
    def __init__(self, a, slots, index=0, untraced=frozenset()):
        self._a, self._s, self._i, self._untraced = a, slots, index, untraced

    def _empty(self, name):
        raise KeyError(f"hp.groups[{self._i}][{name!r}]: param group {self._i} matches no parameter, so it has no "
                       f"hyper-parameters (its selector selects none of the program's params)")

    def __getitem__(self, name):
        if not self._s:
            self._empty(name)
        parts = _parts(name, self._s)
        if parts:
            return tuple(self[k] for k in parts)
        if name not in self._s or name.startswith("1-"):
            self._unknown(name)
        return float(self._a[self._s[name]])

    def _unknown(self, name):
        raise KeyError(f"no hyper-parameter {name!r} in this param group (it has: "
                       f"{', '.join(k for k in self._s if not k.startswith('1-'))})")

    def __setitem__(self, name, value):
        if not self._s:
            self._empty(name)
        if _set_parts(self, name, value, self._s):
            return
        if name not in self._s or name.startswith("1-"):
            self._unknown(name)
        _check_traced(name, value, self._untraced)
        self._a[self._s[name]] = value
        if "1-" + name in self._s:                 # 1 - value in float64 (btjit/optim/near_one.py)
            self._a[self._s["1-" + name]] = 1.0 - float(value)

    def __repr__(self):
        return repr({k: float(self._a[o]) for k, o in self._s.items() if not k.startswith("1-")})


def _parts(name, keys) -> list:
    """The slots name[0], name[1], ... of a tuple hyper-parameter (torch's betas) among keys; [] for a number."""
    return [] if name in keys else [k for k in keys if k.startswith(name + "[")]


def _set_parts(hp, name, value, keys) -> bool:
    """hp[name] = value for a tuple hyper-parameter, one slot per number; False if name is not one."""
    parts = _parts(name, keys)
    if not parts:
        return False
    if len(value) != len(parts):
        raise ValueError(f"hyper-parameter {name!r} holds {len(parts)} numbers, got {value!r}")
    for k, v in zip(parts, value):
        hp[k] = v
    return True
