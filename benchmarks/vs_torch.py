"""stepjax against Hugging Face transformers' Step 3.5 model (torch, CPU) on the same weights.

    python -m benchmarks.vs_torch [--sizes bench medium] [--rounds 5] [--no-compile]

One random Step 3.5 checkpoint per size is written in the published layout
(`model.interop.hf.save_hf_checkpoint`) and loaded by both sides: stepjax through its importer,
torch through `transformers.AutoModel` (the `step3p5` text model) plus the checkpoint's
`lm_head`. Both run forward + backward of the mean next-token cross-entropy on the same token
batch in float32 (stepjax: the jitted loss of `train.step`; torch: eager, and `torch.compile`
unless --no-compile), interleaved round by round so machine load hits every side alike, each
timed call after one untimed call of the same side (so each side runs on its own warmed
allocator: `benchmarks.common.interleaved`); the losses must agree before anything is timed.
A per-module breakdown times fwd+bwd of one layer of each kind (weights from the checkpoint)
the same way. The machine's float32 matmul peak
(`train.telemetry.mfu.measure_matmul_peak`, large and small shapes) turns FLOP/s into MFU.
Results: `benchmarks/results/vs_torch_<sizes>.json` and a markdown table (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.common import interleaved, markdown_table, save
from benchmarks.torch_step35 import torch_loss_and_grad, torch_module_steps, torch_text_model
from model.interop.hf import load_hf_checkpoint, save_hf_checkpoint
from model.layers.attention import Attention
from model.layers.ffn import SwiGLU
from model.layers.moe import MoE
from model.layers.params import unstack_layers
from model.lm import CausalLM, init_variables, output_head_params, split_variables
from train.config import RunConfig, load_run_config
from train.losses import chunked_cross_entropy, shifted_targets
from train.step import loss_fn
from train.telemetry.mfu import measure_matmul_peak, train_flops_per_token

# Step 3.5 layout at benchmark sizes: FSSSFSSS, one leading dense layer, a shared expert.
_MODEL = ["model.num_layers=8", "model.layout=FSSSFSSS", "model.vocab_size=4096",
          "model.head_dim=64", "model.num_kv_heads=2", "model.mtp.num_heads=0",
          "model.swiglu_limits=0", "model.swiglu_limits_shared=0"]
SIZES = {
    "bench": _MODEL + ["model.d_model=512", "model.window=128", "model.full_attention.num_heads=8",
                       "model.swa_attention.num_heads=12", "model.dense_hidden=1536",
                       "model.moe.num_experts=16", "model.moe.top_k=2",
                       "model.moe.expert_hidden=256", "model.moe.shared_hidden=256"],
    "medium": _MODEL + ["model.d_model=1024", "model.head_dim=128", "model.window=256",
                        "model.full_attention.num_heads=8", "model.swa_attention.num_heads=12",
                        "model.dense_hidden=2816", "model.moe.num_experts=16",
                        "model.moe.top_k=4", "model.moe.expert_hidden=512",
                        "model.moe.shared_hidden=512"],
}
BATCH, LENGTH = 4, 512


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_config(size: str) -> RunConfig:
    return load_run_config("configs/tiny.yaml", [
        *SIZES[size], "train.balance_loss_coef=0", "train.mtp_offset_weights=[]",
        f"train.batch_size={BATCH}", f"train.seq_len={LENGTH}", "train.progress=false"])


def write_checkpoint(run: RunConfig, path: Path) -> None:
    """A random stepjax model saved as a published-layout Step 3.5 checkpoint."""
    model = CausalLM(run.model)
    variables = jax.jit(lambda key: nn.meta.unbox(init_variables(model, key)))(jax.random.key(0))
    save_hf_checkpoint(run.model, variables, path, progress=False)


def token_batch(vocab_size: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab_size, (BATCH, LENGTH)).astype(np.int32)


def jax_loss_and_grad(run: RunConfig, path: Path, tokens: np.ndarray):
    """() -> loss: the jitted value-and-gradient of `train.step.loss_fn` on the checkpoint."""
    model = CausalLM(run.model)
    params, balance = split_variables(load_hf_checkpoint(path, progress=False)[1])
    batch = {"tokens": tokens, "segment_ids": np.ones_like(tokens),
             "positions": np.broadcast_to(np.arange(LENGTH, dtype=np.int32), tokens.shape).copy(),
             "meta_mask": np.zeros(tokens.shape, bool)}
    counts = jnp.array([tokens.shape[0] * (LENGTH - 1)], jnp.float32)
    grad = jax.jit(jax.value_and_grad(
        lambda p: loss_fn(model, run, p, balance, batch, False, counts, 1)[0]))

    def step():
        loss, grads = grad(params)
        jax.block_until_ready(grads)
        return float(loss)

    return step, params, balance


# Modules of the breakdown: (name, layer index in the checkpoint, how many such layers a step has).
def breakdown_modules(run: RunConfig) -> list[tuple[str, int | None, int]]:
    cfg = run.model
    types = [cfg.attention_type(i) for i in range(cfg.num_layers)]
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    return [("attention F", types.index("F"), types.count("F")),
            ("attention S", types.index("S"), types.count("S")),
            ("dense FFN", moe.index(False), moe.count(False)),
            ("MoE + shared expert", moe.index(True), moe.count(True)),
            ("LM head + cross-entropy", None, 1)]


def jax_module_steps(run: RunConfig, params, balance, inputs: dict, tokens: np.ndarray) -> dict:
    """name -> fwd+bwd closure of the stepjax module on the same input activation."""
    cfg = run.model
    layers = unstack_layers(params["layers"], cfg)
    layer_balance = unstack_layers(balance.get("layers", {}), cfg)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), tokens.shape)
    segments = jnp.ones(tokens.shape, jnp.int32)
    model = CausalLM(cfg)
    steps = {}
    for name, layer, _ in breakdown_modules(run):
        x = jnp.asarray(inputs[name])
        if name.startswith("attention"):
            module = Attention(cfg, name[-1])
            variables = {"params": layers[f"layer_{layer}"]["self_attn"]}
            apply = lambda v, h, m=module: m.apply(v, h, positions, segments)[0]  # noqa: E731
        elif name == "dense FFN":
            module = SwiGLU(cfg, cfg.dense_hidden)
            variables = {"params": layers[f"layer_{layer}"]["mlp"]}
            apply = module.apply
        elif name.startswith("MoE"):
            module = MoE(cfg)
            variables = {"params": layers[f"layer_{layer}"]["moe"],
                         "balance": layer_balance[f"layer_{layer}"]["moe"]}
            apply = lambda v, h, m=module: m.apply(v, h)[0]  # noqa: E731
        else:
            targets = shifted_targets(tokens, segments, jnp.zeros(tokens.shape, bool), 1, False)
            variables = output_head_params(cfg, params)

            def apply(v, h):
                project = lambda p, z: model.apply({"params": p}, z,  # noqa: E731
                                                   method=CausalLM.project)
                total, count = chunked_cross_entropy(project, v, h, targets,
                                                     run.train.loss_chunk_size)
                return total / count

        grad = jax.jit(jax.grad(lambda v, h, f=apply: jnp.sum(f(v, h)), argnums=(0, 1)))
        steps[name] = lambda g=grad, v=variables, x=x: jax.block_until_ready(g(v, x))
    return steps


def measure(size: str, rounds: int, compile_torch: bool, breakdown: bool) -> dict:
    run = run_config(size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint"
        write_checkpoint(run, path)
        torch_model, lm_head = torch_text_model(path)
        tokens = token_batch(run.model.vocab_size)
        jax_step, params, balance = jax_loss_and_grad(run, path, tokens)
    sides = {"stepjax": jax_step, "torch eager": torch_loss_and_grad(torch_model, lm_head, tokens,
                                                                      compile_it=False)}
    if compile_torch:
        sides["torch.compile"] = torch_loss_and_grad(torch_model, lm_head, tokens, compile_it=True)
    start = time.perf_counter()
    losses = {name: step() for name, step in sides.items()}  # compiles every side
    print(f"[{size}] losses {losses} (first calls {time.perf_counter() - start:.0f} s)", flush=True)
    reference = losses["torch eager"]
    for name, loss in losses.items():
        if abs(loss - reference) > 1e-3 * max(1.0, abs(reference)):
            raise SystemExit(f"vs_torch: {name} loss {loss} differs from torch eager {reference}")
    seconds = interleaved(sides, rounds, settle=1)
    flops = train_flops_per_token(run.model, LENGTH, 0) * BATCH * LENGTH
    result = {"size": size, "tokens": BATCH * LENGTH, "train_flops": flops, "loss": reference,
              "torch_threads": torch.get_num_threads(), "step_s": seconds}
    if breakdown:
        modules = [(name, layer) for name, layer, _ in breakdown_modules(run)]
        torch_steps = torch_module_steps(torch_model, lm_head, tokens, modules)
        jax_steps = jax_module_steps(run, params, balance,
                                     {name: x for name, (_, x) in torch_steps.items()}, tokens)
        rows = {}
        for name, _, count in breakdown_modules(run):
            pair = interleaved({"stepjax": jax_steps[name], "torch": torch_steps[name][0]}, rounds,
                               settle=1)
            rows[name] = {"layers": count, **{side: s for side, s in pair.items()}}
            print(f"[{size}] {name}: stepjax {1e3 * pair['stepjax']:.0f} ms, "
                  f"torch {1e3 * pair['torch']:.0f} ms", flush=True)
        result["breakdown_s"] = rows
    return result


def matmul_peaks() -> dict[str, float]:
    """Best float32 FLOP/s of stepjax's XLA and of torch on a large and a small matmul."""
    peaks = {}
    for label, shape in (("2048x2048x2048", (2048, 2048, 2048)),
                         ("128x512x256", (128, 512, 256))):
        peaks[f"xla {label}"] = measure_matmul_peak(shape)
        m, k, n = shape
        a, b = torch.randn(m, k), torch.randn(k, n)
        best = min(_median_seconds(lambda: a @ b, 5) for _ in range(4))
        peaks[f"torch {label}"] = 2.0 * m * k * n / best
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["bench", "medium"])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--no-compile", dest="compile_torch", action="store_false",
                        help="skip torch.compile (its first call compiles for minutes)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip the per-module breakdown")
    args = parser.parse_args()

    peaks = matmul_peaks()
    peak = peaks["xla 2048x2048x2048"]
    results = [measure(size, args.rounds, args.compile_torch, args.breakdown)
               for size in args.sizes]
    print("\nfloat32 matmul peaks, GFLOP/s: "
          + ", ".join(f"{name} {value / 1e9:.0f}" for name, value in peaks.items()) + "\n")
    rows = []
    for r in results:
        eager = r["step_s"]["torch eager"]
        for side, seconds in r["step_s"].items():
            rows.append([r["size"], side, f"{seconds:.2f}", f"{eager / seconds:.2f}x",
                         f"{r['train_flops'] / seconds / 1e9:.0f}",
                         f"{100 * r['train_flops'] / seconds / peak:.0f}%"])
    print(markdown_table(["size", "side", "fwd+bwd s", "speed vs torch eager", "GFLOP/s", "MFU"],
                         rows))
    for r in results:
        if "breakdown_s" not in r:
            continue
        print(f"\n{r['size']}: per layer fwd+bwd, ms\n")
        print(markdown_table(
            ["module", "layers", "stepjax", "torch eager", "torch / stepjax"],
            [[name, row["layers"], f"{1e3 * row['stepjax']:.0f}", f"{1e3 * row['torch']:.0f}",
              f"{row['torch'] / row['stepjax']:.2f}x"] for name, row in r["breakdown_s"].items()]))
    save("vs_torch_" + "_".join(args.sizes),
         {"matmul_peaks_flops": peaks, "batch": [BATCH, LENGTH], "results": results})


if __name__ == "__main__":
    main()
