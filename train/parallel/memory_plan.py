"""The memory planner behind `python -m train.plan` (whose command line and table are
`plan.py`): state bytes, the activation estimate and `plan_memory`.

The state's shapes come from `jax.eval_shape` (train/state.py) and its PartitionSpecs from the
training's own sharding rules (train/parallel/sharding.py `state_specs`) applied to a
`jax.sharding.AbstractMesh`. Per-device bytes of an array =
prod(shape) / prod(mesh sizes of the axes in its spec) * itemsize.

Rows (per device):
- params: the `params` collection (param_dtype, sharded like training shards it: `embed` over
  fsdp, heads/FFN/vocab over tensor, routed experts over expert, the pipelined segment's
  `layers` axis over pipeline).
- optimizer state: every optax leaf (Muon momentum, Adam moments, counts), with ZeRO-1
  (`mesh.zero1`) sharding it over `data` as well.
- gradients: one param-shaped float32 tree sharded like the params; two when the step
  accumulates gradients over several micro-batches (train.batch_size > micro-batch: the
  running sum and the current micro-batch's gradient are both live).
- other state: the `balance` collection (router biases), step, rng.
- activations: an ESTIMATE (below), not a measurement; XLA's buffer assignment, fusion and
  collective buffers move the real peak either way. Check a real run's peak on a small mesh.

Activation estimate. T = train.seq_len, c = bytes of model.compute_dtype, D = d_model,
t = mesh.tensor (divides head/FFN-sized tensors when it divides the head count / hidden size).
Tokens per device N = micro_batch * T / (data * fsdp * expert) (rows split over the batch axes;
rounded up, with a warning, when they do not split). Per token, each decoder layer has
  projections   M = c * [(H*hd + 2*KV*hd + G)/t + D]                          (q, k, v, gate, o)
                  + c * [2*F/t + D]  or  4*E + c * Ns*(2*Hs/t + D)              (dense SwiGLU, or
                                                                  MoE router + shared experts)
  other tensors O = c * [2*D + 2*H*hd/t] + (attention scores)                  (norms, residual,
                  + c * [2*D + F/t]                                             core out, SwiGLU
                    or 4*E + c * [3*D + k*(2*D + 3*He/t) + Ns*Hs/t]             act; MoE: router
                                   probabilities, top-k dispatched rows, routed gate/up/act/out)
  (G = H with the head-wise gate; E experts, k = top_k, He/Hs routed/shared hidden, Ns shared
  experts, F dense hidden.) M holds the outputs of the unbatched matmuls, which the `dots`
  policy saves; routed-expert products (ragged/batched dots) and attention scores it recomputes.
  attention scores = H/t * keys * (4 + c) with attention_impl=xla (float32 scores plus
                    compute-dtype probabilities; keys = T on full layers, 2*max(W, 128) on
                    sliding-window layers when that is < T), else 4*H/t (flash log-sum-exp).
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
  log-sum-exp; F / S layers) + c*k*(2*He/t + D) (routed gate/up pre-activations, outputs);
  save_attention_out / save_ffn_out -> I + c*D;  full -> I (the layer input only).
Activations = N * sum over the device's layers of that
            + max over layers of 2*N*(M + O)          (the layer being differentiated: its
              + rows * chunk                           recomputed forward and its cotangents)
            + N * (2*c*D + 2*I with a pipeline)       (embeddings, final hidden, pipeline I/O;
              + N * n*D*(c + 4) with mHC               final streams, HyperHead's normed copy)
            + N * per trained MTP head (6*c*D + M + O of its dense SWA block, never rematted)
            + 2 * min(loss_chunk_size, micro_batch*T) * V/t * 4   (one float32 logits chunk
                                                                   and its gradient)
With mesh.pipeline = S > 1 the pipelined segment (model/parallel/pipeline.py: R repeats in
S x V chunks of k = ceil(R / (S V)) slots, V virtual stages) runs on each device as k V slots,
each for one micro-batch per tick over the V m + S - 1 ticks of the schedule (bubble ticks
included; m = pipeline micro-batches): a segment layer's saved activations are scaled by
k (V m + S - 1) / (m R) and its working set by 1 / m; the pipeline's queue and stage buffer add
two layer inputs per token. Unless the stages hold contiguous runs of repeats (V = 1 and S
divides R), the step also holds a stage-layout copy of the segment's params and its gradient
(row `pipeline stage params`; train/parallel/pipeline_plan.py). Routing is assumed balanced
(each device holds about top_k * N expert rows); EP all-to-all buffers are not counted.

Calibration (one CPU device, float32, batch 8 x 256, jax 0.10; `compiled.memory_analysis()`
temporaries of the jitted train step, which also hold the gradients): configs/tiny.yaml 439
MiB with remat none and 186 MiB with full, against estimates of 624 and 198 MiB;
configs/tiny_deepseek_v4.yaml 706 / 406 / 350 MiB with none / dots / full against 706 / 327 /
277 MiB, and 364 MiB against 415 MiB with hc_mult=1. Between 0.7x and 1.4x of XLA's figure:
a guide, not a bound.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P

from model.config import SHARED_KV_KINDS, ModelConfig
from model.layers.layer_plan import LayerKind, layer_kinds, plan_segments
from model.parallel.mesh import spec_axes
from model.parallel.pipeline import pipelined_segment, stage_plan
from model.parallel.rules import abstract_mesh
from model.summary import param_group
from train.config import RunConfig
from train.parallel import context_plan, pipeline_plan
from train.parallel.sharding import check_batch_fits, data_parallel_size, state_specs
from train.parallel.v4_activations import (
    DTYPE_BYTES,
    core_chunk_bytes,
    hyper_connection_bytes,
    shared_kv_attention_bytes,
    tensor_split,
)
from train.state import abstract_state, build_training

GIB = 2**30
MIN_ATTENTION_CHUNK = 128  # model/ops/attention_cores.py MIN_CHUNK: smallest sliding-window chunk


class PlanError(ValueError):
    """A mesh/config combination that training would refuse (exit code 2 on the CLI)."""


def format_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# ---- state bytes -----------------------------------------------------------------------------


_STATE_CACHE: dict[str, tuple] = {}


def _training_and_state(run: RunConfig) -> tuple:
    """(Training, abstract TrainState); cached per model + train config (the mesh does not
    change shapes), so planning several meshes traces the model once."""
    key = json.dumps({"model": run.to_dict()["model"], "train": run.to_dict()["train"]},
                     sort_keys=True, default=str)
    if key not in _STATE_CACHE:
        training = build_training(run)
        _STATE_CACHE[key] = (training, abstract_state(training, run.train.seed))
    return _STATE_CACHE[key]


def sharded_bytes(shape: Sequence[int], dtype: Any, spec: P, sizes: dict[str, int]) -> int:
    """Bytes one device holds of an array of `shape` laid out by `spec` on a mesh of `sizes`."""
    ways = math.prod(sizes[a] for entry in spec for a in spec_axes(entry))
    return math.prod(shape) * np.dtype(dtype).itemsize // ways


def _tree_bytes(tree: Any, specs: Any, sizes: dict[str, int]) -> int:
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))
    return sum(sharded_bytes(x.shape, x.dtype, s, sizes) for x, s in zip(leaves, spec_leaves))


def state_bytes(run: RunConfig, sizes: dict[str, int]) -> dict:
    """Per-device bytes of params / optimizer state / other state, params per group and per
    scanned layer segment, and the global parameter count."""
    training, state = _training_and_state(run)
    specs = state_specs(state, training.variable_axes, abstract_mesh(sizes), run)
    groups: dict[str, int] = {}
    segments: dict[int, int] = {}  # scanned segment index -> its params' bytes
    flat_params = flatten_dict(state.params)
    flat_specs = flatten_dict(specs.params, is_leaf=lambda _, x: isinstance(x, P))
    for path, leaf in flat_params.items():
        keys = tuple(str(k) for k in path)
        size = sharded_bytes(leaf.shape, leaf.dtype, flat_specs[path], sizes)
        group = param_group(keys)
        groups[group] = groups.get(group, 0) + size
        if keys[0] == "layers" and keys[1].startswith("segment_"):
            index = int(keys[1].removeprefix("segment_"))
            segments[index] = segments.get(index, 0) + size
    other = sum(_tree_bytes(getattr(state, name), getattr(specs, name), sizes)
                for name in ("balance", "step", "rng", "skipped", "consecutive_skips"))
    return {
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
        "params": sum(groups.values()),
        "params_by_group": dict(sorted(groups.items())),
        "segments": segments,
        "optimizer": _tree_bytes(state.opt_state, specs.opt_state, sizes),
        "other": other,
    }


# ---- activation estimate ---------------------------------------------------------------------


def _gqa_attention_bytes(cfg: ModelConfig, attention_type: str, seq_len: int,
                         tensor: int) -> tuple[float, float]:
    """(M, O) per token of the attention sublayer of an F or S layer, input norm included."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    geo, d = cfg.attention_geometry(attention_type), cfg.d_model
    heads, kv, hd, dv = geo.num_heads, geo.num_kv_heads, geo.head_dim, geo.v_head_dim
    h = tensor_split(heads, tensor) / heads  # share of the heads on this device
    gate = heads if geo.gate == "headwise" else 0
    matmul = c * ((heads * hd + kv * (hd + dv) + gate) * h + d)
    other = c * (2 * d + heads * (hd + dv) * h)
    if cfg.attention_impl == "xla":
        chunk = max(cfg.window, MIN_ATTENTION_CHUNK)
        keys = 2 * chunk if attention_type == "S" and chunk < seq_len else seq_len
        other += heads * h * keys * (4 + c)
    else:
        other += 4 * heads * h
    return matmul, other


def layer_bytes(cfg: ModelConfig, kind: LayerKind, seq_len: int, tensor: int,
                streams: bool = True) -> tuple[float, float]:
    """(matmul outputs M, other saved tensors O) of one decoder layer, bytes per token (see the
    module docstring). `streams=False`: a block outside the mHC streams (the MTP heads')."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    d = cfg.d_model
    if kind.attention_type in SHARED_KV_KINDS:
        matmul, other = shared_kv_attention_bytes(cfg, kind.attention_type, seq_len, tensor)
    else:
        matmul, other = _gqa_attention_bytes(cfg, kind.attention_type, seq_len, tensor)
    if kind.is_moe:
        moe = cfg.moe
        shared = moe.num_shared_experts
        hidden = tensor_split(moe.expert_hidden, tensor)
        shared_hidden = tensor_split(moe.shared_hidden, tensor)
        # Routed-expert products are ragged/batched dots, which the `dots` policy recomputes:
        # they count as "other", with the dispatched rows, activations and combine.
        matmul += 4 * moe.num_experts + c * shared * (2 * shared_hidden + d)
        other += 4 * moe.num_experts + c * (
            3 * d + moe.top_k * (2 * d + 3 * hidden) + shared * shared_hidden)
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


def kernel_output_bytes(cfg: ModelConfig, kind: LayerKind, tensor: int) -> float:
    """Bytes per token of the named kernel outputs of a layer (pallas_kernels/saved_names.py)
    that `dots_with_kernels` keeps beyond `dots`: the attention core's output and float32
    log-sum-exp (F / S layers) and the routed experts' gate/up pre-activations and outputs."""
    c = DTYPE_BYTES[cfg.compute_dtype]
    saved = 0.0
    if kind.attention_type not in SHARED_KV_KINDS:
        geo = cfg.attention_geometry(kind.attention_type)
        heads = tensor_split(geo.num_heads, tensor)
        saved += heads * (c * geo.v_head_dim + 4)
    if kind.is_moe:
        moe = cfg.moe
        saved += c * moe.top_k * (2 * tensor_split(moe.expert_hidden, tensor) + cfg.d_model)
    return saved


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


def activation_bytes(run: RunConfig, sizes: dict[str, int]) -> dict:
    """Activation estimate per device (module docstring), with its parts."""
    cfg, train = run.model, run.train
    seq_len, micro = train.seq_len, train.micro_batch()
    tensor, stages = sizes["tensor"], sizes["pipeline"]
    ways = math.prod(sizes[a] for a in ("data", "fsdp", "expert"))
    rows, context = -(-micro // ways), sizes.get("context", 1)
    tokens = context_plan.tokens_per_device(rows, seq_len, context)
    lengths = context_plan.attention_lengths(cfg, seq_len, context)  # the attention's keys
    c = DTYPE_BYTES[cfg.compute_dtype]
    d_bytes = c * cfg.d_model
    streams = cfg.hyper_connections.hc_mult
    input_bytes = streams * d_bytes  # a layer's input: the residual, or the n mHC streams

    kinds = layer_kinds(cfg)
    piped_layers: set[int] = set()
    if stages > 1:
        piped_layers = set(plan_segments(kinds)[pipelined_segment(cfg, stages)].layers)
        plan = stage_plan(cfg, stages)
        # a device runs k slots of the segment per tick on one micro-batch, for V M + S - 1
        # ticks: per layer of the segment, k (V M + S - 1) / (M R) of the batch's tokens
        piped_share = plan.slots * (plan.virtual * plan.microbatches + stages - 1) / (
            plan.microbatches * plan.repeats)
    saved = working = 0.0
    for i, kind in enumerate(kinds):
        matmul, other = layer_bytes(cfg, kind, lengths[kind.attention_type], tensor)
        keep = saved_per_layer(cfg.remat_policy, matmul, other, input_bytes, d_bytes,
                               kernel_output_bytes(cfg, kind, tensor))
        differentiated = (2 * tokens * (matmul + other)
                          + rows * chunk_working_bytes(cfg, kind, seq_len, tensor))
        if i in piped_layers:  # one micro-batch at a time
            saved += tokens * keep * piped_share
            working = max(working, differentiated / plan.microbatches)
        else:
            saved += tokens * keep
            working = max(working, differentiated)
    # embeddings and final hidden, the pipeline's queue and stage buffer; mHC: the final
    # streams, their float32 normed copy (HyperHead)
    extras = tokens * (2 * d_bytes + (2 * input_bytes if stages > 1 else 0))
    if streams > 1:
        extras += tokens * streams * cfg.d_model * (c + 4)
    mtp_kind = LayerKind(cfg.mtp.attention_type, False, 0.0, 0.0, False)
    mtp_block = sum(layer_bytes(cfg, mtp_kind, lengths[mtp_kind.attention_type], tensor,
                                streams=False))
    mtp = run.trained_mtp_heads() * tokens * (6 * d_bytes + mtp_block)
    chunk = min(train.loss_chunk_size, micro * seq_len)
    logits = 2 * chunk * tensor_split(cfg.vocab_size, tensor) * 4
    # the step's batch: int32 tokens, segment ids, positions and two bool masks per token
    batch = max(train.batch_sizes()) // micro * tokens * (3 * 4 + 2)
    parts = {"layers_saved": saved, "layer_working_set": working, "embeddings_and_io": extras,
             "mtp_heads": mtp, "logits_chunk": logits, "batch": batch,
             **context_plan.context_activation_bytes(run, rows, context)}
    parts = {k: int(round(v)) for k, v in parts.items()}
    return {"total": sum(parts.values()), "parts": parts, "rows_per_device": rows,
            "tokens_per_device": tokens}


# ---- the plan --------------------------------------------------------------------------------


def plan_memory(run: RunConfig, sizes: dict[str, int], device_memory_gib: float = 80.0) -> dict:
    """The memory plan of `run` on a mesh of `sizes` ({axis: size}, -1 resolved): a JSON-able
    dict. Raises PlanError when training would refuse the mesh (pipeline vs layer plan)."""
    mesh = abstract_mesh(sizes)
    warnings = []
    stages = sizes["pipeline"]
    pipeline = None
    if stages > 1:
        try:
            pipeline = pipeline_plan.describe(run, stages)
        except ValueError as err:
            raise PlanError(str(err)) from None
    try:
        check_batch_fits(run, mesh)
    except ValueError as err:
        warnings.append(f"{err} (the plan assumes the rows per device rounded up)")

    state = state_bytes(run, sizes)
    accumulation = max(run.train.batch_sizes()) // run.train.micro_batch()
    gradient_copies = 2 if accumulation > 1 else 1
    gradients = gradient_copies * state["params"]
    activations = activation_bytes(run, sizes)
    if pipeline:
        segment_bytes = state["segments"][pipeline["segment"]]
        copy = pipeline_plan.stage_copy_bytes(stage_plan(run.model, stages), segment_bytes)
        if copy:
            activations["parts"]["pipeline_stage_params"] = copy
            activations["total"] += copy
        fixed = state["params"] + state["optimizer"] + gradients + state["other"]
        pipeline["schedules"] = pipeline_plan.schedules(run, sizes, segment_bytes, fixed,
                                                        activation_bytes)
    per_device = {"params": state["params"], "optimizer_state": state["optimizer"],
                  "gradients": gradients, "other_state": state["other"],
                  "activations": activations["total"]}
    total = sum(per_device.values())
    budget = int(device_memory_gib * GIB)
    within = total <= budget
    if not within:
        warnings.append(f"over budget: {total / GIB:.2f} GiB per device needed, "
                        f"{device_memory_gib:g} GiB available (--device-memory)")
    return {
        "mesh": dict(sizes), "devices": math.prod(sizes.values()), "zero1": run.mesh.zero1,
        "data_parallel_size": data_parallel_size(mesh),
        "num_params": state["num_params"], "param_dtype": run.model.param_dtype,
        "compute_dtype": run.model.compute_dtype, "remat_policy": run.model.remat_policy,
        "attention_impl": run.model.attention_impl,
        "batch_size": run.train.batch_size, "micro_batch_size": run.train.micro_batch(),
        "accumulation_steps": accumulation, "seq_len": run.train.seq_len,
        "rows_per_device": activations["rows_per_device"],
        "tokens_per_device": activations["tokens_per_device"],
        "pipeline": pipeline,
        "per_device_bytes": {**per_device, "total": total},
        "params_by_group_bytes": state["params_by_group"],
        "activation_parts_bytes": activations["parts"],
        "gradient_copies": gradient_copies,
        "budget_bytes": budget, "within_budget": within,
        "utilisation": total / budget if budget else math.inf,
        "warnings": warnings,
    }
