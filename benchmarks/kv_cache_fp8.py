"""The FP8 KV cache's effect on the logits (`--kv-cache fp8`, model/inference/kv_storage.py).

    python -m benchmarks.kv_cache_fp8 --workdir runs/tiny --workdir runs/tiny_v4 [--prompts 8]

For each trained run: held-out corpus text fed through the decode caches in chunks (teacher
forcing, every position scored), once with the compute-dtype cache and once with the FP8 one;
per position, the logit difference relative to the logits' spread, KL(compute || fp8) of the
next-token distributions and whether the top-1 token agrees; then greedy continuations of the
prompts with each cache and the share of generated tokens that agree before the first
difference. KV-cache bytes at a 64k context of the model's full-size preset (shapes only).
Results: benchmarks/results/kv_cache_fp8.json.
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, save
from benchmarks.decode import heldout_prompts
from model.config import load_config
from model.inference.cache_memory import cache_bytes
from model.inference.decode import Decoder
from model.inference.kv_cache import KVCacheSpec
from model.lm import CausalLM, abstract_variables
from model.weights import load_model

CHUNK = 16
PRESETS = {"deepseek_v4": "configs/deepseek_v4_flash.yaml", "step3p5": "configs/step35_flash.yaml"}


def teacher_forced_logits(config, variables, prompts, fp8: bool) -> np.ndarray:
    """Logits [P, T, V] of every prompt position, fed through the caches CHUNK at a time."""
    rows, length = np.asarray(prompts, np.int32), len(prompts[0])
    model = CausalLM(config, KVCacheSpec(length, 0, fp8))

    @jax.jit
    def step(cache, tokens, positions):
        (normed, *_), mutated = model.apply({**variables, "cache": cache}, tokens, positions,
                                            method=CausalLM.decode_chunk, mutable=["cache"])
        return mutated["cache"], model.apply(variables, normed, method=CausalLM.project)

    cache = Decoder(config, variables, max_len=length, kv_fp8=fp8).init_cache(len(prompts))
    logits = []
    for start in range(0, length, CHUNK):
        tokens = rows[:, start:start + CHUNK]
        positions = np.broadcast_to(np.arange(start, start + tokens.shape[1]), tokens.shape)
        cache, chunk = step(cache, jnp.asarray(tokens), jnp.asarray(positions, np.int32))
        logits.append(np.asarray(chunk, np.float64))
    return np.concatenate(logits, 1)


def greedy_agreement(config, variables, prompts, new_tokens: int) -> float:
    """Mean share of the greedy continuation that agrees before the first differing token."""
    runs = [Decoder(config, variables, max_len=len(prompts[0]) + new_tokens,
                    prefill_chunk=CHUNK, kv_fp8=fp8).generate(prompts, new_tokens).tokens
            for fp8 in (False, True)]
    shares = []
    for plain, fp8 in zip(*runs):
        same = next((i for i, (a, b) in enumerate(zip(plain, fp8)) if a != b), len(plain))
        shares.append(same / len(plain))
    return float(np.mean(shares))


def measure(workdir: str, prompt_count: int, new_tokens: int, length: int) -> dict:
    config, variables = load_model(workdir)
    prompts = heldout_prompts(workdir, prompt_count, length)
    want, got = (teacher_forced_logits(config, variables, prompts, fp8) for fp8 in (False, True))
    spread = want.std(-1, keepdims=True)
    log_p = want - np.logaddexp.reduce(want, -1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, -1, keepdims=True)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), -1)
    family = "deepseek_v4" if set(config.layout) & set("WCH") else "step3p5"
    preset = load_config(PRESETS[family])
    abstract = nn.meta.unbox(abstract_variables(preset))
    sizes = {}
    for fp8 in (False, True):
        decoder = Decoder(preset, abstract, max_len=65536, kv_fp8=fp8)
        sizes[fp8] = sum(cache_bytes(preset, jax.eval_shape(
            lambda v, d=decoder: d._init_cache(v, 1), abstract)).values())
    row = {"workdir": workdir, "family": family, "positions": int(want.shape[0] * want.shape[1]),
           "max_abs_logit_diff_over_std": float(np.max(np.abs(got - want) / spread)),
           "mean_abs_logit_diff_over_std": float(np.mean(np.abs(got - want) / spread)),
           "mean_kl": float(np.mean(kl)), "max_kl": float(np.max(kl)),
           "top1_agreement": float(np.mean(want.argmax(-1) == got.argmax(-1))),
           "greedy_agreement": greedy_agreement(config, variables, prompts, new_tokens),
           "preset_cache_64k_bytes": sizes[False], "preset_cache_64k_bytes_fp8": sizes[True]}
    print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", action="append", required=True,
                        help="a trained run (repeat for several)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="prompt tokens (a multiple of "
                        f"{CHUNK})")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    rows = [measure(w, args.prompts, args.new_tokens, args.length) for w in args.workdir]
    save("kv_cache_fp8", {"rows": rows, "prompts": args.prompts, "length": args.length,
                          "new_tokens": args.new_tokens})
    keys = ["family", "max_abs_logit_diff_over_std", "mean_kl", "top1_agreement",
            "greedy_agreement"]
    print(markdown_table(keys, [[r[k] for k in keys] for r in rows]))


if __name__ == "__main__":
    main()
