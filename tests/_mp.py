"""Run a command on N ranks under ``kdrun`` from a test, with a hard timeout.

Usage::

    from tests._mp import run_job

    result = run_job("tests/multiprocess/worker_allreduce.py", np=2, timeout=60)
    assert result.returncode == 0, result.describe()
    # or, the same in one call:
    run_job(["python", "-c", "import keras_dist as kd; kd.init()"], np=3, timeout=60).check()

To signal a job while it runs (Ctrl-C tests), ``job = start_job(...)``, then
``job.send_signal(signal.SIGINT)`` and ``result = job.wait(timeout)``.

``run_job`` starts ``python -m keras_dist.run -np N --output-dir DIR COMMAND``
in a process group of its own. The repository root is put first on
``PYTHONPATH`` (so the tree is tested, installed or not) and
``PYTHONUNBUFFERED=1`` is set (so output printed before a crash or a kill is
not lost). Each rank's stdout/stderr is written to its own file, so a result
holds every rank's output separately, byte for byte (a ``\\r`` stays one), and
``result.describe()`` formats all of it for an assertion message.

On timeout, kdrun first gets SIGTERM (its own clean shutdown), then, 5 s
later, its process group and every process carrying the job's tag
(``KERAS_DIST_TEST_TAG`` in the environment; MPICH runs each rank in a session
of its own) are SIGKILLed. The result then has ``timed_out=True`` and
``returncode`` is what kdrun returned, or -9 if it had to be killed.

Always pass ``timeout`` well under the test's pytest-timeout, so the helper's
clean-up runs before pytest gives up on the test.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from keras_dist.launcher.cleanup import find_job_processes, kill_processes_with_env

REPO_ROOT = Path(__file__).resolve().parent.parent
TAG_ENV = "KERAS_DIST_TEST_TAG"
#: What a job on the TensorFlow backend hides from its processes unless told
#: otherwise (``hide=``): a TensorFlow-only install has neither, and with them
#: installed each rank's start-up takes 1.4 s longer (tests/_tf_only).
TF_ONLY_HIDDEN = ("jax", "jaxlib", "matplotlib")
_HIDING_DIR = Path(__file__).resolve().parent / "_tf_only"


@dataclasses.dataclass
class JobResult:
    """What a kdrun job did.

    Attributes:
        args: the kdrun command line that ran.
        returncode: kdrun's exit status (-9 when the helper had to kill it).
        stdout: every rank's stdout in rank order, then kdrun's/mpiexec's own stdout.
        stderr: kdrun's/mpiexec's own stderr, then every rank's stderr in rank order.
        launcher_stdout: what kdrun and mpiexec themselves printed to stdout
            (and the ranks' labelled lines without ``per_rank_output``).
        launcher_stderr: what kdrun and mpiexec themselves printed to stderr
            (kdrun's "kdrun: rank 1 ... raised ..." lines are here).
        rank_stdout: ``{rank: text}`` for every rank that wrote a stdout file.
        rank_stderr: ``{rank: text}`` for every rank that wrote a stderr file.
        timed_out: the job ran past ``timeout`` and was stopped by the helper.
        duration: seconds from start until kdrun ended (or was killed).
        tag: the value of ``KERAS_DIST_TEST_TAG`` given to every process of the job.
        leftovers: ``"pid cmdline"`` of processes of the job still alive once
            kdrun had ended (the helper then killed them); kdrun should leave none.
    """

    args: list[str]
    returncode: int
    launcher_stdout: str
    launcher_stderr: str
    rank_stdout: dict[int, str]
    rank_stderr: dict[int, str]
    timed_out: bool
    duration: float
    tag: str
    leftovers: list[str] = dataclasses.field(default_factory=list)

    @property
    def stdout(self) -> str:
        ranks = "".join(self.rank_stdout[rank] for rank in sorted(self.rank_stdout))
        return ranks + self.launcher_stdout

    @property
    def stderr(self) -> str:
        ranks = "".join(self.rank_stderr[rank] for rank in sorted(self.rank_stderr))
        return self.launcher_stderr + ranks

    def output(self, rank: int) -> str:
        """Rank ``rank``'s stdout followed by its stderr."""
        return self.rank_stdout.get(rank, "") + self.rank_stderr.get(rank, "")

    def describe(self) -> str:
        """Everything the job printed, rank by rank, for an assertion message."""
        return format_job_output(self)

    def check(self) -> JobResult:
        """Raises ``AssertionError`` with every rank's output unless the job succeeded."""
        if self.returncode != 0 or self.timed_out:
            raise AssertionError(self.describe())
        return self


def _block(title: str, text: str, limit: int = 20000) -> str:
    if not text:
        return f"----- {title}: (empty)\n"
    if len(text) > limit:
        text = f"[... {len(text) - limit} characters cut ...]\n" + text[-limit:]
    return f"----- {title}:\n{text}{'' if text.endswith(chr(10)) else chr(10)}"


def _is_failed_check(line: str) -> bool:
    return line.startswith("CHECK ") and (" FAILED rank=" in line or " NOT RUN rank=" in line)


def failed_check_lines(result: JobResult) -> list[str]:
    """Every rank's ``CHECK <name> FAILED|NOT RUN rank=R: ...`` line, in rank order."""
    lines = [line for rank in sorted(result.rank_stdout)
             for line in result.rank_stdout[rank].splitlines() if _is_failed_check(line)]
    # without per_rank_output, kdrun labels the ranks' lines: "[1] CHECK ..."
    labelled = (line.partition("] ")[2] for line in result.launcher_stdout.splitlines())
    return lines + [line for line in labelled if _is_failed_check(line)]


def format_job_output(result: JobResult) -> str:
    """Formats a job's exit status and every rank's stdout and stderr, separately."""
    state = "TIMED OUT, killed" if result.timed_out else "ended"
    parts = [
        f"\n===== kdrun job {state} with exit code {result.returncode} after "
        f"{result.duration:.1f}s\n      {' '.join(result.args)}\n",
    ]
    failed_checks = failed_check_lines(result)
    if failed_checks:
        parts.append(_block("failed checks, every rank (tests/multiprocess/workers/_checks.py)",
                            "\n".join(failed_checks) + "\n"))
    parts += [
        _block("kdrun/mpiexec stdout", result.launcher_stdout),
        _block("kdrun/mpiexec stderr", result.launcher_stderr),
    ]
    for rank in sorted(set(result.rank_stdout) | set(result.rank_stderr)):
        parts.append(_block(f"rank {rank} stdout", result.rank_stdout.get(rank, "")))
        parts.append(_block(f"rank {rank} stderr", result.rank_stderr.get(rank, "")))
    if result.leftovers:
        parts.append(_block("processes left running after kdrun ended",
                            "\n".join(result.leftovers) + "\n"))
    parts.append("=====\n")
    return "".join(parts)


#: Pids of live processes whose environment holds ``name=value`` (a /proc scan).
processes_with_env = find_job_processes


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return f"{pid} " + handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_tagged(tag: str) -> None:
    kill_processes_with_env(TAG_ENV, tag)


def _read_outputs(directory: str) -> tuple[dict[int, str], dict[int, str]]:
    stdout: dict[int, str] = {}
    stderr: dict[int, str] = {}
    for path in Path(directory).iterdir():
        # kdrun's layout (MPICH's too): rank<r>.stdout / rank<r>.stderr
        name, _, kind = path.name.partition(".")
        if name.startswith("rank") and name[4:].isdigit() and kind in ("stdout", "stderr"):
            target = stdout if kind == "stdout" else stderr
            target[int(name[4:])] = path.read_bytes().decode(errors="replace")
    return stdout, stderr


class RunningJob:
    """A kdrun job started by ``start_job``; ``wait()`` turns it into a ``JobResult``."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str, per_rank_output: bool):
        self.args = args
        self.tag = env[TAG_ENV]
        self._scratch = tempfile.TemporaryDirectory(prefix="kdtest-")
        self._output_dir = os.path.join(self._scratch.name, "out")
        if per_rank_output:
            self.args = [*args[:5], "--output-dir", self._output_dir, *args[5:]]
        self._out_path = os.path.join(self._scratch.name, "stdout")
        self._err_path = os.path.join(self._scratch.name, "stderr")
        self._start = time.monotonic()
        with open(self._out_path, "wb") as out, open(self._err_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                cwd=cwd, start_new_session=True,
            )

    @property
    def output_dir(self) -> str:
        """Where kdrun writes each rank's output while the job runs (``--output-dir``)."""
        return self._output_dir

    @property
    def pid(self) -> int:
        """kdrun's pid (send it signals with ``send_signal``)."""
        return self.proc.pid

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> JobResult:
        """Waits up to ``timeout`` s (from now) for kdrun, killing the whole job past it."""
        timed_out = False
        try:
            returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.proc.send_signal(signal.SIGTERM)
            try:
                returncode = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                returncode = self.proc.wait()
        finally:
            duration = time.monotonic() - self._start
            leftovers = [_cmdline(pid) for pid in processes_with_env(TAG_ENV, self.tag)]
            self.kill()
        try:
            rank_stdout, rank_stderr = (
                _read_outputs(self._output_dir) if os.path.isdir(self._output_dir) else ({}, {})
            )
            return JobResult(
                args=self.args,
                returncode=returncode,
                launcher_stdout=Path(self._out_path).read_bytes().decode(errors="replace"),
                launcher_stderr=Path(self._err_path).read_bytes().decode(errors="replace"),
                rank_stdout=rank_stdout,
                rank_stderr=rank_stderr,
                timed_out=timed_out,
                duration=duration,
                tag=self.tag,
                leftovers=[line for line in leftovers if line],
            )
        finally:
            self._scratch.cleanup()

    def kill(self) -> None:
        """SIGKILLs kdrun's process group and every process carrying the job's tag."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        _kill_tagged(self.tag)


def start_job(
    script_or_args: str | os.PathLike | Sequence[str],
    np: int,
    env: Mapping[str, str] | None = None,
    *,
    kdrun_args: Sequence[str] = (),
    cwd: str | os.PathLike | None = None,
    per_rank_output: bool = True,
    hide: Sequence[str] | None = None,
) -> RunningJob:
    """Starts a kdrun job without waiting (to signal it); arguments as in ``run_job``.

    Always finish with ``job.wait(timeout)`` (in a ``try/finally`` or with
    ``job.kill()``), so nothing of the job outlives the test.
    """
    if isinstance(script_or_args, (str, os.PathLike)):
        command = [sys.executable, os.fspath(script_or_args)]
    else:
        command = [os.fspath(arg) for arg in script_or_args]
    full_env = job_environment(env, hide)
    args = [sys.executable, "-m", "keras_dist.run", "-np", str(np), *kdrun_args, "--",
            *command]
    return RunningJob(args, full_env, os.fspath(cwd) if cwd is not None else str(REPO_ROOT),
                      per_rank_output)


def job_environment(env: Mapping[str, str] | None, hide: Sequence[str] | None) -> dict[str, str]:
    """A job's environment: this process's, with ``env`` and ``hide`` as in
    ``run_job``, the tree first on ``PYTHONPATH`` and a fresh job tag."""
    full_env = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    if hide is None:
        tensorflow = full_env.get("KERAS_BACKEND", "tensorflow") == "tensorflow"
        hide = TF_ONLY_HIDDEN if tensorflow else ()
    path = full_env.get("PYTHONPATH", "")
    full_env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    if hide:
        full_env["PYTHONPATH"] = f"{_HIDING_DIR}{os.pathsep}{full_env['PYTHONPATH']}"
        full_env["KERAS_DIST_TEST_HIDE"] = ",".join(hide)
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env[TAG_ENV] = secrets.token_hex(8)
    return full_env


def run_job(
    script_or_args: str | os.PathLike | Sequence[str],
    np: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    *,
    kdrun_args: Sequence[str] = (),
    cwd: str | os.PathLike | None = None,
    per_rank_output: bool = True,
    hide: Sequence[str] | None = None,
) -> JobResult:
    """Runs ``kdrun -np np ...`` and returns its result; never hangs.

    Args:
        script_or_args: a Python script path (run as ``sys.executable SCRIPT``),
            or a full command (a list: ``[sys.executable, "-c", code]``,
            ``["python", script, "--flag"]``), passed to kdrun as is.
        np: number of ranks.
        timeout: seconds before the whole job is killed.
        env: variables added to (or overriding) this process's environment.
            A value of ``None`` removes that variable.
        kdrun_args: extra kdrun options (``["-H", "localhost:2"]``, ...).
        cwd: working directory (default: the repository root).
        per_rank_output: give kdrun ``--output-dir`` so each rank's output is
            kept apart. With False the ranks' output is in ``launcher_stdout`` /
            ``launcher_stderr``, as kdrun prints it (``[rank] line``).
        hide: top-level packages the job's processes cannot import. Default:
            ``TF_ONLY_HIDDEN`` for a job on the TensorFlow backend (no
            ``KERAS_BACKEND``, or ``tensorflow``), nothing for the others;
            ``()`` hides nothing.

    Returns:
        A ``JobResult``; check it with ``result.check()`` or assert on
        ``result.returncode`` with ``result.describe()`` as the message.
    """
    job = start_job(script_or_args, np, env, kdrun_args=kdrun_args, cwd=cwd,
                    per_rank_output=per_rank_output, hide=hide)
    return job.wait(timeout)
