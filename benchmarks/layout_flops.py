"""Attention-side FLOPs of a layout sweep's runs relative to one of them, as in report Table 1.

    python -m benchmarks.layout_flops [--sweep configs/sweeps/layout.yaml] [--reference S3F1]

Table 1's "Rel. FLOPs" are attention-side (q/k/v/o/gate projections + scores, `model.flops`)
FLOPs averaged over 64K and 256K contexts, normalised to S3F1, for decode and prefill. The report
uses W = 512, so those contexts are 128 W and 512 W; the tiny sweeps have W = 32, so the same
ratios of context to window are 4K and 16K. Analytic (no timing): the numbers depend on the
configs only.
"""

import argparse

from benchmarks.common import markdown_table, save
from model.config.cli import ArgumentParser
from model.flops import forward_flops
from train.experiments.sweep_file import load_sweep

CONTEXTS_IN_WINDOWS = (128, 512)  # report Table 1: 64K and 256K at W = 512


def attention_flops(cfg, context: int, mode: str) -> int:
    breakdown = forward_flops(cfg, context, mode)["breakdown"]
    return breakdown["attention_projections"] + breakdown["attention_scores"]


def relative_flops(sweep_path: str, reference: str) -> list[dict]:
    """[{name, window, decode, prefill}]: attention-side FLOPs of every run over the reference
    run's, averaged over contexts of 128 and 512 windows."""
    sweep = load_sweep(sweep_path)
    models = {run.name: sweep.run_config(run).model for run in sweep.runs}
    if reference not in models:
        raise ValueError(f"--reference: no run named {reference} in {sweep_path} "
                         f"(runs: {', '.join(models)})")
    rows = []
    for name, cfg in models.items():
        row = {"name": name, "window": cfg.window}
        for mode in ("decode", "prefill"):
            ratios = [attention_flops(cfg, k * cfg.window, mode)
                      / attention_flops(models[reference], k * cfg.window, mode)
                      for k in CONTEXTS_IN_WINDOWS]
            row[mode] = sum(ratios) / len(ratios)
        rows.append(row)
    return rows


def main() -> None:
    parser = ArgumentParser(prog="python -m benchmarks.layout_flops", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="configs/sweeps/layout.yaml", metavar="PATH")
    parser.add_argument("--reference", default="S3F1", metavar="NAME",
                        help="the run the others are normalised to")
    args = parser.parse_args()
    try:
        rows = relative_flops(args.sweep, args.reference)
    except ValueError as err:
        parser.error(str(err))
    print(markdown_table(["run", "W", "rel. decode FLOPs", "rel. prefill FLOPs"],
                         [[r["name"], r["window"], f"{r['decode']:.2f}", f"{r['prefill']:.2f}"]
                          for r in rows]))
    save("layout_flops", {"sweep": args.sweep, "reference": args.reference,
                          "contexts_in_windows": list(CONTEXTS_IN_WINDOWS), "rows": rows})


if __name__ == "__main__":
    main()
