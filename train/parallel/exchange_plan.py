"""The expert-parallel exchange's share of an MoE layer's activations, for the activation estimate
(train/parallel/activation_plan.py).

model/parallel/expert_parallel.py sends each device's routed copies to the experts' owners and
computes on a dropless receive buffer with room for every peer sending all its copies: e =
mesh.expert times the k = top_k routed rows per token. With `model.moe.ep_chunk_tokens` a device
exchanges its n tokens in chunks of `exchange_chunk(n, ep_chunk_tokens)` under `lax.map`, each
chunk rematerialised in the backward pass: the routed rows, the experts' intermediates and the
exchange buffers live one chunk at a time and none of them is saved for the backward pass (the
chunks' inputs are the layer's dispatched rows, counted with the layer).
"""

from model.config import ModelConfig
from model.layers.layer_plan import LayerKind
from model.parallel.expert_parallel import exchange_chunk, resolve_collective
from train.parallel.v4_activations import DTYPE_BYTES, tensor_split


def exchange_tokens(cfg: ModelConfig, tokens: int, sizes: dict[str, int]) -> int:
    """Tokens per exchange of a device holding `tokens` on a mesh of `sizes` (one device routes
    all its tokens at once, unchunked)."""
    if all(size == 1 for size in sizes.values()):
        return tokens
    return exchange_chunk(tokens, cfg.moe.ep_chunk_tokens)


def routed_rows_bytes(cfg: ModelConfig, kind: LayerKind, tensor: int, expert: int) -> float:
    """Bytes per token of an MoE layer's routed rows on the receive buffer: e * k rows of the
    layer input and output, gate, up and activation (2D + 3He/t)."""
    if not kind.is_moe:
        return 0.0
    moe = cfg.moe
    return (DTYPE_BYTES[cfg.compute_dtype] * moe.top_k * expert
            * (2 * cfg.d_model + 3 * tensor_split(moe.expert_hidden, tensor)))


def routed_kernel_bytes(cfg: ModelConfig, kind: LayerKind, tensor: int, expert: int) -> float:
    """Bytes per token of the routed experts' named kernel outputs (gate/up pre-activations and
    outputs on the receive buffer) that `dots_with_kernels` keeps."""
    if not kind.is_moe:
        return 0.0
    moe = cfg.moe
    return (DTYPE_BYTES[cfg.compute_dtype] * moe.top_k * expert
            * (2 * tensor_split(moe.expert_hidden, tensor) + cfg.d_model))


def exchange_bytes(cfg: ModelConfig, kind: LayerKind, expert: int) -> float:
    """Bytes per exchanged token of an MoE layer's expert-parallel exchange while it runs (its
    backward exchanges cotangents the same way, not at the same time): `padded` sends and
    receives [peers, copies, D] both ways, `ragged` lands the copies in one receive buffer."""
    if not kind.is_moe or expert == 1:
        return 0.0
    buffers = {"padded": 4, "ragged": 1}[resolve_collective(cfg.ep_collective)]
    return buffers * expert * cfg.moe.top_k * DTYPE_BYTES[cfg.compute_dtype] * cfg.d_model
