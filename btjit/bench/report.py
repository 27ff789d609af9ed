"""The one table renderer of `btjit bench`: every suite's format_table builds a Table (title, column heads,
rows of cells, notes) and calls render(), which prints it as aligned plain text or, with markdown=True, as the
Markdown docs/benchmarks.md uses -- a line naming the machine (CPU model name, LLVM's host CPU name, cores), the
btjit version, the date and the exact command line, then a pipe table, then the notes as paragraphs.

Also machine_info() (the CPU, cores, Python and package versions a JSON report records) and parse_markdown()
(a rendered Markdown table back to its cells; the tests use it to check the renderer round-trips).
Not here: measuring anything. Imports only the standard library (llvmlite lazily, for the host CPU name).
"""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    head: tuple                               # column titles
    rows: list                                # tuples of cells (anything str() can show)
    notes: list = field(default_factory=list)  # lines printed under the table
    title: str = ""                           # one line above the table ("" = none)
    align: str = ""                           # per column "l" or "r" (missing = "l")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llvm_host_cpu() -> str | None:
    """LLVM's name of this CPU (what the kernel library compiles for), e.g. 'emeraldrapids'."""
    try:
        import llvmlite.binding as llvm
        return llvm.get_host_cpu_name()
    except Exception:                         # noqa: BLE001 -- no llvmlite: the head just leaves it out
        return None


def machine_info() -> dict:
    from importlib import metadata
    info = dict(cpu=cpu_model(), llvm_cpu=llvm_host_cpu(), cores=os.cpu_count(), python=platform.python_version())
    for pkg in ("numpy", "numba", "torch", "jax", "micrograd", "autograd"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


def command_line(argv=None) -> str:
    """The command as the user typed it: `btjit bench ...` for the CLI (also under `python -m btjit`)."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).name if argv else "btjit"
    if prog in ("__main__.py", "btjit", "cli.py"):
        prog = "btjit"
    return shlex.join([prog] + argv[1:])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def head_lines(machine=None, command=None, date=None, markdown=False) -> list:
    """The heading: 'machine: ...' in plain text; in Markdown docs/benchmarks.md's line, e.g. "AMD EPYC 9R14 (LLVM
    `znver4`, 2 cores), btjit 0.1.0, 2026-12-02 02:40 UTC, `btjit bench --suite scale` (Python 3.11.7, ...):"."""
    m = machine_info() if machine is None else machine
    if not markdown:
        return ["machine: " + ", ".join(f"{k} {v}" for k, v in m.items() if v is not None)]
    from btjit import __version__
    llvm = f"LLVM `{m['llvm_cpu']}`, " if m.get("llvm_cpu") else ""
    vers = ", ".join(f"{k.replace('python', 'Python')} {m[k]}" for k in ("python", "numpy", "numba", "torch", "jax")
                     if m.get(k))
    cmd = command if command is not None else command_line()
    return [f"{m.get('cpu', '?')} ({llvm}{m.get('cores', '?')} cores), btjit {__version__}, {date or _now()}, "
            f"`{cmd}` ({vers}):"]


def _esc(cell) -> str:
    return str(cell).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _split_row(line: str) -> list:
    """'| a | b\\|c |' -> ['a', 'b|c']: split on unescaped pipes, then unescape."""
    cells, cur, i = [], "", 0
    body = line.strip()[1:-1]           # render_markdown writes '| ' ... ' |'
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            cur += body[i + 1]
            i += 2
            continue
        if c == "|":
            cells.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    cells.append(cur.strip())
    return cells


def render_markdown(t: Table, machine=None, command=None, date=None) -> str:
    lines = [f"## {t.title}", ""] if t.title else []
    if machine is not False:
        lines += head_lines(machine, command, date, markdown=True) + [""]
    align = t.align.ljust(len(t.head), "l")
    lines.append("| " + " | ".join(_esc(h) for h in t.head) + " |")
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    lines += ["| " + " | ".join(_esc(c) for c in row) + " |" for row in t.rows]
    if t.notes:
        lines += [""] + [n for note in t.notes for n in (note, "")][:-1]
    return "\n".join(lines) + "\n"


def render_text(t: Table, machine=None) -> str:
    """Aligned columns, two spaces apart. machine=False leaves the machine line out."""
    lines = ([t.title] if t.title else []) + (head_lines(machine) + [""] if machine is not False else [])
    grid = [tuple(str(c) for c in t.head)] + [tuple(str(c) for c in r) for r in t.rows]
    n = len(t.head)
    widths = [max(len(r[i]) for r in grid if i < len(r)) for i in range(n)]
    align = t.align.ljust(n, "l")
    for i, row in enumerate(grid):
        lines.append("  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if t.notes:
        lines += [""] + list(t.notes)
    return "\n".join(line.rstrip() for line in lines)


def render(t: Table, markdown=False, machine=None, command=None, date=None) -> str:
    """t as plain text or Markdown. machine: a machine_info() dict, None = this machine, False = no heading."""
    return render_markdown(t, machine, command, date) if markdown else render_text(t, machine)


def parse_markdown(text: str) -> tuple:
    """The (head, rows) of the pipe table in `text` (what render_markdown wrote; rows as lists of cell strings)."""
    rows = [_split_row(line) for line in text.splitlines() if line.strip().startswith("|")]
    if len(rows) < 2:
        raise ValueError("no Markdown table in the text")
    return rows[0], rows[2:]
