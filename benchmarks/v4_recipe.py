"""DeepSeek-V4's own training recipe against Step 3.5's defaults, on the tiny V4 model.

    python -m benchmarks.v4_recipe --workdir runs/v4_recipe [--eval-batches 8] [--eval-lens 512 1024]

1. `recipe`: configs/recipes/tiny_deepseek_v4.yaml (dense attention at 128 and 256 tokens, the
   indexer warm-up at 512, sparse attention at 512 with the decay and MTP weight 0.3 -> 0.1,
   1024 tokens with YaRN; V4's optimizer and losses).
2. `step35`: the same model with Step 3.5's training defaults: Muon
   with Polar Express (T = 6, update RMS 0.2), AdamW eps 1e-8, the EP-group balance loss 0.001
   on top of the sequence-wise 1e-4, sparse attention from the first step (the indexer learns
   only from the KL over its own top-k), MTP weight 0.3 throughout, one length (512), warm-up
   then cosine from 3e-3 to 3e-4; as many training tokens as the recipe.
3. Both final weights on the same held-out batches at each `--eval-lens` length: the main head's
   loss with sparse attention (as trained and deployed) and the indexer's top-k recall against
   the dense attention (C layers switched to dense: the share of the indexer's top-k among the
   attention's top-k entries, over the queries that see more than k); the recall also after
   every recipe stage, at 512 tokens.
Re-running skips finished training. Results: benchmarks/results/v4_recipe.json and
docs/images/v4_recipe.png (training loss per token seen; held-out loss; recall through the
recipe's stages and at the baseline's end).
"""

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import markdown_table, save  # noqa: E402
from model.lm import CausalLM  # noqa: E402
from model.tokenizers.text import load_tokenizer  # noqa: E402
from model.weights import load_model  # noqa: E402
from train.config import load_run_config  # noqa: E402
from train.data.pipeline import make_dataset  # noqa: E402
from train.eval import make_eval_step  # noqa: E402
from train.experiments.recipe import load_recipe, run_recipe  # noqa: E402
from train.loop import train  # noqa: E402
from train.telemetry.metrics import METRICS_FILE, read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "recipes" / "tiny_deepseek_v4.yaml"
PRESET = ROOT / "configs" / "tiny_deepseek_v4.yaml"
IMAGE = ROOT / "docs" / "images" / "v4_recipe.png"
# Step 3.5's training defaults on the V4 model (train/config.py, train/optim/config.py).
STEP35 = ["train.muon.orthogonalizer=polar_express", "train.muon.steps=6",
          "train.muon.finish_steps=null", "train.muon.update_rms=0.2", "train.adam_eps=1e-8",
          "train.balance_loss_coef=0.001", "train.seq_len=512", "train.batch_size=2",
          "train.warmup_steps=10", "train.schedule=cosine", "train.lr=3e-3", "train.min_lr=3e-4",
          "train.eval_every=0", "train.log_every=5", "train.checkpoint_every=1000",
          "train.progress=false"]


def recipe_tokens(recipe) -> int:
    """Training tokens of every stage of `recipe`, batch ramps included."""
    total = 0
    for i in range(len(recipe.stages)):
        t = recipe.stage_config(i).train
        total += sum(t.batch_size_at(step) for step in range(t.steps)) * t.seq_len
    return total


def train_both(workdir: Path) -> dict[str, Path]:
    recipe = load_recipe(RECIPE, ["train.progress=false"])
    run_recipe(recipe, workdir / "recipe", ["train.progress=false"])
    steps = recipe_tokens(recipe) // (2 * 512)
    train(load_run_config(PRESET, [*STEP35, f"train.steps={steps}"]), workdir / "step35")
    return {"recipe": recipe.stage_dir(workdir / "recipe", len(recipe.stages) - 1),
            "step35": workdir / "step35"}


def evaluate(run_dir: Path, seq_len: int, batches: int, loss: bool = True) -> dict:
    """Held-out main-head loss (sparse, as trained) and the indexer's recall (dense C layers)."""
    config, variables = load_model(run_dir)
    data_cfg = load_run_config(PRESET).train.data
    data = make_dataset(data_cfg, load_tokenizer(data_cfg.tokenizer), seq_len=seq_len,
                        batch_size=4, split="heldout", seed=0)
    dense = config.replace(shared_kv_attention=dataclasses.replace(
        config.shared_kv_attention, csa_attention="dense"))
    loss_step = make_eval_step(CausalLM(config), 1024)
    dense_model = CausalLM(dense)
    recall_step = jax.jit(lambda v, b: dense_model.apply(
        v, b["tokens"], b["segment_ids"], b["positions"], compute_logits=False,
        num_mtp_heads=0).aux["indexer_recall"])
    params, balance = variables["params"], variables.get("balance", {})
    total = count = 0.0
    recalls = []
    for _, batch in zip(range(batches), data):
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        if loss:
            loss_sum, weight = loss_step(params, balance, batch)
            total, count = total + float(loss_sum), count + float(weight)
        recalls.append(float(recall_step(variables, batch)))
    out = {"recall": float(np.nanmean(recalls))}
    return {"loss": total / count, "tokens": int(count), **out} if loss else out


def tokens_seen(run_dir: Path) -> int:
    records = [r for r in read_metrics(run_dir / METRICS_FILE) if "tokens_seen" in r]
    return records[-1]["tokens_seen"]


def loss_curve(run_dirs: list[Path]) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """(tokens seen, main-head training loss) over the runs in order, and where each starts."""
    tokens, losses, starts, seen = [], [], [], 0
    for run_dir in run_dirs:
        starts.append(seen)
        for r in read_metrics(run_dir / METRICS_FILE):
            if "loss/lm" in r:
                tokens.append(seen + r["tokens_seen"])
                losses.append(r["loss/lm"])
        seen += tokens_seen(run_dir)
    return np.array(tokens), np.array(losses), starts


def plot(workdir: Path, results: dict, lens: list[int]) -> None:
    recipe = sorted((workdir / "recipe" / "stages").iterdir())
    fig, (curves, bars, recall) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, dirs in (("V4 recipe", recipe), ("Step 3.5 defaults", [workdir / "step35"])):
        x, y, starts = loss_curve(dirs)
        curves.plot(x, y, label=name)
        for start, stage in zip(starts[1:], dirs[1:]):
            curves.axvline(start, color="grey", lw=0.5, ls=":")
            curves.text(start, 0.99, stage.name[3:], rotation=90, va="top", fontsize=7,
                        color="grey", transform=curves.get_xaxis_transform())
    curves.set(xlabel="training tokens", ylabel="main-head training loss (nats)",
               title="training loss (each stage at its own length)")
    curves.legend()
    width = 0.35
    for i, (name, label) in enumerate((("recipe", "V4 recipe"), ("step35", "Step 3.5 defaults"))):
        values = [results[name][str(n)]["loss"] for n in lens]
        xs = np.arange(len(lens)) + (i - 0.5) * width
        bars.bar(xs, values, width, label=label)
        for x, v in zip(xs, values):
            bars.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    low = min(results[n][str(t)]["loss"] for n in ("recipe", "step35") for t in lens)
    bars.set_ylim(low - 0.3, None)
    bars.set_xticks(np.arange(len(lens)), [f"{n} tokens" for n in lens])
    bars.set(ylabel="held-out loss (nats)", title="held-out loss, sparse attention")
    bars.legend(fontsize=8)
    stages = results["recipe_stages"]
    recall.plot([s["tokens"] for s in stages], [s["recall"] for s in stages], "o-",
                label="V4 recipe, after each stage")
    for s in stages:
        recall.annotate(s["stage"], (s["tokens"], s["recall"]), fontsize=7,
                        textcoords="offset points", xytext=(3, -10))
    recall.plot([results["step35_tokens"]], [results["step35"]["512"]["recall"]], "s",
                color="C1", label="Step 3.5 defaults, end")
    recall.set(xlabel="training tokens", ylabel="top-k recall at 512 tokens",
               title="indexer recall against dense attention")
    recall.legend(fontsize=8)
    fig.tight_layout()
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMAGE, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.v4_recipe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--eval-batches", type=int, default=8, metavar="N")
    parser.add_argument("--eval-lens", type=int, nargs="+", default=[512, 1024], metavar="T")
    args = parser.parse_args(argv)
    runs = train_both(args.workdir)
    results = {name: {str(n): evaluate(path, n, args.eval_batches) for n in args.eval_lens}
               for name, path in runs.items()}
    seen, results["recipe_stages"] = 0, []
    for stage in sorted((args.workdir / "recipe" / "stages").iterdir()):
        seen += tokens_seen(stage)
        results["recipe_stages"].append({"stage": stage.name[3:], "tokens": seen, **evaluate(
            stage, 512, args.eval_batches, loss=False)})
    results["step35_tokens"] = tokens_seen(runs["step35"])
    rows = [[name, n, f"{results[name][str(n)]['loss']:.3f}",
             f"{results[name][str(n)]['recall']:.3f}"] for name in runs for n in args.eval_lens]
    rows += [[f"recipe after {s['stage']}", 512, "", f"{s['recall']:.3f}"]
             for s in results["recipe_stages"]]
    print(markdown_table(["run", "eval length", "held-out loss", "indexer recall"], rows))
    save("v4_recipe", {"results": results, "eval_batches": args.eval_batches,
                       "step35_overrides": STEP35})
    plot(args.workdir, results, args.eval_lens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
