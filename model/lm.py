"""`CausalLM`: embeddings -> layer stack -> final norm -> LM head, plus the MTP heads.

    lm = CausalLM(cfg)
    variables = init_variables(lm, key)              # boxed {"params": ..., "balance": ...}
    params, balance = split_variables(nn.meta.unbox(variables))
    out = lm.apply(variables, tokens, segment_ids=None, positions=None)
    out.logits [B, T, V]; out.mtp_logits: one [B, T, V] per MTP head; out.aux: dict

With `compute_logits=False` no [B, T, V] array is formed: `out.hidden` / `out.mtp_hidden` hold
the normalised hidden states and `lm.apply(variables, h, method=CausalLM.project, head=i)`
maps any chunk of them to logits (the training loss does this chunk by chunk).
"""

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.inference.kv_cache import KVCacheSpec
from model.layers.common import dtype_of, normal_init
from model.layers.hyper_connections import HyperHead, expand_embeddings
from model.layers.moe import PER_TOKEN_AUX
from model.layers.mtp import MTPHead, reads_streams, shift_tokens_left
from model.layers.norm import RMSNorm
from model.layers.projection import Projection
from model.layers.router import ep_group_balance_loss
from model.layers.stack import LayerStack
from model.ops.kv_compression import document_offsets
from model.parallel.context import context_layout, from_layout, splits_sequences, to_layout
from model.parallel.mesh import mesh_axis_size


class LMOutput(flax.struct.PyTreeNode):
    logits: jax.Array | None  # [B, T, V] float32, or None with compute_logits=False
    mtp_logits: tuple  # MTP head h: [B, T, V] predicting token t + 1 + h
    aux: dict  # see CausalLM.__call__
    hidden: jax.Array  # final-normed hidden states [B, T, D]
    mtp_hidden: tuple  # per MTP head, normed [B, T, D]


# the MoE balance losses, each summed over the layers with learned routing and the MTP blocks
BALANCE_LOSSES = ("balance_loss", "sequence_balance_loss")
# per-layer aux of the attention
ATTENTION_AUX = frozenset({"gate_mean", "indexer_loss", "indexer_recall_hits",
                           "indexer_recall_slots"})


def learned_routing_mean(cfg: ModelConfig, per_layer: jax.Array) -> jax.Array:
    """Per-MoE-layer values [L_moe, ...] (as `aux["moe"]` stacks them) -> their mean over the
    layers whose routing is learned, not hashed [...] (0 without such layers)."""
    learned = [n for n, i in enumerate(cfg.moe_layer_indices()) if not cfg.is_hash_layer(i)]
    if not learned:
        return jnp.zeros(per_layer.shape[1:], jnp.float32)
    return jnp.mean(per_layer[jnp.asarray(learned)], axis=0)


def balance_groups(cfg: ModelConfig) -> int:
    """G of eq. 1: the real expert-parallel groups under a mesh with an `expert` axis, else
    `moe.num_ep_groups` (the EP degree a single-device run stands in for)."""
    ep = mesh_axis_size("expert")
    return ep if ep > 1 else cfg.moe.num_ep_groups


def stack_moe_aux(cfg: ModelConfig, layers: list[dict]) -> dict[str, jax.Array]:
    """The aux dicts of MoE layers (backbone layers or MTP blocks) -> their MoE entries stacked
    over the layers [L, ...], with each layer's EP-group `balance_loss` (eq. 1)."""
    keys = sorted(layers[0].keys() - ATTENTION_AUX)
    moe = {k: jnp.stack([layer[k] for layer in layers]) for k in keys}
    moe["balance_loss"] = jax.vmap(ep_group_balance_loss, (0, 0, None))(
        moe["expert_load"], moe["expert_prob"], balance_groups(cfg))
    return moe


def collect_aux(cfg: ModelConfig, per_layer: list[dict]) -> dict[str, Any]:
    """Stacks per-layer aux into: `moe` (dict of [L_moe, ...] arrays, including the per-layer
    `balance_loss` of eq. 1 and the `routed_experts` [L_moe, B, T, k] each layer used),
    `balance_loss` and `sequence_balance_loss` (DeepSeek-V4's), each the SUM over the MoE layers
    with learned routing (scalars with gradient), `attention_gate_mean` (tuple of [H] per layer,
    headwise), `indexer_loss` (mean over the CSA layers) and, where CSA attends densely,
    `indexer_recall`: the share of the indexer's top-k among the dense attention's top-k, over
    the queries that see more than k entries (NaN: none does).

    Balance losses are summed over layers, as DeepSeek's reference attaches each MoE layer's
    alpha * L_bal to that layer's output (`AddAuxiliaryLoss` in its Hugging Face modeling code,
    the same in Megatron-Core's per-layer `MoEAuxLossAutoScaler`): the coefficient is per layer,
    and a balanced model's loss is the number of such layers. Hash-routed layers choose by token
    id, so neither loss acts on them (it would only push their router probabilities around)."""
    aux: dict[str, Any] = {}
    moe_layers = cfg.moe_layer_indices()
    if moe_layers:
        aux["moe"] = moe = stack_moe_aux(cfg, [per_layer[i] for i in moe_layers])
        learned = jnp.asarray([not cfg.is_hash_layer(i) for i in moe_layers], jnp.float32)
        for key in BALANCE_LOSSES:
            aux[key] = jnp.sum(moe[key] * learned)
    if any("gate_mean" in layer for layer in per_layer):
        # None for the layers without a head-wise gate (DeepSeek-V4's W / C / H, or a type
        # whose own `gate` is another)
        aux["attention_gate_mean"] = tuple(layer.get("gate_mean") for layer in per_layer)
    csa = [layer["indexer_loss"] for layer in per_layer if "indexer_loss" in layer]
    if csa:
        aux["indexer_loss"] = jnp.mean(jnp.stack(csa))
    dense = [layer for layer in per_layer if "indexer_recall_hits" in layer]
    if dense:  # CSA attending densely: the indexer's top-k recall, pooled over the layers
        hits, slots = (sum(layer[k] for layer in dense)
                       for k in ("indexer_recall_hits", "indexer_recall_slots"))
        aux["indexer_recall"] = jnp.where(slots > 0, hits / jnp.maximum(slots, 1.0), jnp.nan)
    return aux


class CausalLM(nn.Module):
    """`kv_cache` set: the same network with KV caches for incremental decoding, driven
    through `decode_chunk` / `mtp_chunk` (model/inference/decode.py); params are unchanged.
    `staged_pipeline`: under a pipeline mesh axis, the pipelined segment's params are given
    already in their stage layout [S, V, k, ...] (model/parallel/pipeline.py `stage_layout`;
    the train step's copy of the params), not as the stored [R, ...] stacks."""

    config: ModelConfig
    kv_cache: KVCacheSpec | None = None
    staged_pipeline: bool = False

    def setup(self):
        cfg = self.config
        dtype, param_dtype = dtype_of(cfg.compute_dtype), dtype_of(cfg.param_dtype)
        self.embed_tokens = nn.Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
            embedding_init=normal_init(cfg.init_std, ("vocab", "embed")))
        self.layers = LayerStack(cfg, self.kv_cache, self.staged_pipeline)
        hc = cfg.hyper_connections
        if hc.hc_mult > 1:
            self.hc_head = HyperHead(hc_eps=hc.eps, norm_eps=cfg.norm_eps, init_std=cfg.init_std,
                                     param_dtype=param_dtype)
        self.norm = RMSNorm(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                            axis_name="embed")
        if not cfg.tie_embeddings:
            self.lm_head = Projection((cfg.vocab_size,), ("embed", "vocab"), 1, cfg.init_std,
                                      dtype, param_dtype)
        self.mtp = [MTPHead(cfg, self.kv_cache) for _ in range(cfg.mtp.num_heads)]

    def __call__(self, tokens, segment_ids=None, positions=None, *, compute_logits=True,
                 num_mtp_heads=None, routed_experts=None) -> LMOutput:
        """tokens: [B, T] int. `segment_ids` [B, T] (packed documents; attention never crosses
        them) and `positions` [B, T] (default: per-document positions from segment_ids, else
        0..T-1). `num_mtp_heads` runs only the first n MTP heads (default: all).
        `routed_experts` [L_moe, B, T, k] int: the experts of every MoE layer (in layer order)
        to use instead of the routers' top-k, e.g. the `aux["moe"]["routed_experts"]` of
        another forward; a token whose entries are negative keeps its own choice
        (model/layers/router.py, "Replayed routing")."""
        if positions is None:
            positions = (document_offsets(segment_ids) if segment_ids is not None else
                         jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
        # Under `mesh.context` the rows run in the context layout's order
        # (model/parallel/context.py); inputs and outputs are in natural order.
        layout = context_layout(self.config, None if splits_sequences(self) else 1)
        ordered = lambda x, axis=1: None if x is None else to_layout(x, layout, axis)  # noqa: E731
        natural = lambda x, axis=1: from_layout(x, layout, axis)  # noqa: E731
        positions, rows_segments = ordered(positions), ordered(segment_ids)
        x, h_prev, per_layer_aux = self.backbone(ordered(tokens), positions, rows_segments,
                                                 ordered(routed_experts, 2))
        hidden = self.norm(x)

        mtp_hidden, mtp_aux = [], []
        heads = len(self.mtp) if num_mtp_heads is None else num_mtp_heads
        for offset, head in enumerate(self.mtp[:heads], start=1):
            # the shift is in natural order: x_{t+h} may sit on another context shard
            next_embeddings = self.embed_tokens(ordered(shift_tokens_left(tokens, offset)))
            h_prev, aux = head(h_prev, next_embeddings, positions, rows_segments)
            mtp_hidden.append(natural(head.head_norm(h_prev)))
            mtp_aux.append(aux)
        hidden = natural(hidden)

        logits = mtp_logits = None
        if compute_logits:
            logits = self.project(hidden)
            mtp_logits = tuple(self.project(h, head=i + 1) for i, h in enumerate(mtp_hidden))
        aux = collect_aux(self.config, per_layer_aux)
        if mtp_aux and self.config.mtp.block == "layer":  # their MoE's statistics, [heads, ...]
            # An MTP block's MoE adds both balance losses as a backbone layer does (the V4
            # report is silent; Megatron-Core's MTP layers attach their routers' losses alike).
            aux["mtp_moe"] = moe = stack_moe_aux(self.config, mtp_aux)
            for key in BALANCE_LOSSES:
                aux[key] = aux.get(key, jnp.zeros((), jnp.float32)) + jnp.sum(moe[key])
        for group in ("moe", "mtp_moe"):
            for key in PER_TOKEN_AUX:
                if key in aux.get(group, {}):
                    aux[group][key] = natural(aux[group][key], 2)
        return LMOutput(logits=logits, mtp_logits=mtp_logits or (), aux=aux, hidden=hidden,
                        mtp_hidden=tuple(mtp_hidden))

    def decode_chunk(self, tokens, positions):
        """The backbone on a chunk of new tokens, reading and extending the `cache` collection.

        tokens, positions: [B, T] (absolute positions, -1 = padding) -> (normed hidden
        [B, T, D] for `project`, the h_prev of MTP head 1 (pre-norm hidden [B, T, D], or the mHC
        streams [B, T, n, D] for `layer` MTP blocks), the experts each MoE layer routed the
        tokens to [L_moe, B, T, k] int32 or None without MoE layers)."""
        x, h_prev, per_layer_aux = self.backbone(tokens, positions, None)
        moe_layers = self.config.moe_layer_indices()
        routed = (jnp.stack([per_layer_aux[i]["routed_experts"] for i in moe_layers])
                  if moe_layers else None)
        return self.norm(x), h_prev, routed

    def backbone(self, tokens, positions, segment_ids, routed_experts=None):
        """Embeddings and the layer stack: tokens [B, T] -> (pre-norm hidden [B, T, D], the
        MTP heads' h_prev (that, or the streams before the collapse: `mtp.reads_streams`),
        per-layer aux). With mHC the embedding enters every stream and `hc_head` collapses the
        streams at the top (DeepSeek-V4 report 2.2)."""
        x = nn.with_logical_constraint(self.embed_tokens(tokens), ("batch", "length", "act_embed"))
        multiple = self.config.hyper_connections.hc_mult > 1
        if multiple:
            x = expand_embeddings(x, self.config.hyper_connections.hc_mult)
        streams, per_layer_aux = self.layers(x, positions, segment_ids, tokens, routed_experts)
        x = self.hc_head(streams) if multiple else streams
        return x, (streams if reads_streams(self.config) else x), per_layer_aux

    def mtp_chunk(self, head: int, h_prev, tokens, positions):
        """MTP head `head` (1-based) on a chunk with its cache: h_prev (depth head-1, as
        `decode_chunk` gives it), tokens [B, T] = x_{t+head}, positions [B, T] -> (normed
        [B, T, D], this depth's h_prev)."""
        mtp = self.mtp[head - 1]
        h, _ = mtp(h_prev, self.embed_tokens(tokens), positions, None)
        return mtp.head_norm(h), h

    def project(self, normed_hidden, head: int = 0):
        """Logits in float32 from normed hidden states [..., D] -> [..., V]. head 0 = main LM
        head, head h >= 1 = MTP head h (its own output layer unless `mtp.share_output_head`)."""
        if head > 0 and not self.config.mtp.share_output_head:
            out = self.mtp[head - 1].own_logits(normed_hidden)
        elif self.config.tie_embeddings:
            out = self.embed_tokens.attend(normed_hidden)
        else:
            out = self.lm_head(normed_hidden)
        return out.astype(jnp.float32)


def output_head_params(config: ModelConfig, params: dict, head: int = 0) -> dict:
    """The part of `params` that `CausalLM.project(..., head)` reads: apply `project` with
    `{"params": output_head_params(...)}` to differentiate the loss in the head alone."""
    if head > 0 and not config.mtp.share_output_head:
        name = f"mtp_{head - 1}"
        return {name: {"output_head": params[name]["output_head"]}}
    name = "embed_tokens" if config.tie_embeddings else "lm_head"
    return {name: params[name]}


def init_variables(module: nn.Module, key: jax.Array) -> dict:
    """Boxed (logical axes kept) variables of `module.init` on a dummy [1, 8] token batch:
    `CausalLM` or a module wrapping it with the same inputs; no variable's shape depends on
    the batch or the length.

    Jitted: run eagerly, every op of the dummy forward pass (each scan, map and loop body) is
    compiled on its own, which on CPU took twice as long as compiling the whole init at once."""
    return jax.jit(module.init)(key, jnp.zeros((1, 8), jnp.int32))


@functools.lru_cache(maxsize=8)
def abstract_variables(config: ModelConfig) -> dict:
    """Boxed ShapeDtypeStructs of `init_variables(CausalLM(config), ...)` (nothing allocated)."""
    return jax.eval_shape(lambda: init_variables(CausalLM(config), jax.random.key(0)))


def join_variables(params: Any, balance: Any) -> dict:
    """The `apply` variables {"params", "balance"}; `balance` (the router biases) is left out
    when empty, as for a model without router bias."""
    return {"params": params, "balance": balance} if balance else {"params": params}


def split_variables(variables: dict) -> tuple[Any, Any]:
    """(params, balance) of unboxed variables; balance is {} when the model has none."""
    return variables["params"], variables.get("balance", {})
