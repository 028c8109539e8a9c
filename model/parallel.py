"""The device mesh as the model sees it: read from JAX's mesh context while tracing.

The trainer enters `jax.set_mesh(mesh)` and flax's `nn.logical_axis_rules(rules)` (see
`train.sharding`); without them every helper here reports a single device and the model runs
its plain single-device code. Mesh axis names: `pipeline`, `data`, `fsdp`, `expert`, `tensor`.
"""

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec


def mesh_axis_size(name: str) -> int:
    """Size of mesh axis `name` in the current mesh context (1 when absent or no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return mesh.shape[name]


def mesh_axis_names() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(mesh.axis_names)


def logical_spec(*logical_axes: str | None) -> PartitionSpec:
    """PartitionSpec of an array with these logical axes under the active rules (flax's
    `nn.logical_axis_rules`); every dimension unsharded when no rules are set."""
    return nn.logical_to_mesh_axes(logical_axes)


def spec_axes(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)
