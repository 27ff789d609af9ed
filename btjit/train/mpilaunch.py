"""Starting an N-rank `btjit train` job from Python or a notebook: find an mpiexec (find_mpiexec), the command
and environment that start n processes under it (mpiexec_command: Open MPI's switches for root and for more
processes than cores), and `launch`, which runs the job and returns its result. The ranks themselves run
btjit/train/distributed.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from btjit.train.distributed import INSTALL_HINT, DistributedError
from btjit.train.trainer import TrainError


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (a pip-installed MPICH/Open MPI), else the first on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpiexec_command(n: int, mpiexec: str | None = None) -> tuple[list[str], dict]:
    """(argv prefix, environment additions) to start n processes: Open MPI refuses to run as root and to
    start more processes than cores unless told; MPICH needs nothing."""
    exe = mpiexec or find_mpiexec()
    if exe is None:
        raise DistributedError(f"no mpiexec found: {INSTALL_HINT}")
    try:
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DistributedError(f"cannot run {exe} --version: {e}") from None
    argv, env = [exe, "-n", str(int(n))], {}
    if "open mpi" in ver.lower() or "open-mpi" in ver.lower() or "openrte" in ver.lower():
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if n > (os.cpu_count() or 1):
            argv.append("--oversubscribe")
    return argv, env


def launch(config, n: int = 2, out=None, data=None, overrides=(), resume: bool = False, threads=None,
           echo=None, mpiexec: str | None = None, timeout: float | None = None):
    """Run `btjit train` on n MPI processes from Python (e.g. a notebook): starts `mpiexec -n n python -m
    btjit.cli train ... --distributed`, streams rank 0's output to echo, and returns a btjit.train.trainer.Result.
    config: a TOML path or a btjit.train.config.Config. Raises TrainError with the job's last error line."""
    from btjit.train import checkpoint as ckpt_mod
    from btjit.train.config import Config
    from btjit.train.trainer import METRICS, Result
    import json
    echo = echo or (lambda s="": print(s, flush=True))
    tmp = None
    if isinstance(config, Config):
        tmp = tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="btjit_", delete=False)
        tmp.write(config.to_toml())
        tmp.close()
        path = Path(tmp.name)
        out = out if out is not None else Path("runs") / "distributed"
    else:
        path = Path(config)
        out = out if out is not None else Path("runs") / path.stem
    argv, env = mpiexec_command(n, mpiexec)
    cmd = argv + [sys.executable, "-m", "btjit.cli", "train", str(path), "--out", str(out), "--distributed"]
    cmd += [f"--set={s}" for s in overrides]
    cmd += ["--data", str(data)] if data is not None else []
    cmd += ["--threads", str(threads)] if threads is not None else []
    cmd += ["--resume"] if resume else []
    errors = []
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **env}) as proc:
            t0 = time.monotonic()
            for line in proc.stdout:
                line = line.rstrip("\n")
                echo(line)
                if line.startswith("error") or "error:" in line:
                    errors.append(line)
                if timeout is not None and time.monotonic() - t0 > timeout:
                    proc.kill()
                    raise TrainError(f"distributed run did not finish within {timeout:g} s")
            code = proc.wait()
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    if code != 0:
        raise TrainError(errors[-1].split("error:", 1)[-1].strip() if errors else
                         f"mpiexec exited with code {code}")
    ck, _ = ckpt_mod.latest_valid(out)
    val = None
    mp = Path(out) / METRICS
    if mp.exists():
        for line in mp.read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "val":
                val = e["val_loss"]
    return Result(ck.step if ck else 0, ck.path if ck else None, val_loss=val)
