"""A rank's supervisor: ``python -m keras_dist.launcher.supervisor -- COMMAND...``.

kdrun has mpiexec start this in place of each rank's command. It runs COMMAND
as its child (no shell) and reports to kdrun, through its own stdout (which
mpiexec forwards from every host: no shared file system is needed):

- the child's stdout and stderr, a line at a time, never a part of a line
  mixed with another rank's;
- facts the child reports through a private channel (``keras_dist`` writes
  them, see ``keras_dist._runtime.jobstatus``): started (``init()`` done),
  finished (clean ``shutdown()``), and an unhandled exception, with the rank
  it blames when it is the consequence of another rank's failure;
- how the child ended: exit status or signal, the CLOCK_MONOTONIC and wall
  times at which this supervisor saw it, host and pid.

A supervisor that the process manager kills records nothing: kdrun reads that
as "stopped by the launcher".

Frames (one per line, each written with a single ``write`` of at most
``FRAME_BYTES``, so below ``PIPE_BUF`` and atomic; hydra's proxy reads up to
64 KiB, a whole pipe, so its reads end between frames)::

    \\x1ekd1 <rank> <kind> <payload>\\n

``kind`` is ``o`` (stdout) or ``e`` (stderr) followed by how the piece ends:
``n`` (the line ended with ``\\n``), ``r`` (with ``\\r``), ``+`` (the line goes
on in the next frame of that stream) or ``.`` (the stream ended without a line
end); the payload is the raw bytes without the terminator. ``R`` frames carry
a record as one JSON object.

The child channel is one end of a Unix socket pair, its fd in
``KERAS_DIST_SUPERVISOR_FD``: JSON lines from the child; after an ``error``
record, once the child's pending output and the record have been read by the
process manager, the supervisor answers one byte, so the child's MPI abort
(after which the process manager may SIGKILL this supervisor and stop reading)
cannot overtake them. The exit record is likewise read before this process exits.

This file uses the standard library only, and kdrun runs it by path: importing
the ``keras_dist`` package would cost every rank a second of start-up.
"""

from __future__ import annotations

import array
import fcntl
import functools
import json
import os
import re
import selectors
import signal
import socket
import stat
import subprocess
import sys
import termios
import time

SUPERVISOR_FD_ENV = "KERAS_DIST_SUPERVISOR_FD"
#: Set by kdrun in an elastic job (its value is the elastic job's identifier).
ELASTIC_ENV = "KERAS_DIST_ELASTIC_JOB"
#: Set by ``kdrun --gpu-per-rank``: each rank sees the GPU at its local rank.
GPU_PER_RANK_ENV = "KERAS_DIST_GPU_PER_RANK"
#: Environment variables naming a rank's place on its host (hydra, Open MPI,
#: PMIx, Slurm).
LOCAL_RANK_ENV = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK",
                  "SLURM_LOCALID")
#: How often a supervisor of an elastic job says it is alive.
HEARTBEAT_SECONDS = 1.0
MAGIC = b"\x1ekd1 "
#: Largest frame written at once: below PIPE_BUF (4096), so a pipe write is atomic.
FRAME_BYTES = 4000
#: How long, after the child exited, output from processes it left holding its
#: stdout/stderr is still forwarded.
DRAIN_SECONDS = 1.0
#: Longest wait for the process manager to read what was sent before the child
#: may abort the job, or this process exit (a stopped reader must not hang a rank).
DELIVERY_SECONDS = 2.0
#: Environment variables naming a rank (hydra, PMIx, Open MPI, Slurm) and the job size.
RANK_ENV = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_LINE_END = re.compile(rb"[\r\n]")
_READ_BYTES = 65536


def rank_and_size(environ) -> tuple[int, int | None]:
    """This rank and the job size, from the process manager's environment.

    Raises:
        ValueError: no rank variable is set.
    """
    rank = next((environ[name] for name in RANK_ENV if environ.get(name, "").isdigit()), None)
    if rank is None:
        raise ValueError(
            f"the supervisor must run under a process manager that sets one of "
            f"{', '.join(RANK_ENV)}. Received none of them."
        )
    size = next((environ[name] for name in SIZE_ENV if environ.get(name, "").isdigit()), None)
    return int(rank), int(size) if size is not None else None


def gpu_for_local_rank(environ) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a rank of ``kdrun --gpu-per-rank`` (None
    when the option is off): the entry at the rank's local rank of the list
    kdrun was given, else the local rank itself.

    Raises:
        ValueError: no local-rank variable is set, or the list has no entry
            for this local rank (ranks must not share a GPU silently).
    """
    if not environ.get(GPU_PER_RANK_ENV):
        return None
    local = next((environ[name] for name in LOCAL_RANK_ENV
                  if environ.get(name, "").isdigit()), None)
    if local is None:
        raise ValueError(
            f"kdrun --gpu-per-rank needs the rank's local rank from its process manager, "
            f"in one of {', '.join(LOCAL_RANK_ENV)}. Received none of them.")
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return local
    gpus = [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    if int(local) >= len(gpus):
        raise ValueError(
            f"kdrun --gpu-per-rank gives each rank of a host one GPU, and local rank {local} "
            f"has none left: CUDA_VISIBLE_DEVICES lists {len(gpus)} ({listed!r}). Run at "
            "most that many ranks per host.")
    return gpus[int(local)]


def frame(rank: int, kind: str, payload: bytes) -> bytes:
    """One frame: ``MAGIC rank kind payload\\n`` (``payload`` holds no ``\\n``)."""
    return b"%s%d %s %s\n" % (MAGIC, rank, kind.encode(), payload)


def payload_limit(rank: int) -> int:
    """The most payload bytes a frame of ``rank`` holds within ``FRAME_BYTES``."""
    return FRAME_BYTES - len(frame(rank, "o+", b""))


def record_frame(rank: int, record: dict) -> bytes:
    """A record frame; an over-long error message is shortened to fit one frame."""
    record = dict(record)
    for _ in range(8):
        data = frame(rank, "R", json.dumps(record, separators=(",", ":")).encode())
        error = record.get("error")
        if len(data) <= FRAME_BYTES or not error or not error.get("message"):
            return data
        message = error["message"]
        record["error"] = dict(error, message=message[: len(message) // 2] + " [...]")
    return data


class LineSplitter:
    """Cuts one output stream into frames: whole lines, ``\\r`` segments, long lines in pieces."""

    def __init__(self, rank: int, stream: str) -> None:
        self._rank = rank
        self._stream = stream
        self._limit = payload_limit(rank)
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Frames for ``data``; what follows the last line end waits for more."""
        frames = []
        data = self._pending + data
        start = 0
        for end in _LINE_END.finditer(data):
            frames += self._pieces(data[start:end.start()], "n" if end[0] == b"\n" else "r")
            start = end.end()
        rest = data[start:]
        while len(rest) > self._limit:
            frames.append(frame(self._rank, self._stream + "+", rest[: self._limit]))
            rest = rest[self._limit:]
        self._pending = rest
        return frames

    def close(self) -> list[bytes]:
        """Frames for what is left when the stream ends."""
        rest, self._pending = self._pending, b""
        return self._pieces(rest, ".") if rest else []

    def _pieces(self, segment: bytes, end: str) -> list[bytes]:
        frames = []
        while len(segment) > self._limit:
            frames.append(frame(self._rank, self._stream + "+", segment[: self._limit]))
            segment = segment[self._limit:]
        frames.append(frame(self._rank, self._stream + end, segment))
        return frames


def _set_pdeathsig(expected_parent: int) -> None:
    """Be SIGKILLed when the parent dies; exit now if it already has."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != expected_parent:
        os._exit(1)


def _readable_stdin() -> bool:
    """Whether stdin is a pipe or socket this process may read notices from."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _pmi_fds(environ) -> tuple[int, ...]:
    """Descriptors the process manager handed down for MPI start-up (hydra's ``PMI_FD``)."""
    value = environ.get("PMI_FD", "")
    return (int(value),) if value.isdigit() else ()


class Supervisor:
    """Runs one rank's command and reports on it (see the module docstring)."""

    def __init__(self, command: list[str], environ=None, out_fd: int = 1) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.rank, self.size = rank_and_size(self.environ)
        gpu = gpu_for_local_rank(self.environ)
        if gpu is not None:
            self.environ["CUDA_VISIBLE_DEVICES"] = gpu
        self.command = command
        self.out_fd = out_fd
        self.host = socket.gethostname()
        self.started = False
        self.finished = False
        self.error: dict | None = None
        self.stopped_by: str | None = None
        self._output_ok = True
        self._proc: subprocess.Popen | None = None

    # --- sending ---------------------------------------------------------------

    def _send(self, frames: list[bytes]) -> None:
        # Whole frames, several to a write while they fit in FRAME_BYTES: each
        # write stays atomic, and a rank printing short lines costs few calls.
        batches: list[bytes] = []
        for data in frames:
            if batches and len(batches[-1]) + len(data) <= FRAME_BYTES:
                batches[-1] += data
            else:
                batches.append(data)
        for data in batches:
            if not self._output_ok:
                return
            try:
                written = os.write(self.out_fd, data)
                while written < len(data):  # only when out_fd is not a pipe
                    written += os.write(self.out_fd, data[written:])
            except OSError:
                self._output_ok = False  # kdrun is gone; keep draining the child

    def _send_record(self, record: dict) -> None:
        self._send([record_frame(self.rank, dict(record, rank=self.rank, host=self.host))])

    def _wait_delivered(self) -> None:
        """Returns once the process manager has read everything sent (at most
        ``DELIVERY_SECONDS``).

        Written is not delivered: hydra's proxy stops reading the moment it is
        told to kill the job (after an MPI abort, or this process's exit), and
        what is still in the pipe then is lost. The proxy passes on what it
        read at once, so an empty pipe means the records are on their way.
        """
        if not self._output_ok or not stat.S_ISFIFO(os.fstat(self.out_fd).st_mode):
            return
        deadline = time.monotonic() + DELIVERY_SECONDS
        unread = array.array("i", [0])
        while time.monotonic() < deadline:
            try:
                fcntl.ioctl(self.out_fd, termios.FIONREAD, unread)
            except OSError:
                return
            if unread[0] == 0:
                return
            time.sleep(0.001)

    # --- running ---------------------------------------------------------------

    def run(self) -> int:
        """Runs the command to its end; returns this process's exit status."""
        received: list[int] = []

        def on_signal(signum, frame):
            received.append(signum)
            if self._proc is not None and self._proc.returncode is None:
                self.stopped_by = signal.Signals(signum).name
                try:
                    self._proc.send_signal(signum)
                except OSError:
                    pass

        for signum in _FORWARDED_SIGNALS:
            signal.signal(signum, on_signal)
        parent_end, child_end = socket.socketpair()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        env = dict(self.environ, **{SUPERVISOR_FD_ENV: str(child_end.fileno())})
        # In an elastic job kdrun sends host-update notices on the job's stdin
        # (mpiexec forwards it to rank 0): this process reads them, the child not.
        elastic = bool(self.environ.get(ELASTIC_ENV))
        try:
            self._proc = subprocess.Popen(
                self.command, stdout=out_write, stderr=err_write, env=env,
                stdin=subprocess.DEVNULL if elastic else None,
                pass_fds=(child_end.fileno(), *_pmi_fds(self.environ)),
                preexec_fn=functools.partial(_set_pdeathsig, os.getpid()),
            )
        except OSError as error:
            self._send_record({
                "event": "exit", "pid": None, "started": False, "finished": False,
                "returncode": 127 if isinstance(error, FileNotFoundError) else 126,
                "signal": None, "mono": time.monotonic(), "wall": time.time(),
                "error": None, "stopped_by": None,
                "spawn_error": f"cannot run {self.command[0]!r}: {error.strerror or error}",
            })
            return 127 if isinstance(error, FileNotFoundError) else 126
        finally:
            for fd in (out_write, err_write):
                os.close(fd)
            child_end.close()
        if received:  # a signal came before the child existed
            on_signal(received[-1], None)
        # The copy of PMI_FD stays open here until this process exits: hydra kills
        # the job when that socket closes, which must come after the exit record.
        returncode, mono, wall = self._watch(parent_end, out_read, err_read,
                                             notices=elastic and _readable_stdin())
        signum = -returncode if returncode < 0 else None
        self._send_record({
            "event": "exit", "pid": self._proc.pid, "started": self.started,
            "finished": self.finished, "returncode": None if signum else returncode,
            "signal": signal.Signals(signum).name if signum else None,
            "mono": mono, "wall": wall, "error": self.error, "stopped_by": self.stopped_by,
            "spawn_error": None,
        })
        self._wait_delivered()
        if signum:
            return 128 + signum
        if returncode == 0 and self.started and not self.finished:
            return 1  # left without keras_dist.shutdown(): the job must stop
        return returncode

    def _watch(self, channel: socket.socket, out_read: int, err_read: int,
               notices: bool = False):
        """Forwards output and records until the child has exited; returns
        (returncode, monotonic time, wall time) of its exit. With ``notices``,
        kdrun's ``hosts-updated N`` lines on stdin go to the child as ``H N``."""
        proc = self._proc
        selector = selectors.DefaultSelector()
        splitters = {out_read: LineSplitter(self.rank, "o"),
                     err_read: LineSplitter(self.rank, "e")}
        for fd in splitters:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(channel, selectors.EVENT_READ)
        stdin_text = b""
        if notices:
            selector.register(0, selectors.EVENT_READ)
        # In an elastic job kdrun judges a host lost when no record comes from
        # it for a while: send one every HEARTBEAT_SECONDS.
        heartbeat = bool(self.environ.get(ELASTIC_ENV))
        next_beat = time.monotonic()
        pidfd = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        channel_text = b""
        exit_seen = None
        drain_until = None
        while True:
            timeout = 0.05 if pidfd is None else None
            if drain_until is not None:
                timeout = max(0.0, drain_until - time.monotonic())
            if heartbeat:
                if time.monotonic() >= next_beat:
                    self._send_record({"event": "alive"})
                    next_beat = time.monotonic() + HEARTBEAT_SECONDS
                timeout = min(timeout if timeout is not None else HEARTBEAT_SECONDS,
                              max(0.0, next_beat - time.monotonic()))
            for key, _ in selector.select(timeout):
                fd = key.fd
                if fd == pidfd:
                    selector.unregister(pidfd)
                    os.close(pidfd)
                    pidfd = -1
                elif fd == 0:
                    data = os.read(0, _READ_BYTES)
                    if not data:
                        selector.unregister(0)
                        continue
                    stdin_text += data
                    *lines, stdin_text = stdin_text.split(b"\n")
                    for line in lines:
                        number = line.removeprefix(b"hosts-updated ").strip()
                        if number.isdigit():
                            try:
                                channel.sendall(b"H %s\n" % number)
                            except OSError:
                                pass
                elif key.fileobj is channel:
                    try:
                        data = channel.recv(_READ_BYTES)
                    except OSError:
                        # ECONNRESET: the child exited with a host-update notice
                        # unread; what it wrote before that was read already.
                        data = b""
                    if not data:
                        selector.unregister(channel)
                        continue
                    channel_text += data
                    *lines, channel_text = channel_text.split(b"\n")
                    for line in lines:
                        self._on_child_record(line, channel, splitters)
                else:
                    self._pump(fd, splitters, selector)
            if exit_seen is None and proc.poll() is not None:
                exit_seen = (proc.returncode, time.monotonic(), time.time())
                drain_until = time.monotonic() + DRAIN_SECONDS
                self._read_channel_now(channel, channel_text, splitters)
            if exit_seen is not None and (
                    time.monotonic() >= drain_until
                    or not any(fd in splitters for fd in (out_read, err_read))):
                break
        for fd in list(splitters):
            self._send(splitters.pop(fd).close())
            os.close(fd)
        selector.close()
        channel.close()
        return exit_seen

    def _pump(self, fd: int, splitters: dict, selector) -> None:
        try:
            data = os.read(fd, _READ_BYTES)
        except OSError:
            data = b""
        if data:
            self._send(splitters[fd].feed(data))
            return
        selector.unregister(fd)
        self._send(splitters.pop(fd).close())
        os.close(fd)

    def _drain_output(self, splitters: dict) -> None:
        """Forwards whatever output the child has already written."""
        for fd in list(splitters):
            os.set_blocking(fd, False)
            try:
                while True:
                    data = os.read(fd, _READ_BYTES)
                    if not data:
                        break
                    self._send(splitters[fd].feed(data))
            except BlockingIOError:
                pass
            finally:
                os.set_blocking(fd, True)

    def _read_channel_now(self, channel: socket.socket, pending: bytes, splitters) -> None:
        """Records the child wrote just before it exited and not yet read."""
        channel.setblocking(False)
        try:
            while True:
                data = channel.recv(_READ_BYTES)
                if not data:
                    break
                pending += data
        except OSError:
            pass
        for line in pending.split(b"\n"):
            self._on_child_record(line, None, splitters)

    def _on_child_record(self, line: bytes, channel, splitters) -> None:
        try:
            record = json.loads(line)
            event = record["event"]
        except (ValueError, KeyError, TypeError):
            return
        if event == "started":
            self.started, self.finished = True, False
            self._send_record({"event": "started", "pid": self._proc.pid,
                               "mono": time.monotonic(), "wall": time.time()})
        elif event == "finished":
            self.finished = True
        elif event == "resize":
            self._send_record({"event": "resize", "pid": self._proc.pid})
        elif event == "resumed" and isinstance(record.get("info"), dict):
            self._send_record({"event": "resumed", "pid": self._proc.pid,
                               "info": record["info"], "mono": record.get("mono"),
                               "wall": record.get("wall")})
        elif event == "error":
            # The child's own clock readings: when it raised, not when this
            # process got to read about it (same host, same CLOCK_MONOTONIC).
            self.error = {key: record.get(key) for key in ("type", "message", "peer_rank")}
            self.error["mono"] = record.get("mono", time.monotonic())
            self.error["wall"] = record.get("wall", time.time())
            self._drain_output(splitters)
            self._send_record({"event": "error", "pid": self._proc.pid, "error": self.error})
            self._wait_delivered()
            if channel is not None:
                try:
                    channel.sendall(b"k")
                except OSError:
                    pass


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``supervisor -- COMMAND...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("keras_dist supervisor: no command given. Usage: "
                         "python -m keras_dist.launcher.supervisor -- COMMAND...\n")
        return 2
    try:
        _set_pdeathsig(os.getppid())
        supervisor = Supervisor(argv)
    except ValueError as error:
        sys.stderr.write(f"keras_dist supervisor: {error}\n")
        return 2
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
