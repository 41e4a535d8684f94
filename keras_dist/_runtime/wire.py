"""The rendezvous's wire: lines of ``key=value`` fields, the proof of the job's
secret, and a server loop that a stranger cannot end, stall or grow.

Every port keras_dist opens (the process manager of self-started jobs, the
Spark driver's relay) speaks this. Standard library only: the process
manager runs it as a script of its own (``pmi_server.py``).

Lines
    ASCII ``key=value`` fields separated by single spaces, ended by ``\\n``,
    the first field ``cmd`` (PMI-1's own format, which MPICH speaks on the
    same connection once the job starts). keras_dist's free text travels
    URL-quoted. ``parse_line`` never raises; ``format_line`` builds them.

Proof of the secret (HMAC-SHA256; the secret never crosses the network)
    1. The server, on accepting: ``cmd=kd_challenge job=J nonce=Ns``
       (``J`` names this server's job, ``Ns`` is fresh random bytes).
    2. The client: its claim, e.g. ``cmd=kd_hello rank=R size=N host=H
       pid=P nonce=Nc mac=M``, where ``M = proof(secret, "client", J, Ns,
       Nc, claim)`` covers every field of the claim but ``mac``, so the
       proof is bound to this server's job, its nonce and the rank claimed.
    3. The server checks ``M`` before it reads or keeps anything else. Wrong:
       ``cmd=kd_denied`` and the connection is closed; nothing else changes.
       Right: ``cmd=kd_welcome mac=proof(secret, "server", J, Ns, Nc, claim)``,
       by which the client knows the server holds the secret too. Only then
       does the server act on the claim.
    Without a secret both sides use the empty key: the exchange is the same
    and proves nothing (a job that has no secret says so at start-up).

The server (``LineServer``)
    One ``selectors`` loop (no descriptor ceiling); non-blocking sockets with
    an output buffer per connection (a peer that never reads is dropped when
    its buffer passes ``output_bytes``, never waited for); lines capped
    (``UNAUTHENTICATED_LINE_BYTES`` before the proof); at most
    ``max_unauthenticated`` connections waiting to prove themselves (the
    oldest is dropped for a new one once it has had ``stranger_grace_seconds``
    to answer; until then newcomers are turned away) and each for at most
    ``handshake_seconds`` (whole message, not per ``recv``); ``accept``
    errors (``EMFILE``) drop the oldest stranger or pause accepting, never
    end the loop; an exception while handling a connection closes that
    connection only.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import re
import secrets
import selectors
import socket
import time

PROTOCOL = b"keras_dist-rendezvous-1"
#: The longest line a connection may send before it has proved the secret:
#: a claim is a few short fields.
UNAUTHENTICATED_LINE_BYTES = 1024
#: The longest line a client reads from a server (a fake one may send more).
CLIENT_LINE_BYTES = 1 << 20
#: Seconds one attempt of ``connect`` waits for TCP's handshake (a dropped SYN
#: is sent again by a new attempt rather than by TCP's slower backoff) and,
#: once connected, for the proof to be answered.
CONNECT_SECONDS, PROOF_SECONDS = 2.0, 10.0
_NONCE = re.compile(r"[0-9a-f]{32}")
_WHOLE = re.compile(r"-?[0-9]{1,9}")


class DeniedError(ConnectionError):
    """The server did not accept this process's proof of the secret."""


class UnprovenError(ConnectionError):
    """The peer is not a keras_dist server of this job: it did not prove the secret."""


class BusyError(ConnectionError):
    """The server closed the connection before its challenge: it is busy (it
    turns newcomers away while the connections waiting to prove themselves
    are many and young). Try again soon."""


class ForeignServerError(UnprovenError):
    """The peer does not speak keras_dist's rendezvous protocol at all."""


def parse_line(raw: bytes | str) -> dict[str, str]:
    """``b"cmd=put key=a value=b"`` -> ``{"cmd": "put", "key": "a", "value": "b"}``.

    Never raises: bytes that are not UTF-8 become U+FFFD, tokens without
    ``=`` are ignored, and the first of repeated keys wins.
    """
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    fields: dict[str, str] = {}
    for token in text.strip().split(" "):
        key, sep, value = token.partition("=")
        if sep and key and key not in fields:
            fields[key] = value
    return fields


def format_line(cmd: str, **fields) -> bytes:
    """``format_line("put", key="a")`` -> ``b"cmd=put key=a\\n"``.

    Raises:
        ValueError: a value holds a space or a line break (quote free text).
    """
    tokens = [f"cmd={cmd}", *(f"{key}={value}" for key, value in fields.items())]
    for token in tokens:
        if any(char in token for char in " \r\n"):
            raise ValueError(f"a rendezvous field must hold no space or line break. "
                             f"Received: {token!r}")
    return (" ".join(tokens) + "\n").encode()


def whole(fields: dict[str, str], name: str, low: int, high: int) -> int | None:
    """Field ``name`` as a whole number in [low, high], or None (never raises)."""
    value = fields.get(name, "")
    if not _WHOLE.fullmatch(value):
        return None
    number = int(value)
    return number if low <= number <= high else None


def proof(secret: bytes, side: str, job: str, server_nonce: str, client_nonce: str,
          claim: dict[str, str]) -> bytes:
    """The HMAC-SHA256 (hex, as bytes) that ``side`` ("client" or "server")
    shows for ``claim`` (every field but ``mac``) on this job and these nonces."""
    parts = [PROTOCOL, side.encode(), job.encode(), server_nonce.encode(),
             client_nonce.encode()]
    parts += sorted(f"{key}={value}".encode() for key, value in claim.items() if key != "mac")
    return hmac.new(secret, b"\n".join(parts), hashlib.sha256).hexdigest().encode()


def _matches(shown: str, expected: bytes) -> bool:
    return hmac.compare_digest(shown.encode("utf-8", "replace"), expected)


class LineReader:
    """Reads lines from a blocking socket, by a deadline, with a cap on length."""

    def __init__(self, sock: socket.socket, limit: int = CLIENT_LINE_BYTES) -> None:
        self.sock = sock
        self.limit = limit
        self.buffer = bytearray()

    def line(self, deadline: float | None) -> bytes | None:
        """The next line without its ``\\n``; None when the peer closed first.

        Raises:
            TimeoutError: ``deadline`` (``time.monotonic()``) passed first.
            ConnectionError: the line is longer than the cap.
        """
        scanned = 0
        while True:
            end = self.buffer.find(b"\n", scanned)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 1]
                return line
            scanned = len(self.buffer)
            if scanned > self.limit:
                raise ConnectionError(f"the peer sent a line longer than {self.limit} bytes")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no line before the deadline")
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data


def authenticate(sock: socket.socket, secret: bytes, cmd: str, claim: dict[str, str],
                 deadline: float | None) -> LineReader:
    """The client's side of the proof: answers the server's challenge with
    ``claim`` and checks the server's own proof.

    Returns:
        The reader of the server's further lines on ``sock``.

    Raises:
        DeniedError: the server refused the proof (the secrets differ).
        UnprovenError: the peer is not a keras_dist server of this job.
        ConnectionError: the server closed the connection before answering.
        TimeoutError: ``deadline`` passed first.
    """
    reader = LineReader(sock)
    raw = reader.line(deadline)
    if raw is None:
        raise BusyError("the server closed the connection before its challenge")
    challenge = parse_line(raw)
    job, server_nonce = challenge.get("job", ""), challenge.get("nonce", "")
    if challenge.get("cmd") != "kd_challenge" or not _NONCE.fullmatch(server_nonce):
        raise ForeignServerError(f"the server did not speak keras_dist's rendezvous protocol "
                                 f"(its first line: {raw[:80]!r})")
    client_nonce = secrets.token_hex(16)
    fields = {"cmd": cmd, **{key: str(value) for key, value in claim.items()},
              "nonce": client_nonce}
    mac = proof(secret, "client", job, server_nonce, client_nonce, fields).decode()
    sock.sendall(format_line(cmd, **{key: value for key, value in fields.items()
                                     if key != "cmd"}, mac=mac))
    raw = reader.line(deadline)
    if raw is None:
        raise ConnectionError("the server closed the connection before it answered the proof")
    answer = parse_line(raw)
    if answer.get("cmd") == "kd_denied":
        raise DeniedError("the server did not accept this process's proof of the job's secret")
    expected = proof(secret, "server", job, server_nonce, client_nonce, fields)
    if answer.get("cmd") != "kd_welcome" or not _matches(answer.get("mac", ""), expected):
        raise UnprovenError("the server did not prove that it holds the job's secret")
    return reader


def connect(address: tuple[str, int], secret: bytes, cmd: str, claim: dict[str, str],
            deadline: float, pauses: tuple[float, float] = (0.05, 1.0),
            ) -> tuple[socket.socket, LineReader]:
    """A connection to the server at ``address`` that has proved the secret both
    ways (``authenticate``). Tries again until ``deadline``
    (``time.monotonic()``): after ``pauses[0]`` seconds when the server was
    busy (it turned this connection away, ``BusyError``, or did not complete
    an attempt within ``CONNECT_SECONDS`` / ``PROOF_SECONDS``), else pausing
    ``pauses[0]`` seconds and doubling up to ``pauses[1]`` while nothing
    listens there yet, or the connection broke before the proof.

    Raises:
        DeniedError, UnprovenError: at once (the secrets differ; not this job's
            server, or ``ForeignServerError``: not a keras_dist server at all).
        OSError: the last error, once ``deadline`` has passed.
    """
    pause = pauses[0]
    while True:
        sock = None
        start = time.monotonic()
        try:
            sock = socket.create_connection(
                address, timeout=max(0.1, min(deadline - start, CONNECT_SECONDS)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock, authenticate(sock, secret, cmd, claim,
                                      min(deadline, time.monotonic() + PROOF_SECONDS))
        except (DeniedError, UnprovenError):
            sock.close()
            raise
        except OSError as error:  # busy, refused, reset, closed before the proof, timed out
            if sock is not None:
                sock.close()
            busy = isinstance(error, (BusyError, TimeoutError))  # a flooded server
            wait = pauses[0] if busy else pause
            if time.monotonic() + wait > deadline:
                raise
        if not busy:
            pause = min(pause * 2, pauses[1])
        time.sleep(wait)


class Connection:
    """One accepted connection: its buffers and, once proven, its claim."""

    def __init__(self, sock: socket.socket, peer: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.accepted = now
        self.nonce = secrets.token_hex(16)
        self.inbox = bytearray()
        self.scanned = 0
        self.outbox = bytearray()
        #: The fields it proved (``cmd``, ``rank``, ...); None until then.
        self.claim: dict[str, str] | None = None
        self.closing = False
        self.closed = False


class LineServer:
    """The loop shared by keras_dist's servers; subclasses act on proven claims.

    Subclasses override ``claimed`` (a connection proved the secret with this
    claim), ``received`` (a line from a proven connection) and ``lost`` (a
    proven connection closed).
    """

    max_unauthenticated = 256
    #: Seconds a connection that has not proved itself is kept before a newer
    #: one may take its place (room for a client's round trip on a loaded
    #: machine): while every waiting connection is younger, newcomers are
    #: turned away instead (``BusyError`` for the client, which tries again),
    #: so a flood of connections cannot starve a rank that is proving itself.
    stranger_grace_seconds = 1.0
    handshake_seconds = 5.0
    #: Longest line from a proven connection.
    line_bytes = 64 << 10
    #: Most bytes waiting to be sent to one connection.
    output_bytes = 1 << 20
    #: Seconds to stop accepting when the process is out of descriptors.
    accept_pause_seconds = 0.1

    def __init__(self, listener: socket.socket | None, secret: bytes, job: str) -> None:
        self.secret = secret
        self.job = job
        self.selector = selectors.DefaultSelector()
        self.listener = listener
        self.accept_paused_until: float | None = None
        if listener is not None:
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ, None)
        #: Connections that have not proved the secret, oldest first.
        self.strangers: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self.connections: set[Connection] = set()
        #: Proofs refused so far, and the last address that failed one.
        self.denied = 0
        self.last_denied = ""

    # -- hooks ----------------------------------------------------------------
    def claimed(self, conn: Connection, claim: dict[str, str]) -> None:
        """``conn`` proved the secret with ``claim``: serve it, or close it."""

    def received(self, conn: Connection, line: bytes) -> None:
        """A line (without ``\\n``) from a connection that proved the secret."""

    def lost(self, conn: Connection) -> None:
        """A connection that proved the secret closed."""

    def watch(self, fileobj, when_readable) -> None:
        """Calls ``when_readable()`` from the loop whenever ``fileobj`` is readable."""
        self.selector.register(fileobj, selectors.EVENT_READ, when_readable)

    # -- connections ------------------------------------------------------------
    def adopt(self, sock: socket.socket, peer: str = "?") -> Connection | None:
        """Serves ``sock`` (accepted here, or handed over): challenges it first.
        Returns None when it was turned away (too many young strangers)."""
        now = time.monotonic()
        while len(self.strangers) >= self.max_unauthenticated:
            oldest = next(iter(self.strangers))
            if now - oldest.accepted < self.stranger_grace_seconds:
                sock.close()
                return None
            self.close(oldest)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # not TCP (a socket pair in tests)
        conn = Connection(sock, peer, now)
        self.strangers[conn] = None
        self.connections.add(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)
        self.send(conn, format_line("kd_challenge", job=self.job, nonce=conn.nonce))
        return conn

    def send(self, conn: Connection, data: bytes) -> None:
        """Queues ``data`` and sends what the socket takes now, never waiting."""
        if conn.closed:
            return
        conn.outbox += data
        if len(conn.outbox) > self.output_bytes:
            self.close(conn)
            return
        self._flush(conn)

    def close_when_sent(self, conn: Connection) -> None:
        conn.closing = True
        if not conn.outbox:
            self.close(conn)

    def close(self, conn: Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.strangers.pop(conn, None)
        self.connections.discard(conn)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        if conn.claim is not None:
            self.lost(conn)

    def close_all(self, flush_seconds: float = 2.0) -> None:
        """Closes the listener and the strangers, sends what is queued to the
        others (for at most ``flush_seconds``), then closes them."""
        if self.listener is not None:
            if self.accept_paused_until is None:
                self.selector.unregister(self.listener)
            self.listener.close()
        self.listener = None
        for conn in list(self.strangers):
            self.close(conn)
        deadline = time.monotonic() + flush_seconds
        while any(conn.outbox for conn in self.connections) and time.monotonic() < deadline:
            self.step(0.05)
        for conn in list(self.connections):
            self.close(conn)
        self.selector.close()

    # -- the loop -----------------------------------------------------------------
    def step(self, timeout: float) -> None:
        """Waits at most ``timeout`` seconds and serves what arrived. Never raises
        for anything a peer does."""
        now = time.monotonic()
        if self.accept_paused_until is not None and now >= self.accept_paused_until:
            self.accept_paused_until = None
            if self.listener is not None:
                self.selector.register(self.listener, selectors.EVENT_READ, None)
        if self.strangers:
            oldest = next(iter(self.strangers)).accepted
            timeout = max(0.0, min(timeout, oldest + self.handshake_seconds - now))
        for key, events in self.selector.select(timeout):
            conn = key.data
            if conn is None:
                self._accept()
                continue
            if not isinstance(conn, Connection):
                conn()  # a descriptor a subclass watches (``watch``)
                continue
            try:
                if events & selectors.EVENT_WRITE:
                    self._flush(conn)
                if events & selectors.EVENT_READ and not conn.closed:
                    self._read(conn)
            except Exception:  # noqa: BLE001 - one connection's trouble ends that connection
                self.close(conn)
        self._expire()

    def _expire(self) -> None:
        limit = time.monotonic() - self.handshake_seconds
        while self.strangers:
            oldest = next(iter(self.strangers))
            if oldest.accepted > limit:
                return
            self.close(oldest)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self.strangers:
                        self.close(next(iter(self.strangers)))
                        continue
                    self.selector.unregister(self.listener)
                    self.accept_paused_until = time.monotonic() + self.accept_pause_seconds
                return  # ECONNABORTED and the like: the next readiness tries again
            peer = address[0] if isinstance(address, tuple) else str(address)
            self.adopt(sock, peer)

    def _flush(self, conn: Connection) -> None:
        if conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close(conn)
                return
            del conn.outbox[:sent]
        if conn.outbox:
            self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return
        if conn.closing:
            self.close(conn)
            return
        self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.close(conn)
            return
        if conn.closing:
            return  # it is told what it is told, and heard no more
        conn.inbox += data
        while not conn.closed and not conn.closing:
            end = conn.inbox.find(b"\n", conn.scanned)
            if end < 0:
                conn.scanned = len(conn.inbox)
                limit = self.line_bytes if conn.claim is not None else UNAUTHENTICATED_LINE_BYTES
                if len(conn.inbox) > limit:
                    self.close(conn)
                return
            line = bytes(conn.inbox[:end])
            del conn.inbox[:end + 1]
            conn.scanned = 0
            if conn.claim is None:
                self._prove(conn, line)
            else:
                self.received(conn, line)

    def _prove(self, conn: Connection, line: bytes) -> None:
        if len(line) > UNAUTHENTICATED_LINE_BYTES:
            self.close(conn)
            return
        claim = parse_line(line)
        shown = claim.pop("mac", "")
        client_nonce = claim.get("nonce", "")
        expected = proof(self.secret, "client", self.job, conn.nonce, client_nonce, claim)
        if not _NONCE.fullmatch(client_nonce) or not _matches(shown, expected):
            self.denied += 1
            self.last_denied = conn.peer
            self.send(conn, b"cmd=kd_denied\n")
            self.close_when_sent(conn)
            return
        self.strangers.pop(conn, None)
        conn.claim = claim
        mac = proof(self.secret, "server", self.job, conn.nonce, client_nonce, claim)
        self.send(conn, format_line("kd_welcome", mac=mac.decode()))
        if not conn.closed:
            self.claimed(conn, claim)
