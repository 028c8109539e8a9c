"""Mixture-of-Experts FFN (report 2.2, Table 6; docs/architecture.md, "Exact semantics"):
float32 router with a loss-free balancing bias, top-k routed SwiGLU experts (dropless) plus an
always-on shared expert.

The bias lives in the non-trainable `balance` collection (variable `router_bias`, [E]); the
training loop updates it outside the gradient (b_e += u * sign(mean_load - load_e)).
Hash-routed layers (DeepSeek-V4 report 2.1) have no bias; their token -> experts table
`tid2eid` [vocab, k] int32 sits in the same non-trainable collection.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers.common import dtype_of, normal_init
from model.layers.ffn import SwiGLU
from model.layers.hash_routing import hash_route, random_hash_table
from model.layers.router import (
    choices_differ,
    expert_load,
    route,
    routing_confidence,
    sequence_balance_loss,
)
from model.ops.moe_dispatch import ExpertWeights, combine_copies, finalize_statistics
from model.ops.mx_quant import fake_mxfp4_weight
from model.ops.swiglu import SwiGLUClamp
from model.ops.tables import MOE
from model.parallel.expert_parallel import expert_parallel_experts
from model.parallel.context import splits_sequences
from model.parallel.mesh import mesh_size


EXPERT_WEIGHT_FORMATS = {"none": lambda weight: weight, "mxfp4": fake_mxfp4_weight}


def routed_experts(x, indices, combine_weights, weights: ExpertWeights, *, clamp: SwiGLUClamp,
                   impl: str, block_size: int):
    """x: [N, D]; indices/combine_weights: [N, k] -> (y [N, D], per-expert stats dict of [E])."""
    with jax.named_scope("experts"):  # profile attribution (benchmarks/gpu/profiling.py)
        copy_out, sums = MOE.resolve(impl)(x, indices, weights, clamp, block_size)
    with jax.named_scope("dispatch"):
        y = combine_copies(copy_out, combine_weights, x.dtype)
    return y, finalize_statistics(sums, weights.gate.shape[-1])



def _flat_tokens(x: jax.Array, time_major: bool) -> jax.Array:
    """[B, T, ...] -> [B·T, ...], row-major or (time_major) over [T, B]."""
    if time_major:
        x = jnp.swapaxes(x, 0, 1)
    return x.reshape(-1, *x.shape[2:])


def _token_rows(x: jax.Array, batch: int, length: int, time_major: bool) -> jax.Array:
    """Inverse of `_flat_tokens`: [B·T, ...] -> [B, T, ...]."""
    if time_major:
        return jnp.swapaxes(x.reshape(length, batch, *x.shape[1:]), 0, 1)
    return x.reshape(batch, length, *x.shape[1:])


# the aux entries of a MoE layer with a value per token ([B, T, ...]; the rest are per expert)
PER_TOKEN_AUX = ("routed_experts", "routing_confidence", "replay_mismatch")


class MoE(nn.Module):
    """x: [B, T, d_model] -> ([B, T, d_model], aux dict).

    aux (per layer): `expert_load` f_e [E], `expert_prob` p_e [E] (with gradient: the EP-group
    balance loss of eq. 1 is formed from f and p by `model.lm.collect_aux`, after pipeline
    micro-batches are merged), `routing_confidence` Σk [B, T], `routed_experts` [B, T, k] int32
    (the experts each token went to), and the per-expert statistics of
    `moe_dispatch.finalize_statistics`. With `replayed_experts` given (a replayed choice,
    model/layers/router.py) also `replay_mismatch` [B, T] float32: 1 where the router's own
    top-k differs from the replayed experts (0 on hash-routed layers and unrecorded tokens).
    """

    config: ModelConfig
    limit: float = 0.0  # routed experts' SwiGLU clamp
    shared_limit: float = 0.0
    is_hash: bool = False  # experts chosen by token id (needs `token_ids`)

    @nn.compact
    def __call__(self, x, token_ids=None, replayed_experts=None, valid=None):
        """x [B, T, d_model]; token_ids [B, T] int (hash-routed layers only); replayed_experts
        [B, T, k] int: experts to route to instead of the router's top-k (a token with a
        negative entry keeps its own; ignored by hash-routed layers, whose table decides);
        valid [B, T] bool: the tokens that are not padding (the sequence-wise loss counts
        those; None: all)."""
        cfg, moe = self.config, self.config.moe
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        batch, length, d_model = x.shape
        # Tokens in one list, time-major under `mesh.context` (T split over shards, B over the
        # batch axes: merging [T, B] keeps each device's tokens in place, [B, T] would not).
        time_major = splits_sequences(self)
        flat = functools.partial(_flat_tokens, time_major=time_major)
        rows = functools.partial(_token_rows, batch=batch, length=length, time_major=time_major)
        tokens = flat(x)

        router_kernel = self.param(
            "router", normal_init(cfg.init_std, ("embed", "expert")),
            (d_model, moe.num_experts), param_dtype,
        )
        with jax.named_scope("router"):
            logits = tokens.astype(jnp.float32) @ router_kernel.astype(jnp.float32)
        if self.is_hash:
            if token_ids is None:
                raise ValueError("a hash-routed MoE layer needs the token ids")
            table = self.variable(
                "balance", "tid2eid",
                lambda: nn.with_logical_partitioning(random_hash_table, ("vocab", "top_k"))(
                    self.make_rng("params"), cfg.vocab_size, moe.num_experts, moe.top_k),
            ).value
            routing = hash_route(flat(token_ids), table, logits, moe)
        else:
            bias = None
            if moe.router_bias:
                bias = self.variable(
                    "balance", "router_bias",
                    lambda: nn.with_logical_partitioning(
                        jnp.zeros, ("expert",))((moe.num_experts,), jnp.float32),
                ).value
            replayed = (None if replayed_experts is None
                        else flat(replayed_experts))
            routing = route(logits, bias, moe, replayed)

        def expert_param(name, shape, axes):
            # FP4 QAT (DeepSeek-V4 report §3.4): the float32 master as the experts compute with
            # it, at the expert matmuls' input
            weight = self.param(name, normal_init(cfg.init_std, axes), shape, param_dtype)
            return EXPERT_WEIGHT_FORMATS[cfg.qat.expert_weights](weight).astype(dtype)

        e, f = moe.num_experts, moe.expert_hidden
        weights = ExpertWeights(
            gate=expert_param("gate_proj", (e, d_model, f), ("expert", "embed", "expert_mlp")),
            up=expert_param("up_proj", (e, d_model, f), ("expert", "embed", "expert_mlp")),
            down=expert_param("down_proj", (e, f, d_model), ("expert", "expert_mlp", "embed")),
        )
        options = dict(clamp=SwiGLUClamp(self.limit, cfg.swiglu_gate_clamp), impl=cfg.moe_impl,
                       block_size=moe.block_size)
        # Under a mesh, per-shard dispatch (report 3.2: experts live on their EP rank; also
        # keeps the sort per device and lets XLA run the Pallas kernels unpartitioned).
        if mesh_size() > 1:
            y, stats = expert_parallel_experts(tokens.astype(dtype), routing.indices,
                                               routing.weights, weights,
                                               collective=cfg.ep_collective,
                                               chunk=moe.ep_chunk_tokens, **options)
        else:
            y, stats = routed_experts(tokens.astype(dtype), routing.indices, routing.weights,
                                      weights, **options)
        y = rows(y)
        if moe.num_shared_experts:
            y = y + SwiGLU(cfg, moe.shared_hidden * moe.num_shared_experts, self.shared_limit,
                           name="shared_expert")(x)

        load = expert_load(routing.indices, moe.num_experts)
        mean_probs = jnp.mean(routing.probs, axis=0)
        aux = {
            "expert_load": load,
            "expert_prob": mean_probs,
            "routing_confidence": jax.lax.stop_gradient(
                rows(routing_confidence(routing.probs, routing.indices))
            ),
            "routed_experts": rows(routing.indices),
            # DeepSeek-V4's sequence-wise balance loss (report 2.1); a fixed hash choice has
            # nothing to balance.
            "sequence_balance_loss": (jnp.zeros((), jnp.float32) if self.is_hash else
                                      sequence_balance_loss(
                                          rows(routing.probs), rows(routing.indices), valid)),
            **stats,
        }
        if replayed_experts is not None:  # (an unrecorded token's own choice is its choice)
            mismatch = choices_differ(routing.own_choice, routing.indices)
            aux["replay_mismatch"] = rows(mismatch.astype(jnp.float32))
        return y, aux
