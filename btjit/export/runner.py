"""What a traced Program and an exported one (btjit.runtime) share: running a kernel tape over one arena.

`Runner` holds the per-step Python path -- the batch checks and their messages, the index-check flag, the
hyper-parameter slots (lr, `hp`: btjit/export/hyper.py), the optimizer state views and state_dict -- over attributes
its subclass sets (listed in the class docstring); `Named` and `Views` are the arena's named views (prog.params,
buffers, grads, outputs, opt_state[s]: assigning an entry copies into the arena). It imports numpy only:
`btjit.runtime` uses it without numba.
"""
from __future__ import annotations

import numpy as np

from btjit.export.hyper import HyperParams


class Named(dict):
    """A dict whose missing key is a KeyError naming it and the known keys: `where` is how the user wrote the dict
    (prog.grads, p), `noun` what its entries are (param, buffer, state)."""

    def __init__(self, entries, noun, where=None):
        super().__init__(entries)
        self._noun, self._where = noun, where or f"prog.{noun}s"

    def __missing__(self, name):
        known = ", ".join(map(str, self)) or "none"
        raise UnknownName(f"{self._where}[{name!r}]: no such {self._noun} (known: {known})")


class UnknownName(KeyError):
    """A missing key of a Named dict (a KeyError whose str is its message, not the message's repr)."""
    __str__ = Exception.__str__


class Views(Named):
    """A program's named arena views (prog.params, buffers, grads, outputs, opt_state[s]). `views[name] = array`
    (and views.update) copies the array's values into the arena, as torch's load_state_dict does (replacing the
    dict's entry would leave the program reading the old values); an unknown name or another shape is an error
    naming both; the names are the program's: deleting one is an error."""

    def __setitem__(self, name, value):
        if np.shape(value) != self[name].shape:      # self[name]: an unknown name is Named's error
            raise ValueError(f"{self._where}[{name!r}] = an array of shape {np.shape(value)}: the {self._noun} "
                             f"has shape {self[name].shape}")
        self[name][...] = value

    def update(self, other=(), **kw):
        for k, v in (other.items() if hasattr(other, "items") else other):
            self[k] = v
        for k, v in kw.items():
            self[k] = v

    def _fixed(self, *_):
        raise TypeError(f"{self._where} holds the program's {self._noun}s (views into its arena): none can be "
                        f"removed or added; assign values with {self._where}[name] = array")

    __delitem__ = pop = popitem = clear = setdefault = _fixed


def allowed(hi, ok) -> str:
    return f"in [0, {hi})" + (f" or {ok} (the ignore_index)" if ok is not None else "")


class Runner:
    """Subclasses set: a, ia (the float / int32 arenas), _in (input slot views), _in_types ((shape, dtype)
    per input as the caller passes it), input_names, _bounds ({input position: (upper bound, ignore value or
    None)}), _flag (the index-check flag's ia slot), _computed_checks (messages of checks on computed
    indices), _hyper ({name: a slot} of the global hyper-parameters: lr, clip_norm, clip_scale, clip_value,
    step), _group_hyper ([{name: a slot}] per param group), _out (the loss / output view), n_fwd, n_bwd, n_rows,
    has_optimizer, has_grad, has_assigns, params, buffers, _int_state (the ia key block: the step counter, then
    the index-check flag and the seed), _state ([(name, offset)] of optimizer state,
    params-span long), _span (params span length), _state_shapes ({state: {param: shape or None}} where a state's
    shape is not its param's, or the param has no such state) -- and implement _exec(stop, split)."""

    replicas = 1
    _state_shapes: dict = {}

    # ------------------------------------------------------------------ running
    def _load(self, batch):
        if len(batch) != len(self._in):
            raise TypeError(f"expected {len(self._in)} batch arguments ({', '.join(self.input_names)}), "
                            f"got {len(batch)}")
        i = 0
        for x, dst, (shape, dt) in zip(batch, self._in, self._in_types):    # (the per-step path: kept lean)
            if x.__class__ is not np.ndarray or x.dtype is not dt or x.shape != shape:
                x = self._convert(i, x)
            if self.replicas == 1:
                dst[...] = x
            else:
                self._store_shards(i, x)
            i += 1

    def _convert(self, i, x):
        """The slow path of _load: integer arrays of any int dtype are accepted; anything else must match."""
        x = np.asarray(x)
        shape, dt = self._in_types[i]
        if x.shape != shape or (x.dtype.kind in "iu") != (dt.kind == "i") or (dt.kind == "f" and x.dtype != dt):
            want = "int" if dt.kind == "i" else str(dt)
            raise ValueError(f"batch argument {i} ({self.input_names[i]}): expected {want} array of "
                             f"shape {shape}, got {x.dtype} {x.shape}")
        if dt.kind == "i" and x.dtype != dt and x.size:      # would wrap around in the int32 copy
            lo, hi = int(x.min()), int(x.max())
            if lo < np.iinfo(np.int32).min or hi > np.iinfo(np.int32).max:
                rng = allowed(*self._bounds[i]) if i in self._bounds else "in the int32 range"
                raise ValueError(f"batch argument {i} ({self.input_names[i]}): index values must be "
                                 f"{rng}, got min {lo} max {hi}")
        return x

    def _input_values(self, i):
        return self._in[i].ravel()

    def _clear_flag(self):
        self.ia[self._flag] = 0

    def _run_checked(self, stop, split=None):
        """Rows [0, stop) (split: where the update starts, for replicas); a failed index check raises."""
        self._exec(stop, split)
        if self.ia[self._flag]:
            for i, (hi, ok) in self._bounds.items():
                x = self._input_values(i)
                x = x[x != ok] if ok is not None else x
                if x.size and (x.min() < 0 or x.max() >= hi):
                    self._clear_flag()
                    hint = ("; torch's cross_entropy / nll_loss ignore -100 by default, btjit's only with "
                            "ignore_index=-100" if ok is None and x.min() == -100 else "")
                    raise ValueError(f"batch argument {i} ({self.input_names[i]}): index values must be "
                                     f"{allowed(hi, ok)}, got min {x.min()} max {x.max()}{hint}")
            self._clear_flag()
            raise ValueError("an integer index computed in the traced function is out of range: " +
                             "; ".join(self._computed_checks))

    def step(self, *batch) -> float:
        """Forward, backward, optimizer update and the buffers' assigns in one native call; returns the loss."""
        if not (self.has_optimizer or self.has_assigns):
            raise RuntimeError("this program was traced without an optimizer; use forward() or value_and_grad()")
        self._load(batch)
        self._run_checked(self.n_rows, self.n_bwd)
        return float(self._out)

    def value_and_grad(self, *batch) -> float:
        """Loss and gradients (in `grads`), no update."""
        if not self.has_grad:
            raise RuntimeError("this program computes no gradients: trace it with btjit.trace(..., grad=True) "
                               "(the default only with an optimizer)")
        self._load(batch)
        self._run_checked(self.n_bwd)
        self._tick()
        return float(self._out)

    def forward(self, *batch):
        """Evaluate the traced function: a float for a scalar output, else a copy of the output array."""
        self._load(batch)
        self._run_checked(self.n_fwd)
        self._tick()
        return float(self._out) if self._out.shape == () else self._out.copy()

    __call__ = forward

    _rng_ticks = False

    def _tick(self):
        """A program without an optimizer that draws random numbers counts its runs (new ones every call)."""
        if self._rng_ticks:
            self.ia[self._int_state] += 1

    # ------------------------------------------------------------------ state
    @property
    def lr(self) -> float:
        return float(self.a[self._lr_slot()])

    @lr.setter
    def lr(self, v):
        self.a[self._lr_slot()] = v

    def _lr_slot(self):
        if "lr" not in self._hyper:
            raise AttributeError("prog.lr: this program was traced without an optimizer, so it has no learning "
                                 "rate (pass optimizer= to btjit.trace)")
        return self._hyper["lr"]

    @property
    def last_step_skipped(self) -> bool:
        """True if the last step() found a non-finite gradient and skipped the update (skip_nonfinite)."""
        return bool(self._hyper) and bool(np.isnan(self.a[self._hyper["clip_scale"]]))

    @property
    def step_count(self) -> int:
        """The steps taken: the random numbers' step (btjit/kernels/rng.py), equal to the optimizer's step slot
        (the update copies that slot here: a skipped step counts in neither)."""
        return int(self.ia[self._int_state])

    @property
    def hp(self) -> "HyperParams":
        """The optimizer's hyper-parameters as arena slots: `prog.hp["beta1"] = 0.95` (every group),
        `prog.hp.groups[1]["weight_decay"]` (one group); read and written between steps, no recompiling."""
        return HyperParams(self)

    @step_count.setter
    def step_count(self, v: int):
        self.ia[self._int_state] = v
        if "step" in self._hyper:
            self.a[self._hyper["step"]] = v

    def _state_views(self):
        return {name: self.a[off:off + self._span] for name, off in self._state}

    @property
    def opt_state(self) -> dict:
        """{state name: {param name: its state}}: views into the arena (state j of a param lies (2 + j) params
        spans after it, of the param's shape or the one init gave it)."""
        base = self.a.__array_interface__["data"][0]
        out = Named({}, "optimizer state", "prog.opt_state")
        for j, (name, _) in enumerate(self._state):
            odd = self._state_shapes.get(name[len("opt/"):], {})
            views = {}
            for k, v in self.params.items():
                shape = odd.get(k, v.shape)
                if shape is not None:
                    o = (v.__array_interface__["data"][0] - base) // v.itemsize + (2 + j) * self._span
                    views[k] = self.a[o:o + int(np.prod(shape, dtype=np.int64))].reshape(shape)
            out[name[len("opt/"):]] = Views(views, "param", f"prog.opt_state[{name[len('opt/'):]!r}]")
        return out

    def state_dict(self) -> dict:
        d = {f"param/{k}": v.copy() for k, v in self.params.items()}
        d.update({f"buffer/{k}": v.copy() for k, v in self.buffers.items()})
        d.update({k: v.copy() for k, v in self._state_views().items()})
        if self._state:
            d["opt/order"] = self._state_order()
        d["opt/step"] = np.array(self.step_count, np.int64)
        if "step" in self._hyper:
            d["opt/hyper"] = self.a[self._hyper_slots()].astype(np.float64)
        return d

    def _state_order(self) -> np.ndarray:
        """Where each param's state lies in the opt/ blocks: the arena rank of each param, by sorted name."""
        at = sorted(self.params, key=lambda k: self.params[k].__array_interface__["data"][0])
        return np.array([at.index(k) for k in sorted(self.params)], np.int64)

    def _hyper_slots(self):
        """The slots of every hyper-parameter a user may set (as torch keeps them in its param_groups)."""
        return sorted(o for k, o in [*self._hyper.items(), *(kv for s in self._group_hyper for kv in s.items())]
                      if k not in ("step", "clip_scale"))

    def load_state_dict(self, d: dict):
        """Load what state_dict() returned (of a program of the same model: any batch size, threads or dtype --
        the values are cast). Every param and buffer must be there with its shape; the optimizer's state must be
        there whole or not at all (a dict of params only, e.g. a forward program's, leaves it as it is); a
        param/, buffer/ or (with an optimizer) opt/ name the program does not have is an error naming it."""
        state = self._state_views()
        known = {f"param/{k}" for k in self.params} | {f"buffer/{k}" for k in self.buffers} | set(state) | \
            {"opt/step", "opt/hyper", "opt/order"}
        prefixes = ("param/", "buffer/", "opt/") if self.has_optimizer else ("param/", "buffer/")
        extra = sorted(k for k in d if isinstance(k, str) and k.startswith(prefixes) and k not in known)
        if extra:
            raise ValueError(f"the state dict has {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}, which "
                             f"this program does not (another model or optimizer?); it has: {', '.join(sorted(known))}")
        if state and "opt/order" in d and not np.array_equal(d["opt/order"], self._state_order()):
            raise ValueError("the optimizer state was saved from a program holding the params in another order (a "
                             "params dict in another order, or other param groups): each param's state would land on "
                             "another's; trace this program with the params dict in the order of the saving one")
        missing = [k for k in state if k not in d]
        if missing and len(missing) < len(state):
            raise ValueError(f"optimizer state {missing[0]!r}: the state dict has "
                             f"{', '.join(k for k in state if k in d)} but not {', '.join(missing)}")
        for kind, views in (("param", self.params), ("buffer", self.buffers)):
            for k, v in views.items():
                if f"{kind}/{k}" not in d:
                    raise ValueError(f"{kind} {k!r}: the state dict has no {kind}/{k}")
                src = np.asarray(d[f"{kind}/{k}"])
                if src.shape != v.shape:
                    raise ValueError(f"{kind} {k!r}: the state dict has shape {src.shape}, the program {v.shape}")
        for k, v in state.items():
            if k in d and np.shape(d[k]) != v.shape:
                raise ValueError(f"optimizer state {k!r}: the state dict has shape {np.shape(d[k])}, the program "
                                 f"{v.shape} (another model, or params in another order or groups?)")
        if "opt/hyper" in d and "step" in self._hyper and np.shape(d["opt/hyper"]) != (len(self._hyper_slots()),):
            raise ValueError(f"opt/hyper: the state dict has {np.size(d['opt/hyper'])} hyper-parameters, the "
                             f"program {len(self._hyper_slots())} (another optimizer or other param groups)")
        for kind, views in (("param", self.params), ("buffer", self.buffers)):   # checked: nothing half loaded
            for k, v in views.items():
                v[...] = d[f"{kind}/{k}"]
        for k, v in state.items():
            if k in d:
                v[...] = d[k]
        if "opt/step" in d:
            self.step_count = int(d["opt/step"])
        if "opt/hyper" in d and "step" in self._hyper:
            self.a[self._hyper_slots()] = d["opt/hyper"]

    @property
    def n_params(self) -> int:
        return int(sum(v.size for v in self.params.values()))
