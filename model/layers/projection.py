"""`Projection`: a bias-free dense layer over one or more trailing input axes (q/k/v/o/g, the
FFN and expert-free output projections, the LM head), on `model.ops.linear`."""

import flax.linen as nn
import jax.numpy as jnp

from model.layers.common import normal_init
from model.ops.linear import linear


class Projection(nn.Module):
    """x [..., *in] -> [..., *features] with a `kernel` [*in, *features] (flax Dense's param
    name and layout). Flax's DenseGeneral builds its kernel flat and reshapes it, which under a
    mesh context applies the logical sharding constraint to the flat array and fails; this one
    creates the kernel in its final shape."""

    features: tuple[int, ...]
    axes: tuple[str, ...]  # logical axes of the kernel
    contract: int  # number of trailing input dims contracted
    std: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        shape = (*x.shape[x.ndim - self.contract:], *self.features)
        kernel = self.param("kernel", normal_init(self.std, self.axes), shape, self.param_dtype)
        return linear(x.astype(self.dtype), kernel.astype(self.dtype), self.contract)
