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
