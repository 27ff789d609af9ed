"""The package's layering: every import of btjit by btjit (module level or inside a function) points to the same
layer or a lower one, and no modules import each other in a circle. Also the size rules: at most 8 modules at
btjit/'s top level beside its packages, no file over 500 lines in btjit/ or tests/.

Layers, lowest first (a package's modules share its layer):"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "btjit"
TESTS = Path(__file__).resolve().parent

LAYERS = [
    ["btjit.host"],                      # the machine: cache dir, thread pools
    ["btjit.kernels"],                   # the kernel library (numba / llvmlite code, no graph knowledge)
    ["btjit.graph"],                     # IR, tracer, op table, autodiff, fusion, planning, lowering
    ["btjit.optim"],                     # optimizers, written with the tracer
    ["btjit.export"],                    # the runner a program and an export share, exports, the runtime
    ["btjit.core"],                      # trace() and Program
    ["btjit.scalar"],                    # scalar graphs
    ["btjit", "btjit._api", "btjit.runtime", "btjit.testing", "btjit.micrograd"],   # the public API
    ["btjit.models"],                    # built-in models, written with the public API
    ["btjit.train"],                     # the `btjit train` application
    ["btjit.bench"],                     # benchmarks
    ["btjit.cli", "btjit.__main__"],     # the command line
]


def layer_of(mod: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (mod == n or mod.startswith(n + ".")) and len(n) > best:
                best, rank = len(n), i
    assert rank is not None, f"{mod} is in no layer of tests/test_layout.py"
    return rank


def modules() -> dict:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(name: str, path: Path, mods: dict) -> dict:
    """{imported btjit module: line} for every import in the file. `from btjit import __version__` reads a
    constant of the root package (which Python has always loaded first) and is not an edge."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [a.name for a in node.names]
            if base == "btjit" and names == ["__version__"]:
                continue
            targets = [f"{base}.{n}" if f"{base}.{n}" in mods else base for n in names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.setdefault(t, node.lineno)
    return out


def graph():
    mods = modules()
    return mods, {m: imports(m, p, mods) for m, p in mods.items()}


def test_imports_only_downward():
    mods, edges = graph()
    bad = [f"{mods[m].relative_to(PKG.parent)}:{line} imports {t} (layer {layer_of(t)} above {layer_of(m)})"
           for m, ts in edges.items() for t, line in ts.items() if layer_of(t) > layer_of(m)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_circles():
    mods, edges = graph()
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_sizes():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, f"btjit/ has {len(top)} top-level modules (at most 8): {top}"
    files = sorted(PKG.rglob("*.py")) + sorted(TESTS.glob("*.py"))
    long = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in files
            if (n := len(p.read_text().splitlines())) > 500]
    assert not long, "files over 500 lines:\n" + "\n".join(long)


@pytest.mark.parametrize("mod,bad", [("btjit.kernels.x", "btjit.graph.trace"), ("btjit.graph.y", "btjit.core.program")])
def test_layer_rule_catches_upward_imports(mod, bad):
    assert layer_of(bad) > layer_of(mod)
