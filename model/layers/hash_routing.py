"""Hash routing for DeepSeek-V4's first MoE layers (report 2.1, after Roller et al., 2021):
which experts a token uses is a fixed function of its token id; how much each contributes is
still learned.

As in transformers' DeepseekV4HashRouter, the choice is a lookup in a frozen integer table
`tid2eid` [vocab, k] (a persistent buffer: checkpoint tensor `layers.{i}.ffn.gate.tid2eid`,
`model.layers.{i}.mlp.gate.tid2eid` in transformers' names; no loss-free bias in these layers),
while the combine weights come from the layer's router exactly as for top-k routing: the
affinity scores of the table's experts, renormalised and scaled by the routed scaling factor.
The report does not give the hash function; `random_hash_table` builds one for training from
scratch, a released checkpoint brings its own. A replayed choice (model/layers/router.py) has
nothing to replace here: the table decides, whatever parameters routed before.
"""

import jax
import jax.numpy as jnp

from model.config import MoEConfig
from model.layers.router import Routing, affinity_scores, combine_weights


@jax.named_scope("router")  # profile attribution (benchmarks/gpu/profiling.py)
def hash_route(token_ids: jax.Array, table: jax.Array, logits: jax.Array,
               cfg: MoEConfig) -> Routing:
    """token_ids: [N] int; table: tid2eid [vocab, k] int with k = cfg.top_k; logits: the
    router's x W_r [N, E] float32 -> Routing (indices [N, k] = table[token_ids]).

    The gradient reaches the logits through the weights and probs; the table is data.
    """
    if table.shape[-1] != cfg.top_k:
        raise ValueError(f"hash table has {table.shape[-1]} experts per token, "
                         f"top_k={cfg.top_k}")
    scores, probs = affinity_scores(logits, cfg.router_activation)
    indices = jnp.take(table, token_ids, axis=0).astype(jnp.int32)
    return Routing(indices, combine_weights(scores, indices, cfg), probs, indices)


def random_hash_table(key: jax.Array, vocab_size: int, num_experts: int,
                      top_k: int) -> jax.Array:
    """A tid2eid table of k distinct, uniformly random experts per token id: [vocab, k] int32
    (Roller et al.'s random hash; balanced over token ids, not over token frequencies)."""
    noise = jax.random.uniform(key, (vocab_size, num_experts))
    return jax.lax.top_k(noise, top_k)[1].astype(jnp.int32)
