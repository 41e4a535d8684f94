"""Start N plain processes that find their place in environment variables, as
a cluster (torchrun, Kubeflow, an indexed Job) starts them: no kdrun, no
mpiexec. A hard timeout, each rank's output kept, leftovers found.

Usage::

    from tests._selfstart import run_self_started

    result = run_self_started("tests/multiprocess/workers/collectives.py", np=2, timeout=90)
    result.check()

Each process gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless ``variables``
gives others (a function of the rank returning the variables to add), plus
the environment of ``tests._mp.job_environment`` (the tree first on
``PYTHONPATH``, a job tag). The result is a ``tests._mp.JobResult`` whose
``returncode`` is the first non-zero exit status of the ranks (0 when all
succeeded); on timeout every process of the job is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from keras_dist.launcher.cleanup import kill_processes_with_env
from tests._mp import REPO_ROOT, TAG_ENV, JobResult, _cmdline, job_environment
from tests._mp import processes_with_env as _processes_with_env


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous binds it again at once)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def torchrun_variables(np: int, port: int, host: str = "127.0.0.1"):
    """What torchrun gives rank r of np processes on one machine."""
    def variables(rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(np), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(np), "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    return variables


class SelfStartedJob:
    """N processes started with their placement in their environment."""

    def __init__(self, command: list[str], np: int, env: dict[str, str],
                 variables: Callable[[int], Mapping[str, str]], cwd: str) -> None:
        self.args = command
        self.tag = env[TAG_ENV]
        self._scratch = tempfile.TemporaryDirectory(prefix="kdself-")
        self._start = time.monotonic()
        self.procs: list[subprocess.Popen] = []
        self.paths: list[tuple[str, str]] = []
        for rank in range(np):
            out = os.path.join(self._scratch.name, f"rank{rank}.stdout")
            err = os.path.join(self._scratch.name, f"rank{rank}.stderr")
            self.paths.append((out, err))
            with open(out, "wb") as out_file, open(err, "wb") as err_file:
                self.procs.append(subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file,
                    env={**env, **variables(rank)}, cwd=cwd, start_new_session=True))

    def kill_rank(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> JobResult:
        deadline = self._start + timeout
        timed_out = False
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        duration = time.monotonic() - self._start
        if timed_out:
            for proc in self.procs:
                proc.kill()
            codes = [proc.wait() for proc in self.procs]
        # The rendezvous server outlives its rank 0 by at most a moment.
        settle = time.monotonic() + 5
        while _processes_with_env(TAG_ENV, self.tag) and time.monotonic() < settle:
            time.sleep(0.05)
        leftovers = [_cmdline(pid) for pid in _processes_with_env(TAG_ENV, self.tag)]
        kill_processes_with_env(TAG_ENV, self.tag)
        try:
            return JobResult(
                args=self.args, returncode=next((c for c in codes if c != 0), 0),
                launcher_stdout="", launcher_stderr="",
                rank_stdout={r: Path(o).read_bytes().decode(errors="replace")
                             for r, (o, _) in enumerate(self.paths)},
                rank_stderr={r: Path(e).read_bytes().decode(errors="replace")
                             for r, (_, e) in enumerate(self.paths)},
                timed_out=timed_out, duration=duration, tag=self.tag,
                leftovers=[line for line in leftovers if line])
        finally:
            self._scratch.cleanup()


def start_self_started(script_or_args: str | os.PathLike | Sequence[str], np: int,
                       env: Mapping[str, str] | None = None, *,
                       variables: Callable[[int], Mapping[str, str]] | None = None,
                       cwd: str | os.PathLike | None = None) -> SelfStartedJob:
    """Starts the processes without waiting; finish with ``job.wait(timeout)``."""
    if isinstance(script_or_args, (str, os.PathLike)):
        command = [sys.executable, os.fspath(script_or_args)]
    else:
        command = [os.fspath(arg) for arg in script_or_args]
    full_env = job_environment(env, None)
    if variables is None:
        variables = torchrun_variables(np, free_port())
    return SelfStartedJob(command, np, full_env, variables,
                          os.fspath(cwd) if cwd is not None else str(REPO_ROOT))


def run_self_started(script_or_args: str | os.PathLike | Sequence[str], np: int,
                     timeout: float, env: Mapping[str, str] | None = None, *,
                     variables: Callable[[int], Mapping[str, str]] | None = None,
                     cwd: str | os.PathLike | None = None) -> JobResult:
    """Runs the processes and returns their result; never hangs."""
    job = start_self_started(script_or_args, np, env, variables=variables, cwd=cwd)
    return job.wait(timeout)
