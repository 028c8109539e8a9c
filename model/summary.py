"""Parameter counts of a model config, from shapes only (`jax.eval_shape`, nothing allocated).

    python -m model.summary --config configs/step35_flash.yaml [key=value ...] [--json]

Definitions (report Table 6 conventions):
- `total` / `active`: the backbone = token embeddings + decoder layers + final norm + output
  head (`lm_head`). MTP heads are NOT included; they are reported separately as `mtp` and added
  in `with_mtp` (Table 6: "backbone" 196B / 11B vs "with MTP3" 198B / 13B).
- `active`: parameters used per token. Routed experts count `top_k / num_experts` of their
  parameters; everything else (attention, dense FFNs, shared experts, router, norms,
  embeddings, heads) counts fully.
- `*_excl_embeddings`: without the embedding matrix and the main output head. This is how
  Table 6 counts (≈196B total, ≈11B active).
- `mtp`: all MTP heads (eh_proj, norms, one dense SWA block and the head's own output layer,
  ≈0.81B each for Step 3.5 Flash); every MTP parameter is active for every token, except the
  routed experts of a `layer` block (DeepSeek-V4), which count as the backbone's do.
- `with_mtp`: the four counts above plus `mtp` (each head's output layer is kept in the
  excl-embeddings counts too, as Table 6's 198B / 13B do).
- `breakdown`: {group: {total, active}} over the groups embeddings, attention (q/k/v/o/g
  projections, sink logits), dense_ffn, moe_routed, moe_shared, router, norms (layer, q/k and
  final norms), lm_head, mtp, other (anything not in these groups). The groups sum to
  `with_mtp`.
The `balance` collection (the router's loss-free bias) is state, not parameters: not counted.
"""

import json
import math
import sys
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from model.config import ModelConfig
from model.config.cli import config_parser, format_table, human, parse_config
from model.lm import CausalLM

GROUPS = ("embeddings", "attention", "dense_ffn", "moe_routed", "moe_shared", "router", "norms",
          "hyper_connections", "lm_head", "mtp", "other")
_ATTENTION_PARAMS = {"q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "sink",
                     "self_attn"}  # every DeepSeek-V4 attention param sits under self_attn
_NORMS = {"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm"}
_HYPER_CONNECTIONS = {"attn_hc", "ffn_hc", "hc_head"}
_EXCLUDED_FROM_EXCL_EMBEDDINGS = ("embeddings", "lm_head")


def param_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flattened param path -> shape of `CausalLM(cfg).init`, traced abstractly (no memory).

    Scanned segments carry their leading `layers` axis, so sizes include every repeat.
    """
    # Any length gives the same shapes; T > mtp.num_heads keeps every MTP token shift in range.
    tokens = jax.ShapeDtypeStruct((1, cfg.mtp.num_heads + 1), jnp.int32)
    variables = jax.eval_shape(CausalLM(cfg).init, jax.random.key(0), tokens)
    params = nn.meta.unbox(variables["params"])
    return {path: tuple(leaf.shape) for path, leaf in flatten_dict(params).items()}


def param_group(path: tuple[str, ...]) -> str:
    """Group (one of GROUPS) of a flattened param path such as ('layers', 'segment_2',
    'block_0', 'moe', 'gate_proj')."""
    if path[0].startswith("mtp_"):
        return "mtp"
    if path[0] == "embed_tokens":
        return "embeddings"
    if path[0] == "lm_head":
        return "lm_head"
    names = set(path)
    if names & _HYPER_CONNECTIONS:
        return "hyper_connections"
    if names & _NORMS:
        return "norms"
    if "moe" in names:
        if "shared_expert" in names:
            return "moe_shared"
        return "router" if path[-1] == "router" else "moe_routed"
    if "mlp" in names:
        return "dense_ffn"
    if names & _ATTENTION_PARAMS:
        return "attention"
    return "other"


def count_params(cfg: ModelConfig, shapes: dict | None = None) -> dict:
    """Parameter counts of `cfg` (see the module docstring for every key). All values are ints.
    `shapes`: `param_shapes(cfg)` when the caller has them already."""
    breakdown = {group: {"total": 0, "active": 0} for group in GROUPS}
    for path, shape in (param_shapes(cfg) if shapes is None else shapes).items():
        group, size = param_group(path), math.prod(shape)
        breakdown[group]["total"] += size
        # Each routed-expert leaf has an [E] expert axis, so its size is a multiple of E.
        # (an MTP head's routed experts too: `mtp.block: layer`)
        routed = "moe_routed" in (group, param_group(path[1:]) if group == "mtp" else None)
        breakdown[group]["active"] += (size * cfg.moe.top_k // cfg.moe.num_experts
                                       if routed else size)

    def summed(kind: str, skip: Sequence[str]) -> int:
        return sum(v[kind] for g, v in breakdown.items() if g not in skip)

    backbone = {
        "total": summed("total", ["mtp"]),
        "active": summed("active", ["mtp"]),
        "total_excl_embeddings": summed("total", ["mtp", *_EXCLUDED_FROM_EXCL_EMBEDDINGS]),
        "active_excl_embeddings": summed("active", ["mtp", *_EXCLUDED_FROM_EXCL_EMBEDDINGS]),
    }
    mtp = breakdown["mtp"]
    return {**backbone, "mtp": mtp["total"], "mtp_active": mtp["active"],
            "with_mtp": {k: v + mtp["active" if k.startswith("active") else "total"]
                         for k, v in backbone.items()},
            "breakdown": breakdown}


def render(counts: dict, cfg: ModelConfig) -> str:
    """Readable table: per-group counts, then the headline totals."""
    def row(name, total, active):
        return [name, f"{total:,}", human(total), f"{active:,}", human(active)]

    rows = [row(g, v["total"], v["active"]) for g, v in counts["breakdown"].items() if v["total"]]
    table = format_table(["group", "total", "≈", "active", "≈"], rows)
    heads = cfg.mtp.num_heads
    totals = [
        row("backbone", counts["total"], counts["active"]),
        row("backbone excl. embeddings/head", counts["total_excl_embeddings"],
            counts["active_excl_embeddings"]),
        row(f"MTP ({heads} head{'s' * (heads != 1)})", counts["mtp"], counts["mtp_active"]),
        row("with MTP", counts["with_mtp"]["total"], counts["with_mtp"]["active"]),
        row("with MTP excl. embeddings/head", counts["with_mtp"]["total_excl_embeddings"],
            counts["with_mtp"]["active_excl_embeddings"]),
    ]
    return table + "\n\n" + format_table(["summary", "total", "≈", "active", "≈"], totals)


def main(argv: Sequence[str] | None = None) -> int:
    parser = config_parser("model.summary", __doc__)
    args, cfg = parse_config(parser, argv)
    counts = count_params(cfg)
    print(json.dumps(counts, indent=2) if args.json else render(counts, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
