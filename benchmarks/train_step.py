"""Train-step throughput and MFU of `tiny` and a medium config (d_model 1024), float32 on CPU.

    python -m benchmarks.train_step [--configs tiny medium] [--steps 4] [--optimizers muon adamw]

Times the jitted `train.step` (forward, backward, Muon/AdamW, loss-free bias update, monitors)
on batches from the real input pipeline, after one warm-up step. MFU = model FLOPs per trained
token (`model.flops`: forward x 3, MTP heads that train included) x tokens/s over the measured
float32 matmul peak of this machine (`train.telemetry.mfu.measure_matmul_peak`, a 2048^3 product).
Target: MFU >= 40% on the medium config.

The optimizer update is timed on its own too. Muon's orthogonalisation costs a fixed ~4.5
TFLOP per step on the medium model whatever the batch, so at the 2k tokens per step that fit
a CPU benchmark it outweighs the model; pre-training batches are millions of tokens. The
last column projects the step's MFU with `--accumulate` micro-batches of gradient accumulation
from the two measured parts (the step is a scan of forward/backward passes plus one update).
"""

import argparse
import time

import jax
import numpy as np

from benchmarks.common import markdown_table, save
from benchmarks.step_timing import timed_steps
from model.tokenizers.text import load_tokenizer
from train.config import load_run_config
from train.data.pipeline import make_dataset
from train.state import build_training, create_state
from train.telemetry.mfu import measure_matmul_peak, train_flops_per_token

CONFIGS = {
    "tiny": [],
    # Same motif as tiny at d_model 1024: head_dim 128, GQA 8/12 query heads over 2 KV heads,
    # 16 experts (top-4, hidden 512) + shared expert.
    "medium": ["model.d_model=1024", "model.head_dim=128", "model.full_attention.num_heads=8",
               "model.swa_attention.num_heads=12", "model.window=256", "model.dense_hidden=2816",
               "model.moe.expert_hidden=512", "model.moe.shared_hidden=512",
               "train.seq_len=512", "train.batch_size=4"],
}


def measure(name: str, optimizer: str, steps: int) -> dict:
    run = load_run_config("configs/tiny.yaml", [*CONFIGS[name], f"train.optimizer={optimizer}",
                                                "train.progress=false"])
    cfg = run.train
    training = build_training(run)
    data = make_dataset(cfg.data, load_tokenizer(cfg.data.tokenizer), seq_len=cfg.seq_len,
                        batch_size=cfg.micro_batch(), split="train", seed=cfg.seed)
    num_micro = cfg.batch_size // cfg.micro_batch()

    def batch():
        micro = [next(data) for _ in range(num_micro)]
        return {k: np.stack([m[k] for m in micro]) for k in micro[0]}

    state = jax.jit(lambda: create_state(training.model, training.optimizer, cfg.seed))()
    timed = timed_steps(training, run, state, batch, warmup=1, steps=steps)
    state, metrics, compile_s = timed.state, timed.metrics, timed.compile_s
    step_s = float(np.median(timed.step_seconds))
    update_s = optimizer_update_seconds(training, state, steps)
    tokens = cfg.batch_size * cfg.seq_len
    flops_per_token = train_flops_per_token(run.model, cfg.seq_len, run.trained_mtp_heads())
    params = sum(x.size for x in jax.tree.leaves(state.params))
    return {"config": name, "optimizer": optimizer, "params": params, "tokens_per_step": tokens,
            "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "optimizer_update_s": update_s,
            "model_flops_per_token": flops_per_token,
            "achieved_flops": flops_per_token * tokens / step_s,
            "loss_after": float(metrics["loss"])}


def optimizer_update_seconds(training, state, repeats: int) -> float:
    """Median time of the optimizer update alone (clip, Muon/AdamW, decay) on gradient-shaped
    inputs: the part of a step that does not grow with the tokens per step."""
    update = jax.jit(lambda grads, opt_state, params: training.optimizer.update(
        grads, opt_state, params))
    grads = jax.tree.map(lambda p: p * 1e-3, state.params)
    jax.block_until_ready(update(grads, state.opt_state, state.params))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(update(grads, state.opt_state, state.params))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def projected_mfu(result: dict, peak: float, micro_batches: int) -> float:
    """MFU of a step accumulating `micro_batches` batches like the measured one: the step is a
    scan of forward/backward passes plus one optimizer update, so its time is
    micro_batches * (step_s - optimizer_update_s) + optimizer_update_s."""
    model_s = result["step_s"] - result["optimizer_update_s"]
    flops = result["model_flops_per_token"] * result["tokens_per_step"] * micro_batches
    return flops / (micro_batches * model_s + result["optimizer_update_s"]) / peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["tiny", "medium"])
    parser.add_argument("--optimizers", nargs="+", choices=["muon", "adamw"],
                        default=["muon", "adamw"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps (median reported)")
    parser.add_argument("--accumulate", type=int, default=16,
                        help="micro-batches per step for the projected MFU column")
    args = parser.parse_args()

    peak = measure_matmul_peak()
    results = []
    for name in args.configs:
        for optimizer in args.optimizers:
            result = measure(name, optimizer, args.steps)
            result["mfu"] = result["achieved_flops"] / peak
            result["model_only_mfu"] = result["model_flops_per_token"] * result[
                "tokens_per_step"] / (result["step_s"] - result["optimizer_update_s"]) / peak
            result[f"projected_mfu_x{args.accumulate}"] = projected_mfu(result, peak,
                                                                        args.accumulate)
            results.append(result)
            print(f"{name}/{optimizer}: {result['tokens_per_s']:.0f} tokens/s, "
                  f"MFU {100 * result['mfu']:.1f}%", flush=True)
    print(f"\nfloat32 matmul peak (2048^3): {peak / 1e9:.0f} GFLOP/s\n")
    print(markdown_table(
        ["config", "optimizer", "params", "tokens/step", "compile s", "step s", "of which update s",
         "tokens/s", "MFU", "MFU fwd+bwd only", f"MFU at {args.accumulate}x accumulation"],
        [[r["config"], r["optimizer"], f"{r['params'] / 1e6:.1f}M", r["tokens_per_step"],
          f"{r['compile_s']:.0f}", f"{r['step_s']:.2f}", f"{r['optimizer_update_s']:.2f}",
          f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%",
          f"{100 * r['model_only_mfu']:.1f}%",
          f"{100 * r[f'projected_mfu_x{args.accumulate}']:.1f}%"] for r in results]))
    save("train_step", {"matmul_peak_flops": peak, "results": results})


if __name__ == "__main__":
    main()
