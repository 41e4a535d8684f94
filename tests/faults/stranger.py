"""A stranger on the network, in threads of a test's process: it attacks a
port that speaks keras_dist's rendezvous protocol (``keras_dist._runtime.wire``)
and notes, per case, everything it heard that it should not have.

Used by tests/faults/test_rendezvous_attacks.py (the process manager of
self-started jobs) and tests/cluster/test_cluster_attacks.py (Spark's driver
relay, the process manager of Ray's executor). Each case is a method taking
the case's name; ``guarded(case, method)`` runs it in a thread and turns an
exception into a problem of that case. ``problems[case]`` lists what went
wrong; ``lines_heard[case]`` every command heard.
"""

import errno
import random
import secrets
import selectors
import socket
import threading
import time
from urllib.parse import unquote

from keras_dist._runtime import wire

WRONG = b"not-the-jobs-secret-at-all"
#: What a stranger may hear: the challenge, then the refusal.
ALLOWED = {"kd_challenge", "kd_denied"}
#: Seconds any one stranger's connection may stay open: the server closes
#: those that have not proved the secret within 5 s.
PATIENCE = 60.0
CONNECTIONS_HELD = 3000
BATCH = 50


class Stranger:
    """Attacks ``port`` and notes, per case, everything that went wrong."""

    def __init__(self, port):
        self.port = port
        self.problems = {}
        self.lines_heard = {}
        self.seconds = {}
        self.lock = threading.Lock()

    # -- notes ------------------------------------------------------------------
    def problem(self, case, text):
        with self.lock:
            self.problems.setdefault(case, []).append(text)

    def judge(self, case, heard, what, *, denied=None):
        """``heard`` on one connection must be the challenge and, at most, the
        refusal; ``denied``: the refusal must (True) or must not (False) be there."""
        lines = bytes(heard).split(b"\n")
        if lines[-1]:
            self.problem(case, f"{what}: heard a partial line {lines[-1][:120]!r}")
        commands = [wire.parse_line(line).get("cmd") for line in lines[:-1]]
        with self.lock:
            self.lines_heard.setdefault(case, []).extend(commands)
        if set(commands) - ALLOWED or len(commands) > 2 or (
                commands and commands[0] != "kd_challenge"):
            self.problem(case, f"{what}: heard {bytes(heard)[:300]!r}")
        if b"keras_dist_" in heard or b"kvsname" in heard or b"value=" in heard:
            self.problem(case, f"{what}: heard something of the store: {bytes(heard)[:300]!r}")
        if denied is True and "kd_denied" not in commands:
            self.problem(case, f"{what}: not denied (heard {bytes(heard)[:200]!r})")
        if denied is False and "kd_denied" in commands:
            self.problem(case, f"{what}: denied before it sent a whole line")

    def guarded(self, case, attack):
        def run():
            started = time.monotonic()
            try:
                attack(case)
            except Exception as error:  # noqa: BLE001 - reported per case below
                self.problem(case, f"the attack itself failed: {error!r}")
            self.seconds[case] = time.monotonic() - started
        return threading.Thread(target=run, name=f"stranger-{case}", daemon=True)

    # -- one connection -----------------------------------------------------------
    def connect(self):
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=PATIENCE)
        return sock

    def challenge(self, sock, heard):
        """Reads the challenge line into ``heard``; returns its fields."""
        while b"\n" not in heard:
            data = sock.recv(4096)
            if not data:
                break
            heard += data
        return wire.parse_line(bytes(heard).split(b"\n")[0])

    def hear_out(self, sock, heard):
        """Reads until the server closes ``sock``; False if it did not within PATIENCE."""
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return True
                heard += data
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        finally:
            sock.close()

    def say(self, case, what, payload, *, denied=None, prove_with=None):
        """One connection: the challenge, then ``payload`` (bytes, or a function of
        the challenge's fields giving bytes), then everything until the server closes."""
        heard = bytearray()
        sock = self.connect()
        fields = self.challenge(sock, heard)
        data = payload(fields) if callable(payload) else payload
        try:
            sock.sendall(data)
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed by the server before it all went: heard below
        if not self.hear_out(sock, heard):
            self.problem(case, f"{what}: still open after {PATIENCE:g} s")
        self.judge(case, heard, what, denied=denied)

    # -- the cases -----------------------------------------------------------------
    def open_and_close(self, case):
        for index in range(300):
            sock = self.connect()
            if index % 2:  # half of them reset rather than closed
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            sock.close()

    def http(self, case):
        requests = [
            b"GET / HTTP/1.1\r\nHost: rendezvous\r\nUser-Agent: kube-probe/1.29\r\n\r\n",
            b"GET /healthz HTTP/1.0\r\n\r\n",
            b"POST /v1/kv HTTP/1.1\r\nContent-Length: 11\r\n\r\nkey=a value",
            b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
            b"PUT /" + b"a" * 2000 + b" HTTP/1.1\r\n\r\n",
        ]
        for request in requests:
            self.say(case, f"HTTP {request[:20]!r}", request)
        # A TLS client hello: no newline at all; closed when the handshake time runs out.
        self.say(case, "TLS client hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" +
                 bytes(range(11, 43)) + b"\x00" * 400, denied=False)

    def flood(self, case):
        total = 256 << 20
        chunk = b"x" * (1 << 20)
        heard = bytearray()
        sock = self.connect()
        self.challenge(sock, heard)
        sent = 0
        try:
            while sent < total:
                sent += sock.send(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass
        if not self.hear_out(sock, heard):
            self.problem(case, f"256 MiB with no newline: still open after {PATIENCE:g} s")
        self.judge(case, heard, f"256 MiB with no newline ({sent} bytes taken)", denied=False)
        noise = random.Random(38).randbytes(16 << 20)
        self.say(case, "16 MiB of random bytes", noise)

    def hold(self, case):
        """CONNECTIONS_HELD connections, never closed by us, opened in batches of
        BATCH, each batch once the server has taken the last (has challenged
        or closed each of them): the listening queue holds 64, and a connection
        the kernel dropped from a full queue would never reach the server."""
        selector = selectors.DefaultSelector()
        heard = {}
        refused = 0
        deadline = time.monotonic() + PATIENCE

        def serve_until(done):
            nonlocal refused
            while selector.get_map() and not done() and time.monotonic() < deadline:
                for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                    try:
                        data = key.fileobj.recv(65536)
                    except (ConnectionResetError, BrokenPipeError):
                        data = b""
                    except ConnectionRefusedError:
                        refused += 1
                        data = b""
                    if data:
                        heard[key.fileobj] += data
                    else:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                        closed.add(key.fileobj)

        closed = set()
        try:
            for _ in range(0, CONNECTIONS_HELD, BATCH):
                batch = []
                for _ in range(BATCH):
                    sock = socket.socket()
                    sock.setblocking(False)
                    code = sock.connect_ex(("127.0.0.1", self.port))
                    if code not in (0, errno.EINPROGRESS):
                        refused += 1
                        sock.close()
                        continue
                    heard[sock] = bytearray()
                    selector.register(sock, selectors.EVENT_READ)
                    batch.append(sock)
                serve_until(lambda batch=batch: all(b"\n" in heard[sock] or sock in closed
                                                    for sock in batch))
            serve_until(lambda: False)  # until the server has closed every one
            if selector.get_map():
                self.problem(case, f"{len(selector.get_map())} of {CONNECTIONS_HELD} "
                                   f"connections still open after {PATIENCE:g} s")
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()
        for index, data in enumerate(heard.values()):
            self.judge(case, data, f"held connection {index}", denied=False)
        if refused:
            self.problem(case, f"{refused} of {CONNECTIONS_HELD} connections were refused")

    def commands(self, case):
        commands = ["kd_hello", "kd_watch", "kd_challenge", "kd_welcome", "kd_ready", "kd_abort",
                    "kd_refuse", "init", "get_maxes", "get_appnum", "get_my_kvsname",
                    "get_universe_size", "put", "get", "barrier_in", "finalize", "abort",
                    "spawn", "kd_relay", "", "KD_HELLO"]
        variants = {
            "bare": "",
            "malformed": "rank=x size=two pid=-- key= value=%zz exitcode=abc",
            "missing": "rank= size= nonce=",
            "huge": f"rank={1 << 70} size={10 ** 30} pid={'9' * 200} key={'k' * 300}",
            "negative": "rank=-2 size=-1 pid=-1 exitcode=-9 pmi_version=-1",
            "non_ascii": "rank=１ size=² host=h\u00e9te key=\u4e2d value=\xff",
            "too_long": "value=" + "v" * 5000,
        }

        def claim(cmd, text, mac):
            def build(challenge):
                nonce = secrets.token_hex(16)
                fields = wire.parse_line(f"cmd={cmd} {text} nonce={nonce}")
                if mac == "none":
                    shown = ""
                elif mac == "junk":
                    shown = " mac=" + "0" * 64
                elif mac == "wrong_secret":
                    shown = " mac=" + wire.proof(WRONG, "client", challenge.get("job", ""),
                                                 challenge.get("nonce", ""), nonce,
                                                 fields).decode()
                else:  # a proof for another server nonce: a replay
                    shown = " mac=" + wire.proof(b"", "client", challenge.get("job", ""),
                                                 "ab" * 16, nonce, fields).decode()
                return f"cmd={cmd} {text} nonce={nonce}{shown}\n".encode()
            return build

        macs = ["none", "junk", "wrong_secret", "replay"]
        for index, cmd in enumerate(commands):
            for turn, (name, text) in enumerate(variants.items()):
                mac = macs[(index + turn) % len(macs)]  # every command meets every kind of mac
                # A line over the cap is closed on sight, without a refusal.
                denied = None if name == "too_long" else True
                self.say(case, f"cmd={cmd!r} {name} mac={mac}", claim(cmd, text, mac),
                         denied=denied)

    def watch_then_abort(self, case):
        def wrong(challenge):
            nonce = secrets.token_hex(16)
            claim = {"cmd": "kd_watch", "rank": "0", "nonce": nonce}
            mac = wire.proof(WRONG, "client", challenge["job"], challenge["nonce"], nonce, claim)
            return (f"cmd=kd_watch rank=0 nonce={nonce} mac={mac.decode()}\n"
                    "cmd=abort exitcode=1 message=a%20stranger%20aborts\n").encode()
        self.say(case, "watch with a wrong mac, then abort", wrong, denied=True)
        self.say(case, "plain watch, then abort",
                 b"cmd=kd_watch rank=0\ncmd=abort exitcode=1 message=x\n", denied=True)
        self.say(case, "watch rank=x, then abort", b"cmd=kd_watch rank=x\ncmd=abort\n",
                 denied=True)
        self.say(case, "abort alone", b"cmd=abort exitcode=1\n", denied=True)

    def before_every_rank(self, case, size):
        """(g) and (h): greetings a stranger may send before the ranks have come."""
        def greeting(rank, claimed_size, key):
            def build(challenge):
                nonce = secrets.token_hex(16)
                claim = {"cmd": "kd_hello", "rank": str(rank), "size": str(claimed_size),
                         "host": "stranger", "pid": "1", "nonce": nonce}
                line = " ".join(f"{k}={v}" for k, v in claim.items())
                if key is None:
                    return (line + "\n").encode()
                mac = wire.proof(key, "client", challenge["job"], challenge["nonce"], nonce,
                                 claim)
                return f"{line} mac={mac.decode()}\n".encode()
            return build
        ranks = [1, size - 1] if case == "h" else [0, 1]
        sizes = [size] if case == "h" else [size + 1, 1, 0, -1, 1 << 40]
        for rank in ranks:
            for claimed in sizes:
                for key, how in ((None, "no mac"), (WRONG, "a wrong secret"),
                                 (b"", "no secret")):
                    self.say(case, f"kd_hello rank={rank} size={claimed} with {how}",
                             greeting(rank, claimed, key), denied=True)

    def proven_without_secret(self, case, size):
        """With no secret, anyone proves the empty key: such a stranger, once the
        job runs, watches and says ``abort`` (a watcher only listens), and greets
        as a rank (a latecomer is refused alone). It hears its welcome and, as a
        latecomer, its refusal: nothing of the job."""
        watcher = self.connect()
        wire.authenticate(watcher, b"", "kd_watch", {"rank": 0}, time.monotonic() + PATIENCE)
        watcher.sendall(b"cmd=abort exitcode=1 message=a%20stranger%20aborts\n")
        watcher.close()
        latecomer = self.connect()
        reader = wire.authenticate(latecomer, b"", "kd_hello",
                                   {"rank": size - 1, "size": size, "host": "x", "pid": 1},
                                   time.monotonic() + PATIENCE)
        heard = [reader.line(time.monotonic() + PATIENCE)]
        while heard[-1] is not None:
            heard.append(reader.line(time.monotonic() + PATIENCE))
        latecomer.close()
        answers = [wire.parse_line(line) for line in heard[:-1]]
        if [answer.get("cmd") for answer in answers] != ["kd_refuse"] or \
                "has started already" not in unquote(answers[0].get("message", "")):
            self.problem(case, f"a proven latecomer heard {heard!r}")

    def still_answers(self, case):
        """The server still challenges and refuses a newcomer."""
        self.say(case, "a newcomer after the attacks", b"cmd=kd_hello rank=0 size=2\n",
                 denied=True)
