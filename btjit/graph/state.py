"""State in a traced function: the mode it is traced in (`is_training`) and `assign`, which writes a value into a
buffer -- or, through `assign_state`, into any state value of Graph.state_vars (a param, an optimizer's state)
-- when the step ends. The graph records an Assign; memory.pin gives the value its slot, lower.assign_rows
copies it into the target's region after every other row of the step."""
from __future__ import annotations

from btjit.graph import trace as T
from btjit.graph.ir import Assign


def is_training() -> bool:
    """Inside a traced function: True while the training step is traced, False in prog.eval's trace (and in
    btjit.trace(..., training=False)). Outside one it is an error."""
    return T.current_graph().training


def assign(target, value):
    """Write `value` into the buffer `target` (p[name] of btjit.trace(..., buffers=)) when the step ends: every
    read of p[name] in this step sees the old value. No gradient flows through a buffer. In eval mode
    (is_training() False) nothing is written."""
    g = T.current_graph()
    state = g.state_vars()
    if not isinstance(target, T.Tracer) or target.graph is not g or state.get(target.var.id, ("",))[0] != "buffer":
        raise T.TraceError(f"assign: the target must be a buffer as the traced function receives it (p[name] of a "
                           f"name in btjit.trace(..., buffers=)), got {target!r} — {T.user_src()}")
    if g.training:
        assign_state(target.var, T.lift(value, target))


def assign_state(target_var, value):
    """Record that the state value `target_var` (a param, buffer or optimizer state: see Graph.state_vars)
    takes `value` when the step ends. One assign per target; the types must agree."""
    g = T.current_graph()
    kind, name = g.state_vars()[target_var.id]
    if value.var.dtype != target_var.dtype or value.shape != target_var.shape:
        raise T.TraceError(f"assign: {kind} {name!r} is {target_var.type_str}, the value assigned is "
                           f"{value.var.type_str} — {T.user_src()}")
    for a in g.assigns:
        if a.target.id == target_var.id:
            raise T.TraceError(f"assign: {kind} {name!r} is assigned twice: at {a.src} and at {T.user_src()}")
    g.assigns.append(Assign(target_var, value.var, T.user_src()))
