"""From an `Optimizer` to equations of the program's graph (btjit.trace calls this; it is not user API).

`Update(opt, params)` resolves the param groups (the arena orders the params group by group, so each group
is one contiguous slice of the params, grads and state regions), calls `init` for the initial state and lays
out the hyper-parameter slots: GLOBAL first, then one block per group. `trace_into(graph)` appends, after
the backward, the step counter's increment and `opt.update` traced once per group over graph.regions (the
group's slices, the slots), then assigns each new value to the place it replaces (graph.assigns, the
mechanism of btjit.assign). `assign_in_place` (after fusion) computes each
new value straight into its place, or leaves it to the copy that ends the step when an equation still reads
the old value after the new one is written.
"""
from __future__ import annotations

import numpy as np

from btjit.graph import state as S, trace as T
from btjit.graph.fuse_ew import ALIAS, BINARY, UNARY
from btjit.graph.lower import lower_eqns
from btjit.graph.memory import _al, storage_roots

from btjit.optim.base import HyperParams, Optimizer, OptimizerError, flat_hp, resolve_groups
from btjit.optim.builtin import one_pass

GLOBAL = ("lr", "clip_norm", "clip_scale", "clip_value", "step")
ELEMENTWISE = set(UNARY) | set(BINARY) | {"where"}
ONE_MINUS = "1-"              # the slot of 1 - hp[k] is named "1-" + k (see _Hyper)


class Update:
    def __init__(self, opt, params: dict, clip_norm=None, clip_value=None):
        if not isinstance(opt, Optimizer):
            raise TypeError(f"optimizer must be a btjit.optim.Optimizer, got {type(opt).__name__}")
        for k, v in (("clip_norm", clip_norm), ("clip_value", clip_value)):
            if v is not None and not (isinstance(v, (int, float, np.floating)) and v > 0):
                raise ValueError(f"{k} must be a positive number or None, got {v!r}")
        who = type(opt).__name__
        declared = resolve_groups(opt, params, keep_empty=True)
        self.opt, self.groups = opt, [gr for gr in declared if gr[0]]
        self.declared = [i for i, (names, _) in enumerate(declared) if names]   # group j is the user's declared[j]
        self.n_declared = len(declared)
        self.order = [n for names, _ in self.groups for n in names]
        self.state_names, self.init = None, {}
        # the hyper-parameters whose terms are not in the step (nonzero() said False, clipping not asked for)
        self.untraced = {k for k, v in (("clip_norm", clip_norm), ("clip_value", clip_value)) if not v}
        for name in self.order:
            p = np.asarray(params[name])
            with opt.recording_zeros(self.untraced):
                st = opt.init(name, p)
            if not isinstance(st, dict) or not all(isinstance(k, str) for k in st):
                raise OptimizerError(f"{who}.init({name!r}, param) must return a dict of state name -> array, "
                                     f"got {type(st).__name__}")
            if set(st) & {"step", "hyper"}:          # state_dict's opt/step and opt/hyper (step is update's argument)
                raise OptimizerError(f"{who}.init: a state named {sorted(set(st) & {'step', 'hyper'})[0]!r} would be "
                                     f"state_dict's opt/step or opt/hyper (btjit's step count and hyper-parameters; "
                                     f"update gets the step as its argument): name it otherwise")
            if self.state_names is None:
                self.state_names = list(st)
            elif list(st) != self.state_names:
                raise OptimizerError(f"{who}.init gives {name!r} the state {list(st)}, but "
                                     f"{self.order[0]!r} {self.state_names}: every param needs the same state")
            for k, v in st.items():
                v = np.asarray(v, np.float64)
                if v.ndim == 0:         # one number per param (torch's NAdam mu_product, ASGD eta): each element's
                    v = np.full(p.shape, v)
                if v.shape != p.shape:
                    raise OptimizerError(f"{who}.init({name!r}): state {k!r} has shape {v.shape}, the param "
                                         f"{p.shape}; state is elementwise, of the param's shape (or one number)")
                self.init.setdefault(k, {})[name] = v
        self.state_names = self.state_names or []
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

    @property
    def n_hyper(self):
        return len(self.values)

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
        with self.opt.recording_zeros(self.untraced):
            self._trace_into(g, skip_nonfinite)

    def _trace_into(self, g, skip_nonfinite):
        fd, opt, clip_norm, clip_value = g.float_dtype, self.opt, self.clip_norm, self.clip_value
        who = type(opt).__name__
        writes = []

        def region(tag, shape):
            v = g.new_var(shape, fd)
            g.regions[v] = tag
            return T.Tracer(v, g)

        slot_vars = {}

        def hyper(i):                                 # slot i as a scalar value (one var per slot)
            if i not in slot_vars:
                slot_vars[i] = region(("hyper", i), ())
            return slot_vars[i]
        with T.building(g):
            step = hyper(self.slots["step"])
            t = step + 1.0
            scale = hyper(self.slots["clip_scale"]) if clip_norm or skip_nonfinite else None
            ok = T.equal(scale, scale) if skip_nonfinite else None      # False when a gradient is NaN/Inf
            writes.append((T.where(ok, t, step) if skip_nonfinite else t, step))
            for (names, group_hp), slots in zip(self.groups, self.group_slots):
                n = sum(_al(g.params[k].size) for k in names)
                size = sum(g.params[k].size for k in names)
                first = names[0]
                p, grad = region(("slice", 0, first), (n,)), region(("slice", 1, first), (n,))
                state = {k: region(("slice", 2 + j, first), (n,)) for j, k in enumerate(self.state_names)}
                one = {k: _Hyper(hyper(i).node, g, hyper(slots[ONE_MINUS + k])) for k, i in slots.items()
                       if k != "lr_scale" and not k.startswith(ONE_MINUS)}
                hp = {k: tuple(one[f"{k}[{i}]"] for i in range(len(v))) if isinstance(v, tuple) else one[k]
                      for k, v in group_hp.items() if k not in ("lr", "lr_scale")}
                hp["lr"] = hyper(self.slots["lr"]) * hyper(slots["lr_scale"])
                hp = HyperParams(who, hp)
                res = None if clip_value else one_pass(
                    opt, p, grad, state, hp, t, hyper(self.slots["clip_scale"]),
                    {f for f, on in (("scale", clip_norm), ("skip", skip_nonfinite)) if on})
                fused = res is not None                  # else the traced update, clipping first
                if not fused:
                    if clip_norm:
                        grad = grad * scale
                    if clip_value:
                        cv = hyper(self.slots["clip_value"])
                        grad = T.minimum(T.maximum(grad, -cv), cv)
                    first_eqn = len(g.eqns)
                    res = opt.update(p, grad, dict(state), hp, t)
                    _check_elementwise(g.eqns[first_eqn:], n, who)
                if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict)):
                    raise OptimizerError(f"{who}.update must return (new_param, {{state name: new value}})")
                new_p, new_s = res
                if sorted(new_s) != sorted(self.state_names):
                    raise OptimizerError(f"{who}.update returned the state {sorted(new_s)}; init gave "
                                         f"{sorted(self.state_names)}")
                for what, new, old in [("the new param", new_p, p), *((f"state {k!r}", new_s[k], state[k])
                                                                       for k in self.state_names)]:
                    new = T.lift(new) if not isinstance(new, T.Tracer) else new
                    if new.shape != (n,):
                        new = _as_slice(new, n, size, who, what)
                    if skip_nonfinite and not fused:
                        new = T.where(ok, new, old)
                    writes.append((new, old))
            for new, old in writes:
                if new.node is not old.node:
                    S.assign_state(old.node, new)


class _Hyper(T.Tracer):
    """A hyper-parameter's slot. `1 - hp` reads a slot of its own that the host fills with 1 - value computed in
    float64: a float32 arena rounds 0.999 to 0.99900001, and 1 - beta2 would be 1.3e-5 off torch's."""
    __slots__ = ("one_minus",)

    def __init__(self, var, graph, one_minus):
        super().__init__(var, graph)
        self.one_minus = one_minus

    def __rsub__(self, o):
        if isinstance(o, (int, float)) and o == 1:
            return self.one_minus
        return super().__rsub__(o)

    def __pow__(self, e):
        """hp ** step in a float32 program, for hp in [0.875, 1] (betas): exp(step * log1p(-(1 - hp))) from the
        exact 1 - hp slot (a float32 beta2 = 0.99900001 ** step is 1.3e-5 * step off, relatively); `1 - hp ** step`
        then cancels nothing. Other bases (0.5 ** step, exact in float32, or (-1) ** step) take pow's own."""
        if not isinstance(e, T.Tracer) or self.node.dtype != "f32":
            return super().__pow__(e)
        near = T.logical("and", self.one_minus >= 0.0, self.one_minus <= 0.125)
        return _Power(near, e * T.log1p(-self.one_minus), super().__pow__(e))


class _Power(T.Tracer):
    """where(near, exp(y), plain): a hyper-parameter to a traced power, whose `1 - ` is, where near, -expm1(y)
    Kahan's way from u = exp(y): (1 - u) * y / log(u), accurate to a few ulps where 1 - u alone keeps only the
    digits of u's rounding."""
    __slots__ = ("y", "near")

    def __init__(self, near, y, plain):
        u = T.where(near, T.exp(y), plain)
        super().__init__(u.node, u.graph)
        self.y, self.near = y, near

    def __rsub__(self, o):
        if not (isinstance(o, (int, float)) and o == 1):
            return super().__rsub__(o)
        u, y = T.Tracer(self.node, self.graph), self.y
        kahan = T.where(u == 1.0, -y, T.where(u > 0.5, (1.0 - u) * y / T.log(u), 1.0 - u))
        return T.where(self.near, kahan, 1.0 - u)


def _as_slice(new, n, size, who, what):
    if new.shape == ():
        return T.broadcast_to(new, (n,))
    raise OptimizerError(f"{who}.update: {what} has shape {new.shape}; the group's values are one flat vector of "
                         f"its {size} elements: use elementwise ops only")


# the ops an update may trace: elementwise over the group's flat vector (which the arena pads for alignment:
# a reduction, reshape or slice of it would see the padding)
UPDATE_OPS = ELEMENTWISE | set(ALIAS) | {"pow", "to_float", "rand", "gelu", "reshape", "floor", "ceil", "round",
                                         "trunc", "remainder", "fmod"}
NAMED = {"sum": "a reduction", "max": "a reduction", "matmul": "a matrix product", "reshape": "a reshape",
         "slice": "a slice", "transpose": "a transpose", "concatenate": "a concatenation", "take": "an indexing"}


def _check_elementwise(eqns, n, who):
    """An OptimizerError naming the user's line of the first of eqns (traced by opt.update over a group's flat
    vector of n elements, padding included) that is not elementwise over it."""
    ok_in = lambda v: v.shape == (n,) or v.size == 1           # noqa: E731
    for e in eqns:
        if e.op in UPDATE_OPS and all(o.shape in ((), (n,)) for o in e.outs) and all(map(ok_in, e.ins)) and \
                (e.op != "reshape" or e.ins[0].shape == e.outs[0].shape):
            continue
        odd = next((v.shape for v in e.ins + e.outs if not ok_in(v)), None)
        what = (f"{NAMED[e.op]} ({e.op})" if e.op in NAMED else
                f"{e.op} with a value of shape {odd}" if e.op in UPDATE_OPS and odd is not None else
                f"an op that is not elementwise ({e.op})")
        raise OptimizerError(f"{who}.update: {what} at {e.src or 'an unknown line'}: update rules are "
                             f"elementwise over each group's flat vector (its params concatenated, with alignment "
                             f"padding), so reductions (sum, mean, max, min, norm, var ...), reshapes, slices and "
                             f"products are not supported, nor per-param statistics such as LARS/LAMB trust ratios")


def assign_in_place(g, pinned: dict) -> None:
    """The optimizer's assigns (graph.assigns whose target is one of graph.regions), after fusion: each new
    value is computed straight into its target's place (pinned[id] = ("at", target), no copy row) unless the
    old value is still read after the new one is written; then it is pinned as an output and copied into the
    place when the step ends (graph/lower.py: assign_rows), as every other assign is. A value that is not its
    own storage (a param, a region, one value assigned twice) is first copied where the update begins."""
    root = storage_roots(g)
    fixed = {v.id for v in list(g.params.values()) + list(g.buffers.values()) + g.inputs + list(g.consts) +
             list(g.regions)}
    mine = [a for a in g.assigns if a.target in g.regions]
    claimed = set(pinned)
    for a in mine:
        r = root.get(a.value.id, a.value.id)
        if r != a.value.id or r in fixed or r in claimed:
            with T.building(g):
                c = T.copy(T.Tracer(a.value, g))
            g.eqns.insert(g.n_backward, g.eqns.pop())       # reads the value before any update writes
            a.value = c.node
        claimed.add(a.value.id)
    producer = {o.id: i for i, e in enumerate(g.eqns) for o in e.outs}
    for a in mine:
        if _read_after(g, producer[a.value.id], a.value, a.target, root):
            pinned[a.value.id] = ("out", f"assign/optimizer/{':'.join(map(str, g.regions[a.target]))}")
        else:
            pinned[a.value.id] = ("at", a.target)
            a.in_place = True


def _read_after(g, i, new, old, root) -> bool:
    """Is old (or a view of it) read after eqns[i] writes new? Inside a fused chain, by the members after the
    one computing new; an unfused equation reading old only if it is one elementwise op."""
    reads = lambda e: any(root.get(v.id, v.id) == old.id for v in e.ins)   # noqa: E731
    if any(reads(e) for e in g.eqns[i + 1:]):
        return True
    e = g.eqns[i]
    if not reads(e):
        return False
    if e.op != "ew_fused":                           # one elementwise op works in place, any other may not
        return not (e.op in ELEMENTWISE and old.shape == e.outs[0].shape or e.op == "opt_update")
    body = e.attrs["body"]
    at = next(k for k, m in enumerate(body) if m[3] == new.id)
    alias = {old.id}
    for op, _, ins, out in body:
        if op in ALIAS and ins[0] in alias:
            alias.add(out)
    return any(set(ins) & alias for _, _, ins, _ in body[at + 1:])
