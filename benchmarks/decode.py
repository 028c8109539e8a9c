"""Decoding speed with and without MTP speculative decoding, and KV-cache bytes vs context.

    python -m benchmarks.decode --workdir runs/tiny_mtp3 [--prompts 8] [--new-tokens 96]

1. `--workdir`: a trained run (tiny, all MTP heads trained, as `make bench` trains it). Greedy
   continuations of held-out corpus prompts at batch 1: decode tokens/s with 0..3 drafted
   tokens, mean accepted length (tokens committed per main-model pass) and speedup.
2. `medium` (d_model 1024, as benchmarks/train_step.py) with random weights: the cost of one
   plain decode pass and of one verify pass (drafting included) per draft count, and the
   speedup those costs give at the acceptance lengths measured in 1. Random MTP heads accept
   almost nothing, so this part measures cost, not acceptance.
3. KV-cache bytes of the Step 3.5 Flash preset (batch 1, its compute dtype) against context
   length: SWA rings are flat, full-attention caches linear. Shapes only (`jax.eval_shape`).
Results: benchmarks/results/decode.json and decode_cache.png.
"""

import argparse
import time

import flax.linen as nn
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import RESULTS, markdown_table, save  # noqa: E402
from model.config import load_config  # noqa: E402
from model.inference.cache_memory import cache_bytes  # noqa: E402
from model.inference.decode import Decoder  # noqa: E402
from model.lm import CausalLM, abstract_variables, init_variables  # noqa: E402
from model.weights import load_model  # noqa: E402

MEDIUM = ["d_model=1024", "head_dim=128", "full_attention.num_heads=8",
          "swa_attention.num_heads=12", "window=256", "dense_hidden=2816",
          "moe.expert_hidden=512", "moe.shared_hidden=512"]


def heldout_prompts(workdir: str, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` long-enough held-out documents."""
    from pathlib import Path

    from model.generate import workdir_tokenizer
    from model.tokenizers.text import load_tokenizer
    from train.config import DataConfig
    from train.data.corpus import load_documents
    from train.data.documents import split_documents

    tokenizer = load_tokenizer(workdir_tokenizer(Path(workdir)))
    _, heldout = split_documents(load_documents("stdlib"), DataConfig.heldout_fraction)
    prompts = []
    for doc in heldout:
        ids = tokenizer.encode(doc.text)
        if len(ids) >= length:
            prompts.append(ids[:length].tolist())
        if len(prompts) == count:
            break
    return prompts


def trained_speed(workdir: str, prompts, new_tokens: int) -> list[dict]:
    config, variables = load_model(workdir)
    rows, plain_rate = [], None
    for draft in range(config.mtp.num_heads + 1):
        decoder = Decoder(config, variables, max_len=len(prompts[0]) + new_tokens + draft,
                          draft=draft, prefill_chunk=len(prompts[0]))
        decoder.generate(prompts[:1], 8, speculative=draft > 0)  # compile
        tokens = seconds = passes = row_tokens = 0
        for prompt in prompts:
            out = decoder.generate([prompt], new_tokens, speculative=draft > 0)
            tokens += out.decode_tokens
            seconds += out.decode_seconds
            passes += out.forward_passes
            row_tokens += out.mean_accepted * out.forward_passes
        rate = tokens / seconds
        plain_rate = plain_rate or rate
        rows.append({"model": "tiny (trained)", "draft": draft, "tokens_per_s": rate,
                     "mean_accepted": row_tokens / passes, "speedup": rate / plain_rate})
        print(f"tiny draft={draft}: {rate:.1f} tok/s, accepted {row_tokens / passes:.2f}, "
              f"speedup {rate / plain_rate:.2f}x", flush=True)
    return rows


def pass_cost(config, variables, draft: int, prompt_len: int = 64, passes: int = 12) -> float:
    """Median wall seconds of one decode (draft 0) or verify+draft pass at batch 1."""
    decoder = Decoder(config, variables, max_len=prompt_len + passes * (draft + 1) + 8 + draft,
                      draft=draft, prefill_chunk=prompt_len)
    prompt = [list(range(1, prompt_len + 1))]
    decoder.generate(prompt, 4, speculative=draft > 0)  # compile
    out = decoder.generate(prompt, passes * (draft + 1), speculative=draft > 0)
    return out.decode_seconds / max(out.forward_passes - 1, 1)


def medium_costs(accepted: dict[int, float]) -> list[dict]:
    config = load_config("configs/tiny.yaml", MEDIUM)
    variables = nn.meta.unbox(jax.jit(lambda key: init_variables(CausalLM(config), key))(
        jax.random.key(0)))
    base = pass_cost(config, variables, 0)
    rows = []
    for draft in range(config.mtp.num_heads + 1):
        cost = base if draft == 0 else pass_cost(config, variables, draft)
        projected = accepted.get(draft, 1.0) / (cost / base)
        rows.append({"model": "medium (random)", "draft": draft, "pass_s": cost,
                     "tokens_per_s_at_tiny_acceptance": accepted.get(draft, 1.0) / cost,
                     "projected_speedup": projected})
        print(f"medium draft={draft}: {cost * 1e3:.1f} ms/pass, projected speedup "
              f"{projected:.2f}x", flush=True)
    return rows


def cache_scaling(contexts=(4096, 16384, 65536, 262144)) -> list[dict]:
    config = load_config("configs/step35_flash.yaml")
    abstract = nn.meta.unbox(abstract_variables(config))
    rows = []
    for context in contexts:
        decoder = Decoder(config, abstract, max_len=context, draft=3)
        cache = jax.eval_shape(lambda v: decoder._init_cache(v, 1), abstract)
        sizes = cache_bytes(config, cache)
        rows.append({"context": context, **sizes})
        print(f"context {context}: full {sizes['full'] / 2**30:.2f} GiB, "
              f"swa {sizes['swa'] / 2**20:.1f} MiB", flush=True)
    return rows


def plot_cache(rows: list[dict]) -> None:
    contexts = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(contexts, [r["full"] / 2**30 for r in rows], "o-", label="full-attention layers (12)")
    ax.plot(contexts, [r["swa"] / 2**30 for r in rows], "s-",
            label="SWA layers (33) + MTP heads (3)")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="KV cache, GiB (batch 1)", title="Step 3.5 Flash decode cache")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "decode_cache.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="trained run with MTP heads")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    started = time.perf_counter()
    prompts = heldout_prompts(args.workdir, args.prompts, args.prompt_len)
    trained = trained_speed(args.workdir, prompts, args.new_tokens)
    medium = medium_costs({r["draft"]: r["mean_accepted"] for r in trained})
    cache = cache_scaling()
    plot_cache(cache)
    print(markdown_table(
        ["model", "drafted tokens", "decode tok/s", "mean accepted length", "speedup"],
        [[r["model"], r["draft"], f"{r['tokens_per_s']:.1f}", f"{r['mean_accepted']:.2f}",
          f"{r['speedup']:.2f}x"] for r in trained]))
    print(markdown_table(
        ["model", "drafted tokens", "ms per pass", "tok/s at tiny's acceptance",
         "projected speedup"],
        [[r["model"], r["draft"], f"{r['pass_s'] * 1e3:.1f}",
          f"{r['tokens_per_s_at_tiny_acceptance']:.1f}", f"{r['projected_speedup']:.2f}x"]
         for r in medium]))
    print(markdown_table(["context", "full-attention cache", "SWA + MTP cache"],
                         [[r["context"], f"{r['full'] / 2**30:.2f} GiB",
                           f"{r['swa'] / 2**20:.1f} MiB"] for r in cache]))
    save("decode", {"settings": vars(args), "trained": trained, "medium": medium,
                    "cache": cache, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
