"""Finding mpiexec, telling its flavour, and building its command line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from keras_dist.launcher.hosts import format_hosts
from keras_dist.launcher.options import LaunchOptions


def find_mpiexec() -> str | None:
    """The mpiexec beside ``sys.executable`` (the mpich wheel's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


def mpi_flavor(mpiexec: str) -> str:
    """From ``mpiexec --version``: ``"openmpi5"`` (Open MPI 5 and later),
    ``"openmpi"`` (earlier Open MPI) or ``"mpich"`` (hydra, also Intel MPI)."""
    try:
        result = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30,
            stdin=subprocess.DEVNULL,
        )
        text = result.stdout + result.stderr
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text:
        match = re.search(r"\(Open MPI\) (\d+)\.", text)
        return "openmpi5" if match and int(match.group(1)) >= 5 else "openmpi"
    return "mpich"


def build_command(
    mpiexec: str, flavor: str, options: LaunchOptions, job_env: dict[str, str]
) -> list[str]:
    """The mpiexec command line that runs ``options.command`` with ``job_env`` set.

    In a Slurm job (``options.slurm``), hydra is told to start its proxies with
    ``srun`` (``-launcher slurm``) on the job's nodes; Open MPI's mpirun finds
    the job's nodes and launches through Slurm by itself, so it is given no hosts.
    ``options.bind_to`` goes to both as their ``bind-to`` (Open MPI is told
    ``none`` too: it would otherwise pin jobs of one or two ranks to cores, which
    starves a rank's framework threads; hydra pins nothing unless told).
    """
    args = [mpiexec]
    if flavor.startswith("openmpi"):
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-run-as-root")
        args += ["--oversubscribe", "--bind-to", options.bind_to]
        if options.hosts and not options.slurm:
            args += ["-H", format_hosts(options.hosts)]
        for name, value in job_env.items():
            args += ["-x", f"{name}={value}"]
        if options.output_dir and flavor == "openmpi5":
            args += ["--output", f"dir={options.output_dir}"]
        elif options.output_dir:
            args += ["--output-filename", options.output_dir]
        args += ["-np", str(options.num_proc)]
    else:
        if options.slurm:
            args += ["-launcher", "slurm"]
        if options.hosts:
            args += ["-hosts", format_hosts(options.hosts)]
        if options.bind_to != "none":
            args += ["-bind-to", options.bind_to]
        for name, value in job_env.items():
            args += ["-genv", name, value]
        if options.output_dir:
            pattern = os.path.join(options.output_dir, "rank%r")
            args += ["-outfile-pattern", pattern + ".stdout", "-errfile-pattern",
                     pattern + ".stderr"]
        args += ["-n", str(options.num_proc)]
    return args + list(options.command)
