"""Training throughput of keras_dist beside plain Keras, in Horovod's benchmark format.

    kdrun -np 2 python -m keras_dist.bench train --model cnn --batch-size 32
    python -m keras_dist.bench train --model mlp            # one process: the np=1 overhead

Every rank trains the same model on synthetic data (``train_on_batch``, SGD)
in four kinds of timed blocks, alternating within each iteration so that drift
hits all of them, the two of each pair swapping places every other iteration
(each block starts after a barrier):

- ``plain Keras, 1 process``: rank 0 alone, no keras_dist in the step;
- ``keras_dist, size 1``: rank 0 alone, wrapped in ``DistributedOptimizer``
  over a process set of one rank (the wrapper's own cost);
- ``plain Keras, N processes``: every rank at once without communication
  (the contention baseline: what N processes get from this machine);
- ``keras_dist, N ranks``: every rank, gradients averaged.

A block is ``--num-batches-per-iter`` steps; its throughput is
``batch size x steps / seconds``. Reported: images per second per rank, mean
+- 1.96 standard deviations over the iterations (as Horovod's
``tensorflow2_synthetic_benchmark.py``) and the median; the total over ranks;
``np=1 overhead`` = 1 - (keras_dist size 1) / (plain, 1 process), and
``scaling efficiency`` = (keras_dist, N ranks) / (plain, N processes), both
from medians. ``--breakdown`` splits a keras_dist step, per rank, into the
baseline step (plain Keras, N processes), waiting for peers and moving data
inside the collectives (the timeline's counters), and the rest: the host
call, copies in and out of the framework, Python.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

MODELS = ("mlp", "cnn", "resnet-small", "deep-mlp")
_SEED = 1234


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_dist.bench train",
        description="Training throughput of keras_dist beside plain Keras (1 process and N "
        "processes at once) in the same run. Launch on N ranks with kdrun.")
    parser.add_argument(
        "--model", default="cnn", metavar="NAME",
        help=f"one of {', '.join(MODELS)}; a keras.applications name (ResNet50, "
        "MobileNetV2, ...: random weights, --image-size square RGB inputs, 10 classes); or "
        "MODULE:FUNCTION, a function returning an uncompiled Keras model whose output is "
        "class logits. Default cnn")
    parser.add_argument("--image-size", type=int, default=32,
                        help="side of the images for keras.applications models; default 32")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank; default 32")
    parser.add_argument("--num-warmup-batches", type=int, default=5,
                        help="untimed steps per kind of block; default 5")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="steps in a timed block; default 10")
    parser.add_argument("--num-iters", type=int, default=10,
                        help="timed blocks of each kind; default 10")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow intra- and inter-op threads per rank (0: "
                        "TensorFlow's default); default 1")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="keras_dist's optimizer sends the gradients as float16 "
                        "(compression=kd.Compression.fp16; half the bytes, not exact)")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0, metavar="F",
                        help="keras_dist's optimizer scales the gradients by 1/F before "
                        "summing them and by F/size after (as Horovod's option); default 1")
    parser.add_argument("--breakdown", action="store_true",
                        help="split a keras_dist step into compute, waiting, moving data "
                        "and the rest")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw the throughputs as bars (needs matplotlib: "
                        "pip install matplotlib)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. "
                         f"Received: {getattr(args, name)}")
    if args.image_size < 1:
        parser.error(f"--image-size must be >= 1. Received: {args.image_size}")
    if args.model not in MODELS and ":" not in args.model:
        import keras

        if not callable(getattr(keras.applications, args.model, None)):
            parser.error(f"--model must be one of {', '.join(MODELS)}, a keras.applications "
                         f"name (ResNet50, MobileNetV2, ...) or MODULE:FUNCTION. "
                         f"Received: {args.model!r}")
    if args.num_warmup_batches < 0 or args.threads < 0:
        parser.error("--num-warmup-batches and --threads must be >= 0. Received: "
                     f"{args.num_warmup_batches}, {args.threads}")
    return args


def input_shape(model: str) -> tuple[int, ...]:
    return {"mlp": (784,), "cnn": (28, 28, 1), "resnet-small": (32, 32, 3),
            "deep-mlp": (784,)}[model]


def _other_model(name: str, image_size: int):
    """A keras.applications model, or the model MODULE:FUNCTION returns (see --model)."""
    import importlib

    import keras

    if ":" in name:
        module_name, _, function_name = name.partition(":")
        function = getattr(importlib.import_module(module_name), function_name, None)
        if not callable(function):
            raise ValueError(f"--model {name}: {module_name} has no function "
                             f"{function_name!r}.")
        model = function()
        if not isinstance(model, keras.Model):
            raise TypeError(f"--model {name} must return a keras.Model. Received: "
                            f"{type(model).__name__}")
        return model
    return getattr(keras.applications, name)(
        weights=None, input_shape=(image_size, image_size, 3), classes=10,
        classifier_activation=None)


def build_model(name: str, image_size: int = 32):
    """The benchmark's models: small, as this project's CPU machines train them, or
    any other (``--model``), built with the same random seed every time."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(_SEED)
    if name not in MODELS:
        return _other_model(name, image_size)
    inputs = keras.Input(input_shape(name))
    if name == "mlp":  # the MNIST example's size class
        x = layers.Dense(512, activation="relu")(inputs)
        x = layers.Dense(512, activation="relu")(x)
    elif name == "deep-mlp":  # many small gradients (84 tensors): the per-tensor cost
        x = inputs
        for _ in range(41):
            x = layers.Dense(64, activation="relu")(x)
    elif name == "cnn":
        x = layers.Conv2D(16, 3, activation="relu")(inputs)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(32, 3, activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Flatten()(x)
        x = layers.Dense(128, activation="relu")(x)
    else:  # three residual stages on 32x32 images
        x = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
        for filters, stride in ((16, 1), (32, 2), (64, 2)):
            shortcut = x
            y = layers.Conv2D(filters, 3, strides=stride, padding="same",
                              activation="relu")(x)
            y = layers.Conv2D(filters, 3, padding="same")(y)
            if stride != 1 or shortcut.shape[-1] != filters:
                shortcut = layers.Conv2D(filters, 1, strides=stride)(shortcut)
            x = layers.Activation("relu")(layers.Add()([y, shortcut]))
        x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name=name.replace("-", "_"))


def compiled(name: str, optimizer, image_size: int = 32):
    import keras

    model = build_model(name, image_size)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def summarize(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, 1.96 x standard deviation, median)`` of per-iteration throughputs."""
    values = np.asarray(samples, np.float64)
    return float(values.mean()), float(1.96 * values.std()), float(np.median(values))


def ratios(medians: dict[str, float], size: int) -> dict[str, float]:
    """np=1 overhead and scaling efficiency from the modes' median img/s per rank."""
    out = {"np1_overhead": 1.0 - medians["kd1"] / medians["single"]}
    if size > 1:
        out["efficiency"] = medians["kd"] / medians["independent"]
    return out


def breakdown_row(step_ms: float, baseline_ms: float, wait_ms: float, move_ms: float) -> str:
    """One rank's keras_dist step split into its parts, in ms."""
    rest = step_ms - baseline_ms - wait_ms - move_ms
    return (f"step {step_ms:7.2f} ms = baseline {baseline_ms:7.2f} + waiting {wait_ms:6.2f} "
            f"+ moving {move_ms:6.2f} + host call, copies, Python {rest:6.2f}")


def describe_cores(cores: Sequence[Sequence[int]], host_cpus: Sequence[int],
                   hosts: Sequence[str]) -> str:
    """Where the ranks may run, from each rank's CPU affinity (``cores[r]``),
    its host's CPU count (``host_cpus[r]``) and its host (``hosts[r]``):
    pinned (``kdrun --bind-to core``) or not, which changes the results. A
    rank is pinned when its affinity leaves out some of its host's CPUs and no
    other rank of its host has the same affinity (ranks of a container limited
    to some CPUs share them: not pinned)."""
    sets = [tuple(sorted(c)) for c in cores]
    shared = [sum(1 for t, h in zip(sets, hosts) if t == sets[r] and h == hosts[r]) > 1
              for r in range(len(sets))]
    pinned = [len(c) < n and not s for c, n, s in zip(sets, host_cpus, shared)]
    if not any(pinned):
        if len(set(sets)) == 1:
            return f"not pinned (each rank may run on any of cores {_cpu_list(sets[0])})"
        return "not pinned (each rank may run on any core of its host)"
    where = ", ".join(f"rank {r} on {_cpu_list(c)}" if p else
                      f"rank {r} on any of {_cpu_list(c)}"
                      for r, (c, p) in enumerate(zip(sets, pinned)))
    return ("pinned: " if all(pinned) else "partly pinned: ") + where


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def block_order(kinds: Sequence[str], iteration: int) -> list[str]:
    """The kinds' blocks in ``iteration``: in the given order, then with each pair
    swapped (plain 1 process / keras_dist size 1; N processes / N ranks), so
    that no kind always runs first after a barrier or after another kind."""
    kinds = list(kinds)
    if iteration % 2 == 0:
        return kinds
    swapped = []
    for i in range(0, len(kinds) - 1, 2):
        swapped += [kinds[i + 1], kinds[i]]
    return swapped + kinds[len(swapped):]


def jitter_wait(step_times: Sequence[Sequence[float]], draws: int = 100_000,
                seed: int = 0) -> list[float]:
    """The wait per step that the ranks' jitter alone implies, per rank.

    ``step_times[r]`` are rank r's step times without communication (the
    contention baseline). If every step waited for the slowest rank and the
    ranks' step times were independent draws from those samples, a step
    would take E[max over ranks] on every rank: rank r would wait that minus
    its own mean. Estimated from ``draws`` random pairings.
    """
    rng = np.random.default_rng(seed)
    samples = [np.asarray(t, np.float64) for t in step_times]
    drawn = np.stack([t[rng.integers(0, len(t), draws)] for t in samples])
    slowest = float(drawn.max(axis=0).mean())
    return [slowest - float(t.mean()) for t in samples]


def random_batch(model, batch_size: int, rng: np.random.Generator) -> tuple:
    """Random inputs and labels for ``model``: float inputs from a normal
    distribution; integer inputs (token ids) uniform below the smallest
    ``Embedding`` vocabulary in the model (2 without one); a dimension left
    open (``None``, a sequence's length) set to 16; labels below the output's
    last dimension, shaped as the output without it. A list of arrays for a
    model of several inputs."""
    import keras

    def layers_of(layer):
        yield layer
        for inner in getattr(layer, "layers", ()):
            yield from layers_of(inner)

    vocab = min((layer.input_dim for layer in layers_of(model)
                 if isinstance(layer, keras.layers.Embedding)), default=2)
    inputs = []
    for tensor in model.inputs:
        shape = (batch_size, *(16 if d is None else d for d in tensor.shape[1:]))
        if np.issubdtype(np.dtype(tensor.dtype), np.integer):
            inputs.append(rng.integers(0, vocab, size=shape).astype(tensor.dtype))
        else:
            inputs.append(rng.normal(size=shape).astype(tensor.dtype))
    output_shape = model.outputs[0].shape
    labels = rng.integers(0, output_shape[-1],
                          size=(batch_size, *(16 if d is None else d
                                              for d in output_shape[1:-1])))
    return (inputs[0] if len(inputs) == 1 else inputs), labels


def sync_ceiling(step_times: Sequence[Sequence[float]], waits: Sequence[float]) -> float:
    """The scaling efficiency a synchronous step cannot beat with this jitter.

    ``waits`` are ``jitter_wait(step_times)``. With communication free, rank
    r's step would last its mean plain step plus its wait: the efficiency
    against the plain processes would be the mean over ranks of
    ``mean / (mean + wait)``.
    """
    means = [float(np.mean(t)) for t in step_times]
    return float(np.mean([m / (m + w) for m, w in zip(means, waits)]))


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.threads and os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import keras
    from mpi4py import MPI

    import keras_dist as kd
    from keras_dist._runtime import timeline

    # keras_dist at size 1 beside the others: rank 0 alone in a process set.
    solo = kd.ProcessSet([0]) if MPI.COMM_WORLD.Get_size() > 1 else None
    kd.init(process_sets=[solo] if solo is not None else None)
    rank, size = kd.rank(), kd.size()
    rng = np.random.default_rng([_SEED, rank])
    probe = build_model(args.model, args.image_size)
    parameters = probe.count_params()
    x, y = random_batch(probe, args.batch_size, rng)
    del probe

    def say(line: str = "") -> None:
        if rank == 0:
            print(line, flush=True)

    options = {"compression": kd.Compression.fp16 if args.fp16_allreduce
               else kd.Compression.none,
               "gradient_predivide_factor": args.gradient_predivide_factor}
    models = {
        "single": (compiled(args.model, keras.optimizers.SGD(0.01), args.image_size)
                   if rank == 0 else None),
        "kd1": (compiled(args.model, kd.DistributedOptimizer(
            keras.optimizers.SGD(0.01), process_set=solo, **options),
            args.image_size) if rank == 0 else None),
    }
    if size > 1:
        models["independent"] = compiled(args.model, keras.optimizers.SGD(0.01),
                                          args.image_size)
        models["kd"] = compiled(args.model, kd.DistributedOptimizer(
            keras.optimizers.SGD(0.01), **options), args.image_size)
    kinds = [k for k in ("single", "kd1", "independent", "kd") if k in models]
    affinity = sorted(os.sched_getaffinity(0))
    placement = kd.allgather_object((affinity, os.cpu_count() or len(affinity),
                                     socket.gethostname()))
    predivide = (f", gradient_predivide_factor {args.gradient_predivide_factor:g}"
                 if args.gradient_predivide_factor != 1.0 else "")
    say(f"Model: {args.model} ({parameters / 1e6:.3f} M parameters), batch size "
        f"{args.batch_size} per rank, {size} rank(s), threads per rank "
        f"{args.threads or 'default'}, backend {keras.backend.backend()}"
        f"{', gradients sent as float16' if args.fp16_allreduce else ''}{predivide}")
    say(f"Cores: {describe_cores(*zip(*placement))}")
    say(f"Blocks of {args.num_batches_per_iter} steps, {args.num_iters} per kind, kinds "
        "alternating (each pair's order swapped every other iteration); img/sec per rank: "
        "mean +- 1.96 sd over blocks (median)")

    own_timeline = args.breakdown and not timeline.enabled()
    tmpdir = tempfile.mkdtemp(prefix="kd-bench-") if own_timeline else None
    if own_timeline:
        kd.start_timeline(os.path.join(tmpdir, "t.json"))
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    seconds_kd, waits, moves = 0.0, 0.0, 0.0
    baseline_steps: list[float] = []  # with --breakdown: each plain-Keras step at N at once
    try:
        for kind in kinds:
            model = models[kind]
            kd.barrier()
            if model is not None:
                for _ in range(args.num_warmup_batches):
                    model.train_on_batch(x, y)
        for iteration in range(args.num_iters):
            for kind in block_order(kinds, iteration):
                model = models[kind]
                kd.barrier()
                if model is None:
                    continue
                before = timeline.totals() if args.breakdown else None
                timed = args.breakdown and kind == "independent"
                start = _clock()
                for _ in range(args.num_batches_per_iter):
                    if timed:
                        begin = _clock()
                        model.train_on_batch(x, y)
                        baseline_steps.append(_clock() - begin)
                    else:
                        model.train_on_batch(x, y)
                elapsed = _clock() - start
                samples[kind].append(args.batch_size * args.num_batches_per_iter / elapsed)
                if kind == "kd" and before is not None:
                    after = timeline.totals()
                    seconds_kd += elapsed
                    waits += after["wait_s"] - before["wait_s"]
                    moves += after["move_s"] - before["move_s"]
        kd.barrier()
    finally:
        if own_timeline:
            timeline.stop_timeline(summary=False)
            for name in os.listdir(tmpdir):
                os.unlink(os.path.join(tmpdir, name))
            os.rmdir(tmpdir)

    everyone = kd.allgather_object(samples)
    labels = {"single": "plain Keras, 1 process", "kd1": "keras_dist, size 1",
              "independent": f"plain Keras, {size} processes at once",
              "kd": f"keras_dist, {size} ranks"}
    medians = {}
    for kind in kinds:
        ranks = [s[kind] for s in everyone if s[kind]]
        per_iteration = np.mean(np.asarray(ranks), axis=0)  # mean over the ranks that ran
        mean, spread, median = summarize(per_iteration)
        medians[kind] = median
        total = f"; total {mean * len(ranks):.1f} img/sec" if len(ranks) > 1 else ""
        say(f"  {labels[kind]:<34} {mean:9.1f} +- {spread:6.1f} img/sec per rank "
            f"(median {median:.1f}){total}")
    say(f"np=1 overhead: {100 * ratios(medians, size)['np1_overhead']:+.1f}% "
        "(1 - keras_dist size 1 / plain Keras 1 process, medians)")
    if size > 1:
        say(f"scaling efficiency: {100 * ratios(medians, size)['efficiency']:.1f}% "
            f"(keras_dist {size} ranks / plain Keras {size} processes at once, per rank, "
            "medians)")
    if args.breakdown and size > 1:
        steps = args.num_iters * args.num_batches_per_iter
        # Means on both sides: a median baseline against a mean step would put
        # the skew of the step times into the remainder.
        baseline_ms = 1e3 * float(np.mean(baseline_steps))
        row = (1e3 * seconds_kd / steps, baseline_ms, 1e3 * waits / steps, 1e3 * moves / steps)
        rows = kd.allgather_object(row)
        everyone_steps = kd.allgather_object(baseline_steps)
        implied = jitter_wait(everyone_steps)
        say("Breakdown of a keras_dist step (means over the timed steps; baseline: this "
            "rank's mean plain-Keras step with the others training at once):")
        for r, values in enumerate(rows):
            say(f"  rank {r}: {breakdown_row(*values)}")
        say("Waiting the machine's jitter alone implies (the plain-Keras steps of the "
            f"{size} processes at once, drawn independently, each step as long as the "
            "slowest: its mean minus the rank's): "
            + ", ".join(f"rank {r} {1e3 * w:.2f} ms" for r, w in enumerate(implied)))
        say(f"Efficiency that jitter leaves to any synchronous step (communication free): "
            f"{100 * sync_ceiling(everyone_steps, implied):.1f}%")
    if args.plot and rank == 0:
        from keras_dist.bench import plot

        plot.train_bars(args.plot, [labels[k] for k in kinds],
                        [samples_mean(everyone, k) for k in kinds],
                        f"{args.model}, batch {args.batch_size}, {size} rank(s)")
        say(f"plot written to {args.plot}")
    return 0


def samples_mean(everyone: list[dict], kind: str) -> float:
    """Median over blocks of the ranks' mean img/s per rank for ``kind``."""
    ranks = [s[kind] for s in everyone if s[kind]]
    return float(np.median(np.mean(np.asarray(ranks), axis=0)))


def _clock() -> float:
    import time

    return time.perf_counter()


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
