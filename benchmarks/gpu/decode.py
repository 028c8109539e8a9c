"""Section `decode` of `make gpu-check`: greedy decoding tokens/s at batch 1 and 32 (the plan's
`decode_batches`), without and with MTP speculation (drafts from the MTP heads, report 2.2),
for the three families' ~1B configs:

- configs/gpu_1b.yaml (Step 3.5 Flash): the model the train section trained, continuing
  held-out rows of its synthetic cycle, so the drafts can be accepted and the share of
  generated tokens on the cycle says whether training on the device worked;
- configs/gpu_1b_mimo.yaml and configs/gpu_1b_deepseek_v4.yaml: randomly initialised (no time
  to train them too), random prompts: tokens/s of the decoding machinery (caches, the
  sliding-window and compressed caches, MTP drafting); their drafts are all but never
  accepted, so their speculative rows measure the cost of drafting and verifying, not a
  speed-up.
Each (config, batch, speculation) case compiles its own steps once (untimed 8-token call) and
then times `new_tokens` tokens; tokens/s counts every row's committed tokens. Cases run in
order until the section's deadline.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import numpy as np

from benchmarks.gpu.checks import first_line
from model.config import load_config
from model.inference.decode import Decoder
from model.lm import CausalLM, init_variables, join_variables

TRAINED = "gpu_1b (trained)"


def _rates(label: str, model, variables, prompts: np.ndarray, new_tokens: int, draft: int,
           truth: np.ndarray | None, batches: tuple[int, ...], deadline: float) -> list[dict]:
    records = []
    decoder = Decoder(model, variables, max_len=prompts.shape[1] + new_tokens + draft,
                      draft=draft, prefill_chunk=prompts.shape[1])
    plain = {}
    for batch in batches:
        for speculative in dict.fromkeys([False, draft > 0]):
            record = {"config": label, "batch": batch, "draft": draft if speculative else 0}
            if time.monotonic() > deadline:
                records.append({**record, "status": "skipped",
                                "note": "section time limit reached"})
                continue
            rows = [p.tolist() for p in prompts[:batch]]
            try:
                decoder.generate(rows, min(8, new_tokens), speculative=speculative)  # compile
                out = decoder.generate(rows, new_tokens, speculative=speculative)
            except Exception as err:  # e.g. out of memory at batch 32
                records.append({**record, "status": "error", "note": first_line(err)})
                continue
            rate = out.tokens_per_second
            plain.setdefault(batch, rate)
            record.update(status="done", tokens_per_s=rate, mean_accepted=out.mean_accepted,
                          speedup=rate / plain[batch] if plain[batch] else None)
            if truth is not None:  # share of generated tokens that continue the cycle
                record["chain_accuracy"] = float(np.mean([
                    np.mean(np.asarray(tokens[:new_tokens]) == truth[i, :len(tokens[:new_tokens])])
                    for i, tokens in enumerate(out.tokens)]))
            records.append(record)
    return records


def trained_records(trained: tuple, *, prompt_len: int, new_tokens: int,
                    batches: tuple[int, ...], deadline: float) -> list[dict]:
    """The train section's model (run, state, data) on held-out rows of its cycle."""
    run, state, data = trained[:3]  # benchmarks.gpu.training.Trained
    rows = data.rows(max(batches), prompt_len + new_tokens, np.random.default_rng(12345))
    return _rates(TRAINED, run.model, join_variables(state.params, state.balance),
                  rows[:, :prompt_len], new_tokens, run.trained_mtp_heads(),
                  rows[:, prompt_len:], batches, deadline)


def untrained_records(label: str, config: str, overrides: list[str], *, prompt_len: int,
                      new_tokens: int, batches: tuple[int, ...], deadline: float) -> list[dict]:
    """A randomly initialised model of `config`, random prompts."""
    try:
        model = load_config(config, overrides)
        variables = nn.meta.unbox(init_variables(CausalLM(model), jax.random.key(0)))
    except Exception as err:
        return [{"config": label, "batch": "-", "draft": "-", "status": "error",
                 "note": first_line(err)}]
    prompts = np.random.default_rng(0).integers(0, model.vocab_size,
                                                (max(batches), prompt_len)).astype(np.int32)
    return _rates(label, model, variables, prompts, new_tokens, model.mtp.num_heads, None,
                  batches, deadline)


def decode_section(trained: tuple | None, others: tuple, *, prompt_len: int, new_tokens: int,
                   batches: tuple[int, ...], deadline: float) -> dict:
    """others: (label, config path, overrides) of the untrained configs."""
    records = []
    if trained is None:
        records.append({"config": TRAINED, "batch": "-", "draft": "-",
                        "status": "skipped", "note": "no trained model (train section)"})
    else:
        records += trained_records(trained, prompt_len=prompt_len, new_tokens=new_tokens,
                                   batches=batches, deadline=deadline)
    for label, config, overrides in others:
        records += untrained_records(label, config, list(overrides), prompt_len=prompt_len,
                                     new_tokens=new_tokens, batches=batches, deadline=deadline)
    failed = [r for r in records if r["status"] == "error"]
    return {"status": "done", "prompt_len": prompt_len, "new_tokens": new_tokens,
            "records": records,
            "note": f"{len(failed)} of {len(records)} cases failed" if failed else ""}
