"""Analytic forward FLOPs and KV-cache size of a model config at a given context length.

    python -m model.flops --config configs/step35_flash.yaml --context 65536 --mode decode [--json]

Counts matmuls only, one multiply-add = 2 FLOPs; norms, RoPE, softmax, activations, the
compressors' softmax pooling, the mHC stream sums and Sinkhorn, and the embedding lookup are
left out (elementwise work, small next to the matmuls). Batch size 1, one unpacked sequence.

Modes (context N >= 1):
- `decode`: one new token whose context holds N tokens including itself (query i = N-1).
- `prefill`: all N tokens of a prompt, logits at every position (the training/scoring forward,
  as `CausalLM.__call__` computes them), queries i = 0..N-1.
Query i attends to i+1 keys on full layers (F) and min(i+1, W) on sliding-window ones (S; W and
the window branch of C and H). DeepSeek-V4's compressed layers add entries (V4 report §2.3; a
block is visible from its last token on, as in the Hugging Face implementation: entry w iff
w < (i+1) // m): H all ⌊(i+1)/m'⌋ complete blocks of `hca_rate` m', C the top-k selected of the
⌊(i+1)/m⌋ blocks of `csa_rate` m, min(index_topk, ⌊(i+1)/m⌋), after the indexer has scored all
⌊(i+1)/m⌋ (all of them with `csa_attention: dense`, the indexer still scoring every one).
With these definitions prefill(N) = Σ_{c=1..N} decode(c), term by term.

Breakdown (FLOPs; backbone unless named `mtp`):
- attention_projections: F/S: q, k, v, o and the head-wise gate g (Step 3.5 report A.1 eq. 5);
  W/C/H (`shared_kv_attention`, V4 report §2.3.1): q_a [d, d_c], q_b [d_c, n_h c], the shared
  K=V entry kv [d, c], the grouped o_a (g groups of [n_h c / g, d_g]) and o_b [g d_g, d];
- attention_scores: QK^T and PV, 4 * query_heads * head_dim FLOPs per visible (query, key or
  compressed entry) pair;
- kv_compressor: C/H token projections kv and gate, [d, c] on H, [d, 2c] on C (two overlapping
  blocks, eqs. 9-10), per token;
- indexer_projections: C's lightning indexer per token (eqs. 13-15): its own compressor kv and
  gate [d, 2c^I], q_b [d_c, n_I c^I] (from the attention's query latent), weights [d, n_I];
- indexer_scores: q·K^I, 2 * n_I * c^I FLOPs per (query, compressed entry) pair it scores (the
  w-weighted sum over heads, 1/c^I of that, is left out);
- hyper_connections: mHC (`hc_mult` n > 1, V4 report §2.2 eqs. 3-5): the mapping [n d, (2+n) n]
  before each sublayer (2 per layer) and the final head collapse [n d, n], per token;
- ffn_dense: SwiGLU of the dense layers, 3 matrices of d_model x dense_hidden;
- moe_experts: the active experts only, top_k routed + the shared expert(s); hash-routed layers
  (V4 report §2.1) cost the same;
- router: d_model x num_experts logits per MoE layer (hash layers compute them for the gates);
- lm_head: d_model x vocab per position (tied or not);
- mtp: every MTP head (Step 3.5 report 2.2), as model/layers/mtp.py builds it: eh_proj
  (2 d_model -> d_model) + one `mtp.attention_type` block (S or W) with a dense FFN + its output
  head, without mHC; a `layer` block (DeepSeek-V4) has the MoE layer's active experts and
  router, e_proj once and h_proj per stream, and one layer's mHC plus its own head collapse.
  `total` includes it; set mtp.num_heads=0 for the backbone alone.

`kv_cache_bytes` at context N, in the compute dtype (bfloat16 = 2 bytes, float32 = 4):
- F/S: K and V of num_kv_heads * (head_dim + v_head_dim) values per entry; F layers hold N
  entries, S min(N, W);
- W/C/H: one shared K=V entry of c values per token in the window, min(N, W), plus ⌊N/m⌋
  compressed entries of c values (C, H) and ⌊N/m⌋ indexer keys of c^I values (C). The
  compressors' rows of blocks still being filled (at most 2m tokens, a size fixed in N) are
  left out.
The MTP blocks keep their own window caches and are included. The release stores W/C/H entries
in mixed precision instead (V4 report §2.3.4): BF16 RoPE dims and FP8 others (576 B per entry at
c = 512), FP4 indexer keys (64 B at c^I = 128); `kv_cache_bytes_v4_release` counts them so
(FP8/FP4 scale factors left out), F/S layers still in the compute dtype.
"""

import json
import sys
from typing import Sequence

from model.config import ModelConfig
from model.config.cli import config_parser, format_table, human, parse_config
from model.layers.common import dtype_of

MODES = ("prefill", "decode")
BREAKDOWN = ("attention_projections", "attention_scores", "kv_compressor", "indexer_projections",
             "indexer_scores", "hyper_connections", "ffn_dense", "moe_experts", "router",
             "lm_head", "mtp")
STORAGES = ("compute_dtype", "v4_release")


def visible_pairs(context: int, window: int | None) -> int:
    """Σ over queries i < context of the keys query i sees: i+1 (full, window None) or
    min(i+1, window) (sliding window)."""
    if window is None or context <= window:
        return context * (context + 1) // 2
    return window * (window + 1) // 2 + (context - window) * window


def compressed_pairs(context: int, rate: int, topk: int | None = None) -> int:
    """Σ over queries i < context of the compressed entries query i sees: the ⌊(i+1)/rate⌋
    complete blocks, at most `topk` of them when given."""
    def floor_sum(n: int) -> int:  # Σ_{c=1..n} ⌊c/rate⌋
        blocks, rest = divmod(n, rate)
        return rate * blocks * (blocks - 1) // 2 + blocks * (rest + 1)

    if topk is None or context < topk * rate:
        return floor_sum(context)
    return floor_sum(topk * rate - 1) + topk * (context - topk * rate + 1)


def attention_projection_flops(cfg: ModelConfig, attention_type: str) -> int:
    """Per token of an F/S layer: q [d, H*hd], k [d, KV*hd], v [d, KV*dv], o [H*dv, d], gate
    g [d, H] if head-wise."""
    geo, d = cfg.attention_geometry(attention_type), cfg.d_model
    weights = d * (geo.num_heads * (geo.head_dim + geo.v_head_dim)
                   + geo.num_kv_heads * (geo.head_dim + geo.v_head_dim))
    if geo.gate == "headwise":
        weights += d * geo.num_heads
    return 2 * weights


def attention_score_flops(cfg: ModelConfig, attention_type: str, pairs: int) -> int:
    """QK^T and PV over `pairs` visible (query, key) pairs, for every query head (GQA and the
    shared K=V entry share keys between heads, not the products)."""
    if attention_type in "FS":
        geo = cfg.attention_geometry(attention_type)
        return 2 * geo.num_heads * (geo.head_dim + geo.v_head_dim) * pairs
    heads, head_dim = cfg.shared_kv_attention.num_heads, cfg.shared_kv_attention.head_dim
    return 2 * 2 * heads * head_dim * pairs


def shared_kv_projection_flops(cfg: ModelConfig) -> int:
    """Per token of a W/C/H layer: q_a, q_b, kv, grouped o_a (g blocks of [n_h c / g, d_g]
    hold n_h c d_g weights) and o_b."""
    a, d = cfg.shared_kv_attention, cfg.d_model
    weights = (d * a.q_lora_rank + a.q_lora_rank * a.num_heads * a.head_dim + d * a.head_dim
               + a.num_heads * a.head_dim * a.o_lora_rank + a.o_groups * a.o_lora_rank * d)
    return 2 * weights


def compressor_flops(cfg: ModelConfig, attention_type: str) -> int:
    """Per token: kv and gate [d, c] of an H layer, [d, 2c] of a C layer."""
    width = cfg.shared_kv_attention.head_dim * (2 if attention_type == "C" else 1)
    return 2 * 2 * cfg.d_model * width


def indexer_projection_flops(cfg: ModelConfig) -> int:
    """Per token of a C layer: the indexer's kv and gate [d, 2c^I], q_b [d_c, n_I c^I] and the
    head weights [d, n_I]."""
    a, d = cfg.shared_kv_attention, cfg.d_model
    weights = (2 * d * 2 * a.index_head_dim + a.q_lora_rank * a.index_heads * a.index_head_dim
               + d * a.index_heads)
    return 2 * weights


def hyper_connection_flops(cfg: ModelConfig, layers: int | None = None) -> int:
    """Per token: the [n d, (2+n) n] mapping of both sublayers of `layers` layers (default
    every layer) and a head's [n d, n] collapse; 0 without mHC (n = 1)."""
    n, d = cfg.hyper_connections.hc_mult, cfg.d_model
    if n == 1:
        return 0
    layers = cfg.num_layers if layers is None else layers
    return 2 * (layers * 2 * n * d * (2 + n) * n + n * d * n)


def moe_layer_flops(cfg: ModelConfig) -> int:
    """Per token, one MoE layer: the active experts (top_k routed + the shared) and the router."""
    d, moe = cfg.d_model, cfg.moe
    return (moe.top_k * swiglu_flops(d, moe.expert_hidden)
            + moe.num_shared_experts * swiglu_flops(d, moe.shared_hidden)
            + 2 * d * moe.num_experts)


def swiglu_flops(d_model: int, hidden: int) -> int:
    """Per token: gate, up [d, hidden] and down [hidden, d]."""
    return 2 * 3 * d_model * hidden


def _window(cfg: ModelConfig, attention_type: str) -> int | None:
    return None if attention_type == "F" else cfg.window


def _compression(cfg: ModelConfig, attention_type: str) -> tuple[int, int | None] | None:
    """(rate, top-k or None: every visible entry) of a compressed layer; None for F/S/W."""
    a = cfg.shared_kv_attention
    top_k = None if a.csa_attention == "dense" else a.index_topk
    return {"C": (a.csa_rate, top_k), "H": (a.hca_rate, None)}.get(attention_type)


def pair_counts(cfg: ModelConfig, attention_type: str, context: int,
                mode: str) -> tuple[int, int]:
    """(attended pairs, indexer-scored pairs) of one layer: summed over queries 0..N-1
    (prefill) or of query N-1 alone (decode)."""
    window, compression = _window(cfg, attention_type), _compression(cfg, attention_type)
    if mode == "prefill":
        attended, scored = visible_pairs(context, window), 0
        if compression is not None:
            attended += compressed_pairs(context, *compression)
            scored = compressed_pairs(context, compression[0]) if attention_type == "C" else 0
        return attended, scored
    attended, scored = (context if window is None else min(context, window)), 0
    if compression is not None:
        rate, topk = compression
        attended += context // rate if topk is None else min(topk, context // rate)
        scored = context // rate if attention_type == "C" else 0
    return attended, scored


def layer_attention_flops(cfg: ModelConfig, attention_type: str, context: int,
                          mode: str) -> dict[str, int]:
    """FLOPs of one attention layer by breakdown key (the keys it has)."""
    tokens = 1 if mode == "decode" else context
    attended, scored = pair_counts(cfg, attention_type, context, mode)
    out = {"attention_scores": attention_score_flops(cfg, attention_type, attended)}
    if attention_type in "FS":
        out["attention_projections"] = tokens * attention_projection_flops(cfg, attention_type)
        return out
    out["attention_projections"] = tokens * shared_kv_projection_flops(cfg)
    if attention_type in "CH":
        out["kv_compressor"] = tokens * compressor_flops(cfg, attention_type)
    if attention_type == "C":
        a = cfg.shared_kv_attention
        out["indexer_projections"] = tokens * indexer_projection_flops(cfg)
        out["indexer_scores"] = 2 * a.index_heads * a.index_head_dim * scored
    return out


def _check(context: int, mode: str) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context: must be an integer >= 1, got {context!r}")
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}, allowed values are {list(MODES)}")


def forward_flops(cfg: ModelConfig, context: int, mode: str) -> dict:
    """-> {"total": int FLOPs, "breakdown": {BREAKDOWN key: int FLOPs}, "kv_cache_bytes": int,
    "kv_cache_bytes_v4_release": int, "context": N, "mode": mode}; see the module docstring
    for the definitions."""
    _check(context, mode)
    tokens = 1 if mode == "decode" else context
    d, moe = cfg.d_model, cfg.moe
    out = dict.fromkeys(BREAKDOWN, 0)
    for layer in range(cfg.num_layers):
        for key, flops in layer_attention_flops(cfg, cfg.attention_type(layer), context,
                                                mode).items():
            out[key] += flops
        if cfg.is_moe_layer(layer):
            out["router"] += tokens * 2 * d * moe.num_experts
            out["moe_experts"] += tokens * moe_layer_flops(cfg) - tokens * 2 * d * moe.num_experts
        else:
            out["ffn_dense"] += tokens * swiglu_flops(d, cfg.dense_hidden)
    out["hyper_connections"] = tokens * hyper_connection_flops(cfg)
    out["lm_head"] = tokens * 2 * d * cfg.vocab_size

    # MTP head (report 2.2): eh_proj [2d, d], one window block with a dense FFN, output head;
    # or DeepSeek-V4's: e_proj, h_proj per stream, an MoE layer with mHC, its head collapse.
    block = layer_attention_flops(cfg, cfg.mtp.attention_type, context, mode)
    if cfg.mtp.block == "layer":
        ffn = (1 + cfg.hyper_connections.hc_mult) * 2 * d * d + moe_layer_flops(cfg) + (
            hyper_connection_flops(cfg, layers=1))
    else:
        ffn = 2 * 2 * d * d + swiglu_flops(d, cfg.dense_hidden)
    per_head = tokens * (ffn + 2 * d * cfg.vocab_size) + sum(block.values())
    out["mtp"] = cfg.mtp.num_heads * per_head
    return {"total": sum(out.values()), "breakdown": out,
            "kv_cache_bytes": kv_cache_bytes(cfg, context),
            "kv_cache_bytes_v4_release": kv_cache_bytes(cfg, context, "v4_release"),
            "context": context, "mode": mode}


def kv_cache_bytes(cfg: ModelConfig, context: int, storage: str = "compute_dtype") -> int:
    """Bytes of the KV caches after `context` tokens (batch 1), MTP blocks included; `storage`
    `v4_release` stores W/C/H entries as the release does (module docstring)."""
    if storage not in STORAGES:
        raise ValueError(f"storage: got {storage!r}, allowed values are {list(STORAGES)}")
    itemsize = dtype_of(cfg.compute_dtype).itemsize
    a = cfg.shared_kv_attention
    if storage == "v4_release":  # 2-byte RoPE dims, 1-byte others; FP4 keys, 2 per byte
        entry_bytes = 2 * a.rope_dims + (a.head_dim - a.rope_dims)
        index_key_bytes = (a.index_head_dim + 1) // 2
    else:
        entry_bytes, index_key_bytes = a.head_dim * itemsize, a.index_head_dim * itemsize
    total = 0
    for attention_type in list(cfg.layout) + [cfg.mtp.attention_type] * cfg.mtp.num_heads:
        window = _window(cfg, attention_type)
        entries = context if window is None else min(context, window)
        if attention_type in "FS":
            geo = cfg.attention_geometry(attention_type)
            total += entries * geo.num_kv_heads * (geo.head_dim + geo.v_head_dim) * itemsize
            continue
        compression = _compression(cfg, attention_type)
        blocks = 0 if compression is None else context // compression[0]
        total += (entries + blocks) * entry_bytes
        if attention_type == "C":
            total += blocks * index_key_bytes
    return total


def render(result: dict) -> str:
    """Readable table: FLOPs per breakdown entry with its share, then total and KV cache."""
    total = result["total"]
    rows = [[name, f"{flops:,}", human(flops, "FLOP"), f"{100 * flops / total:.1f}%"]
            for name, flops in result["breakdown"].items()]
    rows.append(["total", f"{total:,}", human(total, "FLOP"), "100.0%"])
    title = f"{result['mode']} at context {result['context']:,}"
    kv, released = result["kv_cache_bytes"], result["kv_cache_bytes_v4_release"]
    lines = [title, format_table(["component", "FLOPs", "≈", "share"], rows), "",
             f"KV cache: {kv:,} bytes ({human(kv, 'B')}) in the compute dtype"]
    if released != kv:
        lines.append(f"KV cache as DeepSeek-V4 stores it (FP8 + BF16 RoPE dims, FP4 indexer "
                     f"keys): {released:,} bytes ({human(released, 'B')})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = config_parser("model.flops", __doc__)
    parser.add_argument("--context", type=int, required=True, metavar="N",
                        help="context length in tokens (>= 1)")
    parser.add_argument("--mode", required=True, choices=MODES)
    args, cfg = parse_config(parser, argv)
    try:
        result = forward_flops(cfg, args.context, args.mode)
    except ValueError as err:
        parser.error(str(err))
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
