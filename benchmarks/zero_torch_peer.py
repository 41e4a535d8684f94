"""PyTorch's ZeroRedundancyOptimizer over gloo, beside plain Adam, on zero_memory's model.

    python benchmarks/zero_torch_peer.py --params 100e6 --steps 3

(not under kdrun). The model of ``keras_dist.bench.zero_memory``: a stack of
square Linear layers (``--width``, about ``--params`` parameters), float32,
Adam (lr 1e-4), MSE on random data of ``--batch`` rows, one thread per rank,
in plain PyTorch with no DDP: after the backward pass each gradient is
averaged with ``torch.distributed.all_reduce`` over gloo, then either plain
``torch.optim.Adam`` steps on every weight (unsharded) or
``torch.distributed.optim.ZeroRedundancyOptimizer`` wrapping Adam steps on
this rank's share and broadcasts it (sharded). Each mode runs in fresh
processes (``torch.multiprocessing.spawn``; peak resident memory is a
process's own) and every rank prints one line ``PEER {json}``: the bytes of
optimizer state it holds, its peak resident memory (``ru_maxrss``) and the
median step time after the first, wall-clock and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import time


def _worker(rank: int, size: int, port: int, mode: str, options, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    width = options.width
    layers = max(1, round(options.params / (width * width + width)))
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if mode == "sharded":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=1e-4)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(options.batch, width, generator=generator)
    y = torch.randn(options.batch, width, generator=generator)
    times, cpu = [], []
    for _ in range(options.steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= size
        optimizer.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    inner = optimizer.optim if mode == "sharded" else optimizer
    state = sum(value.numel() * value.element_size() for slots in inner.state.values()
                for value in slots.values() if torch.is_tensor(value))
    queue.put({"rank": rank, "size": size, "mode": mode, "torch": torch.__version__,
               "parameters": sum(p.numel() for p in model.parameters()),
               "optimizer_state_bytes": state,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "median_step_s": statistics.median(times[1:]),
               "median_step_cpu_s": statistics.median(cpu[1:])})
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv=None) -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2, dest="np_")
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["unsharded", "sharded"],
                        choices=["unsharded", "sharded"])
    options = parser.parse_args(argv)
    context = mp.get_context("spawn")
    for mode in options.modes:
        queue = context.SimpleQueue()
        load = os.getloadavg()[0]
        mp.spawn(_worker, args=(options.np_, _free_port(), mode, options, queue),
                 nprocs=options.np_, join=True)
        lines = sorted((queue.get() for _ in range(options.np_)), key=lambda line: line["rank"])
        for line in lines:
            print(f"load {load:.1f} PEER {json.dumps(line)}", flush=True)


if __name__ == "__main__":
    main()
