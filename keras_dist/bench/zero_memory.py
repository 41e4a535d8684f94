"""Memory and step time of sharded optimizer state against the unsharded optimizer.

Run on every rank under kdrun, once per mode (peak resident memory is a
process's own, so each mode gets fresh processes)::

    kdrun -np 2 python -m keras_dist.bench.zero_memory --params 100e6 --mode unsharded
    kdrun -np 2 python -m keras_dist.bench.zero_memory --params 100e6 --mode sharded

``benchmarks/zero_alternating.py`` runs the two modes in turn, several times,
and prints the medians.

Trains a stack of square Dense layers of about ``--params`` parameters with
Adam on random data (Keras ``train_on_batch``, the backend of KERAS_BACKEND,
``--threads`` threads per rank) and prints, per rank, one line ``ZERO
{json}``: the bytes of optimizer state the rank holds, its peak resident
memory (``ru_maxrss``), and the median step time after the first
(compiling) step, in wall-clock and in this process's CPU seconds. With
``--breakdown``, the steps after the first are recorded on the timeline and
the line also holds, per step, the seconds inside the gradients' allreduce
and inside the weights' exchange (sharded), each split into waiting for the
other rank and moving data (``keras_dist._runtime.timeline``), and the
largest resident memory sampled every 2 ms during those steps with the part
of the step it fell in (a collective, or between them).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import tempfile
import threading
import time

#: The name of the sharded weights' exchange on the timeline (``zero.Shards.exchange``).
EXCHANGE = "sharded weights"


def _state_bytes(optimizer) -> int:
    import numpy as np

    inner = optimizer.inner_optimizer
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in inner.variables)


def _set_threads(threads: int) -> None:
    """``threads`` per rank for the backend's framework (0: as the process has it)."""
    if threads == 0:
        return
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)


def _breakdown(part: str, steps: int) -> dict:
    """Seconds per step in the collectives of a timeline part, by what they move."""
    totals: dict = collections.defaultdict(float)
    with open(part) as events:
        pending = None  # the last collective's kind: its child spans follow it
        for line in events:
            event = json.loads(line.rstrip().rstrip(","))
            if event.get("ph") != "X":
                continue
            if event["name"] in ("allreduce", "allgather"):
                pending = "exchange" if event.get("args", {}).get("name") == EXCHANGE \
                    else "gradients"
                totals[f"{pending}_s"] += event["dur"] / 1e9  # a part counts in ns
            elif event["name"] in ("wait for peers", "move data") and pending:
                kind = "wait" if event["name"] == "wait for peers" else "move"
                totals[f"{pending}_{kind}_s"] += event["dur"] / 1e9
    return {key: value / steps for key, value in sorted(totals.items())}


class _RssSampler:
    """This process's resident memory every ``interval`` seconds, in a thread
    (``/proc/self/statm``; Linux), with the timeline's clock (``time.time_ns``)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.samples = interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while not self._stop.wait(self.interval):
                statm.seek(0)
                self.samples.append((time.time_ns(), int(statm.read().split()[1]) * self._page))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _peak_phase(part: str, samples: list) -> dict:
    """Where the largest sample of resident memory fell: inside the gradients'
    allreduce, the weights' exchange, or between collectives (the forward and
    backward pass, the optimizer's update)."""
    if not samples:
        return {}
    when, peak = max(samples, key=lambda sample: sample[1])
    phase = "between collectives"
    with open(part) as events:
        for line in events:
            event = json.loads(line.rstrip().rstrip(","))
            if (event.get("ph") == "X" and event["name"] in ("allreduce", "allgather")
                    and event["ts"] <= when <= event["ts"] + event["dur"]):
                phase = ("exchange" if event.get("args", {}).get("name") == EXCHANGE
                         else "gradients")
    return {"sampled_peak_rss_bytes": peak, "sampled_peak_in": phase}


def run(params: float, mode: str, steps: int, width: int, batch: int, threads: int = 1,
        breakdown: bool = False) -> dict:
    import keras
    import numpy as np

    import keras_dist as kd

    kd.init()
    _set_threads(threads)
    layers = max(1, round(params / (width * width + width)))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width) for _ in range(layers)])
    optimizer = kd.DistributedOptimizer(keras.optimizers.Adam(1e-4),
                                        shard_optimizer_state=mode == "sharded")
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(kd.rank())
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    times, cpu = [], []
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "timeline.json")
        sampler = _RssSampler()
        for step in range(steps + 1):
            if breakdown and step == 1:
                kd.start_timeline(path)
                sampler.__enter__()
            start, start_cpu = time.perf_counter(), time.process_time()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        parts = {}
        if breakdown and steps:
            sampler.__exit__()
            kd.stop_timeline(summary=False)
            part = f"{path}.rank{kd.rank()}"
            if not os.path.exists(part):  # one rank: merged already, and no collective ran
                open(part, "w").close()
            parts = {**_breakdown(part, steps), **_peak_phase(part, sampler.samples)}
    return {"rank": kd.rank(), "size": kd.size(), "mode": mode,
            "backend": keras.backend.backend(), "parameters": model.count_params(),
            "optimizer_state_bytes": _state_bytes(optimizer),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "median_step_s": statistics.median(times[1:]) if steps else None,
            "median_step_cpu_s": statistics.median(cpu[1:]) if steps else None,
            **parts}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--mode", choices=["sharded", "unsharded"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow's (intra- and inter-op) or PyTorch's threads per "
                             "rank; 0: the framework's own setting, unchanged (a process whose "
                             "TensorFlow has started already cannot change it)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the collectives of each step on the timeline")
    args = parser.parse_args(argv)
    result = run(args.params, args.mode, args.steps, args.width, args.batch, args.threads,
                 args.breakdown)
    print("ZERO " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
