"""The decoder layer stack: scanned segments (`scan_layers=True`) or one module per layer.

Param trees:
- scan on: `segment_{s}/block_{j}/...` with a leading `layers` axis of size `repeats`
  (layer index = start + r * period + j);
- scan off: `layer_{i}/...`.
`model.layers.params.unstack_layers` / `stack_layers` convert between the two.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.inference.kv_cache import KVCacheSpec
from model.layers.block import DecoderBlock
from model.layers.layer_plan import Segment, layer_kinds, plan_segments
from model.parallel.mesh import mesh_axis_size
from model.parallel.pipeline import pipeline_forward, pipelined_segment, stage_plan
from pallas_kernels.saved_names import KERNEL_OUTPUTS

_REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # dots, plus the kernel outputs that `dots` would recompute: the routed experts' and the
    # attention core's, named inside their custom VJPs (pallas_kernels/saved_names.py)
    "dots_with_kernels": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*KERNEL_OUTPUTS)),
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
    "save_ffn_out": jax.checkpoint_policies.save_only_these_names("ffn_out"),
}


# A segment of at most this many layers is scanned fully unrolled: its loop runs once, so XLA
# slices the stacked params and residuals at static offsets and overlaps the layers' independent
# ops instead of copying each layer's slice in and out of the stacks (vs_torch's 8-layer model,
# segments of 1 and 3 layers: fwd+bwd 3.5-7% faster). Unrolling so few layers costs little
# compile time; longer segments keep one period per iteration, so deep stacks still compile in
# a time flat in depth.
FULLY_UNROLLED_LAYERS = 4


def scan_unroll(seg: Segment, remat: bool = False) -> int:
    """Iterations per loop step of the scanned segment `seg`. Under a remat policy (`remat`)
    always 1: the backward loop then recomputes one period per step, where a fully unrolled
    segment let XLA schedule several layers' recomputations, and their attention scores,
    together (tiny model at d_model 256, 8 host devices: remat=full peaked at 559 MiB unrolled,
    346 MiB rolled; `python -m train.plan --measure`)."""
    if remat:
        return 1
    return seg.repeats if seg.period * seg.repeats <= FULLY_UNROLLED_LAYERS else 1


def block_class(cfg: ModelConfig, in_loop: bool):
    """The block, rematerialised by the config's policy. `in_loop`: it runs as the body of a
    loop that repeats it (a rolled scan), which keeps XLA from merging the backward pass's
    recomputation with the forward (CSE), so remat needs no barrier there. A fully unrolled
    scan is inlined like straight-line code: without the barrier XLA merges the two and keeps
    every forward activation (measured with `python -m train.plan --measure`)."""
    if cfg.remat_policy == "none":
        return DecoderBlock
    return nn.remat(DecoderBlock, policy=_REMAT_POLICIES[cfg.remat_policy], prevent_cse=not in_loop)


class BlockGroup(nn.Module):
    """One period of a segment: `len(kinds)` consecutive blocks. Scan body: carry = x;
    `routed_experts`: None or one entry per block ([B, T, k] for an MoE block, else None)."""

    config: ModelConfig
    kinds: tuple
    kv_cache: KVCacheSpec | None = None
    in_loop: bool = True  # False: a fully unrolled scan (`block_class`)

    @nn.compact
    def __call__(self, x, positions, segment_ids, token_ids=None, routed_experts=None):
        block = block_class(self.config, self.in_loop)
        auxes = []
        for j, kind in enumerate(self.kinds):
            x, aux = block(self.config, kind.attention_type, kind.is_moe, kind.limit,
                           kind.shared_limit, self.kv_cache, kind.is_hash, name=f"block_{j}")(
                x, positions, segment_ids, token_ids,
                None if routed_experts is None else routed_experts[j])
            auxes.append(aux)
        return x, tuple(auxes)


def per_layer_routes(cfg: ModelConfig, routed_experts) -> list:
    """A replayed expert choice [L_moe, B, T, k] (the MoE layers in order, as `aux["moe"]`
    stacks them) -> one entry per layer: [B, T, k] for an MoE layer, None for a dense one."""
    moe_layers = cfg.moe_layer_indices()
    if routed_experts.shape[0] != len(moe_layers):
        raise ValueError(f"routed_experts: {routed_experts.shape[0]} layers given, the model has "
                         f"{len(moe_layers)} MoE layers")
    routes = [None] * cfg.num_layers
    for n, i in enumerate(moe_layers):
        routes[i] = routed_experts[n]
    return routes


def segment_routes(routes: list, seg: Segment) -> tuple:
    """Per-layer routes -> the scanned input of segment `seg`: per block of the period, the
    repeats' routes stacked [repeats, B, T, k] (None for a dense block)."""
    return tuple(
        None if routes[seg.start + j] is None else
        jnp.stack([routes[seg.start + r * seg.period + j] for r in range(seg.repeats)])
        for j in range(seg.period))


class LayerStack(nn.Module):
    """x: [B, T, d_model] (mHC: streams [B, T, n, d_model]) -> (same shape, per-layer aux list
    of length num_layers). `token_ids` [B, T] feed the hash-routed MoE layers;
    `routed_experts` [L_moe, B, T, k] replays an expert choice (model/layers/router.py). With
    `kv_cache` the layers decode incrementally; their caches are the `cache` collection,
    stacked like params. `staged_pipeline`: the pipelined segment's params come in their stage
    layout (see `model.lm.CausalLM`)."""

    config: ModelConfig
    kv_cache: KVCacheSpec | None = None
    staged_pipeline: bool = False

    @nn.compact
    def __call__(self, x, positions, segment_ids, token_ids=None, routed_experts=None):
        cfg = self.config
        if self.kv_cache is not None and mesh_axis_size("context") > 1:
            raise ValueError("decoding with KV caches does not run under a context mesh axis; "
                             "use mesh.context=1 for inference")
        kinds = layer_kinds(cfg)
        per_layer_aux = [None] * cfg.num_layers
        routes = ([None] * cfg.num_layers if routed_experts is None
                  else per_layer_routes(cfg, routed_experts))
        if not cfg.scan_layers:
            block = block_class(cfg, in_loop=False)
            for i, kind in enumerate(kinds):
                x, per_layer_aux[i] = block(cfg, kind.attention_type, kind.is_moe, kind.limit,
                                            kind.shared_limit, self.kv_cache, kind.is_hash,
                                            name=f"layer_{i}")(
                    x, positions, segment_ids, token_ids, routes[i])
            return x, per_layer_aux

        stages = mesh_axis_size("pipeline")
        if stages > 1 and self.kv_cache is not None:
            raise ValueError("decoding with KV caches does not run under a pipeline mesh axis; "
                             "use mesh.pipeline=1 for inference")
        if stages > 1 and routed_experts is not None:
            raise ValueError("replayed routing (routed_experts) does not run through pipeline "
                             "stages; use mesh.pipeline=1 with it")
        piped = pipelined_segment(cfg, stages) if stages > 1 else None
        for s, seg in enumerate(plan_segments(kinds)):
            unit = tuple(kinds[seg.start:seg.start + seg.period])
            if s == piped and not self.is_initializing():
                x, auxes = self._pipelined(f"segment_{s}", unit, x,
                                           (positions, segment_ids, token_ids), stages)
                _scatter_aux(per_layer_aux, seg, auxes)
                continue
            unroll = scan_unroll(seg, cfg.remat_policy != "none")
            scanned = nn.scan(
                BlockGroup,
                variable_axes={"params": 0, "balance": 0, "cache": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=seg.repeats,
                unroll=unroll,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, auxes = scanned(cfg, unit, self.kv_cache, unroll < seg.repeats,
                               name=f"segment_{s}")(
                x, positions, segment_ids, token_ids,
                None if routed_experts is None else segment_routes(routes, seg))
            _scatter_aux(per_layer_aux, seg, auxes)
        return x, per_layer_aux

    def _pipelined(self, name, unit, x, rows, stages):
        """The scanned segment `name` run as pipeline stages (model/parallel/pipeline.py); its
        variables are read from this scope and applied by an unbound copy of the scan body.
        rows: (positions, segment_ids, token_ids), each [B, T] or None."""
        variables = {col: tree[name] for col, tree in nn.meta.unbox(self.variables).items()
                     if name in tree}
        group = BlockGroup(self.config, unit, parent=None)
        return pipeline_forward(lambda v, h, *r: group.apply(v, h, *r), variables, x, rows,
                                stage_plan(self.config, stages),
                                staged=("params",) if self.staged_pipeline else ())


def _scatter_aux(per_layer_aux: list, seg: Segment, auxes: tuple) -> None:
    """auxes[j] holds arrays stacked over repeats; layer start + r*period + j gets slice r."""
    for r in range(seg.repeats):
        for j in range(seg.period):
            per_layer_aux[seg.start + r * seg.period + j] = jax.tree.map(lambda a: a[r], auxes[j])
