"""`model.ops.linear`: the projection and its hand-laid-out gradients against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.ops.linear import linear


@pytest.mark.parametrize("contract", [1, 2])
def test_linear_value_and_gradients_match_numpy(contract):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    kernel = rng.normal(size=(*x.shape[4 - contract:], 6, 2)).astype(np.float32)
    cotangent = rng.normal(size=(*x.shape[:4 - contract], 6, 2)).astype(np.float32)

    y, vjp = jax.vjp(lambda a, w: linear(a, w, contract), jnp.asarray(x), jnp.asarray(kernel))
    dx, dw = vjp(jnp.asarray(cotangent))

    inner = int(np.prod(x.shape[4 - contract:]))
    x2 = x.reshape(-1, inner).astype(np.float64)
    w2 = kernel.reshape(inner, -1).astype(np.float64)
    g2 = cotangent.reshape(x2.shape[0], -1).astype(np.float64)
    np.testing.assert_allclose(y, (x2 @ w2).reshape(y.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, (g2 @ w2.T).reshape(x.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, (x2.T @ g2).reshape(kernel.shape), rtol=1e-5, atol=1e-5)


def test_linear_keeps_bfloat16_gradients():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 3), jnp.bfloat16)
    dx, dw = jax.grad(lambda a, b: jnp.sum(linear(a, b).astype(jnp.float32)), (0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dw.astype(jnp.float32), np.full((8, 3), 4.0))


def test_linear_rejects_mismatched_axes():
    with pytest.raises(ValueError, match="do not match kernel"):
        linear(jnp.ones((2, 4)), jnp.ones((5, 3)))
