"""The device mesh as the model sees it: read from JAX's mesh context while tracing.

The trainer enters `jax.set_mesh(mesh)` and flax's `nn.logical_axis_rules(rules)` (see
`train.parallel.sharding`); without them every helper here reports a single device and the model
runs its plain single-device code. Mesh axis names: `pipeline`, `data`, `fsdp`, `expert`,
`context`, `tensor`.
"""

import functools
import math

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec


def mesh_axis_size(name: str) -> int:
    """Size of mesh axis `name` in the current mesh context (1 when absent or no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return mesh.shape[name]


def mesh_size() -> int:
    """Devices in the current mesh context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape.values())


def global_view() -> bool:
    """Whether the arrays being traced are global arrays over a mesh of several devices (XLA
    partitions them), rather than one device's blocks inside a `shard_map`."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh_size() > 1 and not mesh.are_all_axes_manual


def logical_spec(*logical_axes: str | None) -> PartitionSpec:
    """PartitionSpec of an array with these logical axes under the active rules (flax's
    `nn.logical_axis_rules`); every dimension unsharded when no rules are set."""
    return nn.logical_to_mesh_axes(logical_axes)


def spec_axes(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def tensor_heads(*head_counts: int) -> str | None:
    """The mesh axis attention heads split over in a `shard_map`: `tensor` where it divides
    every one of `head_counts` (query and KV heads, so each shard holds whole GQA groups),
    else None (the heads whole on every device)."""
    tensor = mesh_axis_size("tensor")
    return "tensor" if tensor > 1 and all(n % tensor == 0 for n in head_counts) else None


def shard_attention_core(core):
    """An attention core (`model.ops.tables.ATTENTION`) run per shard under the current mesh: batch
    over the rules' batch axes, heads over `tensor` when it divides both query and KV heads. XLA
    cannot partition a `pallas_call`, so the Pallas kernels need this; each shard holds whole
    sequences and whole GQA groups, so the result is the unsharded one."""

    @functools.wraps(core)
    def sharded(q, k, v, *, window, segment_ids, sink):
        batch = logical_spec("batch")[0]
        heads = tensor_heads(q.shape[2], k.shape[2])
        qkv = PartitionSpec(batch, None, heads, None)
        args, specs = [q, k, v], [qkv, qkv, qkv]
        if segment_ids is not None:
            args.append(segment_ids)
            specs.append(PartitionSpec(batch, None))
        if sink is not None:
            args.append(sink)
            specs.append(PartitionSpec(heads))

        def local(q, k, v, *rest):
            rest = list(rest)
            seg = rest.pop(0) if segment_ids is not None else None
            return core(q, k, v, window=window, segment_ids=seg,
                        sink=rest.pop(0) if sink is not None else None)

        return jax.shard_map(local, in_specs=tuple(specs), out_specs=qkv, check_vma=False)(*args)

    return sharded
