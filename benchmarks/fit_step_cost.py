"""Per-step cost of the gradient allreduce inside ``model.fit`` (the MNIST example's model).

    python benchmarks/fit_step_cost.py [--repeats 3] [--steps 200] [--warmup 20]

runs, ``--repeats`` times, in alternating order, the MNIST example's model
(Flatten, Dense(256, relu), Dense(10); Adam; batch 64 per rank; one
TensorFlow thread per rank) on the digits shipped with the example:

- 1 rank (no collective: the compute-only reference),
- 2 ranks with ``KERAS_DIST_CPU_OPERATIONS=shm``,
- 2 ranks with ``KERAS_DIST_CPU_OPERATIONS=mpi``,

each under ``kdrun --timeline``. Rank 0 times every
train step (from the last callback's ``on_train_batch_begin`` to the first
callback's ``on_train_batch_end``, so no callback work is counted); the
timeline gives the duration of every gradient allreduce on rank 0 (the
``allreduce`` events: fusion pack, the transport, unpack, including any wait
for the other rank; not TensorFlow's hand-over to the op).
The first ``--warmup`` steps and allreduces are dropped; each run gives
medians (and 10th percentiles, p10); the table shows the median over repeats
of those, then each run's values. "vs 1 rank" is the step time minus the 1-rank step time: all a
step at 2 ranks costs over one at 1 rank (the allreduce, the host-call
hand-over, waiting for the slower rank, and two ranks sharing the machine).

With ``--worker`` the script is one rank of such a job (used by the driver).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(ROOT, "examples", "mnist", "mnist_5k.npz")
BATCH = 64
CONFIGS = [("local (1 rank)", 1, None), ("shm", 2, "shm"), ("mpi", 2, "mpi")]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="steps dropped per run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


# -- one rank --------------------------------------------------------------------


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import keras_dist as kd

    kd.init()
    with np.load(DATA) as data:
        x, y = data["x_train"].astype("float32") / 255.0, data["y_train"]
    total = args.warmup + args.steps
    global_batch = BATCH * kd.size()
    repeat = -(-total * global_batch // len(x))
    x, y = np.concatenate([x] * repeat), np.concatenate([y] * repeat)
    x_local, y_local = kd.shard((x[:total * global_batch], y[:total * global_batch]),
                                batch_size=BATCH)

    keras.utils.set_random_seed(1234 + kd.rank())
    model = keras.Sequential([  # as in examples/mnist/train.py
        keras.Input((28, 28)),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=kd.DistributedOptimizer(keras.optimizers.Adam(0.001 * kd.size())),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    starts, times = {}, []

    class Start(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            starts[batch] = time.perf_counter()

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - starts[batch])

    model.fit(x_local, y_local, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[Stop(), kd.callbacks.BroadcastGlobalVariablesCallback(0),
                         kd.callbacks.MetricAverageCallback(), Start()])
    assert len(times) == total, (len(times), total)
    if kd.rank() == 0:
        with open(args.result, "w") as handle:
            json.dump({"step_s": times, "params": int(model.count_params())}, handle)
    kd.shutdown()  # closes the timeline


# -- the driver ------------------------------------------------------------------


def run_one(args, np_, transport, scratch, index):
    result = os.path.join(scratch, f"result-{index}.json")
    trace = os.path.join(scratch, f"timeline-{index}.json")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HOROVOD_TIMELINE", None)
    if transport:
        env["KERAS_DIST_CPU_OPERATIONS"] = transport
    command = [sys.executable, "-m", "keras_dist.run", "-np", str(np_), "--timeline", trace,
               sys.executable,
               os.path.abspath(__file__), "--worker", "--result", result,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    with open(result) as handle:
        measured = json.load(handle)
    steps = measured["step_s"][args.warmup:]
    reduce_s, nbytes = [], set()
    if os.path.exists(trace):
        with open(trace) as handle:
            trace_json = json.load(handle)
        # kdrun merges every rank's part into one Chrome trace: rank 0's collective spans.
        events = [e for e in trace_json.get("traceEvents", [])
                  if e.get("ph") == "X" and e.get("pid") == 0 and e.get("name") == "allreduce"]
        # The gradient allreduces, one per step (an epoch's end may add one for metrics).
        reduce_s = [e["dur"] / 1e6 for e in events][args.warmup : args.warmup + args.steps]
        nbytes = {e["args"]["bytes"] for e in events}
    if np_ > 1 and len(reduce_s) != args.steps:
        sys.exit(f"expected {args.steps} gradient allreduces after warm-up, found {len(reduce_s)}")
    return {
        "step": statistics.median(steps),
        "step_p10": decile(steps),
        "reduce": statistics.median(reduce_s) if reduce_s else None,
        "reduce_p10": decile(reduce_s) if reduce_s else None,
        "bytes": max(nbytes) if nbytes else 0,
        "params": measured["params"],
    }


def decile(values):
    """The 10th percentile: what a step costs when nothing else on the machine interferes."""
    return sorted(values)[len(values) // 10]


def ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def main():
    args = parse_args()
    if args.worker:
        worker(args)
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    runs = {name: [] for name, _, _ in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="fit_step_cost-") as scratch:
        index = 0
        for repeat in range(args.repeats):
            order = CONFIGS if repeat % 2 == 0 else CONFIGS[::-1]  # alternate the order
            for name, np_, transport in order:
                runs[name].append(run_one(args, np_, transport, scratch, index))
                index += 1
                print(f"  repeat {repeat + 1}/{args.repeats} {name}: step "
                      f"{ms(runs[name][-1]['step'])} ms, allreduce "
                      f"{ms(runs[name][-1]['reduce'])} ms", file=sys.stderr, flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    load = os.getloadavg()
    lines = [
        f"$ python benchmarks/fit_step_cost.py --repeats {args.repeats} --steps {args.steps} "
        f"--warmup {args.warmup}",
        f"date {started:%Y-%m-%d %H:%M} UTC, commit {commit}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, load average at the end {load[0]:.1f} {load[1]:.1f} "
        f"{load[2]:.1f} (machine shared with other jobs)",
        f"MNIST example model ({runs['shm'][0]['params']} parameters), Adam, batch {BATCH} per "
        f"rank, 1 TF thread per rank; {args.steps} steps per run after {args.warmup} warm-up "
        f"steps; medians over {args.repeats} runs of per-run medians",
        "",
        f"{'transport':<15} {'ranks':>5} {'step ms':>8} {'allreduce ms':>12} "
        f"{'bytes/step':>10} {'of step':>7} {'vs 1 rank ms':>12} {'step p10':>8} "
        f"{'allreduce p10':>13}",
    ]
    base = statistics.median(r["step"] for r in runs[CONFIGS[0][0]])
    for name, np_, _ in CONFIGS:
        step = statistics.median(r["step"] for r in runs[name])
        reduces = [r["reduce"] for r in runs[name] if r["reduce"] is not None]
        reduce = statistics.median(reduces) if reduces else None
        fraction = "-" if reduce is None else f"{100 * reduce / step:.0f}%"
        extra = "-" if np_ == 1 else f"{(step - base) * 1e3:+.2f}"
        step_p10 = statistics.median(r["step_p10"] for r in runs[name])
        reduce_p10 = (statistics.median(r["reduce_p10"] for r in runs[name])
                      if reduce is not None else None)
        lines.append(f"{name:<15} {np_:>5} {ms(step):>8} {ms(reduce):>12} "
                     f"{runs[name][0]['bytes'] if np_ > 1 else 0:>10} {fraction:>7} {extra:>12} "
                     f"{ms(step_p10):>8} {ms(reduce_p10):>13}")
    lines += ["", "p10: 10th percentile of a run's steps (least disturbed by other jobs), "
              "median over runs", "per run (step median / allreduce median ms):"]
    for name, _, _ in CONFIGS:
        lines.append(f"  {name:<15} " + ", ".join(f"{ms(r['step'])} / {ms(r['reduce'])}"
                                                  for r in runs[name]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
