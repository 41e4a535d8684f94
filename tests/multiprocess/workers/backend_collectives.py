"""Worker for test_backend_collectives.py: collectives on torch tensors and JAX arrays
(eager, and inside jax.jit), checked on every rank against numpy float64."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

import keras_dist as kd

kd.init()
rank, size = kd.rank(), kd.size()


def inputs(seed, shape=(3, 4)):
    return [np.random.default_rng([seed, r]).normal(size=shape) for r in range(size)]


def check(got, expected, what, tol=1e-6):
    got = np.asarray(got.detach().numpy() if isinstance(got, torch.Tensor) else got, np.float64)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=what)
    blobs = kd.allgather_object(got.tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what}: ranks differ"


for kind, make in (("torch", lambda a: torch.tensor(a, dtype=torch.float32)),
                   ("jax", lambda a: jnp.asarray(a, jnp.float32))):
    xs = inputs(1)
    got = kd.allreduce(make(xs[rank]))
    assert type(got).__module__.split(".")[0] in (kind, "jaxlib"), type(got)
    check(got, np.mean(xs, axis=0), f"{kind} allreduce")
    check(kd.broadcast(make(xs[rank]), root_rank=size - 1), xs[size - 1], f"{kind} broadcast")
    rows = [np.random.default_rng([2, r]).normal(size=(r + 1, 2)) for r in range(size)]
    check(kd.allgather(make(rows[rank])), np.concatenate(rows), f"{kind} allgather")
    print(f"BACKEND COLLECTIVES {kind} ok rank={rank}")

# An optimizer's gradients: CPU torch tensors reduced in their own memory.
from keras_dist.tensor import ops  # noqa: E402

grads = [inputs(5), inputs(6, (7,)), inputs(7, (0,))]
mine = [torch.tensor(g[rank], dtype=torch.float32) for g in grads]
memory = [t.data_ptr() for t in mine]
reduced = ops.grouped_allreduce_gradients(mine, kd.Average, postscale_factor=2.0)
for got, g, tensor, ptr in zip(reduced, grads, mine, memory):
    assert got is tensor and got.data_ptr() == ptr, "not reduced in place"
    check(got, 2.0 * np.mean(g, axis=0), "gradients in place")
# Tensors sharing memory are not overwritten: reduced as grouped_allreduce.
shared = torch.tensor(inputs(8)[rank], dtype=torch.float32)
before = shared.clone()
twice = ops.grouped_allreduce_gradients([shared, shared], kd.Sum)
assert torch.equal(shared, before) and twice[0] is not shared
for got in twice:
    check(got, np.sum(inputs(8), axis=0), "gradients sharing memory")
print(f"BACKEND COLLECTIVES torch gradients ok rank={rank}")

xs, ys = inputs(3), inputs(4, (5,))


@jax.jit
def step(x, y):
    a, b = kd.grouped_allreduce([x, y * 2.0], op=kd.Sum)
    return a + 1.0, b


for _ in range(3):  # the compiled step runs its collectives on every call, in order
    a, b = step(jnp.asarray(xs[rank], jnp.float32), jnp.asarray(ys[rank], jnp.float32))
    check(a, np.sum(xs, axis=0) + 1.0, "jit grouped allreduce", 1e-5)
    check(b, 2.0 * np.sum(ys, axis=0), "jit grouped allreduce (second)", 1e-5)
print(f"BACKEND COLLECTIVES jit ok rank={rank}")

# keras_dist's XLA FFI handler: a jitted allreduce on the CPU with no Python on
# the step; every dtype it carries, several buckets, calls in traced order.
from keras_dist.tensor.ops import COUNTERS  # noqa: E402

dtypes = (np.float32, np.int32, np.float16, jnp.bfloat16, np.uint8)


def everyone(i):
    """Every rank's array of dtype i, as float64 (the exact values each holds)."""
    rows = [np.random.default_rng([9, i, r]).normal(size=(3 + i,)) * 4 for r in range(size)]
    if dtypes[i] is np.uint8:
        rows = [np.abs(row) for row in rows]
    return [np.asarray(jnp.asarray(row, dtypes[i]), np.float64) for row in rows]


mine = [jnp.asarray(everyone(i)[rank], d) for i, d in enumerate(dtypes)]


def native_fn(*arrays):
    summed = kd.grouped_allreduce([a * 1 for a in arrays], op=kd.Sum)
    largest = kd.grouped_allreduce([a * 1 for a in arrays[:2]], op=kd.Max)
    average = kd.grouped_allreduce([arrays[0] * 1], op=kd.Average)
    kd.allreduce(arrays[0] * 1, op=kd.Sum)  # unused: the call stays in the step
    return summed, largest, average


native_step = jax.jit(native_fn)
jaxpr = jax.make_jaxpr(native_fn)(*mine).jaxpr
calls = [e for e in jaxpr.eqns if e.primitive.name == "keras_dist_allreduce"]
assert len(calls) == 4 and not any(e.primitive.name == "buffer_callback" for e in jaxpr.eqns), \
    [e.primitive.name for e in jaxpr.eqns]
for before, after in zip(calls, calls[1:]):  # chained: XLA runs them in the traced order
    assert before.outvars[0] in after.invars
assert native_step.lower(*mine).compile().as_text().count(
    'custom_call_target="keras_dist_allreduce"') == 4
for _ in range(2):
    counted = COUNTERS["allreduce"]
    summed, largest, average = native_step(*mine)
    assert COUNTERS["allreduce"] - counted >= 4, COUNTERS["allreduce"] - counted
    for i, got in enumerate(summed):
        tol = {np.float16: 1e-2, jnp.bfloat16: 5e-2}.get(dtypes[i], 1e-5)
        assert got.dtype == mine[i].dtype
        expected = np.sum(everyone(i), axis=0)
        if dtypes[i] is np.uint8:
            expected = np.mod(expected, 256)
        check(got, expected, f"native sum {np.dtype(dtypes[i]).name}", tol)
    for i, got in enumerate(largest):
        check(got, np.max(everyone(i), axis=0), f"native max {i}", 1e-5)
    check(average[0], np.mean(everyone(0), axis=0), "native average", 1e-5)
print(f"BACKEND COLLECTIVES native ok rank={rank}")

# Scaled (prescale_factor, postscale_factor): floating-point arrays in the
# handler, an integer one in the call sends it to the buffer callback.
PRE, POST = 0.5, 3.0


def scaled_fn(*arrays):
    floats = [arrays[0], arrays[2], arrays[3]]
    return (kd.grouped_allreduce([a * 1 for a in floats], op=kd.Sum, prescale_factor=PRE,
                                 postscale_factor=POST),
            kd.grouped_allreduce([a * 1 for a in floats], op=kd.Average, prescale_factor=PRE,
                                 postscale_factor=POST))


names = [e.primitive.name for e in jax.make_jaxpr(scaled_fn)(*mine).jaxpr.eqns]
assert names.count("keras_dist_allreduce") == 2 and "buffer_callback" not in names, names
summed, average = jax.jit(scaled_fn)(*mine)
for got_sum, got_average, i in zip(summed, average, (0, 2, 3)):
    tol = {np.float16: 2e-2, jnp.bfloat16: 1e-1}.get(dtypes[i], 1e-5)
    scaled_sum = np.sum(everyone(i), axis=0) * PRE * POST
    check(got_sum, scaled_sum, f"native scaled sum {i}", tol)
    check(got_average, scaled_sum / size, f"native scaled average {i}", tol)
    assert got_sum.dtype == mine[i].dtype and got_average.dtype == mine[i].dtype


def scaled_ints(x):
    return kd.allreduce(x * 1, op=kd.Sum, prescale_factor=PRE, postscale_factor=POST)


names = [e.primitive.name for e in jax.make_jaxpr(scaled_ints)(mine[1]).jaxpr.eqns]
assert "keras_dist_allreduce" not in names, names
expected = sum(np.trunc(row * PRE) for row in everyone(1)) * POST
check(jax.jit(scaled_ints)(mine[1]), np.trunc(expected), "scaled int32 (callback)", 0)
print(f"BACKEND COLLECTIVES native scaled ok rank={rank}")

# A timeline records each call as the numpy path does: a span per call,
# split into waiting for peers and moving data.
import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

directory = tempfile.mkdtemp(prefix=f"kd-xla-{rank}-")
kd.start_timeline(os.path.join(directory, "t.json"))
try:
    jax.block_until_ready(native_step(*mine))
finally:
    kd.stop_timeline(summary=False)
(part,) = glob.glob(os.path.join(directory, "t.json.rank*"))
with open(part) as lines:
    spans = [e["name"] for e in map(json.loads, lines) if e.get("ph") == "X"]
for leftover in glob.glob(os.path.join(directory, "*")):
    os.unlink(leftover)
os.rmdir(directory)
assert spans.count("allreduce") == 4, spans
assert "wait for peers" in spans and "move data" in spans, spans
print(f"BACKEND COLLECTIVES native timeline ok rank={rank}")


# Ranks that disagree: every rank raises the mismatch, and the engine goes on.
@jax.jit
def disagree(x):
    return kd.allreduce(x * 1, op=kd.Sum)


try:
    jax.block_until_ready(disagree(jnp.ones(3 + rank, jnp.float32)))
except Exception as error:  # noqa: BLE001 - XLA's runtime error carries the status
    assert "CollectiveMismatchError" in str(error) and "FAILED_PRECONDITION" in str(error), \
        str(error)
else:
    raise AssertionError("a mismatched jitted allreduce did not raise")
check(disagree(jnp.full(4, rank + 1.0, jnp.float32)), np.full(4, size * (size + 1) / 2),
      "native after a mismatch")
print(f"BACKEND COLLECTIVES native mismatch ok rank={rank}")

# Ranks that have joined: the handler's bucket goes to the Python fallback,
# which adds a joined rank's identity (Average still divides by the size).
@jax.jit
def averaged(x):
    return kd.allreduce(x * 1, op=kd.Average)


@jax.jit
def averaged_scaled(x):
    return kd.allreduce(x * 1, op=kd.Average, prescale_factor=PRE, postscale_factor=POST)


def join_data(step, r):
    return np.random.default_rng([step, r, 11]).normal(size=(6, 2)) * 3


assert "keras_dist_allreduce" in str(jax.make_jaxpr(averaged)(jnp.zeros((6, 2), jnp.float32)))
counts = [1 if r == 0 else 2 + r for r in range(size)]
for step in range(counts[rank]):
    got = averaged(jnp.asarray(join_data(step, rank), jnp.float32))
    want = sum(np.asarray(jnp.asarray(join_data(step, r), jnp.float32), np.float64)
               for r in range(size) if counts[r] > step) / size
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5,
                               err_msg=f"native while joined, step {step}")
    got = averaged_scaled(jnp.asarray(join_data(step, rank), jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), want * PRE * POST, rtol=1e-5,
                               atol=1e-5, err_msg=f"native scaled while joined, step {step}")
assert kd.join() == size - 1
print(f"BACKEND COLLECTIVES native join ok rank={rank}")

# A step compiled before kd.shutdown names a plan that is gone: a clear error.
kd.shutdown()
kd.init()
try:
    jax.block_until_ready(disagree(jnp.full(4, 1.0, jnp.float32)))
except Exception as error:  # noqa: BLE001
    assert "plan is gone" in str(error), str(error)
else:
    raise AssertionError("a step compiled before kd.shutdown ran")
print(f"BACKEND COLLECTIVES native plans ok rank={rank}")
