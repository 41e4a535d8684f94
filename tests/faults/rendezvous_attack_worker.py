"""A self-started rank that keeps training while a stranger attacks its
rendezvous: ``python rendezvous_attack_worker.py CONTROL``.

Each step is an allreduce of random data checked against the float64 sum every
rank computes itself, then a step of least-squares training on this rank's
own random data whose averaged gradient is checked against the float64 mean
of every rank's gradient (plain allreduces, not a Keras fit: every rank
starts in a second instead of importing a framework).

Rank 0 connects to the test's Unix socket CONTROL once the job has formed and
says ``up``; at every step it looks whether the test has written there since
(it does once its attacks are over) and broadcasts what it saw, so every rank
stops at the same step. At the end the weights must be identical on every
rank and equal to the float64 reference training.

Prints ``UP rank=R size=N`` once the job formed, and
``TRAINED rank=R size=N steps=S weights identical ok`` at the end.
"""

import select
import socket
import sys

import numpy as np

import keras_dist as kd

CONTROL = sys.argv[1]
FEATURES, ROWS, RATE = 8, 32, 0.05

kd.init()
rank, size = kd.rank(), kd.size()
print(f"UP rank={rank} size={size}", flush=True)
if rank == 0:
    control = socket.socket(socket.AF_UNIX)
    control.connect(CONTROL)
    control.sendall(b"up\n")


def told_to_stop():
    return bool(select.select([control], [], [], 0)[0])


def shard(r):
    rng = np.random.default_rng([11, r])
    inputs = rng.standard_normal((ROWS, FEATURES))
    return inputs, inputs @ np.linspace(-1, 1, FEATURES) + 0.1 * rng.standard_normal(ROWS)


def gradient(weights, r):
    inputs, targets = shards[r]
    return inputs.T @ (inputs @ weights - targets) / ROWS


shards = [shard(r) for r in range(size)]
weights = np.zeros(FEATURES)
reference = np.zeros(FEATURES)
step = 0
while True:
    values = [np.random.default_rng([5, r, step]).standard_normal(1001) for r in range(size)]
    summed = kd.allreduce(values[rank], op=kd.Sum, name="checked_sum")
    np.testing.assert_allclose(summed, np.sum(values, axis=0, dtype=np.float64),
                               rtol=1e-12, atol=1e-12, err_msg=f"step {step}")
    averaged = kd.allreduce(gradient(weights, rank), op=kd.Average, name="gradient")
    expected = np.mean([gradient(reference, r) for r in range(size)], axis=0, dtype=np.float64)
    np.testing.assert_allclose(averaged, expected, rtol=1e-9, atol=1e-12, err_msg=f"step {step}")
    weights -= RATE * averaged
    reference -= RATE * expected
    step += 1
    if kd.broadcast_object(told_to_stop() if rank == 0 else None, root_rank=0):
        break

every = kd.allgather(weights.reshape(1, FEATURES), name="final_weights")
assert (every == every[0]).all(), f"the weights differ between ranks: {every}"
np.testing.assert_allclose(weights, reference, rtol=1e-9, atol=1e-12)
loss = float(np.mean([np.mean((shards[r][0] @ weights - shards[r][1]) ** 2)
                      for r in range(size)]))
print(f"TRAINED rank={rank} size={size} steps={step} loss={loss:.4f} weights identical ok",
      flush=True)
