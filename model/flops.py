"""Analytic forward FLOPs and KV-cache size of a model config at a given context length.

    python -m model.flops --config configs/step35_flash.yaml --context 65536 --mode decode [--json]

Counts matmuls only, one multiply-add = 2 FLOPs; norms, RoPE, softmax, activations and the
embedding lookup are left out (elementwise work, small next to the matmuls). Batch size 1, one
unpacked sequence.

Modes (context N >= 1):
- `decode`: one new token whose context holds N tokens including itself: it attends to N keys
  on full layers and min(N, W) on SWA layers (window W: query i sees keys i-W < j <= i).
- `prefill`: all N tokens of a prompt, logits at every position (the training/scoring forward,
  as `CausalLM.__call__` computes them). Attention counts exactly the visible keys per query:
  query i sees i+1 keys on full layers and min(i+1, W) on SWA layers.
With these definitions prefill(N) = Σ_{c=1..N} decode(c), term by term.

Breakdown (FLOPs; backbone unless named `mtp`):
- attention_projections: q, k, v, o and the head-wise gate g (report A.1 eq. 5) per layer;
- attention_scores: QK^T and PV, 4 * query_heads * head_dim FLOPs per visible (query, key);
- ffn_dense: SwiGLU of the dense layers, 3 matrices of d_model x dense_hidden;
- moe_experts: the active experts only, top_k routed + the shared expert(s);
- router: d_model x num_experts logits per MoE layer;
- lm_head: d_model x vocab per position (tied or not);
- mtp: every MTP head (report 2.2): eh_proj (2 d_model -> d_model) + one SWA block with a dense
  FFN + its output head. `total` includes it; set mtp.num_heads=0 for the backbone alone.

`kv_cache_bytes` at context N: K and V of num_kv_heads * head_dim values per entry in the
compute dtype (bfloat16 = 2 bytes, float32 = 4); full layers hold N entries, SWA layers
min(N, W). The SWA blocks of the MTP heads keep their own caches and are included.
"""

import json
import sys
from typing import Sequence

from model.config import ModelConfig
from model.config.cli import config_parser, format_table, human, parse_config
from model.layers.common import dtype_of

MODES = ("prefill", "decode")
BREAKDOWN = ("attention_projections", "attention_scores", "ffn_dense", "moe_experts", "router",
             "lm_head", "mtp")


def visible_pairs(context: int, window: int | None) -> int:
    """Σ over queries i < context of the keys query i sees: i+1 (full, window None) or
    min(i+1, window) (sliding window)."""
    if window is None or context <= window:
        return context * (context + 1) // 2
    return window * (window + 1) // 2 + (context - window) * window


def attention_projection_flops(cfg: ModelConfig, attention_type: str) -> int:
    """Per token: q [d, H*hd], k and v [d, KV*hd], o [H*hd, d], gate g [d, H] if head-wise."""
    heads, d = cfg.attention_config(attention_type).num_heads, cfg.d_model
    weights = 2 * d * heads * cfg.head_dim + 2 * d * cfg.num_kv_heads * cfg.head_dim
    if cfg.gate == "headwise":
        weights += d * heads
    return 2 * weights


def attention_score_flops(cfg: ModelConfig, attention_type: str, pairs: int) -> int:
    """QK^T and PV over `pairs` visible (query, key) pairs, for every query head (GQA shares
    K/V between heads, not the products)."""
    return 2 * 2 * cfg.attention_config(attention_type).num_heads * cfg.head_dim * pairs


def swiglu_flops(d_model: int, hidden: int) -> int:
    """Per token: gate, up [d, hidden] and down [hidden, d]."""
    return 2 * 3 * d_model * hidden


def _window(cfg: ModelConfig, attention_type: str) -> int | None:
    return cfg.window if attention_type == "S" else None


def _check(context: int, mode: str) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context: must be an integer >= 1, got {context!r}")
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}, allowed values are {list(MODES)}")


def forward_flops(cfg: ModelConfig, context: int, mode: str) -> dict:
    """-> {"total": int FLOPs, "breakdown": {BREAKDOWN key: int FLOPs}, "kv_cache_bytes": int,
    "context": N, "mode": mode}; see the module docstring for the definitions."""
    _check(context, mode)
    tokens = 1 if mode == "decode" else context

    def pairs(attention_type: str) -> int:
        window = _window(cfg, attention_type)
        if mode == "prefill":
            return visible_pairs(context, window)
        return context if window is None else min(context, window)

    def attention(attention_type: str) -> tuple[int, int]:
        return (tokens * attention_projection_flops(cfg, attention_type),
                attention_score_flops(cfg, attention_type, pairs(attention_type)))

    d, moe = cfg.d_model, cfg.moe
    out = dict.fromkeys(BREAKDOWN, 0)
    for layer in range(cfg.num_layers):
        projections, scores = attention(cfg.attention_type(layer))
        out["attention_projections"] += projections
        out["attention_scores"] += scores
        if cfg.is_moe_layer(layer):
            out["moe_experts"] += tokens * (
                moe.top_k * swiglu_flops(d, moe.expert_hidden)
                + moe.num_shared_experts * swiglu_flops(d, moe.shared_hidden))
            out["router"] += tokens * 2 * d * moe.num_experts
        else:
            out["ffn_dense"] += tokens * swiglu_flops(d, cfg.dense_hidden)
    out["lm_head"] = tokens * 2 * d * cfg.vocab_size

    # MTP head (report 2.2): eh_proj [2d, d], one SWA block with a dense FFN, output head.
    projections, scores = attention("S")
    per_head = (tokens * (2 * 2 * d * d + swiglu_flops(d, cfg.dense_hidden)
                          + 2 * d * cfg.vocab_size) + projections + scores)
    out["mtp"] = cfg.mtp.num_heads * per_head
    return {"total": sum(out.values()), "breakdown": out,
            "kv_cache_bytes": kv_cache_bytes(cfg, context), "context": context, "mode": mode}


def kv_cache_bytes(cfg: ModelConfig, context: int) -> int:
    """Bytes of the K and V caches after `context` tokens (batch 1), MTP SWA blocks included."""
    layer_types = list(cfg.layout) + ["S"] * cfg.mtp.num_heads
    entries = sum(context if _window(cfg, t) is None else min(context, cfg.window)
                  for t in layer_types)
    entry_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_of(cfg.compute_dtype).itemsize
    return entries * entry_bytes


def render(result: dict) -> str:
    """Readable table: FLOPs per breakdown entry with its share, then total and KV cache."""
    total = result["total"]
    rows = [[name, f"{flops:,}", human(flops, "FLOP"), f"{100 * flops / total:.1f}%"]
            for name, flops in result["breakdown"].items()]
    rows.append(["total", f"{total:,}", human(total, "FLOP"), "100.0%"])
    title = f"{result['mode']} at context {result['context']:,}"
    kv = result["kv_cache_bytes"]
    return (f"{title}\n" + format_table(["component", "FLOPs", "≈", "share"], rows)
            + f"\n\nKV cache: {kv:,} bytes ({human(kv, 'B')})")


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
