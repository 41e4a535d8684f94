"""How long N self-started processes take to form their job, beside mpiexec forming the same.

    python benchmarks/rendezvous_formation.py [--sizes 2 4 8] [--reps 3]

For each size N, three ways of starting N Python processes that each run
``import keras_dist as kd; kd.init(); kd.barrier()`` and exit, timed from
the first process's start until the last has exited (wall clock, median of
``--reps``):

- ``self-started``: N plain processes with torchrun's variables (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as a cluster starts them;
  rank 0 runs the rendezvous.
- ``mpiexec``: MPICH's own ``mpiexec -n N`` (Hydra) starting the same script,
  the peer.
- ``kdrun``: ``kdrun -np N`` (mpiexec plus a supervisor per rank).

Each process also prints how long its ``kd.init()`` took; the table gives the
median over ranks and repetitions of that too. Ratios are against mpiexec.
Every run is checked: each rank must print its rank and the size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (
    "import os, time; t = time.monotonic()\n"
    "import keras_dist as kd\n"
    "kd.init(); kd.barrier()\n"
    "os.write(1, f'FORMED {kd.rank()} {kd.size()} {time.monotonic() - t:.4f}\\n'.encode())\n"
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check(outputs: list[str], size: int, way: str) -> list[float]:
    """Every rank's init seconds; exits when a rank did not report."""
    found = {}
    for text in outputs:
        for line in text.splitlines():
            if line.startswith("FORMED "):
                _, rank, reported, seconds = line.split()
                found[int(rank)] = (int(reported), float(seconds))
    if sorted(found) != list(range(size)) or any(s != size for s, _ in found.values()):
        sys.exit(f"{way} at {size}: ranks reported {found}; output:\n" + "\n".join(outputs))
    return [seconds for _, seconds in found.values()]


def self_started(size: int) -> tuple[float, list[float]]:
    env, port = _environment(), _free_port()
    start = time.monotonic()
    procs = [subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**env, "RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for r in range(size)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    return time.monotonic() - start, _check(outputs, size, "self-started")


def launched(size: int, way: str) -> tuple[float, list[float]]:
    env = _environment()
    if way == "mpiexec":
        command = [shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec",
                   "-n", str(size)]
    else:
        command = [sys.executable, "-m", "keras_dist.run", "-np", str(size), "--no-label"]
    start = time.monotonic()
    done = subprocess.run([*command, sys.executable, "-c", SCRIPT], capture_output=True,
                          text=True, env=env, timeout=300)
    elapsed = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"{way} at {size} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed, _check([done.stdout], size, way)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ways = {"self-started": self_started,
            "mpiexec": lambda n: launched(n, "mpiexec"),
            "kdrun": lambda n: launched(n, "kdrun")}
    print(f"# {os.cpu_count()} CPUs; median of {args.reps}; wall: first start to last exit; "
          "init: kd.init() in each rank")
    print(f"{'size':>4} {'way':>13} {'wall s':>8} {'init s':>8} {'wall/mpiexec':>13}")
    for size in args.sizes:
        walls, inits = {}, {}
        for _ in range(args.reps):
            for way, run in ways.items():  # interleaved, so drift hits every way alike
                wall, seconds = run(size)
                walls.setdefault(way, []).append(wall)
                inits.setdefault(way, []).extend(seconds)
        peer = statistics.median(walls["mpiexec"])
        for way in ways:
            wall = statistics.median(walls[way])
            print(f"{size:>4} {way:>13} {wall:>8.3f} {statistics.median(inits[way]):>8.3f} "
                  f"{wall / peer:>13.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
