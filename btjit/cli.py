# btjit/cli.py -- the `btjit` command line (click): `train`, `sample`, `plot`, `precompile`, `cache`. The
# group turns every known error into one line on stderr and a non-zero exit (a traceback only with --debug). Other
# commands (e.g. `bench`) register on the same group with @cli.command() / cli.add_command().
# The work itself lives in btjit.train.trainer, btjit.train.sampling, btjit.train.checkpoint; nothing heavy at import.
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

from btjit.train.checkpoint import CheckpointError
from btjit.train.config import ConfigError
from btjit.train.data import DataError


class CLIError(Exception):
    """A bad command-line value; str(e) is the message."""


def _known_errors():
    from btjit.train.trainer import TrainError
    from btjit.train.sampling import SampleError
    from btjit.train.usermodel import ModelFileError
    return (ConfigError, DataError, CheckpointError, TrainError, CLIError, ModelFileError, SampleError)


class BtjitGroup(click.Group):
    """click.Group whose main() prints `error: <one line>` and exits non-zero on any failure."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        debug = "--debug" in args or bool(os.environ.get("BTJIT_DEBUG"))
        code = 0
        try:
            rv = super().main(args, prog_name or "btjit", complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.ClickException as e:
            if debug:
                raise
            hint = ""
            if isinstance(e, click.UsageError) and e.ctx is not None:
                hint = f" (see '{e.ctx.command_path} --help')"
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            code = e.exit_code
        except (click.exceptions.Abort, KeyboardInterrupt):
            if debug:
                raise
            click.echo("error: interrupted", err=True)
            code = 130
        except Exception as e:
            if debug:
                raise
            if isinstance(e, _known_errors()):
                msg = str(e)
            else:
                msg = f"{type(e).__name__}: {e} (run with --debug for the traceback)"
            click.echo(f"error: {' '.join(msg.split(chr(10)))}", err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


debug_option = click.option("--debug", is_flag=True, help="Show tracebacks on errors.")


@click.group(name="btjit", cls=BtjitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@debug_option
def cli(debug):
    """btjit: a Numba-JIT static-graph compiler and trainer for small neural nets on the CPU."""


@cli.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--data", "data_path", type=click.Path(path_type=Path),
              help="Train on this UTF-8 file (default: [data] path, else the bundled [data] corpus).")
@click.option("--out", type=click.Path(path_type=Path), help="Run dir (default: runs/<config stem>).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a config value (a TOML value), e.g. --set train.steps=100, or a key of a table in a "
                   "section, e.g. --set optim.hp.beta2=0.95. Repeatable.")
@click.option("--resume", is_flag=True, help="Continue from the latest valid checkpoint of the run dir.")
@click.option("--threads", type=int,
              help="Threads (overrides train.threads; 0 = $BTJIT_NUM_THREADS or every core, the default).")
@click.option("--distributed/--no-distributed", default=None,
              help="Data-parallel over MPI: run as `mpiexec -n N btjit train ...` (needs mpi4py: pip install "
                   "'btjit[mpi]'). Default: on when an MPI launcher started more than one process.")
@debug_option
def train(config, data_path, out, overrides, resume, threads, distributed, debug):
    """Train a model from a TOML CONFIG (e.g. configs/gpt3_tiny.toml)."""
    from btjit.train import config as config_mod
    from btjit.train import train as run_training
    if threads is not None and threads < 0:
        raise CLIError(f"--threads must be >= 0, got {threads}")
    cfg = config_mod.load(config, overrides)
    run_dir = out if out is not None else Path("runs") / config.stem
    hint = ["btjit", "train", str(config)] + [f"--set={s}" for s in overrides]
    hint += ["--data", str(data_path)] if data_path is not None else []
    hint += ["--threads", str(threads)] if threads is not None else []      # replicas: the same sums on resume
    hint += ["--out", str(out)] if out is not None else []
    hint += ["--distributed"] if distributed else []
    hint += ["--resume"]
    try:
        run_training(cfg, run_dir, data_path=data_path, resume=resume, threads=threads,
                     echo=lambda s="": click.echo(s), resume_hint=" ".join(shlex.quote(h) for h in hint),
                     distributed=distributed)
    except Exception:
        from btjit.train import distributed as dist_mod
        if dist_mod.wanted(distributed) and dist_mod.launched()[1] > 0 and not debug:
            raise click.exceptions.Exit(1) from None    # every rank failed alike; rank 0 prints it
        raise


def _load_checkpoint(path: Path):
    """A checkpoint file as given; for a run dir its best.npz (the lowest val loss), else its newest valid one."""
    from btjit.train import checkpoint
    if path.is_dir():
        best = path / checkpoint.BEST
        if best.exists():
            try:
                ck = checkpoint.load(best)
                val = (ck.meta.get("best") or {}).get("val_loss")
                click.echo(f"using {best} (step {ck.step}" + (f", val loss {val:.4f}" if val is not None else "") +
                           "; give a ckpt_*.npz file for another)", err=True)
                return ck
            except checkpoint.CorruptCheckpoint as e:
                click.echo(f"warning: skipped {e}; using the newest checkpoint instead", err=True)
        ck, skipped = checkpoint.latest_valid(path)
        if ck is None:
            bad = f" ({len(skipped)} corrupt: {', '.join(p.name for p, _ in skipped)})" if skipped else ""
            raise CheckpointError(f"no valid checkpoint (ckpt_*.npz) in {path}{bad}")
        for p, why in skipped:
            click.echo(f"warning: skipped {why}", err=True)
        return ck
    return checkpoint.load(path)


@cli.command()
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.option("--prompt", default="", help="Text to start from (GPT), or the start of each word (one word per line).")
@click.option("--n", "n_chars", type=int, default=500, show_default=True, help="Characters to generate.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the k likeliest (0 = all).")
@click.option("--seed", type=int, default=None, help="Sampling seed (default: the run's train.seed).")
@debug_option
def sample(ckpt, prompt, n_chars, temperature, top_k, seed, debug):
    """Generate text from a checkpoint file CKPT, or from a run dir (its best.npz, else its newest checkpoint)."""
    import numpy as np
    from btjit.train.checkpoint import check_compatible
    from btjit.train.config import Config
    from btjit.train.data import Vocab
    from btjit.train.sampling import Sampler, model_for
    if n_chars < 0:
        raise CLIError(f"--n must be >= 0, got {n_chars}")
    if not temperature >= 0.0:
        raise CLIError(f"--temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise CLIError(f"--top-k must be >= 0, got {top_k}")
    if seed is not None and seed < 0:               # numpy's seeds are >= 0
        raise CLIError(f"--seed must be >= 0, got {seed}")
    ck = _load_checkpoint(ckpt)
    try:
        cfg = Config.from_dict(ck.meta["config"], source=f"config in {ck.path}")
        vocab = Vocab(ck.meta["vocab"])
    except KeyError as e:
        raise CheckpointError(f"checkpoint {ck.path} has no {e.args[0]} entry") from None
    if cfg.data.format == "arrays":
        raise CLIError(f"{ck.path} is a model of array data (data.format = \"arrays\"): it has no text to sample")
    model_file = None
    if cfg.model.kind == "python":                  # the model file the run was trained with, kept in ck.meta
        from btjit.train import usermodel
        model_file = usermodel.from_checkpoint(ck)
    model = model_for(cfg.model, len(vocab), model_file, cfg.data.format)
    expected = model.init_params(np.random.default_rng(0))
    check_compatible(ck, {f"param/{k}": v for k, v in expected.items()}, prefix="param/")
    sampler = Sampler(model, vocab, ck.params, cfg.train.dtype, ck.buffers or model.buffers())
    sampler.check_prompt(prompt)
    rng = np.random.default_rng(cfg.train.seed if seed is None else seed)
    click.echo(sampler.generate(prompt, n_chars, rng, temperature, top_k))


def read_metrics(run_dir: Path):
    """(train steps, train losses, val steps, val losses) from a run dir's metrics.jsonl."""
    from btjit.train.trainer import METRICS
    path = run_dir / METRICS
    if not run_dir.is_dir():
        raise CLIError(f"run dir not found: {run_dir}")
    if not path.exists():
        raise CLIError(f"no {METRICS} in {run_dir} (is it a btjit run dir?)")
    tr, va = [], []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "train":
            tr.append((e["step"], e["loss"]))
        elif e.get("event") == "val":
            va.append((e["step"], e["val_loss"]))
    if not tr and not va:
        raise CLIError(f"{path} has no loss values yet")
    return [s for s, _ in tr], [l for _, l in tr], [s for s, _ in va], [l for _, l in va]


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="PNG to write (default: RUN_DIR/loss.png).")
@debug_option
def plot(run_dir, out, debug):
    """Plot train and val loss against step for RUN_DIR into a PNG."""
    ts, tl, vs, vl = read_metrics(run_dir)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("btjit plot needs matplotlib: pip install 'btjit[plot]'") from None
    out = out if out is not None else run_dir / "loss.png"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if ts:
        ax.plot(ts, tl, label="train loss", lw=1.2)
    if vs:
        ax.plot(vs, vl, "o-", label="val loss", lw=1.5, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"btjit run {run_dir.resolve().name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(out)
    except OSError as e:
        raise CLIError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    click.echo(f"wrote {out}")


@cli.command()
@click.option("--suite", default="paper", show_default=True,
              help="Workload suite: paper, mpi (E6 data-parallel at 1 and 2 MPI ranks; needs btjit[mpi]), "
                   "compile (start -> first step of new programs, P1-P6: --only P1,P6), or footprint (peak RSS and "
                   "step of E1, E6b64 in-process, exported to btjit.runtime and to the C host, beside the peers), "
                   "scale (the GPT at E6 and S1-S4 against torch, JAX, torch.compile with --compile), or nanogpt "
                   "(nanoGPT's CPU recipe end to end: btjit train configs/nanogpt_cpu.toml beside nanoGPT's own "
                   "loop in PyTorch eager; --only btjit to skip torch).")
@click.option("--only", default=None, metavar="E1,E6b1,...",
              help="Only these workloads (nanogpt: btjit,btjit-bf16,torch,torch-bf16).")
@click.option("--peers", default=None, metavar="torch,jax,micrograd,autograd|none",
              help="Peers to run beside btjit (default: every installed one).")
@click.option("--threads", type=int, default=None,
              help="Threads for every measurement (default: every core the process may run on; nanogpt: "
                   "each side's own default).")
@click.option("--reps", type=int, default=5, show_default=True, help="Timed repetitions (median reported).")
@click.option("--steps", type=int, default=None,
              help="nanogpt: optimizer steps instead of the recipe's 2001 (a few for a smoke test).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Also write the rows as JSON.")
@click.option("--markdown", is_flag=True,
              help="Print the table as Markdown, headed by the machine, the date and this command line.")
@click.option("--compile", "use_compile", is_flag=True, help="Add torch.compile rows for E5/E6.")
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="scale: bf16 products (btjit precision=\"bf16\" beside its float32 step, torch under autocast).")
@click.option("--profile", is_flag=True, help="Print btjit's per-op time breakdown for E5/E6 instead.")
@click.option("--debug", is_flag=True, hidden=True)
def bench(suite, only, peers, threads, reps, steps, json_path, markdown, use_compile, precision, profile, debug):
    """Run the paper's workloads (E1-E6) for btjit and each installed peer, side by side (or another --suite)."""
    from btjit.bench import report, suites
    if suite not in suites.SUITES:
        raise CLIError(f"--suite {suite!r} is not one of: {', '.join(suites.SUITES)}")
    if steps is not None and steps < 1:
        raise CLIError(f"--steps must be >= 1, got {steps}")
    if reps < 1:
        raise CLIError(f"--reps must be >= 1, got {reps}")
    if threads is not None and threads < 0:
        raise CLIError(f"--threads must be >= 0, got {threads}")
    if profile:
        from btjit.bench.btjit_impl import profile as run_profile
        from btjit.host.threads import cores
        run_profile(only or "E5,E6b1,E6b64", threads or cores())
        return
    try:
        rows, format_table = suites.run(suite, only=only, peers=peers, threads=threads, reps=reps,
                                        json_path=json_path, use_compile=use_compile, steps=steps,
                                        progress=lambda s: click.echo(s, err=True), precision=precision)
    except ValueError as e:
        raise CLIError(str(e)) from None
    click.echo(format_table(rows, markdown=markdown, command=report.command_line()))


@cli.command("export")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--data", "data_path", type=click.Path(path_type=Path),
              help="The data the model's batches are shaped by (default: the file the run read, else as `btjit train` "
                   "finds it).")
@debug_option
def export_cmd(source, out, data_path, debug):
    """Write a model's training program as a native library dir OUT (btjit.runtime.load, examples/c/train.c).
    SOURCE: a TOML config (the model as initialised) or a checkpoint / run dir (as trained, with its optimizer
    state and the learning rate its schedule had)."""
    import json
    import numpy as np
    from btjit.train import arrays, config as config_mod, data as data_mod, schedule, usermodel
    from btjit.train.registry import model_for
    from btjit.train.runparts import build_program, recorded_data_file, seeds, set_threads
    set_threads(1)                                  # an export is one thread
    ck = None
    if source.suffix == ".toml":
        cfg, vocab, model_file = config_mod.load(source), None, None
        if cfg.model.kind == "python":
            model_file = usermodel.read(cfg.model.file)
        optim_file = cfg.optim.file and usermodel.read(cfg.optim.file, "optimizer")
    else:
        ck = _load_checkpoint(source)
        cfg = config_mod.Config.from_dict(ck.meta["config"], source=f"config in {ck.path}")
        vocab = data_mod.Vocab(ck.meta["vocab"])
        model_file = usermodel.from_checkpoint(ck) if cfg.model.kind == "python" else None
        optim_file = cfg.optim.file and usermodel.from_checkpoint(ck, "optimizer")
    if ck is not None and data_path is None and not cfg.data.path:     # the file the run read (its --data)
        data_path = recorded_data_file(ck)
    ds = arrays.load(cfg, data_path, vocab)                 # any format
    model = model_for(cfg.model, len(ds.vocab), model_file, cfg.data.format)
    x, y = ds.batch("train", cfg.train.batch_size, np.random.default_rng(0))
    prog = build_program(cfg, model, model.init_params(seeds(cfg.train.seed)[0]), x, y,   # buffers: the model's
                         optim_file=optim_file)
    if ck is not None:
        prog.load_state_dict({k: v for k, v in ck.state.items() if not k.startswith("dist/")})
        prog.lr = schedule.for_config(cfg)(ck.step)
    from btjit.export.build import ExportError
    try:
        path = prog.export(out, {"vocab.json": json.dumps(ds.vocab.chars).encode()})
    except ExportError as e:
        raise CLIError(str(e)) from None
    click.echo(f"exported {model.arch} ({prog.n_params:,} params" + (f", step {ck.step}" if ck else "") +
               f", lr {prog.lr:g}, batch {tuple(x.shape)}) to {path}: load it with btjit.runtime.load({str(path)!r}),"
               f" or from C (examples/c/train.c)")


@cli.command()
@debug_option
def precompile(debug):
    """Compile the whole kernel library (float32 and float64) in parallel processes, and measure the GEMM rules
    (btjit/kernels/gemm_rule.py) programs would otherwise measure at their first use; nothing requires it."""
    import time
    from btjit.kernels import gemm_rule, library
    seconds = library.precompile(click.echo)
    t0 = time.perf_counter()
    click.echo(f"GEMM rules: micro-kernels up to B of {gemm_rule.micro_b_max()} floats, B^T on few rows up to "
               f"{gemm_rule.nt_macs()} multiply-adds, chains past 8 MB {'' if gemm_rule.ew_stream() else 'not '}"
               f"streamed ({time.perf_counter() - t0:.1f} s)")
    click.echo(f"done in {seconds + time.perf_counter() - t0:.1f} s; {len(library.cache_entries())} files in "
               f"{library.cache_dir()}")


@cli.group(invoke_without_command=True)
@click.pass_context
def cache(ctx):
    """Print the compile cache: its dir, entries and size (`btjit cache clear` empties it)."""
    if ctx.invoked_subcommand is None:
        from btjit.kernels import library
        files = library.cache_entries()
        kernels = [f for f, _ in files if f.suffix == ".py" and f.parent.name.startswith("lib-")]
        click.echo(f"cache dir: {library.cache_dir()}\n"
                   f"library: {len(kernels)} kernel entries ({', '.join(sorted(f.stem for f in kernels)) or 'none'})\n"
                   f"files: {len(files)}, {sum(n for _, n in files) / 1e6:.2f} MB")


@cache.command("clear")
def cache_clear():
    """Remove everything in the cache dir."""
    from btjit.kernels import library
    click.echo(f"removed {library.clear_cache()} files from {library.cache_dir()}")


def main(argv=None):
    """Console-script entry point (`btjit = "btjit.cli:main"`)."""
    cli.main(args=argv, prog_name="btjit")


if __name__ == "__main__":
    main()
