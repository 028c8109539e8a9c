"""python -m model.generate (--workdir DIR | --hf HF_DIR) (--prompt TEXT | --prompt-file PATH)
    [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--speculative] [--draft D]
    [--kv-cache fp8] [--mesh tensor=T,expert=E] [--chat] [--json] [--print-config]
python -m model.generate ... --chat          # without a prompt: a conversation (model.chat)

Generates a continuation of TEXT with KV-cache decoding (model/inference/decode.py).
- `--workdir`: a `python -m train` or `python -m rl` workdir (latest checkpoint, for RL its
  policy; the run's tokenizer) or a stepjax model directory from `python -m model.hf import`
  (the release's tokenizer and chat template it holds, else give `--tokenizer`).
- `--hf`: a Hugging Face directory of any family (`step3p5`, `deepseek_v4`, `mimo_v2_flash`:
  weights, tokenizer.json, chat template).
- `--speculative`: MTP speculative decoding with `--draft` drafted tokens per step (default:
  every MTP head); greedy output is identical to plain greedy decoding.
- `--kv-cache fp8`: keys and values stored in FP8 but their RoPE channels (DeepSeek-V4's
  layout, model/inference/kv_storage.py), about half the cache of bfloat16.
- `--chat`: wrap TEXT as a user message in the chat template (add_generation_prompt): the
  HF directory's, or for a training workdir the one its chat data was rendered with (the
  shipped template of the `default` tokenizer, or the tokenizer directory's).
- `--mesh`: the parameters sharded over devices as training shards them
  (model/parallel/rules.py: heads and FFN hidden over `tensor`, routed experts over `expert`,
  `embed` over `fsdp`), loaded straight into that layout, so a model larger than one device
  decodes; greedy tokens equal one device's.
- `--chat` without `--prompt`: a multi-turn conversation read line by line from stdin
  (model/conversation.py; `--system`, `--max-len`).
`--json` prints one object: the prompt (and, with --chat, the rendered one), text, token_ids,
prompt_tokens, tokens_per_second (decode passes after the first, which compiles),
mean_accepted_length (tokens per main-model pass) and timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import jax

from model.config import ConfigError, config_to_dict, config_yaml
from model.config.cli import ArgumentParser, finite_float, report_error
from model.conversation import Conversation, Renderer, decoding_context, read_prompt_file, talk
from model.inference.decode import Decoder, required_length
from model.inference.sampling import GREEDY_BELOW, Sampling
from model.interop.model_dir import is_model_dir
from model.interop.workdir import (CheckpointError, latest_run_config, saved_tokenizer,
                                   split_checkpoint_step)
from model.interop.workdir_record import read_record, tokenizer_mismatch
from model.parallel.device_mesh import decode_mesh
from model.tokenizers.chat import chat_tokenizer_for, load_chat_tokenizer
from model.tokenizers.text import load_tokenizer
from model.weights import load_model, load_model_config


def load_tokenizer_for(args) -> Renderer:
    """The tokenizer of the model: encode, decode, stop ids and, for --chat, the renderer of
    messages through the chat template (None without --chat for a training tokenizer)."""
    if args.workdir:
        check_workdir_tokenizer(Path(args.workdir), args.tokenizer)
    directory = chat_tokenizer_directory(args)
    if directory:
        tok = load_chat_tokenizer(directory)
        render = lambda messages: tok.render(messages, add_generation_prompt=True)  # noqa: E731
        return Renderer(render, tok.encode, lambda ids: tok.decode(ids, skip_special_tokens=True),
                        frozenset(tok.eos_ids))
    spec = args.tokenizer or workdir_tokenizer(Path(args.workdir))
    tok = load_tokenizer(spec)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if not args.chat:
        return Renderer(None, lambda text: tok.encode(text).tolist(), decode,
                        frozenset({tok.eos_id}))
    try:  # the template chat SFT renders its data with (train/data/chat.py)
        chat = chat_tokenizer_for(tok)
    except ValueError as err:
        raise ValueError(f"--chat: {err}") from None
    render = lambda messages: chat.render(messages, add_generation_prompt=True)  # noqa: E731
    # chat.encode: the special tokens the template writes (turn ends) are encoded as specials
    return Renderer(render, chat.encode, decode, frozenset(chat.eos_ids) | {tok.eos_id})


def chat_tokenizer_directory(args) -> str | None:
    """A Hugging Face tokenizer directory to read (tokenizer.json with its chat template and
    stop ids): --tokenizer when it names a directory, --hf, or a model directory holding an
    imported release's tokenizer (`python -m model.hf import` copies it)."""
    if args.tokenizer:
        return args.tokenizer if Path(args.tokenizer).is_dir() else None
    if args.hf:
        return args.hf
    imported = is_model_dir(Path(args.workdir)) and (Path(args.workdir) / "tokenizer.json").is_file()
    return args.workdir if imported else None


def check_workdir_tokenizer(checkpoint: Path, spec: str | None) -> None:
    """A training workdir records its tokenizer (model/interop/workdir_record.py): decoding its
    model with another would print noise, so refuse (`spec` None: the run config's tokenizer,
    whose file may have changed since). `checkpoint`: a workdir or `DIR/checkpoints/<step>`."""
    workdir, _ = split_checkpoint_step(checkpoint)
    if read_record(workdir) is None:  # a model directory, or a workdir of an older stepjax
        return
    mismatch = tokenizer_mismatch(workdir, load_tokenizer(spec or workdir_tokenizer(checkpoint)))
    if mismatch:
        raise ValueError(f"--tokenizer: {mismatch}; give --tokenizer the one it was trained with")


def workdir_tokenizer(checkpoint: Path) -> str:
    """The tokenizer a training or RL workdir's latest checkpoint (or `DIR/checkpoints/<step>`)
    was trained with."""
    workdir, step = split_checkpoint_step(checkpoint)
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"--tokenizer: {checkpoint} is not a training workdir; name the "
                         "tokenizer.json (or a directory holding one) to use")
    # The saved run config is complete (every field resolved), so the key is always there.
    return saved_tokenizer(latest_run_config(workdir, step)[1])


def load_for_decoding(args):
    """(config, variables on the --mesh or one device, the mesh or None, Renderer): the mesh is
    checked before the weights load."""
    mesh = decode_mesh(args.mesh)
    config, variables = load_model(args.hf or args.workdir, mesh)
    return config, variables, mesh, load_tokenizer_for(args)


def speculative_draft(args, config) -> int:
    """Drafted tokens per step: 0 without --speculative, else --draft (default every MTP
    head)."""
    if not args.speculative:
        return 0
    draft = config.mtp.num_heads if args.draft is None else args.draft
    if not 1 <= draft <= config.mtp.num_heads:
        raise ValueError(f"--draft: {draft} drafted tokens need as many MTP heads; the model "
                         f"has {config.mtp.num_heads}")
    return draft


def generate(args) -> dict:
    given = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
    config, variables, mesh, renderer = load_for_decoding(args)
    text = renderer.render([{"role": "user", "content": given}]) if args.chat else given
    prompt = renderer.encode(text)
    if not prompt:
        raise ValueError("--prompt: encodes to no tokens")
    draft = speculative_draft(args, config)
    with decoding_context(mesh):
        decoder = Decoder(config, variables, draft=draft, prefill_chunk=args.prefill_chunk,
                          max_len=required_length([len(prompt)], args.max_new_tokens, draft),
                          kv_fp8=args.kv_cache == "fp8")
        out = decoder.generate([prompt], args.max_new_tokens, speculative=bool(draft),
                               sampling=Sampling(args.temperature, args.top_k, args.top_p),
                               key=jax.random.key(args.seed), stop_ids=renderer.stop_ids,
                               progress=not args.json)
    ids = out.tokens[0]
    echo = {"prompt": given, **({"rendered_prompt": text} if args.chat else {})}
    return {**echo, "text": renderer.decode(ids), "token_ids": ids, "prompt_tokens": len(prompt),
            "tokens_per_second": out.tokens_per_second, "mean_accepted_length": out.mean_accepted,
            "forward_passes": out.forward_passes, "prefill_seconds": out.prefill_seconds,
            "decode_seconds": out.decode_seconds}


def print_config(args) -> int:
    """The resolved config: the source's model (its config only) and the decoding settings."""
    try:
        model = config_to_dict(load_model_config(args.hf or args.workdir))
    except (ValueError, OSError, CheckpointError) as err:
        return report_error(err)
    settings = {k: v for k, v in vars(args).items() if k != "print_config"}
    print(config_yaml({"model": model, "generate": settings}), end="")
    return 0


def converse(args) -> None:
    """--chat without a prompt, or `python -m model.chat`: the conversation loop
    (model/conversation.py) on stdin, --prompt / --prompt-file as its first message."""
    first = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
    config, variables, mesh, renderer = load_for_decoding(args)
    draft = speculative_draft(args, config)
    with decoding_context(mesh):
        decoder = Decoder(config, variables, draft=draft, prefill_chunk=args.prefill_chunk,
                          max_len=args.max_len, kv_fp8=args.kv_cache == "fp8")
        chat = Conversation(decoder, renderer, max_new_tokens=args.max_new_tokens,
                            sampling=Sampling(args.temperature, args.top_k, args.top_p),
                            speculative=bool(draft), seed=args.seed, system=args.system)
        talk(chat, sys.stdin, json_lines=args.json, first=first)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m model.generate",
         description: str = __doc__, conversation: bool = False) -> int:
    """`conversation`: always the chat loop (`python -m model.chat`), a prompt being its first
    message."""
    parser = ArgumentParser(prog=prog, description=description,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", metavar="DIR",
                        help="training workdir or stepjax model directory")
    source.add_argument("--hf", metavar="HF_DIR", help="Hugging Face directory (step3p5, deepseek_v4 or mimo_v2_flash)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-file", metavar="PATH", help="the prompt read from a file")
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
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (a conversation: one per turn)")
    parser.add_argument("--mesh", metavar="AXIS=N,...", default=None,
                        help="shard the parameters over devices, e.g. tensor=4,expert=2 "
                             "(axes data, fsdp, expert, tensor; default: one device)")
    parser.add_argument("--max-len", type=int, default=4096, metavar="N",
                        help="conversation: KV-cache positions the history and reply share "
                             "(default 4096; older exchanges are dropped to fit)")
    parser.add_argument("--system", metavar="TEXT", default=None,
                        help="conversation: a system message")
    parser.add_argument("--print-config", action="store_true",
                        help="print the model's config and these settings as YAML and exit "
                             "(no weights read)")
    args = parser.parse_args(argv)
    if args.print_config:
        return print_config(args)
    if conversation:
        args.chat = True
    chatting = conversation or (args.chat and args.prompt is None and args.prompt_file is None)
    if not chatting and args.prompt is None and args.prompt_file is None:
        parser.error("one of --prompt or --prompt-file is required (or --chat alone for a "
                     "conversation)")
    if chatting and args.max_len <= args.max_new_tokens:
        parser.error(f"--max-len: {args.max_len} positions leave no room for a prompt beside "
                     f"--max-new-tokens {args.max_new_tokens}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    try:
        Sampling(args.temperature, args.top_k, args.top_p).validate()
    except ConfigError as err:  # named as the flag
        return report_error(ValueError(f"--{err.field.replace('_', '-')}: {err.problem}"))
    try:
        if chatting:
            converse(args)
            return 0
        result = generate(args)
    except (ValueError, OSError, CheckpointError) as err:
        return report_error(err)
    except KeyboardInterrupt:  # Ctrl-C while loading or compiling
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(f"[{len(result['token_ids'])} tokens, {result['tokens_per_second']:.1f} tok/s, "
              f"{result['mean_accepted_length']:.2f} tokens per pass]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
