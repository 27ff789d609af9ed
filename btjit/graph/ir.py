"""The IR: a flat SSA list of equations over typed values.

`Var` is a value (integer id, shape, dtype); `Eqn` applies one op of the op table to input Vars and defines
new output Vars; `Graph` is the ordered equation list plus the roles of its values (params, inputs,
constants, outputs, grads). Nothing here knows how ops compute: see ops/. `verify()` checks single
assignment, that every use is defined before, and that shapes/dtypes agree with the op's shape rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DTYPES = ("f32", "f64", "i32")


class Var:
    __slots__ = ("id", "shape", "dtype")

    def __init__(self, id: int, shape: tuple, dtype: str):
        assert dtype in DTYPES, dtype
        self.id, self.shape, self.dtype = id, tuple(int(d) for d in shape), dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def type_str(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    def __repr__(self):
        return f"%{self.id}"


@dataclass(eq=False)
class Eqn:
    op: str
    ins: tuple
    outs: tuple
    attrs: dict = field(default_factory=dict)
    src: str = ""           # "file.py:12" of the user's line that created it

    def __str__(self):
        outs = ", ".join(repr(o) for o in self.outs)
        args = ", ".join(repr(i) for i in self.ins)
        attrs = "".join(f", {k}={_fmt(v)}" for k, v in sorted(self.attrs.items()))
        types = ", ".join(o.type_str for o in self.outs)
        line = f"{outs} = {self.op}({args}{attrs})"
        return f"{line:<60s} {types}" + (f"   # {self.src}" if self.src else "")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:g}"
    return repr(v)


@dataclass(eq=False)
class Assign:
    """`target` (a param's, buffer's or optimizer state's Var: a fixed arena region) takes `value` when the
    step ends, after every equation has read the old one."""
    target: Var
    value: Var
    src: str = ""
    in_place: bool = False   # value is computed straight into the target's place: no copy ends the step

    def __str__(self):
        return f"assign {self.target!r} <- {self.value!r}" + (" (in place)" if self.in_place else "") + \
            (f"   # {self.src}" if self.src else "")


@dataclass(eq=False)
class Graph:
    float_dtype: str = "f32"
    eqns: list = field(default_factory=list)
    params: dict = field(default_factory=dict)     # name -> Var
    inputs: list = field(default_factory=list)     # batch Vars, in call order
    input_names: list = field(default_factory=list)
    consts: dict = field(default_factory=dict)     # Var -> np.ndarray
    loss: Var | None = None                         # the scalar that autodiff differentiates
    outputs: dict = field(default_factory=dict)    # name -> Var kept live and readable after a run
    grads: dict = field(default_factory=dict)      # param name -> Var (after autodiff)
    buffers: dict = field(default_factory=dict)    # name -> Var: state a step reads and writes, not trained
    assigns: list = field(default_factory=list)    # Assign: a value written into a state Var when the step ends
    training: bool = True                          # the mode btjit.is_training() reports while tracing
    precision: str = "fp32"                        # of the products (btjit.trace's precision=)
    memo: dict = field(default_factory=dict)       # while fn is traced: (op, input id, attrs) -> Var, pure ops
    #                                                met again on the same input made once (a weight's .T per RNN cell)
    # values at fixed places outside the planned area, read and assigned by the optimizer update
    # (graph/memory.py places them): Var -> ("slice", k, param name) = that param's slice (or a param group's, from
    # its first param) of the params region (k = 0), the grads (k = 1) or optimizer state j (k = 2 + j), which a
    # state of another shape fills from its start; ("hyper", i) = hyper-parameter slot i
    regions: dict = field(default_factory=dict)
    n_forward: int = 0                              # eqns[:n_forward] compute the outputs
    n_backward: int = 0                             # eqns[:n_backward] also compute the grads; the rest update
    rng_key: Var | None = None                      # i32: the random ops' key block (kernels/rng.py)
    rng_sites: int = 0                              # random ops traced so far (each op's site number)
    _next_id: int = 0
    _scalar_consts: dict = field(default_factory=dict)   # (dtype, bytes) -> Var: dedupes scalar constants

    def state_vars(self) -> dict:
        """var id -> (kind, name) of the values that live in fixed arena regions across steps and that an
        assign may write: params, buffers and the optimizer's regions (slices, the step slot)."""
        return {**{v.id: ("param", k) for k, v in self.params.items()},
                **{v.id: ("buffer", k) for k, v in self.buffers.items()},
                **{v.id: ("optimizer", ":".join(map(str, tag))) for v, tag in self.regions.items()}}

    def kept(self) -> list:
        """The values a run must leave readable: outputs, loss, grads and the assigned values."""
        return list(self.outputs.values()) + list(self.grads.values()) + ([self.loss] if self.loss is not None
                                                                          else []) + [a.value for a in self.assigns]

    def new_var(self, shape, dtype) -> Var:
        v = Var(self._next_id, shape, dtype)
        self._next_id += 1
        return v

    def const(self, value, dtype=None) -> Var:
        arr = np.asarray(value)
        dtype = dtype or ("i32" if arr.dtype.kind in "iub" else self.float_dtype)
        arr = arr.astype(np.int32 if dtype == "i32" else _np_dtype(dtype))
        key = (dtype, arr.tobytes()) if arr.ndim == 0 else None
        if key in self._scalar_consts:
            return self._scalar_consts[key]
        v = self.new_var(arr.shape, dtype)
        self.consts[v] = arr
        if key is not None:
            self._scalar_consts[key] = v
        return v

    def __str__(self):
        lines = []
        for name, v in self.params.items():
            lines.append(f"param  {v!r:>6} {v.type_str:<20s} {name}")
        for name, v in self.buffers.items():
            lines.append(f"buffer {v!r:>6} {v.type_str:<20s} {name}")
        for name, v in zip(self.input_names, self.inputs):
            lines.append(f"input  {v!r:>6} {v.type_str:<20s} {name}")
        for v, c in self.consts.items():
            val = f"{c.item():g}" if c.ndim == 0 else f"array{c.shape}"
            lines.append(f"const  {v!r:>6} {v.type_str:<20s} {val}")
        for v, tag in self.regions.items():
            lines.append(f"region {v!r:>6} {v.type_str:<20s} {':'.join(map(str, tag))}")
        for i, e in enumerate(self.eqns):
            if i == self.n_forward and self.n_backward > self.n_forward:
                lines.append("# ---- backward ----")
            if i == self.n_backward and len(self.eqns) > self.n_backward:
                lines.append("# ---- update ----")
            lines.append(str(e))
        if self.loss is not None:
            lines.append(f"loss   {self.loss!r}")
        for name, v in self.grads.items():
            lines.append(f"grad   {v!r:>6} {name}")
        lines += [str(a) for a in self.assigns]
        return "\n".join(lines)


def _np_dtype(dtype: str):
    return {"f32": np.float32, "f64": np.float64, "i32": np.int32}[dtype]


np_dtype = _np_dtype


class VerifyError(Exception):
    pass


def verify(graph: Graph, table) -> None:
    """Single assignment, defined-before-use, shapes and dtypes as the op table's shape rules say."""
    defined = set()
    for v in list(graph.params.values()) + list(graph.buffers.values()) + list(graph.inputs) + \
            list(graph.consts) + list(graph.regions) + ([graph.rng_key] if graph.rng_key is not None else []):
        if v.id in defined:
            raise VerifyError(f"{v!r} defined twice (param/input/const/region)")
        defined.add(v.id)
    for i, e in enumerate(graph.eqns):
        if e.op not in table:
            raise VerifyError(f"eqn {i}: unknown op {e.op!r}")
        for v in e.ins:
            if v.id not in defined:
                raise VerifyError(f"eqn {i} ({e.op}): input {v!r} used before it is defined")
        want = table[e.op].infer([(v.shape, v.dtype) for v in e.ins], e.attrs, graph.float_dtype)
        got = [(o.shape, o.dtype) for o in e.outs]
        if want != got:
            raise VerifyError(f"eqn {i} ({e.op}): outputs {got} but the shape rule gives {want}")
        for o in e.outs:
            if o.id in defined:
                raise VerifyError(f"eqn {i} ({e.op}): {o!r} assigned twice")
            defined.add(o.id)
    for v in [graph.loss, *graph.outputs.values(), *graph.grads.values(), *(a.value for a in graph.assigns)]:
        if v is not None and v.id not in defined:
            raise VerifyError(f"output {v!r} is never defined")
    state = graph.state_vars()
    for a in graph.assigns:
        if a.target.id not in state or (a.target.shape, a.target.dtype) != (a.value.shape, a.value.dtype):
            raise VerifyError(f"{a}: the target is not a state value, or its type differs from the value's")
