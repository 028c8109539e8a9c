"""Train step of `make gpu-check` (benchmarks.gpu.suite), and the same step under another remat
policy (the remat section); the profile and decode sections (benchmarks.gpu.profiling,
benchmarks.gpu.decode) continue from the trained state.

Train: a run config (configs/gpu_1b.yaml on an accelerator) trained for a few dozen steps
through the jitted `train.step` (benchmarks.step_timing: forward, backward, Muon/AdamW,
router-bias update, monitors). tokens/s is the median over the steps after the warm-up; MFU =
model FLOPs per trained token (`model.flops`, forward x 3, the trained MTP heads included) x
tokens/s / the device's dense bf16 peak. Should the configured kernels fail, the step is
measured again with one switch at a time set to its XLA fallback (`attention_impl=xla`,
`moe_impl=ragged_dot`), then both, and every failed attempt is reported. Memory: XLA's
planned scratch of the compiled step beside train.plan's estimate for one device.

Data: rows of one fixed random cycle over `CHAIN_TOKENS` token ids, x_{t+1} = next(x_t), each
row from a random start (one document per row). A few dozen steps learn it, so the MTP head's
drafts can be accepted; random tokens would leave nothing to accept.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, NamedTuple

import jax
import numpy as np

from benchmarks.common import markdown_table
from benchmarks.gpu.checks import first_line
from benchmarks.gpu.moe_legs import plan_of
from benchmarks.step_timing import timed_steps
from model.parallel.rules import MESH_AXES
from model.summary import count_params
from train.config import RunConfig, load_run_config
from train.parallel.memory_plan import plan_memory
from train.state import build_training, create_state
from train.telemetry.mfu import train_flops_per_token

CHAIN_TOKENS = 1024


class ChainData:
    """Batches ([num_micro, micro, T] arrays, train/step.py) and held-out rows of the cycle."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, micro_batch: int,
                 seed: int):
        self.rng = np.random.default_rng(seed)
        self.cycle = self.rng.permutation(min(vocab_size, CHAIN_TOKENS)).astype(np.int32)
        self.seq_len, self.micro = seq_len, micro_batch
        self.num_micro = batch_size // micro_batch

    def rows(self, count: int, length: int, rng: np.random.Generator | None = None) -> np.ndarray:
        starts = (rng or self.rng).integers(0, self.cycle.size, count)
        return self.cycle[(starts[:, None] + np.arange(length)) % self.cycle.size]

    def batch(self) -> dict:
        shape = (self.num_micro, self.micro, self.seq_len)
        tokens = self.rows(self.num_micro * self.micro, self.seq_len).reshape(shape)
        return {"tokens": tokens, "segment_ids": np.ones(shape, np.int32),
                "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), shape),
                "meta_mask": np.zeros(shape, bool)}


def device_memory() -> dict:
    """Peak (over the whole process, earlier sections included) and limit of device 0's memory
    in GiB, where the backend reports them (GPU/TPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {name: stats[key] / 2**30 for name, key in (("process_peak_gib", "peak_bytes_in_use"),
                                                       ("limit_gib", "bytes_limit"))
            if key in stats}


class Trained(NamedTuple):
    """What the train section leaves for the profile and decode sections."""

    run: RunConfig
    state: Any
    data: ChainData
    step: Any  # the compiled train step (it donates the state it is given)


def planner_gib(run: RunConfig) -> dict:
    """train.plan's estimate on one device (GiB) beside which XLA's scratch is reported: the
    step's temporaries hold the gradients and the activations."""
    parts = plan_memory(run, dict.fromkeys(MESH_AXES, 1))["per_device_bytes"]
    return {f"planner_{name}_gib": parts[name] / 2**30
            for name in ("activations", "gradients", "total")}


def measure_training(run: RunConfig, *, warmup: int, steps: int,
                     peak_tflops: float | None) -> tuple[dict, Trained]:
    """(report record, the trained state and its step) of `steps` timed steps after
    `warmup`."""
    cfg = run.train
    training = build_training(run)
    data = ChainData(run.model.vocab_size, cfg.seq_len, cfg.batch_size, cfg.micro_batch(),
                     cfg.seed)
    state = jax.jit(lambda: create_state(training.model, training.optimizer, cfg.seed))()
    timed = timed_steps(training, run, state, data.batch, warmup=warmup, steps=steps)
    step_s = statistics.median(timed.step_seconds)
    tokens = cfg.batch_size * cfg.seq_len
    flops_per_token = train_flops_per_token(run.model, cfg.seq_len, run.trained_mtp_heads())
    counts = count_params(run.model)
    record = {
        "status": "done", "attention_impl": run.model.attention_impl,
        "moe_impl": run.model.moe_impl, "remat_policy": run.model.remat_policy,
        "compute_dtype": run.model.compute_dtype, "optimizer": cfg.optimizer,
        "moe_legs": plan_of(run.model) if run.model.moe_impl == "pallas" else None,
        "params": counts["with_mtp"]["total"], "active_params": counts["with_mtp"]["active"],
        "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "tokens_per_step": tokens,
        "warmup_steps": warmup, "timed_steps": steps, "compile_s": timed.compile_s,
        "step_s_median": step_s, "step_s_mean": statistics.fmean(timed.step_seconds),
        "tokens_per_s": tokens / step_s, "model_flops_per_token": flops_per_token,
        "achieved_tflops": flops_per_token * tokens / step_s / 1e12,
        "mfu": (flops_per_token * tokens / step_s / (peak_tflops * 1e12)
                if peak_tflops else None),
        "loss_first": timed.losses[0], "loss_last": timed.losses[-1],
        "skipped_updates": int(timed.state.skipped), "devices_used": 1,
        "step_scratch_gib": None if timed.temp_bytes is None else timed.temp_bytes / 2**30,
        **planner_gib(run), **device_memory(),
    }
    return record, Trained(run, timed.state, data, timed.compiled)


FALLBACKS = ("xla", "ragged_dot")  # (attention_impl, moe_impl) that XLA itself lowers


def kernel_attempts(attention: str, moe: str) -> list[tuple[str, str]]:
    """(attention_impl, moe_impl) pairs to try in order: the configured pair, then each switch
    alone at its fallback, then both; no pair twice."""
    fallback_attention, fallback_moe = FALLBACKS
    pairs = [(attention, moe), (attention, fallback_moe), (fallback_attention, moe),
             (fallback_attention, fallback_moe)]
    return list(dict.fromkeys(pairs))


def train_section(config: str, overrides: list[str], *, warmup: int, steps: int,
                  peak_tflops: float | None) -> tuple[dict, Trained | None]:
    """(section record, what was trained or None if no attempt trained)."""
    base = load_run_config(config, [*overrides, "train.progress=false"])
    failed = []
    for attention, moe in kernel_attempts(base.model.attention_impl, base.model.moe_impl):
        run = dataclasses.replace(base, model=base.model.replace(attention_impl=attention,
                                                                 moe_impl=moe))
        try:
            record, trained = measure_training(run, warmup=warmup, steps=steps,
                                               peak_tflops=peak_tflops)
        except Exception as err:  # a configured kernel may fail; the fallbacks still give a figure
            failed.append({"attention_impl": attention, "moe_impl": moe,
                           "error": first_line(err)})
            continue
        return {**record, "config": config, "overrides": overrides, "failed": failed}, trained
    return {"status": "error", "config": config, "overrides": overrides, "failed": failed}, None


def remat_section(trained: Trained | None, baseline: dict | None, policy: str, *, warmup: int,
                  steps: int, peak_tflops: float | None) -> dict:
    """The train section's run again with model.remat_policy=`policy`, beside the train
    section's figures (`baseline`, its record)."""
    if trained is None or not baseline or baseline.get("status") != "done":
        return {"status": "skipped", "note": "no trained run to compare with"}
    if policy == trained.run.model.remat_policy:
        return {"status": "skipped", "note": f"the train section ran remat_policy={policy}"}
    run = dataclasses.replace(trained.run, model=trained.run.model.replace(remat_policy=policy))
    record, _ = measure_training(run, warmup=warmup, steps=steps, peak_tflops=peak_tflops)
    keys = ("remat_policy", "step_s_median", "tokens_per_s", "mfu", "compile_s",
            "step_scratch_gib", "planner_activations_gib", "planner_total_gib")
    rows = [{k: r.get(k) for k in keys} for r in (baseline, record)]
    return {"status": "done", "records": rows,
            "speedup": baseline["step_s_median"] / record["step_s_median"]}


def run_remat(ctx, deadline: float) -> dict:
    """The section runner (benchmarks.gpu.suite)."""
    plan = ctx.plan
    return remat_section(ctx.shared.get("trained"), ctx.shared.get("train_record"),
                         plan.remat_policy, warmup=plan.train_warmup, steps=plan.remat_steps,
                         peak_tflops=ctx.peak_tflops)


def remat_markdown(section: dict) -> list[str]:
    keys = ("remat_policy", "step_s_median", "tokens_per_s", "mfu", "compile_s",
            "step_scratch_gib", "planner_activations_gib", "planner_total_gib")
    rows = [[value if isinstance(value, str) else "-" if value is None else f"{value:.4g}"
             for value in (r.get(k) for k in keys)] for r in section.get("records", [])]
    return [markdown_table(list(keys), rows), "",
            f"step time ratio (train section's policy / this one): {section['speedup']:.3f}"]
