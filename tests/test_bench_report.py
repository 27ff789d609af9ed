"""btjit/bench/report.py, the one renderer of `btjit bench` tables: a Markdown table parses back to the same cells
(pipes and backslashes escaped), its heading names the machine, the date and the command, the plain text keeps its
columns aligned, and every suite's format_table renders through it (plain and --markdown)."""
import pytest

from btjit.bench import compile_suite, footprint, harness, mpi, nanogpt_suite, report, scale_suite

MACHINE = dict(cpu="Test CPU 9000", llvm_cpu="emeraldrapids", cores=2, python="3.11.7", numpy="2.4", numba="0.6",
               torch=None)


def test_markdown_round_trips_the_cells():
    t = report.Table(("a", "b|c", "note"), [("1", "x|y", "back\\slash"), (2.5, "", "plain")], ["a note"],
                     align="rl")
    md = report.render(t, markdown=True, machine=MACHINE, command="btjit bench --suite x", date="2026-01-02 03:04 UTC")
    head, rows = report.parse_markdown(md)
    assert head == ["a", "b|c", "note"]
    assert rows == [["1", "x|y", "back\\slash"], ["2.5", "", "plain"]]
    assert "|---:|---|---|" in md and md.rstrip().endswith("a note")


def test_markdown_heading_names_machine_date_and_command():
    t = report.Table(("x",), [("1",)])
    md = report.render(t, markdown=True, machine=MACHINE, command="btjit bench --suite scale --markdown",
                       date="2026-01-02 03:04 UTC")
    first = md.split("| x |")[0]
    for s in ("Test CPU 9000", "`emeraldrapids`", "2 cores", "2026-01-02 03:04 UTC",
              "`btjit bench --suite scale --markdown`"):
        assert s in first, s
    assert first.startswith("Test CPU 9000 (LLVM `emeraldrapids`, 2 cores), btjit ")
    live = report.render(t, markdown=True, command="c")         # this machine: its CPU and core count
    assert live.startswith(report.cpu_model()) and f"{report.os.cpu_count()} cores), btjit" in live


def test_plain_text_aligns_columns():
    t = report.Table(("name", "ms"), [("a", "1.5"), ("longer", "12.25")], ["n1"], title="T", align="lr")
    lines = report.render(t, machine=False).splitlines()
    assert lines == ["T", "name       ms", "------  -----", "a         1.5", "longer  12.25", "", "n1"]
    assert report.render(t, machine=MACHINE).splitlines()[1].startswith("machine: cpu Test CPU 9000, llvm_cpu")


def test_command_line_is_the_users():
    assert report.command_line(["/x/btjit/__main__.py", "bench", "--suite", "a b"]) == "btjit bench --suite 'a b'"
    assert report.command_line(["/usr/bin/btjit", "bench"]) == "btjit bench"


def test_parse_markdown_without_a_table_is_an_error():
    with pytest.raises(ValueError, match="no Markdown table"):
        report.parse_markdown("just text")


ROWS = {   # one ok row and one failed row of each suite, as its run() returns them
    harness: [dict(workload="E1", impl="btjit", status="ok", time_s=2e-7, peak_rss_mb=60.0, compile_s=0.4,
                   ratio_vs_btjit=1.0),
              dict(workload="E1", impl="jax", status="not installed", time_s=None, ratio_vs_btjit=None)],
    scale_suite: [dict(size="S1", impl="btjit", time_s=0.01, gflops=50.0, floor_s=0.005, peak_rss_mb=100,
                       grad_vs_torch=None, status="ok"),
                  dict(size="S1", impl="jax", time_s=None, status="not installed")],
    footprint: [dict(workload="E1", impl="btjit", status="ok", time_s=1e-6, peak_rss_mb=50.0, note="in-process"),
                dict(workload="E1", impl="c-host", status="error: no cc", time_s=None)],
    mpi: [dict(ranks=1, batch_per_rank=64, compressor="none", scaling="base", status="ok", step_ms=2.0, compute_ms=1.9,
               comm_ms=0.1, bytes_per_step=10, speedup=1.0, efficiency=1.0, n_params=5, dense_bytes=20, data="x",
               mpi="Open MPI"),
          dict(ranks=2, batch_per_rank=32, compressor="topk", ratio=0.01, scaling="strong", status="error: boom")],
    compile_suite: [dict(program="P6", title="rnn", cold=dict(status="ok", ready_s=3.0, compiled=["a"], import_s=1,
                                                               data_s=0, trace_wall_s=1, compile_s=1, first_step_s=0.1,
                                                               entries=4, loss=3.3), cached=None, warm=None, jax=None),
                    dict(program="P2", title="x", cold=dict(status="error: rc 1"), cached=None, warm=None, jax=None)],
    nanogpt_suite: [dict(impl="btjit", status="ok", wall_s=40.0, steps=2001, ms_per_step=15.0, n_params=804096,
                         val_losses=[[0, 4.2], [2001, 1.9]], threads=2, startup_s=1.5),
                    dict(impl="torch", status="not installed (torch)", wall_s=None)],
}


@pytest.mark.parametrize("mod", list(ROWS), ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_every_suite_renders_through_the_one_renderer(mod):
    rows = ROWS[mod]
    md = mod.format_table(rows, machine=MACHINE, markdown=True, command="btjit bench")
    head, cells = report.parse_markdown(md)
    assert len(cells) == len(rows) and all(len(c) == len(head) for c in cells)
    assert "Test CPU 9000" in md and "`btjit bench`" in md
    text = mod.format_table(rows, machine=False)
    assert "|" not in text.splitlines()[0] and cells[0][1] in text
    assert any(c.startswith(("not installed", "error")) for c in cells[-1]), cells[-1]   # the failure is shown


def test_cli_markdown_names_the_command(monkeypatch):
    from click.testing import CliRunner
    from btjit.cli import cli
    args = ["bench", "--only", "E3", "--peers", "none", "--reps", "1", "--markdown"]
    monkeypatch.setattr("sys.argv", ["/somewhere/btjit/__main__.py"] + args)
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "`btjit bench --only E3 --peers none --reps 1 --markdown`" in r.output
    head, rows = report.parse_markdown(r.output[r.output.index("## paper"):])
    assert head[:3] == ["workload", "impl", "time/iter"] and rows[0][:2] == ["E3", "btjit"]
