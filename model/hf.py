"""Hugging Face checkpoint import and export: the documented path (the code is in model/interop/).

    python -m model.hf import HF_DIR --out MODEL_DIR           # -> a stepjax model directory
    python -m model.hf import --hf ORG/NAME --out MODEL_DIR    # downloads it first ([hub] extra)
    python -m model.hf export MODEL_DIR_OR_WORKDIR --out HF_DIR [--dtype bfloat16]
        [--names release] [--expert-dtype fp4]                 # DeepSeek-V4's release layout

    cfg, variables = load_hf_checkpoint("Step-3.5-Flash/")     # streams shard by shard
    save_hf_checkpoint(cfg, variables, "exported/", dtype="bfloat16")

Supported families, picked by config.json's `model_type` on import and by the model's layers on
export (W/C/H layers: DeepSeek-V4; a sink or per-type GQA geometry: MiMo-V2-Flash; else
Step 3.5):
- Step 3.5 Flash (`model_type: step3p5`, model/interop/step3p5.py), the published format;
- DeepSeek-V4 (`model_type: deepseek_v4`, model/interop/deepseek_v4.py), as transformers'
  DeepseekV4ForCausalLM saves and loads it (save_pretrained's default tensor names), plus the
  release's MTP layers (`mtp.{h}.*`, which transformers skips); imports also read the release's
  own tensor names and config keys, as transformers' from_pretrained reads them; exports write
  save_pretrained's names or the release's;
- MiMo-V2-Flash (`model_type: mimo_v2_flash`, model/interop/mimo_v2_flash.py), as transformers'
  MiMoV2FlashForCausalLM saves and loads it (no MTP layers).
An export from a training or RL workdir writes the run's tokenizer beside the weights
(tokenizer.json, tokenizer_config.json with its chat template), so `python -m model.generate
--hf` reads the directory as it is; `--drop-mtp` leaves the MTP heads out (MiMo-V2-Flash's
transformers model has none; DeepSeek-V4 exports only its own kind, `mtp.block: layer`).
Quantized checkpoints in the layouts transformers' FP8 loader reads (FP8 block-wise weights,
DeepSeek-V4's MXFP4 experts: model/interop/quantized.py) are dequantized on import into the
parameter dtype; other quantization layouts are refused by key. Export writes no quantization,
except DeepSeek-V4's MXFP4 routed experts on request (`--expert-dtype fp4`: the values FP4
quantization-aware training computes with, `qat.expert_weights: mxfp4`), optionally under the
release's own tensor names (`--names release`).
Config keys that do not change the network (token ids, max_position_embeddings, torch_dtype,
...) are ignored on import. An import writes bfloat16 params by default (`--dtype float32` on
request), streaming tensor by tensor (host memory holds a few copies of one tensor, not the
model), copies the
release's tokenizer and chat template beside them and prints one summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from model.config import DTYPES, ModelConfig
from model.config.cli import ArgumentParser, report_error
from model.interop.hf import load_hf_checkpoint, save_hf_checkpoint
from model.interop.hf_import import import_release
from model.interop.hub import check_repo_id, download_release
from model.interop.model_dir import locked_output
from model.interop.workdir import CheckpointError, latest_run_config, saved_tokenizer
from model.interop.workdir_lock import WorkdirInUse
from model.tokenizers.text import TextTokenizer, load_tokenizer
from model.weights import load_model

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m model.hf", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{import,export}",
                                     parser_class=ArgumentParser)
    imports = commands.add_parser(
        "import", help="Hugging Face checkpoint -> stepjax model directory",
        description="Converts a Hugging Face Step 3.5, DeepSeek-V4 or MiMo-V2-Flash directory "
                    "(config.json + safetensors) into a stepjax model directory "
                    "(model/interop/model_dir.py) with its tokenizer files, streaming tensor by "
                    "tensor; FP8 / MXFP4 releases are dequantized into --dtype.")
    release = imports.add_mutually_exclusive_group(required=True)
    release.add_argument("source", metavar="HF_DIR", nargs="?",
                         help="a local Hugging Face directory (config.json + *.safetensors)")
    release.add_argument("--hf", metavar="ORG/NAME",
                         help="download this Hub model first (its safetensors, config and "
                              "tokenizer files only; needs pip install 'stepjax[hub]')")
    imports.add_argument("--revision", metavar="REV", default=None,
                         help="with --hf: a branch, tag or commit (default: main)")
    imports.add_argument("--out", required=True, metavar="MODEL_DIR", help="new or empty")
    imports.add_argument("--dtype", "--param-dtype", dest="dtype", choices=DTYPES,
                         default="bfloat16",
                         help="dtype of the imported params (default bfloat16: half the bytes "
                              "of float32; router biases stay float32)")
    exports = commands.add_parser(
        "export", help="stepjax model directory or training workdir -> Hugging Face checkpoint",
        description="Writes a Hugging Face directory from a stepjax model directory or a "
                    "`python -m train` workdir (its latest checkpoint): DeepSeek-V4 for a model "
                    "with W/C/H layers, MiMo-V2-Flash for one with a sink or per-type "
                    "attention geometry, else Step 3.5.")
    exports.add_argument("source", metavar="DIR")
    exports.add_argument("--out", required=True, metavar="HF_DIR", help="new or empty")
    exports.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                         help="tensor dtype in the files (default: the params' dtype)")
    exports.add_argument("--names", choices=("transformers", "release"), default="transformers",
                         help="tensor names: what transformers' save_pretrained writes "
                              "(default) or DeepSeek-V4's own release names")
    exports.add_argument("--expert-dtype", choices=("fp4",), default=None,
                         help="DeepSeek-V4: routed experts in the release's MXFP4 layout "
                              "(default: --dtype like every other weight)")
    exports.add_argument("--max-shard-gib", type=float, default=5.0, metavar="GIB",
                         help="largest shard file (default 5)")
    exports.add_argument("--drop-mtp", action="store_true",
                         help="leave the MTP heads out (MiMo-V2-Flash's format has none; "
                              "DeepSeek-V4's holds only `mtp.block: layer` heads)")
    exports.add_argument("--tokenizer", metavar="PATH", default=None,
                         help="tokenizer written beside the weights (default: a workdir's own; a "
                              "model directory has none): 'default', 'arith_chars' or a "
                              "tokenizer.json")
    args = parser.parse_args(argv)
    if args.command == "import" and args.revision and not args.hf:
        parser.error("--revision: only with --hf ORG/NAME")
    if args.command == "import" and args.hf:
        try:
            check_repo_id(args.hf)
        except ValueError as err:
            parser.error(str(err))
    summary = None
    try:
        if args.command == "export" and args.max_shard_gib <= 0:
            raise ValueError(f"--max-shard-gib must be > 0, got {args.max_shard_gib}")
        with locked_output(Path(args.out)):  # before the long load: nothing is overwritten
            if args.command == "import":
                source = (download_release(args.hf, args.revision) if args.hf else args.source)
                summary = import_release(source, args.out, dtype=args.dtype)
            else:
                config, variables = load_model(args.source)
                if args.drop_mtp:
                    config, variables = without_mtp(config, variables)
                tokenizer = export_tokenizer(Path(args.source), args.tokenizer)
                save_hf_checkpoint(config, variables, args.out, dtype=args.dtype,
                                   tokenizer=tokenizer,
                                   max_shard_bytes=int(args.max_shard_gib * 2**30),
                                   names=args.names, expert_dtype=args.expert_dtype)
    # CheckpointError: a bad workdir; WorkdirInUse: another command is writing --out
    except (ValueError, OSError, CheckpointError, WorkdirInUse) as err:
        return report_error(err)
    print(summary.line() if summary else f"wrote {args.out}")
    return 0


def without_mtp(config: ModelConfig, variables: dict) -> tuple[ModelConfig, dict]:
    """The model without its MTP heads (`mtp_<h>` params, and router biases of `layer` MTP
    blocks): the main head's outputs are unchanged, the heads only ever predict further
    tokens."""
    mtp = dataclasses.replace(config.mtp, num_heads=0)
    return config.replace(mtp=mtp), {
        name: {k: v for k, v in collection.items() if not k.startswith("mtp_")}
        for name, collection in variables.items()}


def export_tokenizer(source: Path, spec: str | None) -> TextTokenizer | None:
    """The tokenizer an export writes: `spec` (--tokenizer), else the one a training or RL
    workdir trained with; None for a model directory without --tokenizer."""
    if spec is None and (source / "checkpoints").is_dir():
        spec = saved_tokenizer(latest_run_config(source)[1])
    return None if spec is None else load_tokenizer(spec)


if __name__ == "__main__":
    sys.exit(main())
