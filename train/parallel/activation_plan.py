"""The activation estimate of `python -m train.plan` (train/parallel/memory_plan.py holds the
state rows and the plan): bytes per device of what the train step keeps for its backward pass
and the working set of the layer it differentiates.

Activation estimate. T = train.seq_len, c = bytes of model.compute_dtype, D = d_model,
t = mesh.tensor (divides head/FFN-sized tensors when it divides the head count / hidden size).
Tokens per device N = micro_batch * T / (data * fsdp * expert * pipeline * context) (rows split
over the batch axes, `pipeline` too outside the pipelined segment, each row's tokens over
`context`; rows rounded up, with a warning, when they do not split). With mesh.context > 1 the
attention terms see the lengths of train/parallel/context_plan.py `attention_lengths`, and its
`context_activation_bytes` (gathered K/V, halos, compressed entries) join the parts. Per
token, each decoder layer has
  projections   M = c * [(H*hd + 2*KV*hd + G)/t + D]                          (q, k, v, gate, o)
                  + c * [2*F/t + D]  or  4*E + c * Ns*(2*Hs/t + D)              (dense SwiGLU, or
                                                                  MoE router + shared experts)
  other tensors O = c * [2*D + 2*H*hd/t] + 4*H/t + KV/t*keys (xla)            (norms, residual,
                  + c * [2*D + F/t]                                       core out, log-sum-exp,
                    or 4*E + c * [3*D + k*e*(2*D + 3*He/t) + Ns*Hs/t]     the xla core's bool
                    mask; SwiGLU act; MoE: router probabilities, top-k dispatched rows, routed
                    gate/up/act/out on e = mesh.expert times the rows under expert parallelism:
                    its receive buffer has room for every peer's copies, dropless)
  (G = H with the head-wise gate; E experts, k = top_k, He/Hs routed/shared hidden, Ns shared
  experts, F dense hidden.) M holds the outputs of the unbatched matmuls, which the `dots`
  policy saves; routed-expert products (ragged/batched dots) it recomputes. Attention scores
  are never saved (every core recomputes its probabilities from the log-sum-exp); keys =
  2*max(W, 128) on sliding-window layers when that is < T, else the causal blocks' share of T
  (5/8 T with the 4 blocks of model/ops/attention_cores.py).
  While a layer runs it also holds (working set only) its attention scores, S = H/t * keys *
  (4 + c) with attention_impl=xla (float32 scores and probabilities; 0 for the flash kernels of
  the other cores), and with e > 1 the expert exchange, X = c*k*e*D*(4 with the `padded`
  collective: send and receive buffers of both exchanges; 1 with `ragged`: its landing buffer).
  The exchange runs n = exchange_chunk(N, model.moe.ep_chunk_tokens) tokens at a time, each
  chunk rematerialised (train/parallel/exchange_plan.py): X and the routed rows r =
  c*k*e*(2*D + 3*He/t) of O count for n tokens in the working set, and with n < N the routed
  rows (and their kernel outputs in K) are not saved.
DeepSeek-V4 layers W / C / H (train/parallel/v4_activations.py) replace the attention terms;
the FFN terms stay. Hq = H*hd/t query channels on the device (`heads` shards over tensor; the
latent, output-group, compressor and indexer widths do not), L = q_lora_rank, G*R = o_groups
* o_lora_rank, nrm(w) = 8*w (12*w when c < 4: an RMSNorm keeps float32 copies):
  W:  M = c * [L + Hq + hd + D]                                (q_a, q_b, kv, o_b projections)
      O = nrm(D + L + hd) + (4 - c)*Hq + c * [hd + 2*Hq + G*R]     (norms, float32 q for its
                       norm; window keys, roped query, un-roped output, o_a (a batched dot))
  H:  W + cmp(hd, hca_rate)        C:  W + cmp(hd, csa_rate, overlapped) + the indexer:
      cmp(Id, csa_rate, overlapped), M += c*(Hi*Id + Hi) (queries, head weights), O += 4*(Hi*Id
      + Hi) + T/csa_rate * (5*Hi + 1) + 28*k (every query chunk's float32 scores, ReLU and
      visibility masks: the indexer's lax.map is not rematerialised; the [k = index_topk]
      selection and indexer-loss arrays). Hi, Id: index heads, head dim.
  cmp(w, m), u = w (2w overlapped) channels: M = 2*c*u (kv, gate), O = 12*u + 16*w/m (+ 10*w
      overlapped): float32 gathered values, softmax exp and weights, pooled entries.
  The core attention runs query chunks of C = min(max(window, query_chunk), T) rows, each
  rematerialised in the backward (jax.checkpoint inside lax.map): only its inputs above are
  saved, and while a layer is differentiated one chunk adds, per batch row,
  chunk = 2*C*[H/t*(2C + e)*(4 + c) + c*k*hd (C only)]   (e = 0 W, k C, T/hca_rate H
  compressed entries; float32 logits, probabilities; CSA's gathered selected entries).
mHC with n = hc_mult > 1 streams adds per layer (two sublayers; MTP blocks have one stream)
  M += 2 * 4*(2+n)*n                                          (mapping pre-activations)
  O += 2 * [(c + f + 4)*n*D + 2*c*D + 8*iters*n*(n+2)]  (streams, their float32 copy: f = 4
         when c < 4 else 0, their float32 normed copy, collapsed input, sublayer output,
         Sinkhorn's iterates)
and the layer input I below is the streams, n*c*D (else I = c*D).
What a layer keeps for the backward pass depends on model.remat_policy:
  none -> M + O;  dots -> I + M (the layer input and the projection outputs);
  dots_with_kernels -> I + M + K, K = c*H*Dv/t + 4*H/t (attention core output, float32
  log-sum-exp; F / S layers) + c*k*e*(2*He/t + D) (routed gate/up pre-activations, outputs);
  save_attention_out / save_ffn_out -> I + c*D;  full -> I (the layer input only).
Activations = N * sum over the device's layers of that
            + max(max over layers of N*2*(M + O - r + S)  (the working set: the layer
                    + n*(2*r + X) + rows * chunk,   being differentiated, its recomputed
                  2 * min(loss_chunk_size, micro_batch*T) * V/t * 4)  forward and cotangents,
                                            or one float32 logits chunk and its gradient, which
                                            the loss forms before the layers' backward pass)
            + N * 2*c*D                               (embeddings, final hidden;
              + N * n*D*(c + 4) with mHC               final streams, HyperHead's normed copy)
            + N * per trained MTP head (6*c*D + what its dense SWA block keeps under the
              policy, rematerialised like a layer; its 2*(M + O) joins the working sets)
With mesh.pipeline = S > 1 the pipelined segment (model/parallel/pipeline.py: R repeats in
S x V chunks of k = ceil(R / (S V)) slots, V virtual stages) runs on each device as k V slots,
each for one micro-batch of Np = micro_batch * T / (m * data * fsdp * expert) tokens per tick
over the V m + S - 1 ticks of the schedule (bubble ticks included; m = pipeline micro-batches).
A segment layer's working set counts Np tokens. With model.pipeline_stage_remat (default) a
tick saves only its stage input, (V m + S - 1) * Np * I, and the backward recomputes one
chunk's k * period layers at a time, adding Np * k * period * (the most a segment layer keeps)
to the working set; without it every tick keeps its slots' saved activations, k (V m + S - 1)
/ R * Np * (what the layer keeps) per segment layer. The pipeline's queue and stage buffer add
2 * m * Np * I.

Checked against XLA (`python -m train.plan --measure`, docs/parallelism.md "Checking the
estimate against XLA"): within 25% of the compiled step's peak on 8 host devices for the tiny
preset at d_model 256 on data, fsdp, expert and pipeline meshes, every remat policy and both
pipeline schedules (tests/train/test_plan_measure.py compiles seven of those cases). On much
shallower models, where one layer's working set outweighs what all layers keep, it overshoots.
"""

from __future__ import annotations

import numpy as np

from model.config import SHARED_KV_KINDS, ModelConfig
from model.layers.layer_plan import LayerKind, layer_kinds, plan_segments
from model.ops.attention_cores import CAUSAL_BLOCKS, MIN_CHUNK
from model.parallel.pipeline import pipelined_segment, stage_plan
from train.config import RunConfig
from train.data.packing import DTYPES, FEATURES
from train.parallel import context_plan
from train.parallel.exchange_plan import (
    exchange_bytes,
    exchange_tokens,
    routed_kernel_bytes,
    routed_rows_bytes,
)
from train.parallel.sharding import row_shards
from train.parallel.v4_activations import (
    DTYPE_BYTES,
    core_chunk_bytes,
    hyper_connection_bytes,
    shared_kv_attention_bytes,
    tensor_split,
)

BATCH_BYTES_PER_TOKEN = sum(np.dtype(DTYPES[k]).itemsize for k in FEATURES)


def _keys(cfg: ModelConfig, attention_type: str, seq_len: int) -> float:
    """Keys a query's scores span in the `xla` core (model/ops/attention_cores.py): two chunks
    of max(window, 128) on sliding-window layers, the causal blocks' share of T on full ones."""
    chunk = max(cfg.window, MIN_CHUNK)
    if attention_type == "S" and chunk < seq_len:
        return 2 * chunk
    blocks = max(1, min(CAUSAL_BLOCKS, seq_len // MIN_CHUNK))
    return seq_len * (blocks + 1) / (2 * blocks)


def _gqa_attention_bytes(cfg: ModelConfig, attention_type: str, seq_len: int,
                         tensor: int) -> tuple[float, float]:
    """(M, O) per token of the attention sublayer of an F or S layer, input norm included."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    geo, d = cfg.attention_geometry(attention_type), cfg.d_model
    heads, kv, hd, dv = geo.num_heads, geo.num_kv_heads, geo.head_dim, geo.v_head_dim
    h = tensor_split(heads, tensor) / heads  # share of the heads on this device
    gate = heads if geo.gate == "headwise" else 0
    matmul = c * ((heads * hd + kv * (hd + dv) + gate) * h + d)
    # norms, residual, the core's output and float32 log-sum-exp (the cores recompute their
    # probabilities in the backward pass); the xla core also its boolean [T, keys] mask
    other = c * (2 * d + heads * (hd + dv) * h) + 4 * heads * h
    if cfg.attention_impl == "xla":
        other += kv * h * _keys(cfg, attention_type, seq_len)
    return matmul, other


def scores_bytes(cfg: ModelConfig, kind: LayerKind, seq_len: int, tensor: int) -> float:
    """Bytes per token of an F / S layer's attention scores while it runs (float32 scores and
    probabilities of the `xla` core, recomputed in the backward pass, never saved; the flash
    kernels of the other cores keep them in on-chip tiles)."""
    if kind.attention_type in SHARED_KV_KINDS or cfg.attention_impl != "xla":
        return 0.0
    heads = tensor_split(cfg.attention_geometry(kind.attention_type).num_heads, tensor)
    return heads * _keys(cfg, kind.attention_type, seq_len) * (4 + DTYPE_BYTES[cfg.compute_dtype])


def layer_bytes(cfg: ModelConfig, kind: LayerKind, seq_len: int, tensor: int,
                streams: bool = True, expert: int = 1) -> tuple[float, float]:
    """(matmul outputs M, other saved tensors O) of one decoder layer, bytes per token (see the
    module docstring). `streams=False`: a block outside the mHC streams (the MTP heads');
    `expert`: the mesh's expert-parallel size."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    d = cfg.d_model
    if kind.attention_type in SHARED_KV_KINDS:
        matmul, other = shared_kv_attention_bytes(cfg, kind.attention_type, seq_len, tensor)
    else:
        matmul, other = _gqa_attention_bytes(cfg, kind.attention_type, seq_len, tensor)
    if kind.is_moe:
        moe = cfg.moe
        shared = moe.num_shared_experts
        shared_hidden = tensor_split(moe.shared_hidden, tensor)
        # Routed-expert products are ragged/batched dots, which the `dots` policy recomputes:
        # they count as "other", with the dispatched rows, activations and combine.
        matmul += 4 * moe.num_experts + c * shared * (2 * shared_hidden + d)
        # Expert parallelism computes on a receive buffer with room for every peer's copies
        # (dropless, the worst case): `expert` times the routed rows.
        other += (4 * moe.num_experts + c * (3 * d + shared * shared_hidden)
                  + routed_rows_bytes(cfg, kind, tensor, expert))
    else:
        matmul += c * (2 * tensor_split(cfg.dense_hidden, tensor) + d)
        other += c * (2 * d + tensor_split(cfg.dense_hidden, tensor))
    if streams and cfg.hyper_connections.hc_mult > 1:
        hc_matmul, hc_other = hyper_connection_bytes(cfg)
        matmul, other = matmul + hc_matmul, other + hc_other
    return matmul, other


def chunk_working_bytes(cfg: ModelConfig, kind: LayerKind, seq_len: int, tensor: int) -> float:
    """Bytes per batch row of a layer's chunked attention working set beyond 2 * (M + O): the
    DeepSeek-V4 core attention's query chunk (F / S layers count their scores in O)."""
    if kind.attention_type in SHARED_KV_KINDS:
        return core_chunk_bytes(cfg, kind.attention_type, seq_len, tensor)
    return 0.0


def kernel_output_bytes(cfg: ModelConfig, kind: LayerKind, tensor: int,
                        expert: int = 1) -> float:
    """Bytes per token of the named kernel outputs of a layer (pallas_kernels/saved_names.py)
    that `dots_with_kernels` keeps beyond `dots`: the attention core's output and float32
    log-sum-exp (F / S layers) and the routed experts' gate/up pre-activations and outputs
    (on `expert` times the copies under expert parallelism: its receive buffer)."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    saved = 0.0
    if kind.attention_type not in SHARED_KV_KINDS:
        geo = cfg.attention_geometry(kind.attention_type)
        heads = tensor_split(geo.num_heads, tensor)
        saved += heads * (c * geo.v_head_dim + 4)
    return saved + routed_kernel_bytes(cfg, kind, tensor, expert)


def saved_per_layer(policy: str, matmul: float, other: float, input_bytes: float,
                    d_bytes: float, kernel_bytes: float) -> float:
    """Bytes per token a layer keeps for the backward pass under remat `policy`; `input_bytes`
    of the layer input (c*D, or c*n*D for n mHC streams), `d_bytes` of a sublayer output,
    `kernel_bytes` of its named kernel outputs (`kernel_output_bytes`)."""
    if policy == "none":
        return matmul + other
    if policy == "dots":
        return input_bytes + matmul
    if policy == "dots_with_kernels":
        return input_bytes + matmul + kernel_bytes
    if policy in ("save_attention_out", "save_ffn_out"):
        return input_bytes + d_bytes
    return input_bytes  # full


def _layer_terms(cfg: ModelConfig, kind: LayerKind, seq_len: int, length: int,
                 sizes: dict[str, int], rows: int, input_bytes: float) -> tuple[float, float]:
    """(bytes per token kept for the backward pass, working set while differentiated) of one
    layer run on `rows` batch rows of the device at a time (T / mesh.context of each), whose
    attention sees `length` (context_plan.attention_lengths)."""
    tensor, expert = sizes["tensor"], sizes["expert"]
    tokens = context_plan.tokens_per_device(rows, seq_len, sizes.get("context", 1))
    matmul, other = layer_bytes(cfg, kind, length, tensor, expert=expert)
    kernels = kernel_output_bytes(cfg, kind, tensor, expert)
    routed = routed_rows_bytes(cfg, kind, tensor, expert)
    n = exchange_tokens(cfg, tokens, sizes) if kind.is_moe else tokens
    if n < tokens:  # chunks rematerialised one at a time: their routed rows are never saved
        kept_other = other - routed
        kernels -= routed_kernel_bytes(cfg, kind, tensor, expert)
    else:
        kept_other = other
    keep = saved_per_layer(cfg.remat_policy, matmul, kept_other, input_bytes,
                           DTYPE_BYTES[cfg.compute_dtype] * cfg.d_model, kernels)
    # its recomputed forward and cotangents; the routed rows and exchange buffers of one chunk
    working = (tokens * 2 * (matmul + other - routed + scores_bytes(cfg, kind, length, tensor))
               + n * (2 * routed + exchange_bytes(cfg, kind, expert))
               + rows * chunk_working_bytes(cfg, kind, seq_len, tensor))
    return keep, working


def activation_bytes(run: RunConfig, sizes: dict[str, int]) -> dict:
    """Activation estimate per device (module docstring), with its parts."""
    cfg, train = run.model, run.train
    seq_len, micro = train.seq_len, train.micro_batch()
    tensor, stages = sizes["tensor"], sizes["pipeline"]
    ways = row_shards(sizes)
    rows = -(-micro // (ways * stages))  # outside the pipelined segment rows split over all
    context = sizes.get("context", 1)
    tokens = context_plan.tokens_per_device(rows, seq_len, context)
    c = DTYPE_BYTES[cfg.compute_dtype]
    d_bytes = c * cfg.d_model
    streams = cfg.hyper_connections.hc_mult
    input_bytes = streams * d_bytes  # a layer's input: the residual, or the n mHC streams
    lengths = context_plan.attention_lengths(cfg, seq_len, context)
    terms: dict[tuple[LayerKind, int], tuple[float, float]] = {}

    def layer_terms(kind: LayerKind, layer_rows: int) -> tuple[float, float]:
        """`_layer_terms`, once per kind and rows: every layer of a kind costs the same."""
        if (kind, layer_rows) not in terms:
            terms[kind, layer_rows] = _layer_terms(cfg, kind, seq_len,
                                                   lengths[kind.attention_type], sizes,
                                                   layer_rows, input_bytes)
        return terms[kind, layer_rows]

    kinds = layer_kinds(cfg)
    piped_layers: set[int] = set()
    if stages > 1:
        piped_layers = set(plan_segments(kinds)[pipelined_segment(cfg, stages)].layers)
        plan = stage_plan(cfg, stages)
        # one pipeline micro-batch on a device: M of them make the rows of one stage's devices
        piped_rows = -(-micro // (plan.microbatches * ways))
        piped_tokens = context_plan.tokens_per_device(piped_rows, seq_len, context)
        ticks = plan.virtual * plan.microbatches + stages - 1
        chunk_layers = plan.slots * len(piped_layers) // plan.repeats  # k slots x period
    saved = working = piped_keep = 0.0
    for i, kind in enumerate(kinds):
        if i in piped_layers:  # one micro-batch at a time
            keep, differentiated = layer_terms(kind, piped_rows)
            piped_keep = max(piped_keep, keep)
            if not plan.remat:  # every tick's k slots keep their layers' saved residuals
                saved += piped_tokens * keep * plan.slots * ticks / plan.repeats
        else:
            keep, differentiated = layer_terms(kind, rows)
            saved += tokens * keep
        working = max(working, differentiated)
    if piped_layers and plan.remat:
        # a tick saves its stage input; the backward recomputes one chunk's layers at a time
        saved += ticks * piped_tokens * input_bytes
        working += piped_tokens * chunk_layers * piped_keep
    # embeddings and final hidden, the pipeline's queue and stage buffer; mHC: the final
    # streams, their float32 normed copy (HyperHead)
    extras = tokens * 2 * d_bytes
    if stages > 1:
        extras += 2 * plan.microbatches * piped_tokens * input_bytes
    if streams > 1:
        extras += tokens * streams * cfg.d_model * (c + 4)
    mtp_kind = LayerKind(cfg.mtp.attention_type, False, 0.0, 0.0, False)
    mtp_length = lengths[mtp_kind.attention_type]
    mtp_matmul, mtp_other = layer_bytes(cfg, mtp_kind, mtp_length, tensor, streams=False)
    mtp_keep = saved_per_layer(cfg.remat_policy, mtp_matmul, mtp_other, d_bytes, d_bytes,
                               kernel_output_bytes(cfg, mtp_kind, tensor))
    heads = run.trained_mtp_heads()
    mtp = heads * tokens * (6 * d_bytes + mtp_keep)  # the block rematerialised like a layer
    if heads:
        working = max(working, tokens * 2 * (mtp_matmul + mtp_other + scores_bytes(
            cfg, mtp_kind, mtp_length, tensor)))
    chunk = min(train.loss_chunk_size, micro * seq_len)
    logits = 2 * chunk * tensor_split(cfg.vocab_size, tensor) * 4
    # the step's batch: every feature the data pipeline yields (int32 tokens, segment ids,
    # positions and two bool masks per token)
    batch = max(train.batch_sizes()) // micro * tokens * BATCH_BYTES_PER_TOKEN
    # the loss head's logits chunk and a layer's working set are never live together
    parts = {"layers_saved": saved, "working_set": max(working, logits),
             "embeddings_and_io": extras, "mtp_heads": mtp, "batch": batch,
             **context_plan.context_activation_bytes(run, rows, context)}
    parts = {k: int(round(v)) for k, v in parts.items()}
    return {"total": sum(parts.values()), "parts": parts, "rows_per_device": rows,
            "tokens_per_device": tokens,
            "working_sets": {"layer": int(round(working)), "logits_chunk": int(round(logits))}}
