"""A per-rank memory cap that ends the unsharded run and lets the sharded one train.

    KERAS_BACKEND=torch python benchmarks/zero_cgroup.py -- --params 100e6 --steps 3

(as root, on Linux). Runs ``kdrun -np N python -m keras_dist.bench.zero_memory
--mode M ARGS`` with each rank in a memory cgroup of its own, made under this
process's own memory cgroup: first unsharded and sharded with no cap, to
print each rank's peak (the cgroup's and ``ru_maxrss``), then both again
with every rank capped at ``--cap`` bytes (default: halfway between the
largest sharded peak and the smallest unsharded one) and no swap. Per job it
prints the exit status, whether the kernel's OOM killer ended a rank (the
cgroup's ``oom_kill`` count) and each rank's peak. Every cgroup it made is
removed on any exit.

Each rank joins its cgroup itself: kdrun runs ``zero_cgroup.py --join DIR
-- COMMAND`` per rank, which writes its own pid into ``DIR/rank<R>`` (R from
the process manager's rank variable) and then execs COMMAND, so the rank's
whole life is charged to its cgroup. cgroup v1 (``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes``, ``memory.oom_control``,
``memory.max_usage_in_bytes``) and v2 (``memory.max``, ``memory.swap.max``,
``memory.events``, ``memory.peak``) are both handled.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time

ROOT = "/sys/fs/cgroup"
RANK_ENV = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def _v2() -> bool:
    return os.path.exists(os.path.join(ROOT, "cgroup.controllers"))


def _own_cgroup() -> str:
    """This process's memory cgroup directory (new cgroups go under it)."""
    with open("/proc/self/cgroup") as lines:
        for line in lines:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if _v2() and controllers == "":
                return os.path.join(ROOT, path.lstrip("/"))
            if not _v2() and "memory" in controllers.split(","):
                return os.path.join(ROOT, "memory", path.lstrip("/"))
    sys.exit("zero_cgroup.py: this process is in no memory cgroup")


def _write(path: str, value) -> None:
    with open(path, "w") as file:
        file.write(str(value))


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def _cap(group: str, cap: int | None) -> None:
    if _v2():
        _write(os.path.join(group, "memory.max"), cap if cap else "max")
        _write(os.path.join(group, "memory.swap.max"), 0)
    elif cap:
        _write(os.path.join(group, "memory.limit_in_bytes"), cap)
        swap = os.path.join(group, "memory.memsw.limit_in_bytes")
        if os.path.exists(swap):  # memory + swap: the same cap, so no swap
            _write(swap, cap)


def _oom_kills(group: str) -> int:
    name = "memory.events" if _v2() else "memory.oom_control"
    for line in _read(os.path.join(group, name)).splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def _cgroup_peak(group: str) -> int | None:
    path = os.path.join(group, "memory.peak" if _v2() else "memory.max_usage_in_bytes")
    return int(_read(path)) if os.path.exists(path) else None


def _remove(group: str, parent: str) -> None:
    """Move any process left in ``group`` to ``parent`` and remove it."""
    if not os.path.isdir(group):
        return
    for child in os.listdir(group):
        if os.path.isdir(os.path.join(group, child)):
            _remove(os.path.join(group, child), parent)
    procs = os.path.join(group, "cgroup.procs")
    for pid in _read(procs).split() if os.path.exists(procs) else []:
        try:
            _write(os.path.join(parent, "cgroup.procs"), pid)
        except OSError:
            pass  # it ended meanwhile
    for _ in range(100):  # an ended rank's cgroup stays busy for a moment (v1)
        try:
            os.rmdir(group)
            return
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
            time.sleep(0.1)
    os.rmdir(group)


def _job(base: str, np_: int, mode: str, cap: int | None, args: list[str],
         timeout: float) -> dict:
    groups = [os.path.join(base, f"rank{rank}") for rank in range(np_)]
    for group in groups:
        os.mkdir(group)
        _cap(group, cap)
    command = ["kdrun", "-np", str(np_), "--no-label", sys.executable, os.path.abspath(__file__),
               "--join", base, "--", sys.executable, "-m", "keras_dist.bench.zero_memory",
               "--mode", mode, *args]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
    lines = {line["rank"]: line for line in
             (json.loads(text[len("ZERO "):]) for text in out.splitlines()
              if text.startswith("ZERO "))}
    ranks = [{"rank": rank, "oom_kill": _oom_kills(group), "cgroup_peak_bytes": _cgroup_peak(group),
              "peak_rss_bytes": lines.get(rank, {}).get("peak_rss_bytes"),
              "optimizer_state_bytes": lines.get(rank, {}).get("optimizer_state_bytes"),
              "median_step_s": lines.get(rank, {}).get("median_step_s")}
             for rank, group in enumerate(groups)]
    for group in groups:
        _remove(group, os.path.dirname(base))
    return {"mode": mode, "cap_bytes": cap, "exit": job.returncode, "ranks": ranks,
            "tail": (out + err)[-1500:]}


def _print(result: dict) -> None:
    cap = f"{result['cap_bytes']:,} B" if result["cap_bytes"] else "none"
    killed = [r["rank"] for r in result["ranks"] if r["oom_kill"]]
    print(f"{result['mode']:9s} cap {cap}: exit {result['exit']}, OOM killer ended "
          f"{'rank ' + ', '.join(map(str, killed)) if killed else 'no rank'}", flush=True)
    for rank in result["ranks"]:
        print(f"  {json.dumps(rank)}", flush=True)
    if result["exit"]:
        print("  last output: " + result["tail"].replace("\n", "\n    "), flush=True)


def _join(base: str, command: list[str]) -> None:
    """Put this process into ``base/rank<R>``, then become ``command``."""
    rank = next((os.environ[name] for name in RANK_ENV if os.environ.get(name, "").isdigit()),
                None)
    if rank is None:
        sys.exit(f"zero_cgroup.py --join: none of {', '.join(RANK_ENV)} is set")
    _write(os.path.join(base, f"rank{rank}", "cgroup.procs"), os.getpid())
    os.execvp(command[0], command)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2, dest="np_")
    parser.add_argument("--cap", type=float, default=None,
                        help="bytes per rank (default: between the two modes' uncapped peaks)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--join", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help="zero_memory's arguments (after --)")
    options = parser.parse_args(argv)
    if options.join:
        _join(options.join, options.args)
    parent = _own_cgroup()
    base = os.path.join(parent, f"kd_zero_cgroup_{os.getpid()}")
    print(f"cgroup {'v2' if _v2() else 'v1'}, under {parent}; backend "
          f"{os.environ.get('KERAS_BACKEND', 'tensorflow')}; load {os.getloadavg()[0]:.1f}",
          flush=True)
    os.mkdir(base)
    try:
        if _v2():
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory")
        cap = int(options.cap) if options.cap else None
        if cap is None:
            peaks = {}
            for mode in ("unsharded", "sharded"):
                result = _job(base, options.np_, mode, None, options.args, options.timeout)
                _print(result)
                if result["exit"]:
                    sys.exit(f"the uncapped {mode} job failed")
                peaks[mode] = [rank["cgroup_peak_bytes"] or rank["peak_rss_bytes"]
                               for rank in result["ranks"]]
            low, high = max(peaks["sharded"]), min(peaks["unsharded"])
            print(f"largest sharded peak {low:,} B, smallest unsharded peak {high:,} B",
                  flush=True)
            if low >= high:
                sys.exit("no cap lies between the two modes' peaks")
            cap = (low + high) // 2
        for mode in ("unsharded", "sharded"):
            _print(_job(base, options.np_, mode, cap, options.args, options.timeout))
    finally:
        _remove(base, parent)


if __name__ == "__main__":
    main()
