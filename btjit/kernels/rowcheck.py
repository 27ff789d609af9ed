"""Each tape kernel's row, checked against its source: `check_rows` finds where a kernel reads its row otherwise
than its one declaration (`@row(...)` above the kernel, btjit/kernels/common.py) says."""
from __future__ import annotations

import ast
import inspect
import sys

from btjit.kernels.common import ROWS
from btjit.kernels.entries import GENERATED, KERNELS, MODULE_OF


def check_rows(names=None) -> list:
    """Where a kernel reads its row otherwise than its declaration says: a name bound to r[i] that is not the
    declared i-th argument, or an r[i] beyond the row -- in the kernel and in the functions of its source that
    it passes r to. [] when every kernel agrees with its declaration."""
    problems = []
    for name in names or KERNELS:
        if name in GENERATED:        # attn_lanes.entry_ir reads every row field by its declared name
            continue
        src = inspect.getsource(sys.modules[MODULE_OF[name]])
        defs = {f.name: f for f in ast.walk(ast.parse(src)) if isinstance(f, ast.FunctionDef)}
        problems += _check_fn(name, defs, name, "r", ROWS[name].args, set())
    return problems


def _check_fn(kernel, defs, fn, rname, args, seen):
    if (fn, rname) in seen or fn not in defs:
        return []
    seen.add((fn, rname))
    out = []

    def index(node):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == rname \
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
            return node.slice.value
        return None
    for node in ast.walk(defs[fn]):
        i = index(node)
        if i is not None and not 1 <= i <= len(args):
            out.append(f"{kernel}: {fn} reads r[{i}], beyond its row [op, {', '.join(args)}]")
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t, v = node.targets[0], node.value
            pairs = zip(t.elts, v.elts) if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) else [(t, v)]
            for tgt, val in pairs:
                i = index(val)
                if i is not None and isinstance(tgt, ast.Name) and 1 <= i <= len(args) and tgt.id != args[i - 1]:
                    out.append(f"{kernel}: {fn} names r[{i}] {tgt.id!r}, its row declares {args[i - 1]!r}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defs:
            params = [a.arg for a in defs[node.func.id].args.args]
            for k, arg in enumerate(node.args):
                if isinstance(arg, ast.Name) and arg.id == rname and k < len(params):
                    out += _check_fn(kernel, defs, node.func.id, params[k], args, seen)
    return out
