"""torch tensors and JAX arrays through the tensor layer at size 1."""

import numpy as np
import pytest

import keras_dist as kd
from keras_dist.tensor import kinds

torch = pytest.importorskip("torch", reason="needs torch (the test extra installs it)")
jax = pytest.importorskip("jax", reason="needs jax (the test extra installs it)")
jnp = jax.numpy


pytestmark = pytest.mark.usefixtures("initialised")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bfloat16])
def test_torch_round_trip_keeps_dtype_shape_and_memory(dtype):
    tensor = (torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5).to(dtype)
    array = kinds.to_numpy(tensor)
    assert array.shape == (2, 3)
    if dtype != torch.bfloat16:
        assert array.dtype == kinds.dtype_of(tensor)
        assert array.ctypes.data == tensor.data_ptr()  # a view, not a copy
    back = kinds.like(tensor, array)
    assert back.dtype == dtype and torch.equal(back, tensor)
    scalar = kinds.like(tensor, np.asarray(array[0, 0]))
    assert tuple(scalar.shape) == ()


def test_torch_and_jax_values_through_the_public_calls():
    t = torch.tensor([1.5, -2.0])
    for result in (kd.allreduce(t), kd.broadcast(t, 0), kd.allgather(t)):
        assert isinstance(result, torch.Tensor) and torch.equal(result, t)
    a = jnp.asarray([1.5, -2.0], jnp.float32)
    got = kd.allreduce(a, op=kd.Sum)
    assert isinstance(got, jax.Array) and np.array_equal(np.asarray(got), np.asarray(a))
    assert kinds.dtype_of(jnp.zeros(2, jnp.bfloat16)).name == "bfloat16"
    assert kinds.cast(t, np.float16).dtype == torch.float16


def test_jax_traced_allreduce_is_a_host_callback_and_shapes_must_be_static():
    @jax.jit
    def step(x):
        return kd.grouped_allreduce([x * 2.0, x], op=kd.Sum)

    x = jnp.arange(4.0, dtype=jnp.float32)
    doubled, same = step(x)
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(4.0) * 2)
    np.testing.assert_array_equal(np.asarray(same), np.arange(4.0))

    with pytest.raises(NotImplementedError, match="static output shape"):
        jax.jit(lambda v: kd.allgather(v))(x)
