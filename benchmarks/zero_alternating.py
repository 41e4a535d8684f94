"""Sharded against unsharded optimizer state, in alternating fresh jobs, medians quoted.

    python benchmarks/zero_alternating.py --rounds 2 -- --params 100e6 --steps 3 --breakdown

Runs ``kdrun -np N python -m keras_dist.bench.zero_memory --mode M ARGS`` for
M = unsharded, sharded, unsharded, sharded, ... (``--rounds`` pairs; each a
fresh job, since peak resident memory is a process's own), prints every
rank's ``ZERO`` line with the load average before the job, then per mode and
rank the median over the runs of each number, and the sharded / unsharded
ratios of the step time and the peak memory beside the state saved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

NUMBERS = ("optimizer_state_bytes", "peak_rss_bytes", "median_step_s", "median_step_cpu_s",
           "gradients_s", "exchange_s", "exchange_wait_s", "exchange_move_s")


def _job(np_: int, mode: str, args: list[str]) -> list[dict]:
    command = ["kdrun", "-np", str(np_), "--no-label", sys.executable, "-m",
               "keras_dist.bench.zero_memory", "--mode", mode, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [json.loads(line[len("ZERO "):]) for line in done.stdout.splitlines()
             if line.startswith("ZERO ")]
    if done.returncode or len(lines) != np_:
        sys.exit(f"{' '.join(command)} failed (exit {done.returncode}):\n"
                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return sorted(lines, key=lambda line: line["rank"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2, dest="np_")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("args", nargs="*", help="zero_memory's arguments (after --)")
    options = parser.parse_args(argv)
    runs: dict = {"unsharded": [], "sharded": []}
    for _ in range(options.rounds):
        for mode in runs:
            load = os.getloadavg()[0]
            lines = _job(options.np_, mode, options.args)
            runs[mode].append(lines)
            for line in lines:
                print(f"load {load:.1f} ZERO {json.dumps(line)}", flush=True)
    medians = {mode: [{key: statistics.median(run[rank][key] for run in runs[mode])
                       for key in NUMBERS if key in runs[mode][0][rank]}
                      for rank in range(options.np_)] for mode in runs}
    for mode, ranks in medians.items():
        for rank, numbers in enumerate(ranks):
            print(f"MEDIAN {mode} rank={rank} {json.dumps(numbers)}")
    for rank in range(options.np_):
        plain, sharded = medians["unsharded"][rank], medians["sharded"][rank]
        saved = plain["optimizer_state_bytes"] - sharded["optimizer_state_bytes"]
        fall = plain["peak_rss_bytes"] - sharded["peak_rss_bytes"]
        print(f"RATIO rank={rank} step {sharded['median_step_s'] / plain['median_step_s']:.3f}x "
              f"(cpu {sharded['median_step_cpu_s'] / plain['median_step_cpu_s']:.3f}x), "
              f"peak memory {fall / 1e6:.0f} MB lower for {saved / 1e6:.0f} MB of state saved "
              f"({fall / saved:.2f}x)")


if __name__ == "__main__":
    main()
