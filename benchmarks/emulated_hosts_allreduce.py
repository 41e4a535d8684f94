"""Allreduce across emulated hosts: kd.allreduce, mpi4py and gloo side by side.

Run from the repository root as root (the driver builds the hosts with
``benchmarks/emulated_hosts.py`` for each layout, one after the other)::

    python benchmarks/emulated_hosts_allreduce.py --layouts 2x1,4x1,2x2 --rate 1gbit \\
        -b 4K -e 256M -f 4

Each layout ``HxR`` is H hosts of R ranks, started by kdrun through its host
file (``--launch selfstart``: started with torchrun's variables). In every rank, for
each size, the peers alternate call by call after a barrier: ``kd.allreduce``
(the public call), mpi4py's ``Allreduce`` on preallocated buffers on the same
MPICH, and ``torch.distributed.all_reduce`` over gloo; each one's result is
checked exactly (float32 inputs holding small integers, so every order of
summation gives the same sum) once per size, untimed. The time of a call is
the slowest rank's; the table gives medians, in nccl-tests' columns (``size
count type redop time algbw busbw #wrong``, busbw = algbw * 2(n-1)/n) per
peer, and each peer's bus bandwidth over the hosts (algbw * 2(H-1)/H, H hosts:
what each host's link must carry) as a fraction of the link (what one TCP
stream between two hosts carried): 1.0 is the link's speed. A 4-byte
allreduce's latency opens each layout.

``--worker`` is the rank program (what the driver runs in the hosts).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
PEERS = ("kd", "mpi", "gloo")


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"a size is a number of bytes with K, M or G, "
                                         f"e.g. 4K. Received: {text!r}")
    return int(match.group(1)) * UNITS[match.group(2)]


def human(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]}{unit}"
    return str(size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2x1,4x1,2x2",
                        help="HOSTSxRANKS,... (default 2x1,4x1,2x2)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=4 << 10)
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=256 << 20)
    parser.add_argument("-f", "--factor", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per size")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="of kd, mpi, gloo and ring (keras_dist's pipelined ring over "
                        "MPI point-to-point, keras_dist/transports/ring.py, called directly)")
    parser.add_argument("--segment", type=parse_size, default=1 << 20,
                        help="the ring's segment (default 1M)")
    parser.add_argument("--latency-calls", type=int, default=200,
                        help="4-byte calls per timed round of the latency line")
    parser.add_argument("--link-seconds", default="2",
                        help="how long the link is measured (the harness's option)")
    parser.add_argument("--launch", choices=["kdrun", "selfstart"], default="kdrun",
                        help="start the ranks with kdrun's host file or self-started")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def sizes(args) -> list[int]:
    out, size = [], args.min_bytes
    while size <= args.max_bytes:
        out.append(size)
        size *= args.factor
    return out


# -- the rank program ------------------------------------------------------------

def _inner_calls(nbytes: int) -> int:
    """Calls per timed round: enough that small sizes are not timer noise."""
    return max(1, min(50, (1 << 20) // max(nbytes, 1)))


def worker(args) -> int:
    import socket

    import numpy as np

    import keras_dist as kd
    from keras_dist.transports import ring

    kd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    peers = args.peers.split(",")
    calls, buffers = {}, {}
    if "gloo" in peers:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        master = comm.bcast(_my_address(), root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{master}:29611", rank=rank,
                                world_size=size)
    link = float(os.environ.get("KD_EMULATED_LINK_MBPS", "0")) * 1e6
    bus = 2 * (size - 1) / size

    sent = {peer: 0 for peer in peers}  # bytes this host's eth0 sent in timed calls
    floor = {peer: 0.0 for peer in peers}  # what a ring must send from each host

    def timed(call, inner: int, peer: str, nbytes: int) -> float:
        comm.Barrier()
        before = _tx_bytes()
        start = time.perf_counter()
        for _ in range(inner):
            call()
        mine = (time.perf_counter() - start) / inner
        sent[peer] += _tx_bytes() - before
        floor[peer] += inner * nbytes * 2 * (machines - 1) / machines
        return comm.allreduce(mine, op=MPI.MAX)

    def make(count: int):
        data = ((np.arange(count, dtype=np.int64) + rank) % 13).astype(np.float32)
        pattern = np.array([sum((i + r) % 13 for r in range(size)) for i in range(13)],
                           np.float32)
        expected = np.resize(pattern, count)
        recv = np.empty_like(data)
        def kd_call():
            # The previous result is dropped first, as a training step drops
            # the last step's reduced gradients (kd reuses its memory).
            buffers["kd"] = None
            buffers["kd"] = kd.allreduce(data, op=kd.Sum)

        calls["kd"] = kd_call
        calls["mpi"] = lambda: comm.Allreduce(data, recv, MPI.SUM)
        buffers["mpi"] = recv
        if "ring" in peers:  # keras_dist's ring, whatever the transport would choose
            ring_out = np.empty_like(data)
            scratch = np.empty(count // size + 1, data.dtype)
            buffers["ring"] = ring_out

            def ring_call():
                np.copyto(ring_out, data)
                ring.allreduce(comm, ring_out, np.add, scratch, args.segment)

            calls["ring"] = ring_call
        if "gloo" in peers:
            tensor = torch.from_numpy(data.copy())
            buffers["gloo"] = tensor
            calls["gloo"] = lambda: dist.all_reduce(tensor)
        return data, expected

    def wrong(peer: str, data, expected) -> int:
        """One untimed call on fresh input; elements that differ from the exact sum."""
        if peer == "gloo":
            buffers["gloo"].copy_(torch.from_numpy(data))
        calls[peer]()
        result = buffers[peer]
        result = result.numpy() if peer == "gloo" else result
        return int(comm.allreduce(int(np.count_nonzero(result != expected)), op=MPI.SUM))

    machines = len(set(comm.allgather(socket.gethostname())))
    local = size // machines
    # What each host's link must carry per byte reduced (a ring over the hosts):
    # the hosts' bus bandwidth over the link is 1.0 at the link's speed.
    across = 2 * (machines - 1) / machines
    if rank == 0:
        print(f"# {size} ranks on {machines} hosts, "
              f"link {link / 1e6:.1f} MB/s (one TCP stream), "
              f"kd transport {_transport_name(kd)}, load {os.getloadavg()[0]:.2f}", flush=True)
    # 4-byte latency
    data, expected = make(1)
    lat = {peer: [] for peer in peers}
    bad = {peer: wrong(peer, data, expected) for peer in peers}
    for rep in range(args.reps):
        for peer in peers[rep % len(peers):] + peers[:rep % len(peers)]:
            lat[peer].append(timed(calls[peer], args.latency_calls, peer, 4))
    if rank == 0:
        print("# 4-byte allreduce latency (us, median): " + "  ".join(
            f"{peer} {statistics.median(lat[peer]) * 1e6:.1f} (#wrong {bad[peer]})"
            for peer in peers), flush=True)
        head = f"{'size':>10} {'count':>10} {'type':>6} {'redop':>5}"
        for peer in peers:
            head += f" | {peer + ' time(us)':>14} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        head += " | " + " ".join(f"{peer + '/link':>9}" for peer in peers)
        print(head + "   (GB/s; time: median of the slowest rank)", flush=True)
    failures = sum(bad.values())
    for nbytes in sizes(args):
        count = nbytes // 4
        data, expected = make(count)
        bad = {peer: wrong(peer, data, expected) for peer in peers}
        failures += sum(bad.values())
        inner = _inner_calls(nbytes)
        reps = args.reps if nbytes < (64 << 20) else max(2, args.reps - 2)
        times = {peer: [] for peer in peers}
        for rep in range(reps):
            for peer in peers[rep % len(peers):] + peers[:rep % len(peers)]:
                times[peer].append(timed(calls[peer], inner, peer, nbytes))
        if rank == 0:
            row = f"{nbytes:>10} {count:>10} {'float':>6} {'sum':>5}"
            ratios = []
            for peer in peers:
                seconds = statistics.median(times[peer])
                algbw = nbytes / seconds / 1e9
                row += (f" | {seconds * 1e6:>14.1f} {algbw:>7.3f} {algbw * bus:>7.3f}"
                        f" {bad[peer]:>6}")
                ratios.append(f"{algbw * across * 1e9 / link:>9.2f}" if link else f"{'-':>9}")
            print(row + " | " + " ".join(ratios), flush=True)
        del data, expected
        buffers.clear()
        calls.clear()
    # Where the bytes went: a host's eth0 must carry at least what a ring sends
    # (less would mean the data took another way, past the shaped link).
    wire = comm.gather({peer: sent[peer] / floor[peer] for peer in peers}, root=0)
    if rank == 0:
        print("# bytes each host's eth0 sent in the timed calls, over a ring's minimum "
              "(min..max over hosts' first ranks): " + "  ".join(
                  f"{peer} {min(w[peer] for w in wire[::local]):.2f}.."
                  f"{max(w[peer] for w in wire[::local]):.2f}" for peer in peers), flush=True)
    if "gloo" in peers:
        dist.destroy_process_group()
    kd.shutdown()
    return 1 if failures else 0


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as handle:
        return int(handle.read())


def _transport_name(kd) -> str:
    transport = kd._get().transport
    inner = getattr(transport, "inner", None) or getattr(transport, "_inner", None)
    return getattr(inner, "name", None) or transport.name


def _my_address() -> str:
    """This host's address on its one interface (eth0 of the emulated host)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                             struct.pack("256s", b"eth0"))
    return socket.inet_ntoa(packed[20:24])


# -- the driver ----------------------------------------------------------------

def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{os.cpu_count()} CPUs, load {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
          f"{' '.join(f'{k}={v}' for k, v in os.environ.items() if k.startswith('MPIR_CVAR'))} "
          f"python {' '.join(sys.argv)}", flush=True)
    code = 0
    for layout in args.layouts.split(","):
        hosts, ranks = (int(v) for v in layout.split("x"))
        print(f"\n## {hosts} hosts x {ranks} rank(s), {args.rate}", flush=True)
        forwarded = [f"--min-bytes={args.min_bytes}", f"--max-bytes={args.max_bytes}",
                     f"--factor={args.factor}", f"--reps={args.reps}", f"--peers={args.peers}",
                     f"--segment={args.segment}", f"--latency-calls={args.latency_calls}"]
        done = subprocess.run(
            [sys.executable, str(HERE / "emulated_hosts.py"), "--hosts", str(hosts),
             "--ranks-per-host", str(ranks), "--rate", args.rate,
             "--link-seconds", args.link_seconds, "--timeout",
             str(args.timeout), args.launch, "--", sys.executable, __file__, "--worker",
             *forwarded],
            env={**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
        code = code or done.returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
