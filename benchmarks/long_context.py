"""Long context: KV-cache bytes and per-token decode FLOPs of the three full-size presets from 4k
to 1M tokens next to the reports' claims, and measured decode speed of tiny models as the
prompt grows.

    python -m benchmarks.long_context [--prompt-lens 64 256 1024 4096] [--new-tokens 64]
                                      [--rounds 7] [--analytic-only]

1. Analytic (`model.flops`, nothing allocated), backbone only (`mtp.num_heads=0`), batch 1, the
   presets' bfloat16: KV-cache bytes and the FLOPs of one decode token at context N. Each KV
   figure is checked against the decode cache's shapes (`jax.eval_shape` of the Decoder's cache
   init at max_len N): its key / value / entry arrays must hold exactly `kv_cache_bytes`; the
   slot positions and the compressors' tails come on top and are reported. Next to the claims:
   Step 3.5 Flash report Table 8 (whole-model FLOPs of layouts relative to S3F1 with 64 SWA
   heads, 64K / 256K), the MiMo-V2-Flash report's "KV-cache storage and attention compute
   reduced by nearly 6x" against all-global attention, the DeepSeek-V4 report's KV "about 2%"
   of a BF16 GQA-8 baseline at 1M (§2.3.4; its V3.2 comparison, Figure 1, is in
   docs/performance.md, "DeepSeek-V4-Flash at 1M context").
2. Measured: greedy decode tokens/s at batch 1 of the three tiny presets (random weights,
   float32) at each prompt length, plain and with MTP drafts (every head the model has), each
   Decoder sized to its prompt (max_len = prompt + new tokens + drafts: a static-shape decoder's
   step cost is set by max_len, not by how much of the cache is filled). Every family, prompt
   length and mode runs once per round, all compiled beforehand; median and best over rounds,
   next to the growth of the backbone's decode FLOPs (`model.flops`). Random MTP heads accept
   few drafts: the accepted length is reported with each row.
Results: benchmarks/results/long_context.json and long_context.png.
"""

import argparse
import statistics
import time
from pathlib import Path

import flax.linen as nn
import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import RESULTS, markdown_table, save  # noqa: E402
from model.config import load_config  # noqa: E402
from model.config.cli import human  # noqa: E402
from model.flops import forward_flops, kv_cache_bytes  # noqa: E402
from model.inference.decode import Decoder, required_length  # noqa: E402
from model.lm import CausalLM, abstract_variables, init_variables  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PRESETS = {"Step 3.5 Flash": "step35_flash.yaml", "MiMo-V2-Flash": "mimo_v2_flash.yaml",
           "DeepSeek-V4-Flash": "deepseek_v4_flash.yaml"}
TINY = {"Step 3.5": "tiny.yaml", "MiMo-V2": "tiny_mimo.yaml",
        "DeepSeek-V4": "tiny_deepseek_v4.yaml"}
BACKBONE = ["mtp.num_heads=0"]
CONTEXTS = (4096, 32768, 131072, 1048576)
PLOT_CONTEXTS = tuple(2**k for k in range(12, 21))
# Cache leaves that hold keys / values / compressed entries (and the CSA indexer's keys, also
# `entries`); the others are slot positions and the compressors' per-token tails.
KV_LEAVES = ("key", "value", "window_kv", "entries")

# Step 3.5 report Table 8, Step 3.5 Flash rows: FLOPs relative to S3F1 with 64 SWA heads.
TABLE8 = {"S3F1+Head": {"decode": (1.02, 1.01), "prefill": (1.08, 1.04)},
          "S1F1": {"decode": (1.18, 1.47), "prefill": (1.38, 1.71)},
          "FFFF": {"decode": (1.51, 2.33), "prefill": (2.07, 3.00)}}
TABLE8_LAYOUTS = {"S3F1": ["swa_attention.num_heads=64"], "S3F1+Head": [],
                  "S1F1": ["swa_attention.num_heads=64", "layout=F+SF*22"], "FFFF": ["layout=F*45"]}
TABLE8_CONTEXTS = (65536, 262144)
MIMO_ALL_GLOBAL = ["layout=F*48"]  # every layer a GA layer with its 4 KV heads
V4_GQA8 = ["layout=F*43", "num_kv_heads=8", "head_dim=128"]  # §2.3.4's BF16 GQA-8 baseline


def preset(name: str, overrides=()):
    return load_config(CONFIGS / PRESETS[name], [*BACKBONE, *overrides])


def decoder_cache_bytes(cfg, context: int) -> tuple[int, int]:
    """(bytes of the key / value / entry arrays, bytes of every array) of the decode cache at
    max_len = context, batch 1, no drafts; from shapes only."""
    abstract = nn.meta.unbox(abstract_variables(cfg))
    decoder = Decoder(cfg, abstract, max_len=context)
    cache = jax.eval_shape(lambda v: decoder._init_cache(v, 1), abstract)
    kv = total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        size = leaf.size * leaf.dtype.itemsize
        total += size
        kv += size if path[-1].key in KV_LEAVES else 0
    return kv, total


def preset_scaling(contexts=CONTEXTS, check=True) -> list[dict]:
    """Per preset and context: KV bytes (compute dtype, and as V4's release stores them), the
    decode cache's bytes from eval_shape (`check`), decode FLOPs and their score part
    (attention and indexer scores, the terms that grow with the context)."""
    rows = []
    for name in PRESETS:
        cfg = preset(name)
        for context in contexts:
            result = forward_flops(cfg, context, "decode")
            breakdown = result["breakdown"]
            row = {"preset": name, "context": context, "decode_flops": result["total"],
                   "score_flops": breakdown["attention_scores"] + breakdown["indexer_scores"],
                   "kv_cache_bytes": result["kv_cache_bytes"],
                   "kv_cache_bytes_v4_release": result["kv_cache_bytes_v4_release"]}
            if check:
                kv, total = decoder_cache_bytes(cfg, context)
                if kv != row["kv_cache_bytes"]:
                    raise AssertionError(f"{name} at {context}: decode cache K/V arrays hold {kv} "
                                         f"bytes, kv_cache_bytes says {row['kv_cache_bytes']}")
                row["decoder_cache_bytes"] = total
            rows.append(row)
    return rows


def table8_ratios() -> list[dict]:
    """Whole-model FLOPs of Table 8's Step 3.5 Flash layouts over S3F1 with 64 SWA heads, and
    `score_weight`: the weight w on the attention-score FLOPs A (the rest R kept) at which
    (R + wA) / (R_S3F1 + wA_S3F1) equals the report's ratio r, w = (r R_S3F1 - R) / (A - r A_S3F1)
    (1 = the plain count agrees)."""
    def parts(layout, mode, n):
        result = forward_flops(preset("Step 3.5 Flash", TABLE8_LAYOUTS[layout]), n, mode)
        scores = result["breakdown"]["attention_scores"]
        return result["total"] - scores, scores

    rows = []
    for layout in TABLE8:
        for mode in ("decode", "prefill"):
            for n, report in zip(TABLE8_CONTEXTS, TABLE8[layout][mode]):
                (rest, scores), (base_rest, base_scores) = (parts(layout, mode, n),
                                                            parts("S3F1", mode, n))
                # +Head differs from S3F1 in SWA heads only: its ratio, given to 2 decimals,
                # does not pin w down, so none is fitted.
                weight = None if layout == "S3F1+Head" else (
                    (report * base_rest - rest) / (scores - report * base_scores))
                rows.append({"layout": layout, "mode": mode, "context": n, "report": report,
                             "ratio": (rest + scores) / (base_rest + base_scores),
                             "score_weight": weight})
    return rows


def baseline_ratios(contexts=CONTEXTS) -> dict:
    """MiMo against all-global attention (KV and decode attention scores) and DeepSeek-V4's KV
    against the BF16 GQA-8 baseline, per context."""
    mimo, mimo_ga = preset("MiMo-V2-Flash"), preset("MiMo-V2-Flash", MIMO_ALL_GLOBAL)
    v4, gqa8 = preset("DeepSeek-V4-Flash"), preset("DeepSeek-V4-Flash", V4_GQA8)

    def scores(cfg, n):
        return forward_flops(cfg, n, "decode")["breakdown"]["attention_scores"]

    return {
        "mimo_vs_all_global": [
            {"context": n, "kv": kv_cache_bytes(mimo_ga, n) / kv_cache_bytes(mimo, n),
             "decode_scores": scores(mimo_ga, n) / scores(mimo, n)} for n in contexts],
        "v4_vs_gqa8": [
            {"context": n, "gqa8_bytes": kv_cache_bytes(gqa8, n),
             "as_stored": kv_cache_bytes(v4, n, "v4_release") / kv_cache_bytes(gqa8, n),
             "bf16": kv_cache_bytes(v4, n) / kv_cache_bytes(gqa8, n)} for n in contexts]}


def plot(rows: list[dict], path: Path) -> None:
    fig, (kv_ax, flops_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, marker in zip(PRESETS, "osD"):
        own = [r for r in rows if r["preset"] == name]
        contexts = [r["context"] for r in own]
        line, = kv_ax.plot(contexts, [r["kv_cache_bytes"] / 1e9 for r in own], marker + "-",
                           label=f"{name} (bf16)")
        if name == "DeepSeek-V4-Flash":
            kv_ax.plot(contexts, [r["kv_cache_bytes_v4_release"] / 1e9 for r in own],
                       marker + "--", color=line.get_color(), label=f"{name} (as released)")
        flops_ax.plot(contexts, [r["decode_flops"] / 1e9 for r in own], marker + "-",
                      label=name)
    kv_ax.set(ylabel="KV cache, GB (batch 1)", title="KV cache vs context")
    flops_ax.set(ylabel="GFLOPs per decoded token", title="decode FLOPs vs context")
    for ax in (kv_ax, flops_ax):
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)")
        ax.set_xticks(PLOT_CONTEXTS, [f"{n // 1024}k" if n < 2**20 else "1M"
                                      for n in PLOT_CONTEXTS])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Backbones (no MTP), model.flops; full-size presets", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tiny_model(path: str):
    config = load_config(CONFIGS / path)
    variables = nn.meta.unbox(jax.jit(lambda key: init_variables(CausalLM(config), key))(
        jax.random.key(0)))
    return config, variables


def measured_speed(prompt_lens, new_tokens: int, rounds: int) -> list[dict]:
    """Decode tokens/s per tiny family, prompt length and mode (plain / speculative)."""
    runs = {}
    for family, path in TINY.items():
        config, variables = tiny_model(path)
        draft = config.mtp.num_heads
        for length in prompt_lens:
            prompt = [np.random.default_rng(length).integers(1, config.vocab_size,
                                                             length).tolist()]
            decoder = Decoder(config, variables, draft=draft,
                              max_len=required_length([length], new_tokens, draft))
            for speculative in (False, True):
                decoder.generate(prompt, 4, speculative=speculative)  # compile
                runs[family, length, speculative] = (decoder, prompt, [])
        print(f"{family}: compiled for prompts of {prompt_lens}", flush=True)
    # Every (family, length, mode) once per round: a slow patch of the shared machine hits all
    # of them alike, so the ratios to the shortest prompt hold even when the rates drift.
    for round_ in range(rounds):
        for (family, length, speculative), (decoder, prompt, outs) in runs.items():
            outs.append(decoder.generate(prompt, new_tokens, speculative=speculative))
        print(f"round {round_ + 1}/{rounds} done", flush=True)
    rows = []
    for (family, length, speculative), (decoder, _, outs) in runs.items():
        rates = [o.tokens_per_second for o in outs]
        backbone = load_config(CONFIGS / TINY[family], BACKBONE)
        rows.append({"family": family, "prompt_len": length, "speculative": speculative,
                     "draft": decoder.spec.draft if speculative else 0,
                     "tokens_per_s": statistics.median(rates), "tokens_per_s_best": max(rates),
                     "mean_accepted": statistics.mean(o.mean_accepted for o in outs),
                     "prefill_s": statistics.median(o.prefill_seconds for o in outs),
                     "backbone_decode_flops": forward_flops(backbone, length, "decode")["total"]})
    for row in rows:
        shortest = next(r for r in rows if r["family"] == row["family"]
                        and r["speculative"] == row["speculative"])
        for key in ("tokens_per_s", "tokens_per_s_best", "backbone_decode_flops"):
            row[f"{key}_vs_shortest"] = row[key] / shortest[key]
    return rows


def print_tables(scaling, table8, baselines, speed) -> None:
    print(markdown_table(
        ["preset", "context", "KV cache (bf16)", "decode cache arrays", "decode FLOPs",
         "of which scores"],
        [[r["preset"], f"{r['context']:,}", human(r["kv_cache_bytes"], "B"),
          human(r["decoder_cache_bytes"], "B"),
          human(r["decode_flops"], "FLOP"), f"{100 * r['score_flops'] / r['decode_flops']:.0f}%"]
         for r in scaling]))
    print(markdown_table(["layout", "mode", "context", "model.flops", "Table 8",
                          "score weight that gives Table 8"],
                         [[r["layout"], r["mode"], r["context"], f"{r['ratio']:.2f}",
                           f"{r['report']:.2f}",
                           "" if r["score_weight"] is None else f"{r['score_weight']:.2f}"]
                          for r in table8]))
    print(markdown_table(["context", "MiMo all-GA / hybrid KV", "decode scores",
                          "V4 KV / GQA-8, as stored", "bf16"],
                         [[f"{m['context']:,}", f"{m['kv']:.2f}x", f"{m['decode_scores']:.2f}x",
                           f"{100 * v['as_stored']:.2f}%", f"{100 * v['bf16']:.2f}%"]
                          for m, v in zip(baselines["mimo_vs_all_global"],
                                          baselines["v4_vs_gqa8"])]))
    if speed:
        print(markdown_table(
            ["family", "prompt", "drafts", "decode tok/s, median / best", "vs shortest",
             "accepted length", "backbone FLOPs per token vs shortest"],
            [[r["family"], r["prompt_len"], r["draft"],
              f"{r['tokens_per_s']:.1f} / {r['tokens_per_s_best']:.1f}",
              f"{r['tokens_per_s_vs_shortest']:.2f}x / {r['tokens_per_s_best_vs_shortest']:.2f}x",
              f"{r['mean_accepted']:.2f}", f"{r['backbone_decode_flops_vs_shortest']:.2f}x"]
             for r in speed]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="timed generations per row")
    parser.add_argument("--analytic-only", action="store_true",
                        help="part 1 only, printed (no timing; the results file is left alone)")
    args = parser.parse_args()
    started = time.perf_counter()
    scaling = preset_scaling()
    curves = preset_scaling(PLOT_CONTEXTS, check=False)
    plot(curves, RESULTS / "long_context.png")
    table8, baselines = table8_ratios(), baseline_ratios()
    if args.analytic_only:
        print_tables(scaling, table8, baselines, [])
        return
    speed = measured_speed(args.prompt_lens, args.new_tokens, args.rounds)
    print_tables(scaling, table8, baselines, speed)
    save("long_context", {"settings": vars(args), "presets": scaling, "table8": table8,
                          **baselines, "measured": speed,
                          "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
