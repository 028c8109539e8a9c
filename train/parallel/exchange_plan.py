"""The expert-parallel exchange's share of an MoE layer's working set, for the activation
estimate (train/parallel/memory_plan.py). model/parallel/expert_parallel.py sends each device's
routed copies to the experts' owners with a dropless receive buffer of ep * n * k rows (room for
every peer sending all its copies), for n tokens per device at a time: all of a layer's, or at
most `model.moe.ep_chunk_tokens` of them under `lax.map`, each chunk rematerialised in the
backward pass so that its rows and the experts' intermediates live one chunk at a time."""

from model.config import ModelConfig
from model.layers.layer_plan import LayerKind
from model.parallel.expert_parallel import exchange_chunk
from train.parallel.v4_activations import DTYPE_BYTES, tensor_split


def exchange_bytes(cfg: ModelConfig, kind: LayerKind, tokens: int, sizes: dict[str, int]
                   ) -> float:
    """Bytes to add to an MoE layer's working set 2 * tokens * (M + O), whose O counts k routed
    rows per token (layer input and output, gate/up/activation: 2D + 3F): the exchange holds
    ep * n * k such rows, forward and cotangent, instead of tokens * k. Negative when chunks
    hold fewer rows than the layer's tokens."""
    if not kind.is_moe or all(size == 1 for size in sizes.values()):
        return 0.0  # one device: no exchange, no chunks
    moe, c = cfg.moe, DTYPE_BYTES[cfg.compute_dtype]
    n = exchange_chunk(tokens, moe.ep_chunk_tokens)
    row = c * (2 * cfg.d_model + 3 * tensor_split(moe.expert_hidden, sizes["tensor"]))
    return 2 * moe.top_k * row * (sizes["expert"] * n - tokens)
