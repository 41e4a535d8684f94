"""The process manager of a job whose processes started themselves.

MPICH forms ``MPI_COMM_WORLD`` through a process manager that speaks PMI-1
(Hydra, Slurm's PMI plugins): each process reaches it on a socket named by
``PMI_FD``, exchanges its address card through the manager's key-value store
and meets the others at its barriers. When a cluster (torchrun, Kubeflow, Ray,
Spark) starts the processes, there is no Hydra: rank 0 runs this server, every
rank (rank 0 too) connects to it, and MPI forms the world as under ``mpiexec``.
Tensors never pass here: they go over MPI, shared memory or NCCL.

Run by ``keras_dist._runtime.rendezvous`` as a script of its own
(``python pmi_server.py --fd FD --size N --timeout S``): it imports nothing but
the standard library, so it starts in milliseconds and cannot disturb rank 0's
frameworks. It inherits its listening socket from rank 0, so a port already in
use is rank 0's error, raised in rank 0.

Each connection is one rank's, and carries, in order:

1. keras_dist's greeting, before MPI starts: ``cmd=kd_hello rank=R size=N
   host=H pid=P``. Once all N ranks have greeted with the same size, each gets
   ``cmd=kd_ready``; a rank that gives another size or a rank already taken
   gets ``cmd=kd_refuse message=...`` (URL-quoted), and when the start-up
   timeout passes first, every rank that came gets ``kd_refuse`` naming the
   ranks that did not.
2. The PMI-1 exchange of MPICH's ``MPI_Init`` .. ``MPI_Finalize`` (``init``,
   ``get_maxes``, ``get_appnum``, ``get_my_kvsname``, ``put``, ``get``,
   ``barrier_in``, ``get_universe_size``, ``finalize``, ``abort``).

A rank may also open a second connection, ``cmd=kd_watch rank=R`` (answered
``cmd=kd_watching``), on which it only listens: when a rank's connection
closes before that rank finalised MPI (it died), or a rank aborts MPI, every
watcher is sent ``cmd=kd_abort rank=R message=...`` and the server ends;
Hydra would kill the other ranks then, and here each rank ends itself on that
message. Ray's and Spark's executors watch as rank -1, to name the rank.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import socket
import sys
import time
from urllib.parse import quote, unquote

#: The key, value and store-name lengths offered to MPICH (its own limits are
#: larger; a business card of MPICH's UCX device fits in 1024).
KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 256, 4096


def parse_line(line: str) -> dict[str, str]:
    """``"cmd=put key=a value=b"`` -> ``{"cmd": "put", "key": "a", "value": "b"}``."""
    fields = {}
    for token in line.split(" "):
        if "=" in token:
            key, value = token.split("=", 1)
            fields[key] = value
    return fields


def format_line(cmd: str, **fields) -> bytes:
    return (" ".join([f"cmd={cmd}", *(f"{k}={v}" for k, v in fields.items())]) + "\n").encode()


class _Rank:
    """One connection: a rank's PMI socket, or a watcher."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.rank: int | None = None
        self.host = "?"
        self.pid = "?"
        self.watching = False
        self.ready = False
        self.finalized = False

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass


class Server:
    """The key-value store, barrier and liveness watch of one job."""

    def __init__(self, listener: socket.socket, size: int, timeout: float) -> None:
        self.listener = listener
        self.size = size
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.store: dict[str, str] = {}
        # MPICH names its shared-memory segments after the store: one name per job.
        self.kvsname = f"keras_dist_{os.getpid()}_{secrets.token_hex(4)}"
        self.connections: list[_Rank] = []
        self.ranks: dict[int, _Rank] = {}
        self.barrier: list[_Rank] = []
        self.started = False
        self.done = False

    # -- start-up ---------------------------------------------------------
    def _hello(self, conn: _Rank, fields: dict[str, str]) -> None:
        conn.host, conn.pid = fields.get("host", "?"), fields.get("pid", "?")
        if self.started:  # a latecomer cannot join; the running job goes on
            conn.send(format_line("kd_refuse", message=quote(
                f"the job of {self.size} processes at this rendezvous has started already; "
                f"this process (host {conn.host}, pid {conn.pid}) is not part of it")))
            self._drop(conn)
            return
        try:
            rank, size = int(fields["rank"]), int(fields["size"])
        except (KeyError, ValueError):
            self._refuse_all(f"a process (host {conn.host}, pid {conn.pid}) sent a malformed "
                             f"greeting: {fields!r}", conn)
            return
        if size != self.size:
            self._refuse_all(f"rank {rank} (host {conn.host}, pid {conn.pid}) was told the job "
                             f"has {size} processes, rank 0 was told {self.size}: every "
                             "process must be given the same world size", conn)
            return
        if rank in self.ranks:
            other = self.ranks[rank]
            self._refuse_all(f"two processes claim rank {rank}: host {other.host} pid "
                             f"{other.pid} and host {conn.host} pid {conn.pid}", conn)
            return
        conn.rank = rank
        self.ranks[rank] = conn
        if len(self.ranks) == self.size:
            self.started = True
            for member in self.ranks.values():
                member.ready = True
                member.send(format_line("kd_ready"))

    def _refuse_all(self, message: str, *others: _Rank) -> None:
        """Ends the start-up: every process that came is told why."""
        for member in [*self.ranks.values(), *others]:
            member.send(format_line("kd_refuse", message=quote(message)))
        sys.stderr.write(f"keras_dist rendezvous: {message}\n")
        self.done = True

    def _start_timed_out(self) -> None:
        missing = sorted(set(range(self.size)) - set(self.ranks))
        came = ", ".join(member.describe() for member in
                         sorted(self.ranks.values(), key=lambda m: m.rank))
        self._refuse_all(f"ranks {missing} of {self.size} did not reach the rendezvous within "
                         f"{self.timeout:g} s (KERAS_DIST_RENDEZVOUS_TIMEOUT); those that "
                         f"came: {came or 'none'}")

    # -- PMI-1 --------------------------------------------------------------
    def _pmi(self, conn: _Rank, fields: dict[str, str]) -> None:
        cmd = fields.get("cmd")
        if cmd == "init":
            conn.send(format_line("response_to_init", pmi_version=1, pmi_subversion=1, rc=0))
        elif cmd == "get_maxes":
            conn.send(format_line("maxes", kvsname_max=KVSNAME_MAX, keylen_max=KEYLEN_MAX,
                                  vallen_max=VALLEN_MAX, rc=0))
        elif cmd == "get_appnum":
            conn.send(format_line("appnum", appnum=0, rc=0))
        elif cmd == "get_my_kvsname":
            conn.send(format_line("my_kvsname", kvsname=self.kvsname, rc=0))
        elif cmd == "get_universe_size":
            conn.send(format_line("universe_size", size=self.size, rc=0))
        elif cmd == "put":
            self.store[fields.get("key", "")] = fields.get("value", "")
            conn.send(format_line("put_result", rc=0, msg="success"))
        elif cmd == "get":
            key = fields.get("key", "")
            if key in self.store:
                conn.send(format_line("get_result", rc=0, msg="success", value=self.store[key]))
            else:
                conn.send(format_line("get_result", rc=-1, msg="key_not_found"))
        elif cmd == "barrier_in":
            self.barrier.append(conn)
            if len(self.barrier) == self.size:
                for member in self.barrier:
                    member.send(format_line("barrier_out", rc=0))
                self.barrier = []
        elif cmd == "finalize":
            conn.finalized = True
            conn.send(format_line("finalize_ack", rc=0))
        elif cmd == "abort":
            code = fields.get("exitcode", "?")
            text = unquote(fields.get("message", "")).strip()
            self._abort(conn.rank, f"{conn.describe()} aborted the job (exit code {code})"
                                   + (f": {text}" if text else ""))
        else:
            conn.send(format_line(f"{cmd}_result", rc=-1, msg="unsupported_by_keras_dist"))

    # -- liveness -----------------------------------------------------------
    def _abort(self, rank: int | None, message: str) -> None:
        if self.done:
            return
        self.done = True
        for member in self.connections:  # the failed rank's own watch too: it stays quiet
            if member.watching:
                member.send(format_line("kd_abort", rank=rank, message=quote(message)))

    def _drop(self, conn: _Rank) -> None:
        if conn in self.connections:
            self.connections.remove(conn)
        try:
            conn.sock.close()
        except OSError:
            pass

    def _closed(self, conn: _Rank) -> None:
        self._drop(conn)
        if conn.watching or conn.rank is None or conn.finalized:
            return
        if self.ranks.get(conn.rank) is conn:
            what = ("ended before MPI finished (its connection to the rendezvous closed): "
                    "it died or exited without finishing")
            self._abort(conn.rank, f"{conn.describe()} {what}")

    def _handle(self, conn: _Rank, line: str) -> None:
        fields = parse_line(line)
        cmd = fields.get("cmd")
        if cmd == "kd_hello":
            self._hello(conn, fields)
        elif cmd == "kd_watch":
            conn.watching = True
            conn.rank = int(fields.get("rank", -1))
            conn.send(format_line("kd_watching"))
        elif conn.rank is not None and conn.ready:
            self._pmi(conn, fields)

    def serve(self) -> int:
        """Runs until every rank has finished (0), or the job ended on a failure (1);
        then closes every connection (watchers hear the end)."""
        try:
            return self._serve()
        finally:
            for conn in list(self.connections):
                self._drop(conn)

    def _serve(self) -> int:
        while True:
            if self.done:
                return 1
            if self.started and not any(c for c in self.connections if not c.watching):
                return 0
            if not self.started and time.monotonic() > self.deadline:
                self._start_timed_out()
                return 1
            sockets = [self.listener] + [c.sock for c in self.connections]
            readable, _, _ = select.select(sockets, [], [], 1.0)
            for sock in readable:
                if sock is self.listener:
                    accepted, _ = self.listener.accept()
                    accepted.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.connections.append(_Rank(accepted))
                    continue
                conn = next((c for c in self.connections if c.sock is sock), None)
                if conn is None:
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self._closed(conn)
                    continue
                conn.buffer += data
                while b"\n" in conn.buffer and conn in self.connections:
                    raw, conn.buffer = conn.buffer.split(b"\n", 1)
                    self._handle(conn, raw.decode(errors="replace").strip())
                if self.done:
                    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    listener = socket.socket(fileno=args.fd)
    os.set_blocking(args.fd, True)
    return Server(listener, args.size, args.timeout).serve()


if __name__ == "__main__":
    sys.exit(main())
