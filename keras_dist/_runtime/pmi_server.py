"""The process manager of a job whose processes started themselves.

MPICH forms ``MPI_COMM_WORLD`` through a process manager that speaks PMI-1
(Hydra, Slurm's PMI plugins): each process reaches it on a socket named by
``PMI_FD``, exchanges its address card through the manager's key-value store
and meets the others at its barriers. When a cluster (torchrun, Kubeflow, Ray,
Spark) starts the processes, there is no Hydra: this server stands in for it
(started by rank 0, or by Ray's and Spark's executors), every rank connects to
it, and MPI forms the world as under ``mpiexec``. Tensors never pass here:
they go over MPI, shared memory or NCCL.

Run by ``keras_dist._runtime.rendezvous.start_process_manager`` as a script of
its own (``python pmi_server.py --fd FD --size N --timeout S``): it imports
nothing but the standard library (and ``wire.py`` beside it), so it starts in
milliseconds and cannot disturb rank 0's frameworks. It inherits its
listening socket, bound once by its starter. Its standard input is a pipe
from the starter: the first line is the job's secret (hex; empty for none),
and the end of the pipe means the starter is gone (before every rank came,
the start is then called off).

Every connection first proves the job's secret (``wire.py``: challenge,
HMAC-SHA256 proof bound to this job, the nonces and the claim). A connection
that fails is closed and nothing else changes. The claims:

1. A rank's, before MPI starts: ``cmd=kd_hello rank=R size=N host=H pid=P``.
   Once all N ranks have come with the same size, each gets ``cmd=kd_ready``;
   a proven process that gives another size, a rank out of range or a rank
   already taken makes every rank that came get ``cmd=kd_refuse message=...``
   (URL-quoted): a misconfigured job stops at once, on every rank. When the
   start-up timeout passes first, every rank that came gets ``kd_refuse``
   naming the ranks that did not. A rank that comes after the start is
   refused alone; the job goes on.
   Then the PMI-1 exchange of MPICH's ``MPI_Init`` .. ``MPI_Finalize`` on the
   same connection (``init``, ``get_maxes``, ``get_appnum``,
   ``get_my_kvsname``, ``put``, ``get``, ``barrier_in``,
   ``get_universe_size``, ``finalize``, ``abort``), each field checked.
2. A watch, ``cmd=kd_watch rank=R`` (R in [-1, N); -1 for an executor that is
   not a rank): the connection only listens. When a rank's connection closes
   before that rank finalised MPI (it died), or a rank aborts MPI, every
   watcher is sent ``cmd=kd_abort rank=R message=...`` and the server ends;
   Hydra would kill the other ranks then, and here each rank ends itself on
   that message. Ray's and Spark's executors watch as rank -1, to name the
   rank.
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import socket
import sys
import time
from urllib.parse import quote, unquote

if __package__:
    from keras_dist._runtime import wire
else:  # run as a script: wire.py is beside it on sys.path
    import wire

#: The key, value and store-name lengths offered to MPICH (its own limits are
#: larger; a business card of MPICH's UCX device fits in 1024).
KVSNAME_MAX, KEYLEN_MAX, VALLEN_MAX = 256, 256, 4096
#: Entries a job may keep in the store: MPICH puts a few per rank.
STORE_ENTRIES_PER_RANK = 256


class Server(wire.LineServer):
    """The key-value store, barrier and liveness watch of one job."""

    # A PMI line carries one key and one value at most.
    line_bytes = KVSNAME_MAX + KEYLEN_MAX + VALLEN_MAX + 256

    def __init__(self, listener: socket.socket | None, size: int, timeout: float,
                 secret: bytes = b"", starter=None) -> None:
        """``starter``: a pipe from the process that started this server, whose
        end means that process is gone (None: not watched)."""
        super().__init__(listener, secret, job=secrets.token_hex(8))
        self.starter = starter
        if starter is not None:
            self.watch(starter, self._starter_readable)
        self.size = size
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.store: dict[str, str] = {}
        self.store_limit = STORE_ENTRIES_PER_RANK * size
        # MPICH names its shared-memory segments after the store: one name per job.
        self.kvsname = f"keras_dist_{os.getpid()}_{secrets.token_hex(4)}"
        self.ranks: dict[int, wire.Connection] = {}
        self.rank_of: dict[wire.Connection, int] = {}
        self.finalized: set[int] = set()
        self.watchers: set[wire.Connection] = set()
        self.barrier: set[wire.Connection] = set()
        self.started = False
        self.done = False
        self.exit_code = 0
        #: Why the start was called off, while the server stays to tell the
        #: ranks still to come (None: not called off).
        self.refusal: str | None = None

    def describe(self, conn: wire.Connection) -> str:
        claim = conn.claim or {}
        return (f"rank {claim.get('rank', '?')} (host {claim.get('host', '?')}, "
                f"pid {claim.get('pid', '?')})")

    # -- claims -----------------------------------------------------------------
    def claimed(self, conn: wire.Connection, claim: dict[str, str]) -> None:
        cmd = claim.get("cmd")
        if (cmd == "kd_watch" and self.refusal is None
                and wire.whole(claim, "rank", -1, self.size - 1) is not None):
            self.watchers.add(conn)
        elif cmd == "kd_hello":
            self._hello(conn, claim)
        else:
            self.close(conn)

    def _hello(self, conn: wire.Connection, claim: dict[str, str]) -> None:
        who = f"host {claim.get('host', '?')}, pid {claim.get('pid', '?')}"
        if self.refusal is not None:  # the start was called off: say why to each who comes
            self._refuse(conn, self.refusal)
            return
        if self.started:  # a latecomer cannot join; the running job goes on
            self._refuse(conn, f"the job of {self.size} processes at this rendezvous has "
                               f"started already; this process ({who}) is not part of it")
            return
        size = wire.whole(claim, "size", 1, 1 << 24)
        rank = wire.whole(claim, "rank", 0, self.size - 1)
        if size != self.size:
            self._refuse_all(f"rank {claim.get('rank', '?')} ({who}) was told the job has "
                             f"{claim.get('size', '?')} processes, rank 0 was told "
                             f"{self.size}: every process must be given the same world size",
                             conn, linger=True)
            return
        if rank is None:
            self._refuse_all(f"a process ({who}) claimed rank {claim.get('rank', '?')!r}, "
                             f"outside [0, {self.size})", conn, linger=True)
            return
        if rank in self.ranks:
            other = self.ranks[rank].claim
            self._refuse_all(f"two processes claim rank {rank}: host {other.get('host', '?')} "
                             f"pid {other.get('pid', '?')} and {who.replace(',', '')}", conn,
                             linger=True)
            return
        self.ranks[rank] = conn
        self.rank_of[conn] = rank
        if len(self.ranks) == self.size:
            self.started = True
            for member in self.ranks.values():
                self.send(member, wire.format_line("kd_ready"))

    def _refuse(self, conn: wire.Connection, message: str) -> None:
        self.send(conn, wire.format_line("kd_refuse", message=quote(message)))
        self.close_when_sent(conn)

    def _refuse_all(self, message: str, *others: wire.Connection, linger: bool = False) -> None:
        """Calls the start off: every process that came is told why. ``linger``
        (a rank's claim stopped the start), where the process that started this
        server is watched: the server stays until that process ends (or the
        start-up timeout passes), telling each rank that comes later the same;
        that process, rank 0, may greet after the rank that stopped the start,
        and must hear why rather than wait for a server that is gone."""
        for member in [*self.ranks.values(), *others]:
            self._refuse(member, message)
        self.ranks.clear()
        self.rank_of.clear()
        sys.stderr.write(f"keras_dist rendezvous: {message}\n")
        if linger and self.starter is not None:
            self.refusal = message
            for watcher in list(self.watchers):  # an executor's watch hears the end now
                self.close(watcher)
            self.watchers.clear()
        else:
            self._end(1)

    def _start_timed_out(self) -> None:
        missing = sorted(set(range(self.size)) - set(self.ranks))
        came = ", ".join(self.describe(self.ranks[rank]) for rank in sorted(self.ranks))
        message = (f"ranks {missing} of {self.size} did not reach the rendezvous within "
                   f"{self.timeout:g} s (KERAS_DIST_RENDEZVOUS_TIMEOUT); those that came: "
                   f"{came or 'none'}")
        if self.denied:
            message += (f"; {self.denied} connection(s) did not prove the job's secret (the "
                        f"last from {self.last_denied}): a rank given another "
                        "KERAS_DIST_SECRET is refused")
        self._refuse_all(message)

    def _starter_readable(self) -> None:
        if os.read(self.starter.fileno(), 4096):
            return
        self.selector.unregister(self.starter)  # the process that started this server ended
        if self.refusal is not None:
            self._end(1)
        elif not self.started and not self.done:
            self._refuse_all("the process that started this job's rendezvous ended before "
                             "every rank came")

    # -- PMI-1 --------------------------------------------------------------------
    def received(self, conn: wire.Connection, line: bytes) -> None:
        rank = self.rank_of.get(conn)
        if rank is None or not self.started:
            return  # watchers only listen; ranks speak PMI once the job starts
        fields = wire.parse_line(line)
        reply = self._pmi(conn, rank, fields.get("cmd", ""), fields)
        if reply is not None:
            self.send(conn, reply)

    def _pmi(self, conn: wire.Connection, rank: int, cmd: str,
             fields: dict[str, str]) -> bytes | None:
        line = wire.format_line
        if cmd == "init":
            return line("response_to_init", pmi_version=1, pmi_subversion=1, rc=0)
        if cmd == "get_maxes":
            return line("maxes", kvsname_max=KVSNAME_MAX, keylen_max=KEYLEN_MAX,
                        vallen_max=VALLEN_MAX, rc=0)
        if cmd == "get_appnum":
            return line("appnum", appnum=0, rc=0)
        if cmd == "get_my_kvsname":
            return line("my_kvsname", kvsname=self.kvsname, rc=0)
        if cmd == "get_universe_size":
            return line("universe_size", size=self.size, rc=0)
        if cmd == "put":
            key, value = fields.get("key", ""), fields.get("value", "")
            if not key or len(key) > KEYLEN_MAX or len(value) > VALLEN_MAX:
                return line("put_result", rc=-1, msg="key_or_value_too_long")
            if key not in self.store and len(self.store) >= self.store_limit:
                return line("put_result", rc=-1, msg="store_full")
            self.store[key] = value
            return line("put_result", rc=0, msg="success")
        if cmd == "get":
            value = self.store.get(fields.get("key", ""))
            if value is None:
                return line("get_result", rc=-1, msg="key_not_found")
            return line("get_result", rc=0, msg="success", value=value)
        if cmd == "barrier_in":
            self.barrier.add(conn)
            if len(self.barrier) == self.size:
                for member in self.barrier:
                    self.send(member, line("barrier_out", rc=0))
                self.barrier = set()
            return None
        if cmd == "finalize":
            self.finalized.add(rank)
            return line("finalize_ack", rc=0)
        if cmd == "abort":
            code = fields.get("exitcode", "?")[:16]
            text = unquote(fields.get("message", "")).strip()
            self._abort(rank, f"{self.describe(conn)} aborted the job (exit "
                                             f"code {code})" + (f": {text}" if text else ""))
            return None
        name = "".join(char for char in cmd[:32] if char.isalnum() or char == "_") or "unknown"
        return line(f"{name}_result", rc=-1, msg="unsupported_by_keras_dist")

    # -- liveness -------------------------------------------------------------------
    def _abort(self, rank: int | None, message: str) -> None:
        if self.done:
            return
        for member in self.watchers:  # the failed rank's own watch too: it stays quiet
            self.send(member, wire.format_line("kd_abort", rank=rank, message=quote(message)))
        self._end(1)

    def _end(self, code: int) -> None:
        self.done = True
        self.exit_code = code

    def lost(self, conn: wire.Connection) -> None:
        self.watchers.discard(conn)
        self.barrier.discard(conn)
        rank = self.rank_of.pop(conn, None)
        if rank is None or rank in self.finalized:
            return
        if not self.started:
            del self.ranks[rank]  # it may come again; the start-up timeout bounds the wait
            return
        self._abort(rank, f"{self.describe(conn)} ended before MPI finished (its connection "
                          "to the rendezvous closed): it died or exited without finishing")

    # -- the loop -------------------------------------------------------------------
    def serve(self) -> int:
        """Runs until every rank has finished (0), or the job ended on a failure (1);
        then closes every connection (watchers hear the end)."""
        try:
            while not self.done:
                if self.started and len(self.finalized) == self.size and not any(
                        member in self.connections for member in self.ranks.values()):
                    break
                if not self.started and time.monotonic() > self.deadline:
                    if self.refusal is None:
                        self._start_timed_out()
                    self._end(1)
                    break
                self.step(1.0)
            return self.exit_code
        finally:
            self.close_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    starter = sys.stdin.buffer.raw
    secret = b""
    while not secret.endswith(b"\n"):  # unbuffered: what follows the line is the pipe's end
        byte = os.read(starter.fileno(), 1)
        if not byte:
            break
        secret += byte
    # Strangers may hold many connections: take every descriptor allowed.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            hard = soft
    listener = socket.socket(fileno=args.fd)
    server = Server(listener, args.size, args.timeout, bytes.fromhex(secret.decode().strip()),
                    starter)
    server.max_unauthenticated = max(64, min(1024, hard // 2))
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
