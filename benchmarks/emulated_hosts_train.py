"""Training across emulated hosts: keras_dist beside PyTorch DDP over gloo.

Run from the repository root as root (the hosts are built with
``benchmarks/emulated_hosts.py`` for each host count, one after the other)::

    python benchmarks/emulated_hosts_train.py --hosts 2,4 --models mlp,cnn --rate 1gbit

For each host count H (one rank per host, started by kdrun through its host
file), every rank trains ``keras_dist.bench train``'s MLP and CNN (batch 32
per rank, SGD at 0.01, one TensorFlow / torch thread per rank, this rank's
synthetic batch) seven ways, in timed blocks of ``--steps`` steps that
alternate (the order rotated every round; each block after a gloo barrier and
``--warmup`` untimed steps):

- ``keras-alone`` / ``torch-alone``: rank 0 alone, no communication, the
  other ranks blocked in the barrier (a socket wait, no CPU): the model alone;
- ``keras-N`` / ``torch-N``: every rank at once, no communication: what H
  processes get from this machine's CPUs (on 2 cores, 4 "hosts" are 4
  processes on 2 cores: the CPU, not the link, then sets this baseline);
- ``keras_dist`` and ``keras_dist-fp16``: ``kd.DistributedOptimizer``
  (compression off, on);
- ``DDP``: the torch twin (``_torch_twins.py``: the same layer shapes) in
  ``DistributedDataParallel`` over gloo, its default buckets, with a comm
  hook that does what DDP's default hook does (divide, allreduce) and
  records when each bucket's allreduce started and ended.

Printed per model and configuration: the median (over blocks) step in ms,
mean over ranks; the added time per step against the same framework's model
alone and against its H processes at once; and the fraction of a step spent
on the network: for keras_dist the time inside its collectives (waiting for
peers plus moving data) from every rank's timeline (``kd.start_timeline``,
mean over ranks); for DDP the time from the first bucket's allreduce starting
to the last one's ending (the union of the buckets' spans: it overlaps the
backward pass, so it bounds DDP's waiting from above). Checked at the end:
every loss finite, and every distributed model's weights equal on every rank
(float64 sums of every variable); a failed check exits 1. One ``RESULT
{json}`` line per configuration for other tools (``emulated_hosts_cost.py``).

``--worker`` is the rank program (what the driver runs in the hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _blocks
import emulated_hosts
from emulated_hosts_allreduce import _my_address

#: The configurations, in the order of the first round.
KINDS = ("keras_dist", "DDP", "keras_dist-fp16", "keras-N", "torch-N", "keras-alone",
         "torch-alone")
#: Each distributed configuration's framework baselines (alone, H at once).
BASELINES = {"keras_dist": ("keras-alone", "keras-N"),
             "keras_dist-fp16": ("keras-alone", "keras-N"),
             "DDP": ("torch-alone", "torch-N")}
GLOO_PORT = 29612


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="2,4", help="host counts, one run each (default 2,4)")
    parser.add_argument("--models", default="mlp,cnn", help="of mlp and cnn (default both)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--reps", type=int, default=5, help="blocks of each configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before a block")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="which configurations (default all seven)")
    parser.add_argument("--link-seconds", default="2",
                        help="how long the link is measured (the harness's option)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


# -- the rank program ------------------------------------------------------------

def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) spans."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def _timed_hook(spans: list, bucket):
    """DDP's default hook (divide by the world size, allreduce), timed."""
    import torch.distributed as dist

    start = time.perf_counter()
    tensor = bucket.buffer().div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()

    def done(finished):
        spans.append((start, time.perf_counter()))
        return finished.value()[0]

    return future.then(done)


def _models(name: str, kinds: list[str], rank: int) -> dict:
    import keras
    import torch
    from _torch_twins import Twin, module

    import keras_dist as kd
    from keras_dist.bench import train

    def sgd():
        return keras.optimizers.SGD(0.01)

    makers = {
        "keras-alone": lambda: train.compiled(name, sgd()) if rank == 0 else None,
        "torch-alone": lambda: Twin(module(name)) if rank == 0 else None,
        "keras-N": lambda: train.compiled(name, sgd()),
        "torch-N": lambda: Twin(module(name)),
        "keras_dist": lambda: train.compiled(name, kd.DistributedOptimizer(sgd())),
        "keras_dist-fp16": lambda: train.compiled(name, kd.DistributedOptimizer(
            sgd(), compression=kd.Compression.fp16)),
        "DDP": lambda: Twin(torch.nn.parallel.DistributedDataParallel(module(name))),
    }
    models = {kind: makers[kind]() for kind in kinds}
    if "DDP" in models:
        models["DDP"].spans = []
        models["DDP"].net.register_comm_hook(models["DDP"].spans, _timed_hook)
    return models


def run_model(name: str, args, rank: int, size: int) -> tuple[dict, int]:
    """This model's blocks; returns rank 0's summary (others: {}) and the failures."""
    import numpy as np
    import torch.distributed as dist

    from keras_dist._runtime import timeline

    kinds = args.kinds.split(",")
    x, y = _blocks.batch(name, args.batch_size, rank)
    models = _models(name, kinds, rank)
    steps = {k: [] for k in kinds}
    network = {k: [] for k in kinds}
    losses = {}
    for rep in range(args.reps):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            dist.barrier()
            model = models[kind]
            if model is None:
                continue
            for _ in range(args.warmup):
                model.train_on_batch(x, y)
            spans = getattr(model, "spans", [])
            spans.clear()
            before = timeline.totals()
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = model.train_on_batch(x, y)
            elapsed = time.perf_counter() - start
            after = timeline.totals()
            steps[kind].append(elapsed / args.steps)
            inside = (after["wait_s"] + after["move_s"] - before["wait_s"] - before["move_s"])
            network[kind].append((_union(spans) if kind == "DDP" else inside) / args.steps)
            losses[kind] = float(np.asarray(loss))
    medians = {k: (float(np.median(steps[k])), float(np.median(network[k])))
               for k in kinds if steps[k]}
    checked = [models[k] for k in ("keras_dist", "keras_dist-fp16", "DDP") if k in models]
    everyone, unequal = _blocks.gather_checked((medians, losses), checked)
    infinite = sum(not np.isfinite(v) for _, rank_losses in everyone
                   for v in rank_losses.values())
    parameters = next(m for m in models.values() if m is not None).count_params()
    dist.barrier()
    del models
    if rank != 0:
        return {}, unequal + infinite
    summary = {"parameters": parameters, "unequal": unequal, "infinite": infinite,
               "step_ms": {}, "network_ms": {}}
    for kind in kinds:
        ranks = [m[kind] for m, _ in everyone if kind in m]
        summary["step_ms"][kind] = 1e3 * float(np.mean([s for s, _ in ranks]))
        summary["network_ms"][kind] = 1e3 * float(np.mean([n for _, n in ranks]))
    return summary, unequal + infinite


def report(name: str, summary: dict, size: int, link: float, load: float) -> None:
    """Rank 0's table for one model, and a RESULT line per configuration."""
    step, network = summary["step_ms"], summary["network_ms"]
    grad_bytes = 4 * summary["parameters"]
    wire_ms = 1e3 * grad_bytes * 2 * (size - 1) / size / link if link else float("nan")
    print(f"\n### {name}: {summary['parameters'] / 1e6:.3f} M parameters "
          f"({grad_bytes / 1e6:.2f} MB of float32 gradients), {size} hosts x 1 rank, "
          f"link {link / 1e6:.1f} MB/s, a ring's wire time for the float32 gradients "
          f"{wire_ms:.1f} ms; load {load:.2f}", flush=True)
    print(f"{'configuration':<16} {'step ms':>8} | {'alone ms':>8} {'added':>7} | "
          f"{'H at once':>9} {'added':>7} | {'network ms':>10} {'of step':>7}", flush=True)
    for kind in step:
        if kind not in BASELINES:
            print(f"{kind:<16} {step[kind]:>8.2f} |", flush=True)
    added = {}
    for kind, (alone, together) in BASELINES.items():
        if kind not in step:
            continue
        added[kind] = step[kind] - step.get(alone, float("nan"))
        against = step[kind] - step.get(together, float("nan"))
        print(f"{kind:<16} {step[kind]:>8.2f} | {step.get(alone, float('nan')):>8.2f} "
              f"{added[kind]:>7.2f} | {step.get(together, float('nan')):>9.2f} "
              f"{against:>7.2f} | {network[kind]:>10.2f} {network[kind] / step[kind]:>7.2f}",
              flush=True)
        print("RESULT " + json.dumps({
            "model": name, "hosts": size, "config": kind, "parameters": summary["parameters"],
            "step_ms": step[kind], "alone_ms": step.get(alone), "together_ms":
            step.get(together), "network_ms": network[kind], "link_mbytes_per_s": link / 1e6,
            "load": load}), flush=True)
    if "DDP" in added:
        for kind in ("keras_dist", "keras_dist-fp16"):
            if kind in added:
                print(f"{kind} added / DDP added (against the model alone): "
                      f"{added[kind] / added['DDP']:.2f} (goal <= 0.5)", flush=True)
    print(f"checked: weights equal on every rank ({summary['unequal']} ranks differ), "
          f"losses finite ({summary['infinite']} not)", flush=True)


def worker(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        _blocks.one_thread()
    import torch
    import torch.distributed as dist

    import keras_dist as kd
    from keras_dist._runtime import timeline

    kd.init()
    rank, size = kd.rank(), kd.size()
    torch.set_num_threads(1)
    master = kd.allgather_object(_my_address())[0]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=rank,
                            world_size=size)
    link = float(os.environ.get(emulated_hosts.LINK_ENV, "0")) * 1e6
    scratch = tempfile.mkdtemp(prefix="kd-train-")
    kd.start_timeline(os.path.join(scratch, "t.json"))
    failures = 0
    try:
        for name in args.models.split(","):
            summary, failed = run_model(name, args, rank, size)
            failures += failed
            if rank == 0:
                report(name, summary, size, link, os.getloadavg()[0])
    finally:
        timeline.stop_timeline(summary=False)
        for entry in os.listdir(scratch):
            os.unlink(os.path.join(scratch, entry))
        os.rmdir(scratch)
    dist.destroy_process_group()
    kd.shutdown()
    if rank == 0:
        print(f"# ranks done, {failures} failed checks", flush=True)
    return 1 if failures else 0


# -- the driver ----------------------------------------------------------------

def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs, "
          f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
          f"python {' '.join(sys.argv)}", flush=True)
    os.environ.update({"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    forwarded = [f"--models={args.models}", f"--batch-size={args.batch_size}",
                 f"--steps={args.steps}", f"--reps={args.reps}", f"--warmup={args.warmup}",
                 f"--kinds={args.kinds}"]
    code = 0
    for hosts in (int(h) for h in args.hosts.split(",")):
        print(f"\n## {hosts} hosts x 1 rank, {args.rate}", flush=True)
        code = code or emulated_hosts.main([
            "--hosts", str(hosts), "--rate", args.rate, "--link-seconds", args.link_seconds,
            "--timeout", str(args.timeout), "kdrun", "--", sys.executable, __file__,
            "--worker", *forwarded])
    return code


if __name__ == "__main__":
    sys.exit(main())
