"""From an `Optimizer` to equations of the program's graph (btjit.trace calls this; it is not user API).

`Update(opt, params)` resolves the param groups (the arena orders the params group by group, so each group
is one contiguous slice of the params, grads and state regions), calls `init` for the initial state and lays
out the hyper-parameter slots: GLOBAL first, then one block per group. `trace_into(graph)` appends, after
the backward, the step counter's increment and `opt.update` traced for each group over graph.regions (slices
of the params, grads and state regions, the slots), then assigns each new value to the place it replaces
(graph.assigns, the mechanism of btjit.assign).

A group's update is traced one of two ways. Group mode, the fast path: once over the group's slices, flat
vectors of its length (alignment padding included), which gives every param what its own trace would when the
rule is elementwise and blind to the param's shape -- the group's trace must be elementwise and have the same
equations as a trace at each of its params' shapes (made and rolled back first). Otherwise param mode: once
per param, over its own slices (region ("slice", k, name)) at its real shapes and its state's, so any traced
op may be used: reductions (LARS / LAMB trust ratios), matmuls and transposes (Muon), a state of another shape
(Adafactor's row and column statistics). Such a state lies at the start of its slot: state j of param k is at
param_off[k] + (2 + j) * params span, whatever its shape (at most the param's size), so state_dict, checkpoints
and exports keep it as they keep the others. btjit/optim/inplace.py's `assign_in_place` (after fusion) computes
each new value straight into its place where that is safe.
"""
from __future__ import annotations

import contextlib

import numpy as np

from btjit.graph import state as S, trace as T
from btjit.graph.fuse_ew import ALIAS
from btjit.graph.lower import lower_eqns
from btjit.graph.memory import _al

from btjit.optim.base import HyperParams, Optimizer, OptimizerError, defined_at, flat_hp, resolve_groups
from btjit.optim.builtin import one_pass
from btjit.optim.inplace import ELEMENTWISE
from btjit.optim.near_one import Hyper, scalars

GLOBAL = ("lr", "clip_norm", "clip_scale", "clip_value", "step")
ONE_MINUS = "1-"              # the slot of 1 - hp[k] is named "1-" + k (btjit/optim/near_one.py)


class Update:
    def __init__(self, opt, params: dict, clip_norm=None, clip_value=None):
        if not isinstance(opt, Optimizer):
            raise TypeError(f"optimizer must be a btjit.optim.Optimizer, got {type(opt).__name__}")
        for k, v in (("clip_norm", clip_norm), ("clip_value", clip_value)):
            if v is not None and not (isinstance(v, (int, float, np.floating)) and v > 0):
                raise ValueError(f"{k} must be a positive number or None, got {v!r}")
        declared = resolve_groups(opt, params, keep_empty=True)
        self.opt, self.groups = opt, [gr for gr in declared if gr[0]]
        self.declared = [i for i, (names, _) in enumerate(declared) if names]   # group j is the user's declared[j]
        self.n_declared = len(declared)
        self.order = [n for names, _ in self.groups for n in names]
        self.state_names, self.init = [], {}          # the names any param has, first seen first; {name: {param: v}}
        self.shapes = {k: tuple(np.shape(params[k])) for k in self.order}
        # the hyper-parameters whose terms are not in the step (nonzero() said False, clipping not asked for)
        self.untraced = {k for k, v in (("clip_norm", clip_norm), ("clip_value", clip_value)) if not v}
        for names, hp in self.groups:
            for name in names:
                self._init_state(name, np.asarray(params[name]), hp)
        self.clip_norm, self.clip_value = clip_norm, clip_value
        start = {"lr": opt.hp["lr"], "clip_norm": float(clip_norm or 0.0), "clip_scale": 1.0,
                 "clip_value": float(clip_value or 0.0), "step": 0.0}
        self.slots = {k: i for i, k in enumerate(GLOBAL)}
        self.values = [start[k] for k in GLOBAL]
        self.group_slots = []
        for _, hp in self.groups:
            hp = flat_hp(hp)
            names = [k for k in hp if k != "lr"]
            names += [ONE_MINUS + k for k in names if k != "lr_scale"]
            self.group_slots.append({k: len(self.values) + i for i, k in enumerate(names)})
            self.values += [1.0 - hp[k[len(ONE_MINUS):]] if k.startswith(ONE_MINUS) else hp[k] for k in names]

    def _init_state(self, name, p, group_hp):
        """opt.init(name, p), self.hp its group's, checked (a dict of state name -> numbers of at most p's size)
        into self.init and self.state_names."""
        opt, who = self.opt, type(self.opt).__name__
        with opt.recording_zeros(self.untraced), opt.group_hp(group_hp):
            st = opt.init(name, p)
        at = f" — {defined_at(type(opt).init)}"
        if not isinstance(st, dict) or not all(isinstance(k, str) for k in st):
            raise OptimizerError(f"{who}.init({name!r}, param) must return a dict of state name -> array, "
                                 f"got {type(st).__name__}{at}")
        if set(st) & {"step", "hyper"}:          # state_dict's opt/step and opt/hyper (step is update's argument)
            raise OptimizerError(f"{who}.init: a state named {sorted(set(st) & {'step', 'hyper'})[0]!r} would be "
                                 f"state_dict's opt/step or opt/hyper (btjit's step count and hyper-parameters; "
                                 f"update gets the step as its argument): name it otherwise{at}")
        for k, v in st.items():
            v = np.asarray(v)
            if v.dtype.kind not in "biuf":
                raise OptimizerError(f"{who}.init({name!r}): state {k!r} is {_describe(st[k])}, not a number or an "
                                     f"array of real numbers{at}")
            if v.size > p.size:
                raise OptimizerError(f"{who}.init({name!r}): state {k!r} has shape {v.shape}, the param {p.shape}; "
                                     f"a state has at most its param's elements (it is kept in the param's slot): "
                                     f"a full-matrix statistic of a vector (or a Shampoo preconditioner) is not, a "
                                     f"diagonal or factored one (Adafactor's rows and columns) is{at}")
            if k not in self.state_names:
                self.state_names.append(k)
            self.init.setdefault(k, {})[name] = v.astype(np.float64)

    @property
    def n_hyper(self):
        return len(self.values)

    def states(self, name) -> dict:
        """{state name: shape} of param `name`'s state."""
        return {k: self.init[k][name].shape for k in self.state_names if name in self.init[k]}

    def odd_shapes(self) -> dict:
        """{state name: {param: shape, or None where the param has no such state}} of the states whose shape is
        not their param's (prog.opt_state's views; {} for an elementwise optimizer's)."""
        odd = {}
        for k in self.state_names:
            for name, shape in self.shapes.items():
                got = self.init[k][name].shape if name in self.init[k] else None
                if got != shape:
                    odd.setdefault(k, {})[name] = None if got is None else list(got)
        return odd

    def slot_offsets(self, plan):
        """({global name: arena offset}, [{name: arena offset} per group]) of the hyper-parameter slots; a group
        declared but matching no param has {} (so entry i is the user's group i)."""
        groups = [{}] * self.n_declared
        for i, s in zip(self.declared, self.group_slots):
            groups[i] = {k: plan.hyper_off + o for k, o in s.items()}
        return {k: plan.hyper_off + i for k, i in self.slots.items()}, groups

    def write_initial(self, a, plan):
        """The hyper-parameters' and the state's initial values into the arena a."""
        a[plan.hyper_off:plan.hyper_off + self.n_hyper] = self.values
        for j, k in enumerate(self.state_names):
            for name, v in self.init[k].items():
                o = plan.param_off[name] + (2 + j) * plan.params_span[1]
                a[o:o + v.size] = v.ravel()

    def rows(self, g, L, hyper, skip_nonfinite):
        """The update's tape rows: the gradient-norm row (a clip by global norm, a non-finite step skipped: the
        one hand-written kernel), then the traced update's equations (g.eqns[g.n_backward:])."""
        p = L.plan
        clip = [L.row("k_clip_scale", og=p.grads_start, n=p.params_span[1], omax=hyper["clip_norm"],
                      oscale=hyper["clip_scale"])] if self.clip_norm or skip_nonfinite else []
        return clip + lower_eqns(g.eqns[g.n_backward:], L)[0]

    def trace_into(self, g, skip_nonfinite=False):
        with self.opt.recording_zeros(self.untraced), scalars(), _no_numpy_random(type(self.opt).__name__):
            self._trace_into(g, skip_nonfinite)

    def _trace_into(self, g, skip_nonfinite):
        fd, opt, clip_norm, clip_value = g.float_dtype, self.opt, self.clip_norm, self.clip_value
        who = type(opt).__name__

        def region(tag, shape):
            v = g.new_var(shape, fd)
            g.regions[v] = tag
            return T.Tracer(v, g)

        slot_vars = {}

        def hyper(i):                                 # slot i as a scalar value (one var per slot)
            if i not in slot_vars:
                slot_vars[i] = region(("hyper", i), ())
            return slot_vars[i]

        def call(p, grad, state, hp, name):
            """opt.update on traced values, the grad clipped first: ([(new value, old value, what)], {var id:
            role} of the arguments, the index of its first equation)."""
            if clip_norm:
                grad = grad * scale
            if clip_value:
                grad = T.minimum(T.maximum(grad, -cv), cv)
            first_eqn = len(g.eqns)
            res = opt.update(p, grad, _State(who, name, state), hp, t)
            roles = {p.node.id: "param", grad.node.id: "grad", **{v.node.id: ("state", k) for k, v in state.items()}}
            return _results(who, name, res, p, state, defined_at(type(opt).update)), roles, first_eqn

        def slices(name, shape, states):
            """param `name`'s slices (a group's from its first param when shape is the group's (n,))."""
            return (region(("slice", 0, name), shape), region(("slice", 1, name), shape),
                    {k: region(("slice", 2 + self.state_names.index(k), name), s) for k, s in states.items()})

        def as_group(names, hp):
            """[(new, old)] of the update traced once over the group's slices, or None (nothing traced) when that
            is not what each param's trace computes."""
            n = sum(_al(g.params[k].size) for k in names)
            states = self.states(names[0])
            if any(self.states(k) != {s: self.shapes[k] for s in states} for k in names):
                return None                           # a state of another shape, or params of other states
            mark = _mark(g)
            try:
                p, grad, state = slices(names[0], (n,), {k: (n,) for k in states})
                res = None if clip_value else one_pass(opt, p, grad, state, hp, t, scale, {
                    f for f, on in (("scale", clip_norm), ("skip", skip_nonfinite)) if on})
                if res is not None:
                    return [(res[0], p), *((res[1][k], state[k]) for k in states)]   # its kernel skips, clips
                sigs = set()
                for shape in dict.fromkeys(self.shapes[k] for k in names):          # dry runs at the params' shapes
                    dry = _mark(g)
                    args = [T.Tracer(g.new_var(shape, fd), g) for _ in range(2 + len(states))]
                    sigs.add(_signature(g, *call(args[0], args[1], dict(zip(states, args[2:])), hp, names[0]), shape))
                    _rollback(g, dry)
                out = call(p, grad, state, hp, names[0])
                fits = sigs == {_signature(g, *out, (n,))} and _elementwise(g.eqns[out[2]:], (n,)) and \
                    all(new.shape in ((n,), ()) for new, _, _ in out[0])
            except Exception:                         # noqa: BLE001 -- param mode traces it again, and raises
                fits = False
            if not fits:
                _rollback(g, mark)
                return None
            news = [(T.broadcast_to(new, (n,)) if new.shape == () else new, old) for new, old, _ in out[0]]
            return [(T.where(ok, new, old) if skip_nonfinite else new, old) for new, old in news]

        def widen(name, hp):
            """A 0-d state of param `name` for which update returns a value of the param's shape (init's number,
            then arrays as numpy's broadcasting makes them) starts as that number in every element of the shape."""
            states = self.states(name)
            if () not in states.values():
                return
            mark = _mark(g)
            try:
                out, _, _ = call(*slices(name, self.shapes[name], states), hp, name)
            except Exception:                         # noqa: BLE001 -- the trace that follows raises it
                return
            finally:
                _rollback(g, mark)
            for k, (new, _, _) in zip(states, out[1:]):
                if states[k] == () and new.shape == self.shapes[name]:
                    self.init[k][name] = np.full(new.shape, self.init[k][name])

        def per_param(name, hp):
            shape = self.shapes[name]
            out, _, _ = call(*slices(name, shape, self.states(name)), hp, name)
            for new, old, what in out:
                if new.shape == () != old.shape:
                    new = T.broadcast_to(new, old.shape)
                if new.shape != old.shape:
                    at = next((e.src for e in reversed(g.eqns) if new.node in e.outs and e.src), None)
                    raise OptimizerError(f"{who}.update for param {name!r}: {what} has shape {new.shape}, not "
                                         f"{old.shape} ({'the param' if what == 'the new param' else 'init'}'s) — "
                                         f"{at or defined_at(type(opt).update)}")
                yield (T.where(ok, new, old) if skip_nonfinite else new), old

        with T.building(g):
            step = hyper(self.slots["step"])
            t = step + 1.0
            scale = hyper(self.slots["clip_scale"])
            cv = hyper(self.slots["clip_value"]) if clip_value else None
            ok = T.equal(scale, scale) if skip_nonfinite else None      # False when a gradient is NaN/Inf
            writes = [(T.where(ok, t, step) if skip_nonfinite else t, step)]
            for (names, group_hp), slots in zip(self.groups, self.group_slots):
                one = {k: Hyper(hyper(i).node, g, hyper(slots[ONE_MINUS + k])) for k, i in slots.items()
                       if k != "lr_scale" and not k.startswith(ONE_MINUS)}
                hp = {k: tuple(one[f"{k}[{i}]"] for i in range(len(v))) if isinstance(v, tuple) else one[k]
                      for k, v in group_hp.items() if k not in ("lr", "lr_scale")}
                hp["lr"] = hyper(self.slots["lr"]) * hyper(slots["lr_scale"])
                hp = HyperParams(who, hp)
                for name in names:
                    widen(name, hp)
                writes += as_group(names, hp) or [w for name in names for w in per_param(name, hp)]
            for new, old in writes:
                if new.node is not old.node:
                    S.assign_state(old.node, new)


class _State(dict):
    """The state an update reads: a name init did not give this param is an error naming the param and its state."""

    def __init__(self, who, name, values):
        super().__init__(values)
        self.who, self.name = who, name

    def __missing__(self, k):
        raise OptimizerError(f"{self.who}.update reads state[{k!r}]; init gave param {self.name!r} "
                             f"{sorted(self) or 'no state'} — {T.user_src()}")


def _results(who, name, res, p, state, at):
    """[(new value, the value it replaces, what it is)] of update's result, checked for its form and names; at:
    where update is defined."""
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict)):
        got = "None (no return?)" if res is None else _describe(res)
        raise OptimizerError(f"{who}.update must return (new_param, {{state name: new value}}), got {got} — {at}")
    new_p, new_s = res
    if sorted(new_s) != sorted(state):
        raise OptimizerError(f"{who}.update returned the state {sorted(new_s)}; init gave {name!r} {sorted(state)}"
                             f" — {at}")
    out = []
    for what, v, old in [("the new param", new_p, p), *((f"state {k!r}", new_s[k], v) for k, v in state.items())]:
        if not isinstance(v, (T.Tracer, bool, int, float, np.number, np.ndarray)):
            raise OptimizerError(f"{who}.update for param {name!r}: {what} is a {type(v).__name__}, not a traced "
                                 f"value or a number — {at}")
        out.append((T.lift(v), old, what))
    return out


NUMPY_RANDOM = ("rand", "randn", "normal", "uniform", "standard_normal", "random", "random_sample", "randint",
                "choice", "laplace", "binomial", "poisson", "permutation", "shuffle", "default_rng")


@contextlib.contextmanager
def _no_numpy_random(who):
    """Inside (update is traced): np.random's functions raise. They would draw once, while tracing, and every step
    would add the same numbers (SGLD's noise frozen)."""
    def refuse(name):
        def f(*a, **k):
            raise OptimizerError(f"{who}.update calls np.random.{name}, which draws its numbers once, when the update "
                                 f"is traced: every step would use the same ones. Use btjit.randn_like(p) (normal) or "
                                 f"btjit.rand_like(p) (uniform in [0, 1)): new numbers every step — {T.user_src()}")
        return f
    before = {k: getattr(np.random, k) for k in NUMPY_RANDOM}
    for k in NUMPY_RANDOM:
        setattr(np.random, k, refuse(k))
    try:
        yield
    finally:
        for k, f in before.items():
            setattr(np.random, k, f)


def _describe(v) -> str:
    """v for an error message: a tuple by its items' types, an array by its dtype and shape, else its repr."""
    if isinstance(v, tuple):
        return f"({', '.join(type(x).__name__ for x in v)})"
    if isinstance(v, np.ndarray):
        return f"an array of {v.dtype} of shape {v.shape}"
    if isinstance(v, T.Tracer):
        return f"a traced value of shape {v.shape}"
    return repr(v) if len(repr(v)) < 60 else f"a {type(v).__name__}"


def _mark(g):
    """What tracing may add to g besides equations after len(g.eqns): constants, the memo, random sites, regions."""
    return (len(g.eqns), len(g.consts), dict(g._scalar_consts), dict(g.memo), g.rng_sites, g.rng_key,
            dict(g.regions), len(g.assigns))


def _rollback(g, mark):
    """g as it was at _mark (var ids are not reused: nothing can still name a var made since)."""
    n, n_consts, g._scalar_consts, g.memo, g.rng_sites, g.rng_key, g.regions, n_assigns = mark
    del g.eqns[n:], g.assigns[n_assigns:]
    for v in list(g.consts)[n_consts:]:
        del g.consts[v]


def _signature(g, results, roles, first_eqn, full):
    """g.eqns[first_eqn:] and the results as two traces of one update are compared: ops, attributes, where each
    input comes from (an earlier equation's output, an argument of update by its role, a constant by its value,
    a value traced before), output types; full (the traced param's shape) reads "full" everywhere."""
    made = {}

    def shape(s):
        return "full" if s == full else s

    def src(v):
        if v.id in made:
            return made[v.id]
        c = g.consts.get(v)
        return roles.get(v.id) or (("var", v.id) if c is None else ("const", v.dtype, shape(v.shape), c.tobytes()))
    sig = []
    for i, e in enumerate(g.eqns[first_eqn:]):
        sig.append((e.op, tuple((k, shape(a) if isinstance(a, tuple) else a) for k, a in sorted(e.attrs.items())),
                    tuple(map(src, e.ins)), tuple((o.dtype, shape(o.shape)) for o in e.outs)))
        made.update({o.id: ("eqn", i, j) for j, o in enumerate(e.outs)})
    return tuple(sig) + tuple((src(new.node), shape(new.shape)) for new, _, _ in results)


# the ops a group mode update may trace: elementwise over the group's flat vector (which the arena pads for
# alignment: a reduction, reshape or slice of it would see the padding)
UPDATE_OPS = ELEMENTWISE | set(ALIAS) | {"pow", "to_float", "rand", "gelu", "reshape", "floor", "ceil", "round",
                                         "trunc", "remainder", "fmod"}


def _elementwise(eqns, full) -> bool:
    """Do eqns compute each element of values of shape `full` from the same element of their inputs (and scalars)?"""
    ok_in = lambda v: v.shape == full or v.size == 1           # noqa: E731
    return all(e.op in UPDATE_OPS and all(o.shape in ((), full) for o in e.outs) and all(map(ok_in, e.ins)) and
               (e.op != "reshape" or e.ins[0].shape == e.outs[0].shape) for e in eqns)
