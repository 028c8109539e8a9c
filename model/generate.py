"""python -m model.generate (--workdir DIR | --hf HF_DIR) --prompt TEXT [--max-new-tokens N]
    [--temperature T] [--top-k K] [--top-p P] [--speculative] [--draft D] [--kv-cache fp8]
    [--chat] [--json]

Generates a continuation of TEXT with KV-cache decoding (model/inference/decode.py).
- `--workdir`: a `python -m train` or `python -m rl` workdir (latest checkpoint, for RL its
  policy; the run's tokenizer) or a stepjax model directory from `python -m model.hf import`
  (give `--tokenizer`).
- `--hf`: a Hugging Face directory of any family (`step3p5`, `deepseek_v4`, `mimo_v2_flash`:
  weights, tokenizer.json, chat template).
- `--speculative`: MTP speculative decoding with `--draft` drafted tokens per step (default:
  every MTP head); greedy output is identical to plain greedy decoding.
- `--kv-cache fp8`: keys and values stored in FP8 but their RoPE channels (DeepSeek-V4's
  layout, model/inference/kv_storage.py), about half the cache of bfloat16.
- `--chat`: wrap TEXT as a user message in the chat template (add_generation_prompt): the
  HF directory's, or for a training workdir the one its chat data was rendered with (the
  shipped template of the `default` tokenizer, or the tokenizer directory's).
`--json` prints one object: text, token_ids, prompt_tokens, tokens_per_second (decode passes
after the first, which compiles), mean_accepted_length (tokens per main-model pass) and timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import jax

from model.config import ConfigError
from model.config.cli import ArgumentParser, finite_float, report_error
from model.inference.decode import Decoder, required_length
from model.inference.sampling import GREEDY_BELOW, Sampling
from model.interop.workdir import CheckpointError, latest_run_config, saved_tokenizer
from model.interop.workdir_record import read_record, tokenizer_mismatch
from model.tokenizers.chat import chat_tokenizer_for, load_chat_tokenizer
from model.tokenizers.text import load_tokenizer
from model.weights import load_model


def load_tokenizer_for(args):
    """-> (encode(text) -> ids, decode(ids) -> text, stop ids, render(text) for --chat or None)."""
    if args.workdir:
        check_workdir_tokenizer(Path(args.workdir), args.tokenizer)
    if args.hf or (args.tokenizer and Path(args.tokenizer).is_dir()):
        tok = load_chat_tokenizer(args.tokenizer or args.hf)
        render = lambda text: tok.render([{"role": "user", "content": text}],  # noqa: E731
                                         add_generation_prompt=True)
        return tok.encode, lambda ids: tok.decode(ids, skip_special_tokens=True), \
            set(tok.eos_ids), render
    spec = args.tokenizer or workdir_tokenizer(Path(args.workdir))
    tok = load_tokenizer(spec)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if not args.chat:
        return lambda text: tok.encode(text).tolist(), decode, {tok.eos_id}, None
    try:  # the template chat SFT renders its data with (train/data/chat.py)
        chat = chat_tokenizer_for(tok)
    except ValueError as err:
        raise ValueError(f"--chat: {err}") from None
    render = lambda text: chat.render([{"role": "user", "content": text}],  # noqa: E731
                                      add_generation_prompt=True)
    # chat.encode: the special tokens the template writes (turn ends) are encoded as specials
    return chat.encode, decode, set(chat.eos_ids) | {tok.eos_id}, render


def check_workdir_tokenizer(workdir: Path, spec: str | None) -> None:
    """A training workdir records its tokenizer (model/interop/workdir_record.py): decoding its
    model with another would print noise, so refuse (`spec` None: the run config's tokenizer,
    whose file may have changed since)."""
    if read_record(workdir) is None:  # a model directory, or a workdir of an older stepjax
        return
    mismatch = tokenizer_mismatch(workdir, load_tokenizer(spec or workdir_tokenizer(workdir)))
    if mismatch:
        raise ValueError(f"--tokenizer: {mismatch}; give --tokenizer the one it was trained with")


def workdir_tokenizer(workdir: Path) -> str:
    """The tokenizer a training or RL workdir's latest checkpoint was trained with."""
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"--tokenizer: {workdir} is not a training workdir; name the "
                         "tokenizer.json (or a directory holding one) to use")
    # The saved run config is complete (every field resolved), so the key is always there.
    return saved_tokenizer(latest_run_config(workdir)[1])


def generate(args) -> dict:
    config, variables = load_model(args.hf or args.workdir)
    encode, decode, stop_ids, render = load_tokenizer_for(args)
    text = render(args.prompt) if args.chat else args.prompt
    prompt = encode(text)
    if not prompt:
        raise ValueError("--prompt: encodes to no tokens")
    draft = 0
    if args.speculative:
        draft = config.mtp.num_heads if args.draft is None else args.draft
        if not 1 <= draft <= config.mtp.num_heads:
            raise ValueError(f"--draft: {draft} drafted tokens need as many MTP heads; the model "
                             f"has {config.mtp.num_heads}")
    decoder = Decoder(config, variables, draft=draft, prefill_chunk=args.prefill_chunk,
                      max_len=required_length([len(prompt)], args.max_new_tokens, draft),
                      kv_fp8=args.kv_cache == "fp8")
    out = decoder.generate([prompt], args.max_new_tokens, speculative=bool(draft),
                           sampling=Sampling(args.temperature, args.top_k, args.top_p),
                           key=jax.random.key(args.seed), stop_ids=stop_ids,
                           progress=not args.json)
    ids = out.tokens[0]
    return {"text": decode(ids), "token_ids": ids, "prompt_tokens": len(prompt),
            "tokens_per_second": out.tokens_per_second, "mean_accepted_length": out.mean_accepted,
            "forward_passes": out.forward_passes, "prefill_seconds": out.prefill_seconds,
            "decode_seconds": out.decode_seconds}


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m model.generate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", metavar="DIR",
                        help="training workdir or stepjax model directory")
    source.add_argument("--hf", metavar="HF_DIR", help="Hugging Face directory (step3p5, deepseek_v4 or mimo_v2_flash)")
    parser.add_argument("--prompt", required=True, metavar="TEXT")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="tokenizer.json or a directory with tokenizer(_config).json")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--temperature", type=finite_float, default=0.0,
                        help=f"0 = greedy (default; so is any below {GREEDY_BELOW:.2g})")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    parser.add_argument("--top-p", type=finite_float, default=1.0, metavar="P", help="1 = off")
    parser.add_argument("--speculative", action="store_true", help="MTP speculative decoding")
    parser.add_argument("--draft", type=int, default=None, metavar="D",
                        help="drafted tokens per step (default: all MTP heads)")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--prefill-chunk", type=int, default=256, metavar="C")
    parser.add_argument("--kv-cache", choices=("compute", "fp8"), default="compute",
                        help="KV-cache storage: the compute dtype (default) or FP8 with the "
                             "RoPE channels kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    try:
        Sampling(args.temperature, args.top_k, args.top_p).validate()
    except ConfigError as err:  # named as the flag
        return report_error(ValueError(f"--{err.field.replace('_', '-')}: {err.problem}"))
    try:
        result = generate(args)
    except (ValueError, OSError, CheckpointError) as err:
        return report_error(err)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(f"[{len(result['token_ids'])} tokens, {result['tokens_per_second']:.1f} tok/s, "
              f"{result['mean_accepted_length']:.2f} tokens per pass]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
