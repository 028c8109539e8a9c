"""The estimated step time by which `python -m train.plan --fit` ranks layouts: a model of where
the time goes, for comparing layouts of one run, not a prediction to the second.

    step = compute / (1 - bubble) + exposed communication

compute = N * [(3 F_o + (3 F_l + R)(1 - s)) / S + (3 F_l + R + F_s) s k V / Rp] / t / (peak mfu)
    N: tokens per stage's device and step (the batch over data x fsdp x expert, each row's
    tokens over mesh.context, whose exchanges are not counted: --fit keeps context 1), t:
    mesh.tensor, S: mesh.pipeline. F_l: the decoder layers' forward FLOPs per token at train.seq_len, F_o:
    the rest (output heads, the MTP heads that train) (model/flops.py; matmuls only); 3 F:
    forward and backward. R: the forward FLOPs the remat policy recomputes in the backward
    pass: none 0; dots_with_kernels the attention scores; dots also the routed experts (batched
    and grouped products are not saved by `dots_with_no_batch_dims_saveable`); full,
    save_attention_out, save_ffn_out the decoder layers' forward. With a pipeline, s is the
    pipelined segment's share of the layers, of whose Rp repeats a device runs k V slots
    (model/parallel/pipeline.py); the other layers, embeddings and heads split their rows over
    the S stages as well. F_s = F_l with model.pipeline_stage_remat (a tick saves only its
    stage input, so the backward pass reruns each tick's forward first), else 0. peak:
    --peak-tflops per device (default 989: H100/H800 dense BF16), mfu: --mfu, the share of it
    the kernels reach (default 0.4).
bubble = (S - 1) / (V M + S - 1) with S pipeline stages, V virtual stages, M micro-batches.

Communication, bytes per device per step, ring collectives over w devices moving (w - 1) / w of
the buffer each way:
    data parallel   the gradient all-reduce over data x fsdp x expert: 2 (w-1)/w * gradient
                    bytes (ZeRO-1's reduce-scatter and all-gather move the same; P: the
                    device's params, times mesh.data when float32 master weights shard over it)
    fsdp            the all-gather of the params before the forward and again before the
                    backward, per accumulated micro-batch: 2 a (f-1) * P (an upper bound:
                    params fsdp does not shard need no gather)
    tensor          two all-reduces of the layer's [tokens, D] output per layer (attention,
                    FFN) forward and two backward: 4 * 2 (t-1)/t * N c D per layer
    expert          dispatch and combine all-to-alls, forward and backward: 4 (e-1)/e * N k c D
                    per MoE layer
    pipeline        each of the V M + S - 1 ticks sends a micro-batch's stage input on and its
                    cotangent back: 2 (V M + S - 1) * N / M * c * (stream width)
(N tokens per device and step, c compute-dtype bytes, k experts per token.) An axis is inside a
node when it and the axes inside it (mesh order pipeline, data, fsdp, expert, context, tensor,
tensor innermost) span at most --node-size devices; its bytes then move at --intra-node-gbps
(default 400 GB/s, NVLink of an H800), else at --inter-node-gbps (default 50 GB/s: a 400 Gb/s
NIC per GPU). Exposed: tensor, expert and pipeline traffic sits between dependent computations and
counts in full; data-parallel and FSDP traffic overlaps with the step's compute and counts only
beyond it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from model.config import ModelConfig
from model.flops import forward_flops
from model.layers.layer_plan import layer_kinds, plan_segments
from model.parallel.pipeline import pipelined_segment, stage_plan
from model.parallel.rules import MESH_AXES
from train.config import RunConfig
from train.parallel.sharding import row_shards, shards_master_weights
from train.parallel.v4_activations import DTYPE_BYTES

GB = 1e9
# forward FLOPs (model/flops.py breakdown keys) each remat policy recomputes in the backward
_LAYER_KEYS = ("attention_projections", "attention_scores", "kv_compressor", "indexer_projections",
               "indexer_scores", "hyper_connections", "ffn_dense", "moe_experts", "router")
RECOMPUTED = {"none": (), "dots_with_kernels": ("attention_scores", "indexer_scores"),
              "dots": ("attention_scores", "indexer_scores", "moe_experts"),
              "full": _LAYER_KEYS, "save_attention_out": _LAYER_KEYS,
              "save_ffn_out": _LAYER_KEYS}


@dataclasses.dataclass(frozen=True)
class Hardware:
    peak_tflops: float = 989.0
    mfu: float = 0.4
    intra_node_gbps: float = 400.0
    inter_node_gbps: float = 50.0
    node_size: int = 8


@functools.lru_cache(maxsize=256)
def token_flops(cfg: ModelConfig, seq_len: int, mtp_heads: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of the decoder layers, of the rest (output and trained MTP heads)
    and of what cfg.remat_policy recomputes (model/flops.py)."""
    forward = forward_flops(cfg.replace(mtp=dataclasses.replace(cfg.mtp, num_heads=mtp_heads)),
                            seq_len, "prefill")
    layers = sum(forward["breakdown"][k] for k in _LAYER_KEYS) / seq_len
    recomputed = sum(forward["breakdown"][k] for k in RECOMPUTED[cfg.remat_policy]) / seq_len
    return layers, forward["total"] / seq_len - layers, recomputed


@functools.lru_cache(maxsize=256)
def _moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(cfg.moe_layer_indices())


def link_gbps(sizes: dict[str, int], axis: str, hardware: Hardware) -> float:
    """Bandwidth of `axis`: the node's when it and the axes inside it fit in one node."""
    inner = math.prod(sizes.get(a, 1) for a in MESH_AXES[MESH_AXES.index(axis):])
    return hardware.intra_node_gbps if inner <= hardware.node_size else hardware.inter_node_gbps


def step_time(run: RunConfig, sizes: dict[str, int], rows: dict, hardware: Hardware) -> dict:
    """Seconds per step of `run` on a mesh of `sizes`, from its memory rows (`device_rows`):
    {"seconds", "compute", "bubble", "exposed_communication", "communication": {axis: s}}."""
    cfg, train = run.model, run.train
    layer_flops, other_flops, recomputed = token_flops(cfg, train.seq_len,
                                                       run.trained_mtp_heads())
    stages, bubble, layer_work, other_work = sizes["pipeline"], 0.0, 1.0, 1.0
    stage_recompute = 0.0
    if stages > 1:
        plan = stage_plan(cfg, stages)
        segment = plan_segments(layer_kinds(cfg))[pipelined_segment(cfg, stages)]
        share = segment.period * segment.repeats / cfg.num_layers
        piped_work = share * plan.slots * plan.virtual / plan.repeats
        layer_work = (1 - share) / stages + piped_work
        other_work = 1 / stages
        # model.pipeline_stage_remat: the backward reruns each tick's forward first
        stage_recompute = layer_flops * piped_work if plan.remat else 0.0
        bubble = plan.bubble
    ways = row_shards(sizes)  # the data-parallel replicas of a stage
    local_tokens = (-(-train.micro_batch() // ways) * train.seq_len * rows["accumulation_steps"]
                    // sizes.get("context", 1))
    flops = local_tokens * (3 * other_flops * other_work
                            + (3 * layer_flops + recomputed) * layer_work + stage_recompute)
    compute = flops / sizes["tensor"] / (hardware.peak_tflops * 1e12 * hardware.mfu)

    per_device = rows["per_device"]
    accumulation = rows["accumulation_steps"]
    c, d = DTYPE_BYTES[cfg.compute_dtype], cfg.d_model
    layers = cfg.num_layers * layer_work
    moe_layers = len(_moe_layers(cfg)) * layer_work
    ring = lambda w: (w - 1) / w  # noqa: E731
    width = cfg.hyper_connections.hc_mult * d
    params = per_device["params"] * (sizes["data"] if shards_master_weights(run) else 1)
    volume = {
        "data": 2 * ring(ways) * params if ways > 1 else 0.0,
        "fsdp": 2 * accumulation * (sizes["fsdp"] - 1) * params,
        "tensor": 8 * ring(sizes["tensor"]) * local_tokens * c * d * layers,
        "expert": 4 * ring(sizes["expert"]) * local_tokens * cfg.moe.top_k * c * d * moe_layers,
        "pipeline": 0.0,
    }
    if stages > 1:
        ticks = plan.virtual * plan.microbatches + stages - 1
        volume["pipeline"] = 2 * ticks * local_tokens / plan.microbatches * c * width
    seconds = {axis: v / (link_gbps(sizes, axis, hardware) * GB) for axis, v in volume.items()}
    exposed = (seconds["tensor"] + seconds["expert"] + seconds["pipeline"]
               + max(0.0, seconds["data"] + seconds["fsdp"] - compute))
    total = compute / (1 - bubble) + exposed
    return {"seconds": total, "compute": compute, "bubble": bubble,
            "exposed_communication": exposed, "communication": seconds}
