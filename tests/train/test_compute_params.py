"""The train step's copy of the params (train/parallel/compute_params.py): which params it holds
in bfloat16, the stage layout of the pipelined segment, ZeRO-1 master weights, and the memory
plan's rows for them. Abstract shapes only (jax.eval_shape on an abstract mesh): nothing is
compiled."""

import jax
import jax.numpy as jnp
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P
from train_helpers import PIPELINABLE, small_run

from model.parallel.rules import abstract_mesh
from train.parallel.compute_params import compute_params, compute_specs
from train.parallel.memory_plan import plan_memory
from train.parallel.sharding import state_specs
from train.state import abstract_state, build_training

BF16 = ("model.compute_dtype=bfloat16",)


def _copy(run, sizes=None, mtp_heads=None):
    """(flat {path: ShapeDtypeStruct} of the stored params, of their copy, the copy's specs)."""
    training = build_training(run)
    params = abstract_state(training, 0).params
    axes = training.variable_axes["params"]
    fn = lambda p: compute_params(p, axes, run.model, mtp_heads)  # noqa: E731
    if sizes is None:
        copy, specs = jax.eval_shape(fn, params), None
    else:
        mesh = abstract_mesh(sizes)
        with jax.sharding.use_abstract_mesh(mesh):
            copy = jax.eval_shape(fn, params)
        specs = flatten_dict(compute_specs(axes, params, mesh, run.model),
                             is_leaf=lambda _, x: isinstance(x, P))
    return flatten_dict(params), flatten_dict(copy), specs


def _sizes(**axes):
    return {"pipeline": 1, "data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **axes}


def test_mixed_precision_copies_weight_matrices_in_bfloat16():
    stored, copy, _ = _copy(small_run(*BF16), mtp_heads=1)
    segment = ("layers", "segment_1", "block_0")
    bf16 = [("embed_tokens", "embedding"), ("lm_head", "kernel"),
            (*segment, "self_attn", "q_proj", "kernel"), (*segment, "moe", "gate_proj"),
            (*segment, "moe", "shared_expert", "up_proj", "kernel"),
            ("mtp_0", "eh_proj", "kernel"), ("mtp_0", "output_head", "kernel"),
            ("mtp_0", "block", "self_attn", "o_proj", "kernel")]
    float32 = [(*segment, "moe", "router"),  # routing logits are float32
               (*segment, "input_layernorm", "weight"), (*segment, "self_attn", "q_norm", "weight"),
               ("mtp_0", "enorm", "weight"), ("norm", "weight"),
               ("mtp_1", "output_head", "kernel")]  # the head the loss does not run: not copied
    for path in bf16:
        assert copy[path].dtype == jnp.bfloat16, path
    for path in float32:
        assert copy[path].dtype == jnp.float32, path
    assert all(stored[p].shape == copy[p].shape for p in stored)  # no mesh: no stage layout
    assert all(x.dtype == jnp.float32 for x in stored.values())


def test_float32_compute_copies_nothing_and_qat_experts_stay_float32():
    run = small_run()
    training = build_training(run)
    params = jax.tree.map(jnp.zeros_like, abstract_state(training, 0).params)
    same = compute_params(params, training.variable_axes["params"], run.model)
    assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)))
    _, copy, _ = _copy(small_run(*BF16, "model.qat.expert_weights=mxfp4"))
    assert copy[("layers", "segment_1", "block_0", "moe", "gate_proj")].dtype == jnp.float32
    assert copy[("lm_head", "kernel")].dtype == jnp.bfloat16


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipelined_segment_is_copied_in_stage_layout(virtual):
    """F+SSSF: the S segment of 3 repeats on 2 stages (uneven: k = 2 with 1 virtual stage, 4
    chunks of k = 1 with 2), [S, V, k, ...] over `pipeline`; the rest keeps its shape."""
    run = small_run(*BF16, f"model.pipeline_virtual_stages={virtual}")
    stored, copy, specs = _copy(run, _sizes(pipeline=2, data=2))
    slots = 2 if virtual == 1 else 1
    for path, leaf in stored.items():
        if path[:2] == ("layers", "segment_1"):
            assert leaf.shape[0] == 3
            assert copy[path].shape == (2, virtual, slots, *leaf.shape[1:]), path
            assert specs[path][:3] == ("pipeline", None, None), path
            assert "data" not in jax.tree.leaves(tuple(specs[path])), path
        else:
            assert copy[path].shape == leaf.shape, path


def test_zero1_shards_float32_master_weights_over_data_under_mixed_precision():
    def specs(*overrides):
        run = small_run(*overrides)
        training = build_training(run)
        out = state_specs(abstract_state(training, 0), training.variable_axes,
                          abstract_mesh(_sizes(data=4)), run)
        return flatten_dict(out.params, is_leaf=lambda _, x: isinstance(x, P))

    embedding = ("embed_tokens", "embedding")
    assert "data" in jax.tree.leaves(tuple(specs(*BF16)[embedding]))
    for overrides in ((), (*BF16, "mesh.zero1=false")):  # float32 compute; no ZeRO-1
        assert all("data" not in jax.tree.leaves(tuple(s)) for s in specs(*overrides).values())


def test_plan_counts_the_copy_and_both_gradients():
    """tiny at bfloat16 on data=4: stored float32 params over data (a quarter), their copy
    whole in about half the bytes, gradients = the copy's (bfloat16) + the float32 sum (stored
    layout); float32 compute: no copy, one gradient like the params."""
    sizes, both_heads = _sizes(data=4), "train.mtp_offset_weights=[1.0, 0.5]"
    mixed = plan_memory(small_run(*BF16, both_heads), sizes)["per_device_bytes"]
    plain = plan_memory(small_run(both_heads), sizes)["per_device_bytes"]
    assert plain["compute_params"] == 0 and plain["gradients"] == plain["params"]
    assert mixed["params"] < plain["params"] / 3  # 1/4, but for the unsharded small vectors
    assert plain["params"] / 2 < mixed["compute_params"] < 0.6 * plain["params"]
    assert mixed["gradients"] == mixed["compute_params"] + mixed["params"]


def test_float32_pipeline_copy_counts_only_the_rearranged_segment():
    """float32 compute on pipeline=2, data=2, 8 identical layers in one segment: params outside
    the segment are their own copy (same dtype and layout: no new buffer). With V = 1 the
    stages hold contiguous runs of 4 repeats, a reshape of the stored stack: no copy, one
    gradient tree. With V = 2 the stage layout is new: per device 2 x 2 slots, the 4 repeats'
    worth the stored stack holds there (its layers' attention, experts, router and norms)."""
    sizes = _sizes(pipeline=2, data=2)
    contiguous = plan_memory(small_run(*PIPELINABLE), sizes)["per_device_bytes"]
    assert contiguous["compute_params"] == 0
    assert contiguous["gradients"] == contiguous["params"]
    staged = plan_memory(small_run(*PIPELINABLE, "model.pipeline_virtual_stages=2"), sizes)
    groups = staged["params_by_group_bytes"]
    layers = sum(groups[g] for g in ("attention", "moe_routed", "moe_shared", "router"))
    copy = staged["per_device_bytes"]["compute_params"]
    assert layers < copy < layers + groups["norms"]
    assert staged["per_device_bytes"]["gradients"] == copy + staged["per_device_bytes"]["params"]
