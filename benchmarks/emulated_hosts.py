"""Emulated hosts on one machine: network namespaces on a bridge, shaped links.

H "hosts", each a network namespace with one interface (``eth0``, an address
in a private /24 used only here) on a bridge that lives in a namespace of its
own (the "switch"); nothing is added to the machine's own namespace, so all
traffic stays between the namespaces made here. Each host's egress is shaped
with ``tc``: ``tbf`` at the chosen rate, under ``netem`` for the chosen delay
where the kernel has netem (where it has not, the delay is not applied and
the run says so). Processes run in a host through ``tests/faults/
netns_launcher.sh`` (the stand-in for ssh that hydra also uses there), in a
UTS namespace whose hostname is the host's name.

Usage (as root, from the repository root)::

    python benchmarks/emulated_hosts.py --hosts 2 --rate 1gbit link
    python benchmarks/emulated_hosts.py --hosts 2 --ranks-per-host 2 kdrun -- python W.py
    python benchmarks/emulated_hosts.py --hosts 4 selfstart -- python W.py

``link`` measures what the link carries (one TCP stream between two hosts,
Python sockets) and the round trip of a 1-byte message; ``kdrun`` starts
``kdrun -np H*R --hostfile F COMMAND`` in host 0 (hydra reaches the other
hosts through the launcher); ``selfstart`` starts the H*R processes itself,
each in its host, with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` = host 0,
``MASTER_PORT``), as a cluster would. ``kdrun`` and ``selfstart`` measure the
link first too, unless ``--link-seconds 0``, and give the processes the rate
one TCP stream reached in ``KD_EMULATED_LINK_MBPS`` (MB/s).

Every name made here starts with a prefix unique to the run (``--prefix``,
default ``kdeh`` and 6 random hex digits); every process started here
carries ``KD_EMULATED_HOSTS=<prefix>`` in its environment. Whatever happens
(an error, a timeout, SIGTERM or Ctrl-C), the namespaces' processes are
killed and the namespaces deleted, which takes their interfaces and the
bridge with them; the run ends by checking nothing is left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = REPO_ROOT / "tests" / "faults" / "netns_launcher.sh"
TAG_ENV = "KD_EMULATED_HOSTS"
#: What the processes started in the hosts learn the measured link rate from (MB/s).
LINK_ENV = "KD_EMULATED_LINK_MBPS"
#: What a self-started job's rank 0 listens on in host 0 (a fresh namespace: free).
MASTER_PORT = 29500


def parse_rate(text: str) -> float:
    """``"1gbit"``, ``"2.5gbit"``, ``"100mbit"`` -> bits per second."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", text.strip().lower())
    if not match:
        raise ValueError(f"`--rate` must be a number of kbit, mbit or gbit, e.g. 1gbit. "
                         f"Received: --rate {text!r}")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def namespaces_with_prefix(prefix: str) -> list[str]:
    """The network namespaces whose names start with ``prefix``."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip().startswith(prefix)]


def links_with_prefix(prefix: str) -> list[str]:
    """Interfaces of this namespace whose names start with ``prefix``."""
    names = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", "show").stdout, re.M)
    return [name for name in names if name.startswith(prefix)]


def processes_with_tag(prefix: str) -> list[int]:
    """Pids of processes whose environment holds ``KD_EMULATED_HOSTS=<prefix>``."""
    wanted = f"{TAG_ENV}={prefix}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if wanted in handle.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def leftovers(prefix: str) -> list[str]:
    """Whatever a run with ``prefix`` left: namespaces, interfaces, processes."""
    return ([f"netns {name}" for name in namespaces_with_prefix(prefix)]
            + [f"link {name}" for name in links_with_prefix(prefix)]
            + [f"pid {pid}" for pid in processes_with_tag(prefix)])


class EmulatedHosts:
    """H network-namespace hosts on a bridge, egress shaped to ``rate_bps``.

    Use as a context manager; leaving it (however) removes everything.

    Args:
        hosts: how many hosts (2 to 200).
        rate_bps: each host's egress rate in bits per second (None: unshaped).
        delay_us: one-way delay added to each host's egress (needs netem).
        prefix: what every name made here starts with (unique to the run).
        mtu: the hosts' MTU.
    """

    def __init__(self, hosts: int, rate_bps: float | None = 1e9, delay_us: float = 0.0,
                 prefix: str | None = None, mtu: int = 1500) -> None:
        if not 2 <= hosts <= 200:
            raise ValueError(f"`hosts` must be in [2, 200]. Received: hosts={hosts}")
        self.prefix = prefix or f"kdeh{secrets.token_hex(3)}"
        if len(self.prefix) > 12 or not re.fullmatch(r"[a-z][a-z0-9]*", self.prefix):
            raise ValueError("`prefix` must be at most 12 lowercase letters and digits. "
                             f"Received: prefix={self.prefix!r}")
        self.rate_bps, self.delay_us, self.mtu = rate_bps, delay_us, mtu
        token = int(self.prefix[-4:], 16) if re.fullmatch(r".*[0-9a-f]{4}", self.prefix) else 0
        self.subnet = f"10.{100 + token % 100}.{token // 100 % 250}"
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.addresses = [f"{self.subnet}.{i + 10}" for i in range(hosts)]
        self.hostnames = [f"{self.prefix}-host{i}" for i in range(hosts)]
        self.delay_applied = False
        #: What one TCP stream carried between two hosts (MB/s), once measured.
        self.link_mbytes_per_s: float | None = None
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self.scratch = tempfile.mkdtemp(prefix=f"{self.prefix}-")

    # -- building and removing -------------------------------------------

    def __enter__(self) -> EmulatedHosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def _build(self) -> None:
        self._netns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index, namespace in enumerate(self.namespaces):
            self._netns(namespace)
            port = f"p{index}"
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth",
                 "peer", "name", "eth0", "netns", namespace)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", namespace, "link", "set", "eth0", "mtu", str(self.mtu))
            _run("ip", "-n", namespace, "addr", "add", f"{self.addresses[index]}/24",
                 "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            self._shape(namespace)

    def _shape(self, namespace: str) -> None:
        """tbf at the rate (a burst of 1 ms at the rate, at least 64 KiB: a veth
        hands tbf 64 KiB segments), under netem for the delay if asked."""
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "eth0"]
        parent = ["root"]
        if self.delay_us > 0:
            netem = _run(*tc, "root", "handle", "1:", "netem", "delay",
                         f"{self.delay_us:g}us", "limit", "100000", check=False)
            self.delay_applied = netem.returncode == 0
            if self.delay_applied:
                parent = ["parent", "1:1", "handle", "10:"]
        if self.rate_bps:
            burst = max(65536 + 1514, int(self.rate_bps / 8 * 1e-3))
            _run(*tc, *parent, "tbf", "rate", f"{int(self.rate_bps)}bit",
                 "burst", str(burst), "latency", "20ms")

    def close(self) -> None:
        """Kills every process in the namespaces, deletes them, checks nothing is left."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for namespace in reversed(self._made):
            for _ in range(50):
                pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.05)
        for pid in processes_with_tag(self.prefix):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for namespace in reversed(self._made):
            _run("ip", "netns", "del", namespace, check=False)
        self._made = []
        subprocess.run(["rm", "-rf", self.scratch], check=False)

    # -- running things in the hosts ---------------------------------------

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment, plus what a process in a host needs."""
        env = dict(os.environ)
        env.update({
            TAG_ENV: self.prefix,
            "KD_NETNS_HOSTS": ",".join(
                f"{a}={n}={h}" for a, n, h in zip(self.addresses, self.namespaces,
                                                  self.hostnames)),
            # hydra reaches the other hosts through the launcher, as ssh
            "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(LAUNCHER),
            "HYDRA_IFACE": "eth0",
            # MPI and gloo over the host's one interface. Not UCX's shared
            # memory: UCX sees one machine through the namespaces and would
            # carry "cross-host" messages in memory, past the shaped link.
            "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp",
            "GLOO_SOCKET_IFNAME": "eth0",
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                    os.pathsep) if p]),
            "PYTHONUNBUFFERED": "1",
        })
        if self.link_mbytes_per_s:
            env[LINK_ENV] = f"{self.link_mbytes_per_s:.2f}"
        env.update(extra or {})
        return env

    def start(self, host: int, argv: list[str], env: dict[str, str] | None = None,
              **popen) -> subprocess.Popen:
        """Starts ``argv`` in host ``host`` (its network and hostname)."""
        proc = subprocess.Popen([str(LAUNCHER), self.addresses[host], *argv],
                                env=self.environment(env), cwd=str(REPO_ROOT),
                                start_new_session=True, **popen)
        self._procs.append(proc)
        return proc

    def measure_link(self, seconds: float = 2.0, a: int = 0, b: int = 1) -> dict[str, float]:
        """One TCP stream from host a to host b for ``seconds``, and 1-byte round trips.

        Returns ``{"mbytes_per_s": ..., "rtt_us": ...}`` (megabytes of 10^6 bytes)."""
        sink = self.start(b, [sys.executable, __file__, "_sink", self.addresses[b]],
                          stdout=subprocess.PIPE, text=True)
        ready = sink.stdout.readline()
        if not ready.startswith("LISTENING"):
            raise RuntimeError(f"the TCP sink in host {b} did not start: {ready!r}")
        source = self.start(a, [sys.executable, __file__, "_source", self.addresses[b],
                                str(seconds)], stdout=subprocess.PIPE, text=True)
        source_out, _ = source.communicate(timeout=seconds + 60)
        sink_out, _ = sink.communicate(timeout=60)
        measured = dict(item.split("=") for item in sink_out.split()[1:])
        measured.update(item.split("=") for item in source_out.split()[1:])
        measured = {key: float(value) for key, value in measured.items()}
        self.link_mbytes_per_s = measured["mbytes_per_s"]
        return measured


# -- the TCP stream, run inside the hosts ------------------------------------

def _sink(address: str) -> None:
    with socket.create_server((address, 5201)) as server:
        print("LISTENING", flush=True)
        connection, _ = server.accept()
        with connection:
            while connection.recv(1) != b"q":  # round trips first
                connection.sendall(b"r")
            received, buffer = 0, bytearray(1 << 20)
            first = connection.recv_into(buffer)
            start = time.perf_counter()
            while True:
                count = connection.recv_into(buffer)
                if not count:
                    break
                received += count
            elapsed = time.perf_counter() - start
    del first
    print(f"STREAM mbytes_per_s={received / elapsed / 1e6:.2f}", flush=True)


def _source(address: str, seconds: str) -> None:
    with socket.create_connection((address, 5201)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(200):
            start = time.perf_counter()
            connection.sendall(b"p")
            connection.recv(1)
            trips.append(time.perf_counter() - start)
        connection.sendall(b"q")
        data = bytes(1 << 20)
        end = time.perf_counter() + float(seconds)
        while time.perf_counter() < end:
            connection.sendall(data)
    trips.sort()
    print(f"TRIPS rtt_us={trips[len(trips) // 2] * 1e6:.1f}", flush=True)


# -- the command line ----------------------------------------------------------

def _describe(hosts: EmulatedHosts, link: dict[str, float] | None) -> None:
    rate = f"{hosts.rate_bps / 1e9:g} Gbit/s" if hosts.rate_bps else "unshaped"
    delay = ("no delay" if not hosts.delay_us else
             f"{hosts.delay_us:g} us delay" if hosts.delay_applied else
             f"delay {hosts.delay_us:g} us NOT applied (this kernel has no netem)")
    print(f"# emulated hosts: {len(hosts.namespaces)} x {rate}, {delay}, prefix {hosts.prefix}",
          flush=True)
    print(f"# made: netns {' '.join([hosts.switch, *hosts.namespaces])}", flush=True)
    if link:
        nominal = f" ({link['mbytes_per_s'] * 8e6 / hosts.rate_bps:.2f}x nominal)" \
            if hosts.rate_bps else ""
        print(f"# link: one TCP stream host0->host1 {link['mbytes_per_s']:.1f} MB/s{nominal}, "
              f"round trip {link['rtt_us']:.0f} us", flush=True)


def _selfstart(hosts: EmulatedHosts, ranks_per_host: int, command: list[str],
               timeout: float) -> int:
    size = len(hosts.namespaces) * ranks_per_host
    procs, outputs = [], []
    for rank in range(size):
        variables = {"RANK": str(rank), "WORLD_SIZE": str(size),
                     "LOCAL_RANK": str(rank % ranks_per_host),
                     "LOCAL_WORLD_SIZE": str(ranks_per_host),
                     "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": str(MASTER_PORT)}
        path = os.path.join(hosts.scratch, f"rank{rank}.out")
        outputs.append(path)
        with open(path, "wb") as out:
            procs.append(hosts.start(rank // ranks_per_host, command, variables,
                                     stdout=out, stderr=subprocess.STDOUT))
    print(f"# started: pids {' '.join(str(proc.pid) for proc in procs)}", flush=True)
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            print(f"# selfstart: timed out after {timeout:g} s", flush=True)
            codes.append(124)
            break
    for rank, path in enumerate(outputs):
        text = Path(path).read_text(errors="replace")
        if rank == 0:
            sys.stdout.write(text)
        else:
            for line in text.splitlines():
                print(f"[{rank}] {line}")
    sys.stdout.flush()
    return next((code for code in codes if code), 0)


def _kdrun(hosts: EmulatedHosts, ranks_per_host: int, command: list[str],
           timeout: float) -> int:
    hostfile = os.path.join(hosts.scratch, "hostfile")
    with open(hostfile, "w") as handle:
        handle.writelines(f"{address} slots={ranks_per_host}\n" for address in hosts.addresses)
    size = len(hosts.namespaces) * ranks_per_host
    proc = hosts.start(0, [sys.executable, "-m", "keras_dist.run", "-np", str(size),
                           "--hostfile", hostfile, *command])
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"# kdrun: timed out after {timeout:g} s", flush=True)
        return 124


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--rate", default="1gbit", help="egress rate, e.g. 1gbit; 'none': unshaped")
    parser.add_argument("--delay-us", type=float, default=100.0)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--prefix", default=None)
    parser.add_argument("--link-seconds", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("mode", choices=["link", "kdrun", "selfstart", "_sink", "_source"])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.mode == "_sink":
        _sink(*args.command)
        return 0
    if args.mode == "_source":
        _source(*args.command)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.mode != "link" and not command:
        parser.error(f"`{args.mode}` needs a command after --")

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    rate = None if args.rate == "none" else parse_rate(args.rate)
    code = 1
    hosts = EmulatedHosts(args.hosts, rate, args.delay_us, args.prefix, args.mtu)
    try:
        with hosts:
            link = hosts.measure_link(args.link_seconds) if args.link_seconds > 0 else None
            _describe(hosts, link)
            if args.mode == "link":
                code = 0
            elif args.mode == "kdrun":
                code = _kdrun(hosts, args.ranks_per_host, command, args.timeout)
            else:
                code = _selfstart(hosts, args.ranks_per_host, command, args.timeout)
    finally:
        left = leftovers(hosts.prefix)
        print(f"# cleanup: {'nothing left' if not left else 'LEFT ' + ', '.join(left)}",
              flush=True)
    return code if not left else 1


if __name__ == "__main__":
    sys.exit(main())
