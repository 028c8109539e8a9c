"""DeepSeek-V4 terms of the activation estimate: shared-KV attention layers W / C / H (their KV
compressors and CSA's lightning indexer), the chunked core attention's working set, and mHC
streams. The accounting and its symbols are in train/parallel/activation_plan.py's docstring;
these functions return bytes per token (matmul outputs M, other saved tensors O) or, for the
chunked working set, bytes per batch row.
"""

from __future__ import annotations

from model.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def tensor_split(n: int, ways: int) -> float:
    """n elements over `ways` tensor shards when they divide it, else replicated."""
    return n / ways if ways > 1 and n % ways == 0 else float(n)


def norm_bytes(c: int, width: int) -> float:
    """Per token of an RMSNorm over `width` channels (model/layers/norm.py): it keeps x * rsqrt
    and the weighted output in float32, and a float32 copy of its input when c < 4."""
    return (8 if c == 4 else 12) * width


def compressor_bytes(c: int, width: int, rate: int, overlap: bool) -> tuple[float, float]:
    """(M, O) per token of one KV compressor (model/ops/kv_compression.py) of `width`-channel
    entries, one per `rate` tokens; `overlap` for CSA's two series (projections of 2·width)."""
    out = 2 * width if overlap else width
    matmul = 2 * c * out  # kv_proj and gate_proj outputs
    # Every token sits in one pooled slot per channel: the gathered values in float32, the
    # softmax's exp and weights (softmax_pool); then the pooled, normed entries (float32).
    other = 12 * out + 16 * width / rate
    if overlap:  # the previous-block halves, masked at document starts: values, logits, masks
        other += 10 * width
    return matmul, other


def shared_kv_attention_bytes(cfg: ModelConfig, attention_type: str, seq_len: int,
                              tensor: int) -> tuple[float, float]:
    """(M, O) per token of the attention sublayer of a W, C or H layer
    (model/layers/shared_kv_attention.py), input norm included."""
    attn = cfg.shared_kv_attention
    c = DTYPE_BYTES[cfg.compute_dtype]
    d, hd, latent = cfg.d_model, attn.head_dim, attn.q_lora_rank
    q_heads = tensor_split(attn.num_heads, tensor) * hd  # query / output channels on the device
    matmul = c * (latent + q_heads + hd + d)  # q_a_proj, q_b_proj, kv_proj, o_b_proj
    # input norm, q_a_norm, kv_norm; the padded window keys, the roped query and the un-roped
    # output, the o_a_proj output (a batched dot: `dots` recomputes it); the per-head query
    # norm keeps a float32 copy beyond the q_b_proj output when c < 4.
    other = (norm_bytes(c, d + latent + hd) + (4 - c) * q_heads
             + c * (hd + 2 * q_heads + attn.o_groups * attn.o_lora_rank))
    parts = [(matmul, other)]
    if attention_type == "H":
        parts.append(compressor_bytes(c, hd, attn.hca_rate, overlap=False))
    if attention_type == "C":
        parts.append(compressor_bytes(c, hd, attn.csa_rate, overlap=True))
        parts.append(compressor_bytes(c, attn.index_head_dim, attn.csa_rate, overlap=True))
        # `index_heads` is not a sharded logical axis: the indexer is whole on every device.
        heads, queries = attn.index_heads, attn.index_heads * attn.index_head_dim
            # The indexer's query chunks are rematerialised (their scores are working set, see
        # `core_chunk_bytes`); saved: the float32 queries and head weights, and the
        # [index_topk] selection (indices, picks, scores) and indexer-loss arrays (target,
        # log-probabilities, masks): 7 x 4 bytes.
        parts.append((c * (queries + heads), 4 * (queries + heads) + 28 * attn.index_topk))
    return sum(m for m, _ in parts), sum(o for _, o in parts)


def core_chunk_bytes(cfg: ModelConfig, attention_type: str, seq_len: int, tensor: int) -> float:
    """Working set per batch row of the chunked core attention (model/ops/compressed_attention
    .py) while one query chunk is differentiated: its recomputed scores and their cotangents."""
    attn = cfg.shared_kv_attention
    c = DTYPE_BYTES[cfg.compute_dtype]
    chunk = min(max(cfg.window, attn.query_chunk), seq_len)
    dense = attention_type == "C" and attn.csa_attention == "dense"  # every visible entry
    compressed = {"W": 0, "C": seq_len // attn.csa_rate if dense else attn.index_topk,
                  "H": seq_len // attn.hca_rate}[attention_type]
    heads = tensor_split(attn.num_heads, tensor)
    scores = heads * (2 * chunk + compressed) * (4 + c)  # float32 logits, probabilities
    gathered = c * attn.index_topk * attn.head_dim if attention_type == "C" and not dense else 0
    core = 2 * chunk * (scores + gathered)  # CSA: each query's selected entries [k, head_dim]
    if attention_type != "C":
        return core
    # The indexer's chunk, recomputed in the backward: float32 scores and ReLU mask per
    # (query, indexer head, entry) and the visibility mask, forward and cotangent; the indexer
    # is whole on every device. The two chunks are differentiated one after the other.
    index_rows = min(attn.query_chunk, seq_len)
    indexer = 2 * index_rows * (seq_len // attn.csa_rate) * (5 * attn.index_heads + 1)
    # Dense: the attention's float32 probability of every entry for every query, the target of
    # the indexer's KL (model.ops.sparse_indexer.dense_indexer_terms), lives through the layer.
    target = 4 * seq_len * (seq_len // attn.csa_rate) if dense else 0
    return max(core, indexer) + target


def hyper_connection_bytes(cfg: ModelConfig) -> tuple[float, float]:
    """(M, O) per token of one layer's two mHC sublayer wrappings
    (model/layers/hyper_connections.py) with n = hc_mult > 1 streams."""
    hc, d = cfg.hyper_connections, cfg.d_model
    c, n = DTYPE_BYTES[cfg.compute_dtype], hc.hc_mult
    mixes = 4 * (2 + n) * n  # the mappings' float32 pre-activations (a plain dot)
    # the sublayer's input streams, a float32 copy of them when c < 4, their float32 RMS-normed
    # copy, the collapsed input, the sublayer output (post's gradient) and Sinkhorn's iterates:
    # the fori_loop keeps each step's two [n, n] matrices and four [n] sums, float32.
    copy = 4 if c < 4 else 0
    other = (c + copy + 4) * n * d + 2 * c * d + 8 * hc.sinkhorn_iters * n * (n + 2)
    return 2 * mixes, 2 * other
