"""The rendezvous's wire and its process manager, attacked in one process:
socket pairs handed to ``Server.adopt`` and the loop pumped by ``step(0)``, no
threads and no sleeps. A connection that has not proved the job's secret is
told the challenge and ``kd_denied`` and nothing else, is dropped alone
(lines past the cap, a stranger past the cap, silence past the handshake, an
``accept`` out of descriptors), and changes nothing in the job."""

import errno
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_dist._runtime import pmi_server, wire

SECRET = b"0123456789abcdef-the-jobs-secret"
WRONG = b"0123456789abcdef-another-secret!"


class Recording(pmi_server.Server):
    """A process manager that keeps every exception its handlers raise, before
    the loop's catch-all turns it into a closed connection."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.errors = []

    def _record(self, method, *args):
        try:
            return method(*args)
        except Exception as error:
            self.errors.append(repr(error))
            raise

    def _read(self, conn):
        return self._record(super()._read, conn)

    def _prove(self, conn, line):
        return self._record(super()._prove, conn, line)

    def received(self, conn, line):
        return self._record(super().received, conn, line)


class Peer:
    """The far end of a socket pair the server serves: what it sends and hears."""

    def __init__(self, server, sock):
        self.server = server
        self.sock = sock
        self.sock.setblocking(False)
        self.heard = bytearray()
        self.closed = False

    def send(self, data):
        """Sends ``data``, pumping the server while the pair's buffer is full;
        stops quietly once the server closed its end."""
        view = memoryview(data)
        while view and not self.closed:
            try:
                sent = self.sock.send(view[:65536])
            except BlockingIOError:
                sent = 0
            except OSError:
                self.closed = True
                return
            view = view[sent:]
            self.server.step(0)
            self.hear()

    def hear(self):
        """Reads what the server sent so far; notes when it closed."""
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return
            self.heard += data

    def lines(self):
        return [wire.parse_line(line) for line in bytes(self.heard).splitlines()]

    def challenge(self):
        first = self.lines()[0]
        assert first["cmd"] == "kd_challenge", self.heard
        return first

    def claim(self, cmd, secret=SECRET, **fields):
        """Answers the challenge with ``cmd`` and ``fields``, proved with ``secret``;
        returns the claim the proof covers."""
        challenge = self.challenge()
        claim = {"cmd": cmd, **{key: str(value) for key, value in fields.items()},
                 "nonce": "ab" * 16}
        mac = wire.proof(secret, "client", challenge["job"], challenge["nonce"], claim["nonce"],
                         claim).decode()
        self.send(wire.format_line(cmd, **{k: v for k, v in claim.items() if k != "cmd"},
                                   mac=mac))
        pump(self.server)
        self.hear()
        return claim


def pump(server, times=4):
    for _ in range(times):
        server.step(0)


def serve(size=2, secret=SECRET, server_class=Recording, listener=None, **kwargs):
    return server_class(listener, size, 60.0, secret, **kwargs)


def connect(server, **socket_options):
    ours, theirs = socket.socketpair()
    for option, value in socket_options.items():
        ours.setsockopt(socket.SOL_SOCKET, getattr(socket, option), value)
    conn = server.adopt(ours, "peer")
    peer = Peer(server, theirs)
    peer.conn = conn
    pump(server)
    peer.hear()
    return peer


def snapshot(server):
    return (dict(server.store), dict(server.ranks), set(server.watchers), server.started,
            server.done, set(server.finalized))


def ready(server):
    """Every rank of ``server``'s job greeted with the secret and told ``kd_ready``."""
    ranks = [connect(server) for _ in range(server.size)]
    for rank, peer in enumerate(ranks):
        peer.claim("kd_hello", rank=rank, size=server.size, host="h", pid=100 + rank)
    pump(server)
    for peer in ranks:
        peer.hear()
        assert peer.lines()[-1] == {"cmd": "kd_ready"}, peer.heard
    return ranks


def test_a_wrong_secret_is_denied_and_nothing_changes():
    server = serve()
    before = snapshot(server)
    peer = connect(server)
    peer.claim("kd_hello", secret=WRONG, rank=0, size=2, host="h", pid=1)
    assert [line["cmd"] for line in peer.lines()] == ["kd_challenge", "kd_denied"]
    assert peer.closed and peer.conn.closed
    assert snapshot(server) == before and server.denied == 1
    assert not server.strangers and not server.connections and not server.errors


def test_the_right_secret_is_welcomed_and_the_servers_proof_checks():
    server = serve()
    peer = connect(server)
    challenge = peer.challenge()
    claim = peer.claim("kd_hello", rank=1, size=2, host="h", pid=7)
    welcome = peer.lines()[1]
    assert welcome["cmd"] == "kd_welcome"
    assert welcome["mac"].encode() == wire.proof(SECRET, "server", challenge["job"],
                                                 challenge["nonce"], claim["nonce"], claim)
    assert welcome["mac"].encode() != wire.proof(WRONG, "server", challenge["job"],
                                                 challenge["nonce"], claim["nonce"], claim)
    assert list(server.ranks) == [1] and not peer.closed and not server.strangers


def test_a_proof_made_for_another_claim_or_nonce_is_denied():
    server = serve()
    first = connect(server)
    # A proof over one rank, sent with another rank in the claim.
    challenge = first.challenge()
    claim = {"cmd": "kd_hello", "rank": "0", "size": "2", "nonce": "cd" * 16}
    mac = wire.proof(SECRET, "client", challenge["job"], challenge["nonce"], claim["nonce"],
                     claim).decode()
    first.send(f"cmd=kd_hello rank=1 size=2 nonce={'cd' * 16} mac={mac}\n".encode())
    # The same proof replayed on a connection with another nonce.
    second = connect(server)
    second.send(f"cmd=kd_hello rank=0 size=2 nonce={'cd' * 16} mac={mac}\n".encode())
    pump(server)
    for peer in (first, second):
        peer.hear()
        assert [line["cmd"] for line in peer.lines()] == ["kd_challenge", "kd_denied"]
    assert not server.ranks and server.denied == 2 and not server.errors


def test_a_line_past_the_cap_closes_that_connection_only():
    server = serve()
    ranks = ready(server)
    bystander, talker = connect(server), connect(server)
    talker.send(b"x" * (wire.UNAUTHENTICATED_LINE_BYTES + 2))
    pump(server)
    talker.hear()
    assert talker.closed and talker.conn.closed
    assert [line["cmd"] for line in talker.lines()] == ["kd_challenge"]
    assert not bystander.conn.closed and bystander.conn in server.strangers
    # A newline-ended line of the same length is refused as a proof, as closely.
    teller = connect(server)
    teller.send(b"cmd=kd_hello " + b"y" * wire.UNAUTHENTICATED_LINE_BYTES + b"\n")
    pump(server)
    teller.hear()
    assert teller.closed and [line["cmd"] for line in teller.lines()] == ["kd_challenge"]
    # The job's ranks go on being served.
    ranks[0].send(b"cmd=get_universe_size\n")
    pump(server)
    ranks[0].hear()
    assert ranks[0].lines()[-1] == {"cmd": "universe_size", "size": "2", "rc": "0"}
    assert not server.done and not server.errors


def test_past_the_cap_a_newcomer_is_turned_away_until_the_oldest_has_had_its_grace():
    server = serve()
    peers = [connect(server) for _ in range(server.max_unauthenticated)]
    # Every waiting stranger is young: the newcomer is turned away unheard
    # (a rank's client tries again), so a flood cannot starve one proving itself.
    turned_away = connect(server)
    assert turned_away.conn is None and turned_away.closed and not turned_away.lines()
    assert not any(peer.closed for peer in peers)
    # Once the oldest has had its grace to answer, a newcomer takes its place.
    peers[0].conn.accepted -= server.stranger_grace_seconds
    newcomer = connect(server)
    peers[0].hear()
    assert peers[0].closed and peers[0].conn.closed
    assert [line["cmd"] for line in newcomer.lines()] == ["kd_challenge"]
    assert list(server.strangers) == [peer.conn for peer in peers[1:]] + [newcomer.conn]
    for peer in [*peers[1:], newcomer]:
        peer.sock.close()
    pump(server)
    assert not server.strangers and not server.errors


def test_a_silent_stranger_is_closed_after_the_handshake_time():
    server = serve()
    rank = connect(server)
    rank.claim("kd_hello", rank=0, size=2, host="h", pid=1)
    silent, late = connect(server), connect(server)
    silent.conn.accepted = time.monotonic() - server.handshake_seconds - 1
    late.send(b"cmd=kd_hello rank=1")  # half a line, then nothing: a whole-message deadline
    late.conn.accepted = time.monotonic() - server.handshake_seconds - 1
    server.step(0)
    for peer in (silent, late):
        peer.hear()
        assert peer.closed and [line["cmd"] for line in peer.lines()] == ["kd_challenge"]
    assert not rank.closed and list(server.ranks) == [0] and not server.strangers


def test_a_peer_that_never_reads_is_dropped_once_its_output_passes_the_cap():
    class SmallBuffers(Recording):
        output_bytes = 32 << 10

    server = serve(server_class=SmallBuffers)
    ranks = [connect(server, SO_SNDBUF=4096) for _ in range(2)]
    for rank, peer in enumerate(ranks):
        peer.claim("kd_hello", rank=rank, size=2, host="h", pid=rank)
    watcher = connect(server)
    watcher.claim("kd_watch", rank=-1)
    ranks[1].send(b"cmd=put key=k value=" + b"v" * pmi_server.VALLEN_MAX + b"\n")
    pump(server)
    # Rank 0 asks and asks, and never reads an answer (a send that blocked the
    # server would hang here: the test's hard timeout would end it).
    ranks[0].send(b"cmd=get key=k\n" * 64)
    pump(server)
    assert ranks[0].conn.closed, "the server still buffers for a peer that never reads"
    assert len(ranks[0].conn.outbox) <= server.output_bytes + pmi_server.VALLEN_MAX + 256
    # It is a rank that stopped listening: the job ends, naming it, as for a death.
    watcher.hear()
    abort = watcher.lines()[-1]
    assert abort["cmd"] == "kd_abort" and abort["rank"] == "0" and server.done
    assert not server.errors


class Exhausted:
    """A listener whose ``accept`` fails with EMFILE ``failures`` times first."""

    def __init__(self, real, failures):
        self.real, self.failures = real, failures

    def fileno(self):
        return self.real.fileno()

    def close(self):
        self.real.close()

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.real.accept()


def test_emfile_on_accept_drops_the_oldest_stranger_and_the_loop_goes_on():
    listener = socket.create_server(("127.0.0.1", 0))
    server = serve(listener=listener)
    try:
        strangers = [connect(server) for _ in range(3)]
        server.listener = Exhausted(listener, failures=1)
        newcomer = socket.create_connection(listener.getsockname(), timeout=30)
        pump(server)
        for peer in strangers:
            peer.hear()
        assert strangers[0].closed and not strangers[1].closed and not strangers[2].closed
        newcomer.settimeout(30)
        assert wire.LineReader(newcomer).line(time.monotonic() + 30).startswith(
            b"cmd=kd_challenge ")
        # No stranger left to drop: accepting pauses, then resumes.
        for peer in strangers[1:]:
            peer.sock.close()
        newcomer.close()
        pump(server)
        assert not server.strangers
        server.listener = Exhausted(listener, failures=1)
        server.accept_pause_seconds = 0.0
        second = socket.create_connection(listener.getsockname(), timeout=30)
        server.step(0)
        assert server.accept_paused_until is not None
        pump(server)
        assert server.accept_paused_until is None
        assert wire.LineReader(second).line(time.monotonic() + 30).startswith(
            b"cmd=kd_challenge ")
        second.close()
        assert not server.errors and not server.done
    finally:
        server.close_all(0)


# -- property: arbitrary and near-miss byte streams --------------------------------

COMMANDS = ["kd_hello", "kd_watch", "kd_challenge", "kd_welcome", "kd_ready", "kd_abort",
            "init", "get_maxes", "get_appnum", "get_my_kvsname", "get_universe_size", "put",
            "get", "barrier_in", "finalize", "abort", "spawn", "", "KD_HELLO", "kd_hello\x00"]
FIELDS = ["rank", "size", "host", "pid", "nonce", "mac", "key", "value", "exitcode",
          "message", "kvsname", "pmi_version", "cmd", ""]
NUMBERS = st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from([-1, 0, 1, 2, 3, 1 << 24]))
VALUES = st.one_of(
    NUMBERS.map(str),
    st.text(alphabet="az09-_.:/%=é中\u00ff\ufffd\x00\r\t", max_size=12),
    st.binary(max_size=16).map(lambda b: b.hex()),
    st.just("ab" * 16), st.just("0" * 64), st.just("x" * 1100), st.just(""),
)


@st.composite
def near_miss_lines(draw):
    """A line of the protocol with fields malformed, missing, huge, negative or
    not ASCII, and a mac that is missing, junk or made with another secret."""
    cmd = draw(st.sampled_from(COMMANDS))
    fields = draw(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6))
    fields.pop("mac", None)
    mac = draw(st.sampled_from(["none", "junk", "wrong_secret", "wrong_nonce"]))
    text = " ".join([f"cmd={cmd}", *(f"{key}={value}" for key, value in fields.items())])
    return text, mac


def _stranger_bytes(peer, item):
    if isinstance(item, bytes):
        return item
    text, mac = item
    challenge = peer.challenge()
    claim = wire.parse_line(text)
    if mac == "none":
        return text.encode("utf-8", "surrogatepass") + b"\n"
    if mac == "junk":
        return (text + " mac=" + "f" * 64).encode("utf-8", "surrogatepass") + b"\n"
    nonce = claim.get("nonce", "")
    if mac == "wrong_secret":
        shown = wire.proof(WRONG, "client", challenge["job"], challenge["nonce"], nonce, claim)
    else:  # the right secret, over another server nonce: a replay
        shown = wire.proof(SECRET, "client", challenge["job"], "cd" * 16, nonce, claim)
    return (text + " mac=" + shown.decode()).encode("utf-8", "surrogatepass") + b"\n"


STREAMS = st.lists(st.lists(st.one_of(st.binary(max_size=300), near_miss_lines()),
                            min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams=STREAMS)
def test_no_stream_from_strangers_raises_is_served_or_changes_the_job(streams):
    server = serve(size=2)
    rank = connect(server)  # one real rank came already
    rank.claim("kd_hello", rank=0, size=2, host="h", pid=1)
    before = snapshot(server)
    peers = [connect(server) for _ in streams]
    for peer, stream in zip(peers, streams):
        for item in stream:
            peer.send(_stranger_bytes(peer, item))
        pump(server)
        peer.hear()
    for peer in peers:
        commands = [line.get("cmd") for line in peer.lines()]
        assert commands[0] == "kd_challenge" and set(commands[1:]) <= {"kd_denied"}, commands
        assert len(commands) <= 2, commands
    assert snapshot(server) == before
    assert server.errors == []
    assert [line["cmd"] for line in rank.lines()] == ["kd_challenge", "kd_welcome"]


PMI_LINES = st.one_of(st.binary(max_size=200),
                      near_miss_lines().map(lambda item: item[0].encode("utf-8",
                                                                        "surrogatepass")))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(PMI_LINES, min_size=1, max_size=8))
def test_no_line_from_a_proven_rank_raises_in_the_process_manager(lines):
    server = serve(size=2)
    ranks = ready(server)
    for line in lines:
        ranks[1].send(line.replace(b"\n", b" ") + b"\n")
    pump(server)
    assert server.errors == []
    assert len(server.store) <= server.store_limit
    assert all(len(key) <= pmi_server.KEYLEN_MAX and len(value) <= pmi_server.VALLEN_MAX
               for key, value in server.store.items())


@pytest.mark.parametrize("line", [b"", b"cmd", b"=", b"cmd= =x", b"\xff\xfe=\x00",
                                  b"a=b a=c", b" cmd=put  key=a "])
def test_parse_line_never_raises(line):
    fields = wire.parse_line(line)
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in fields.items())
    assert wire.parse_line(b"a=b a=c") == {"a": "b"}


def test_whole_takes_only_whole_numbers_in_range():
    for value in ["x", "", "1.0", "0x1", " 1", "1" * 12, "--1", "²"]:
        assert wire.whole({"rank": value}, "rank", -1, 10) is None
    assert wire.whole({"rank": "-1"}, "rank", -1, 10) == -1
    assert wire.whole({"rank": "11"}, "rank", -1, 10) is None
    assert wire.whole({}, "rank", -1, 10) is None


def test_format_line_refuses_a_space_or_line_break():
    assert wire.format_line("put", key="a", value=1) == b"cmd=put key=a value=1\n"
    for bad in ["a b", "a\nb", "a\rb"]:
        with pytest.raises(ValueError, match="must hold no space or line break"):
            wire.format_line("put", key=bad)
