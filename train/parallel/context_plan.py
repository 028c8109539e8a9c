"""What splitting each sequence over `mesh.context` costs a device in memory, per layer kind
(model/parallel/context.py, context_attention.py, context_compression.py): the terms the
memory planner adds for context parallelism.

With C context shards a device holds T / C of each row's tokens, so every per-token activation
term of the planner scales with `tokens_per_device`. On top of that, per layer while it runs
(and kept for the backward pass, as the inputs of the rematerialised attention blocks):
- F (full attention): K, V and segment ids all-gathered, [rows, T]; in the backward their
  float32 gradients, summed over the query blocks before they are scattered back; one query
  block's scores (`SCORES_PER_BLOCK`) instead of the whole rows' [T, T].
- S (sliding window): the halo, the W - 1 rows before each of the device's k chunks, of K, V
  and segment ids, and as many zero query rows in front of each chunk (their outputs dropped).
- W / C / H (DeepSeek-V4): the window halo of the shared KV entry; C and H also the
  compressor's halo (2m - 1 or m - 1 rows of its projections, gates in float32, and the rows'
  offsets, segments and positions), the all-gathered entries before and after selection
  (whole on every device, repeated per chunk for the attention) and, for C, the same for the
  lightning indexer's keys.
Bytes per device; `rows` is the micro-batch rows a device holds (the batch axes' share).
The activation estimate (activation_plan.py) counts the per-token terms on
`tokens_per_device`, each F / S layer's attention at `attention_lengths`, and adds
`context_activation_bytes`.
"""

from __future__ import annotations

from model.config import ModelConfig
from model.parallel.context import ContextLayout, context_layout
from model.parallel.context_attention import SCORES_PER_BLOCK
from train.config import RunConfig
from train.parallel.v4_activations import DTYPE_BYTES

INT = 4  # int32 token indices, segment ids, offsets, positions


def tokens_per_device(rows: int, seq_len: int, context: int) -> int:
    """Tokens of the micro-batch a device holds: its rows, T / C of each."""
    return rows * seq_len // context


def _gqa_terms(cfg: ModelConfig, kind: str, rows: int, seq_len: int,
               layout: ContextLayout) -> dict[str, int]:
    c = DTYPE_BYTES[cfg.compute_dtype]
    geo = cfg.attention_geometry(kind)
    kv_row = geo.num_kv_heads * (geo.head_dim + geo.v_head_dim)  # K and V channels per token
    if kind == "F":
        return {"gathered_kv": rows * seq_len * (kv_row * c + INT),
                "gathered_kv_grad": rows * seq_len * kv_row * 4,
                "score_block": 4 * SCORES_PER_BLOCK}
    halo = layout.halo(cfg.window - 1, seq_len)
    return {"halo": rows * layout.slots * halo * (kv_row * c + INT),
            "halo_queries": rows * layout.slots * halo * geo.num_heads * (geo.head_dim
                                                                   + geo.v_head_dim) * c}


def _compressor_terms(width: int, rate: int, overlap: bool, rows: int, seq_len: int,
                      layout: ContextLayout, c: int) -> dict[str, int]:
    """One KV compressor's halo and gathered entries (`context_compress`)."""
    projected = (2 if overlap else 1) * width
    halo = layout.halo((2 if overlap else 1) * rate - 1, seq_len)
    per_chunk = -(-(seq_len // layout.chunks) // rate)
    entry = width * c + 2 * INT  # value, last token, segment
    return {"halo": rows * layout.slots * halo * (projected * (c + 4) + 3 * INT),
            "gathered": rows * layout.chunks * per_chunk * entry,
            "selected": rows * (seq_len // rate) * entry,
            "per_chunk_copies": rows * layout.slots * (seq_len // rate) * width * c}


def _shared_kv_terms(cfg: ModelConfig, kind: str, rows: int, seq_len: int,
                     layout: ContextLayout) -> dict[str, int]:
    attn = cfg.shared_kv_attention
    c = DTYPE_BYTES[cfg.compute_dtype]
    halo = layout.halo(cfg.window - 1, seq_len)
    terms = {"halo": rows * layout.slots * halo * (attn.head_dim * c + INT)}
    parts = {"H": [("compressor", attn.head_dim, attn.hca_rate, False)],
             "C": [("compressor", attn.head_dim, attn.csa_rate, True),
                   ("indexer", attn.index_head_dim, attn.csa_rate, True)]}.get(kind, [])
    for name, width, rate, overlap in parts:
        for key, value in _compressor_terms(width, rate, overlap, rows, seq_len, layout,
                                            c).items():
            terms[f"{name}_{key}"] = value
    return terms


def context_layer_bytes(cfg: ModelConfig, seq_len: int, rows: int, context: int
                        ) -> dict[str, dict[str, int]]:
    """Per layer kind of `cfg` (its layout and MTP block): the bytes per device that context
    parallelism adds to one layer of that kind (module docstring), {kind: {term: bytes}}; empty
    terms for context = 1."""
    kinds = sorted(set(cfg.layout) | ({cfg.mtp.attention_type} if cfg.mtp.num_heads else set()))
    if context == 1:
        return {kind: {} for kind in kinds}
    layout = context_layout(cfg, context)
    out = {}
    for kind in kinds:
        terms = _gqa_terms if kind in "FS" else _shared_kv_terms
        out[kind] = terms(cfg, kind, rows, seq_len, layout)
    return out


# the terms that live only while one layer is differentiated; the others are kept per layer
WORKING_TERMS = ("gathered_kv_grad", "score_block")


def attention_lengths(cfg: ModelConfig, seq_len: int, context: int) -> dict[str, int]:
    """Per attention type of `cfg` (its layout and MTP block), the sequence length the
    planner's per-token attention terms (activation_plan.layer_bytes) see on a device: a
    sliding-window layer's core runs on [halo; chunk], a full layer keeps no scores per token
    (its query blocks are `score_block`), W / C / H layers see every gathered entry."""
    kinds = set(cfg.layout) | {cfg.mtp.attention_type}
    if context == 1:
        return dict.fromkeys(kinds, seq_len)
    layout = context_layout(cfg, context)
    window = seq_len // layout.chunks + layout.halo(cfg.window - 1, seq_len)
    return {kind: {"F": 0, "S": window}.get(kind, seq_len) for kind in kinds}


def context_activation_bytes(run: RunConfig, rows: int, context: int) -> dict[str, int]:
    """What context parallelism adds to a device's activations in `run`'s layers and trained
    MTP blocks: the kept terms summed over the layers, the working terms of the largest.
    Pipelined layers are counted as whole-batch ones."""
    if context == 1:
        return {}
    cfg = run.model
    attention_types = list(cfg.layout) + [cfg.mtp.attention_type] * run.trained_mtp_heads()
    terms = context_layer_bytes(cfg, run.train.seq_len, rows, context)
    kept = sum(v for kind in attention_types for k, v in terms[kind].items()
               if k not in WORKING_TERMS)
    working = max(sum(v for k, v in terms[kind].items() if k in WORKING_TERMS)
                  for kind in attention_types)
    return {"context_exchanged": kept, "context_working_set": working}
