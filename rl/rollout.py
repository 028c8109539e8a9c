"""Rollouts: sample responses with the inference path (KV-cache decoding,
model/inference/decode.py), record its log-probabilities as pi_infer (and, for Rollout Routing
Replay, the experts every token was routed to), and lay prompts and responses out as [B, T] rows.

    rollouts = collect_rollouts(decoder, prompt_ids, length=T, max_new_tokens=8,
                                sampling=Sampling(1.0), stop_id=eos, key=key)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from model.inference.decode import Decoder
from model.inference.sampling import Sampling


@dataclasses.dataclass
class Rollouts:
    tokens: np.ndarray  # int32 [B, T]: prompt, response (its stop token included), padding 0
    segment_ids: np.ndarray  # int32 [B, T]: 1 on prompt and response, 0 on padding
    mask: np.ndarray  # float32 [B, T]: 1 on response tokens
    infer_logp: np.ndarray  # float32 [B, T]: inference-path log-prob of each response token
    truncated: np.ndarray  # bool [B]: hit max_new_tokens without the stop token
    responses: list[list[int]]  # response ids without the stop token
    # int32 [B, L_moe, T, k] (`rl.routing_replay`): the experts each MoE layer of the inference
    # path routed token t to; -1 where nothing was routed (the last token, padding). Else None.
    routed_experts: np.ndarray | None = None

    @property
    def response_lengths(self) -> np.ndarray:
        return self.mask.sum(axis=1)

    def take(self, rows: np.ndarray) -> "Rollouts":
        """The given rows (int indices), in the order given."""
        def pick(value):
            if value is None:
                return None
            return [value[i] for i in rows] if isinstance(value, list) else value[rows]

        return Rollouts(**{f.name: pick(getattr(self, f.name))
                           for f in dataclasses.fields(Rollouts)})


def concat_rollouts(parts: Sequence[Rollouts]) -> Rollouts:
    """Row-wise concatenation of rollouts with equal row lengths."""
    fields = {f.name: [getattr(p, f.name) for p in parts] for f in dataclasses.fields(Rollouts)}

    def concat(values):
        if values[0] is None:
            return None
        return ([row for part in values for row in part] if isinstance(values[0], list)
                else np.concatenate(values))

    return Rollouts(**{name: concat(values) for name, values in fields.items()})


def layout_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[prompt; response; padding] rows -> (tokens, segment_ids, response mask), each [B, T]."""
    batch = len(prompts)
    tokens = np.zeros((batch, length), np.int32)
    segment_ids = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), np.float32)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        end = len(prompt) + len(response)
        if end > length:
            raise ValueError(f"rollout {b}: {end} tokens do not fit rows of {length}")
        tokens[b, :end] = [*prompt, *response]
        segment_ids[b, :end] = 1
        mask[b, len(prompt):end] = 1.0
    return tokens, segment_ids, mask


def collect_rollouts(decoder: Decoder, prompts: Sequence[Sequence[int]], *, length: int,
                     max_new_tokens: int, sampling: Sampling, stop_id: int,
                     key: jax.Array, record_routing: bool = False) -> Rollouts:
    """One response per prompt (repeat a prompt N times for N samples), sampled with
    `decoder`'s weights and dtype; rows are `length` tokens. `record_routing`: keep the
    experts every token was routed to (`Rollouts.routed_experts`)."""
    generation = decoder.generate(prompts, max_new_tokens, sampling=sampling, key=key,
                                  stop_ids=(stop_id,), record_routing=record_routing)
    responses = generation.tokens
    tokens, segment_ids, mask = layout_rows(prompts, responses, length)
    infer_logp = np.zeros_like(mask)
    for b, (prompt, logprobs) in enumerate(zip(prompts, generation.logprobs)):
        infer_logp[b, len(prompt):len(prompt) + len(logprobs)] = logprobs
    finished = np.array([bool(r) and r[-1] == stop_id for r in responses])
    routed = None
    if generation.routed_experts is not None:
        layers, _, k = generation.routed_experts[0].shape
        routed = np.full((len(prompts), layers, length, k), -1, np.int32)
        for b, experts in enumerate(generation.routed_experts):
            routed[b, :, :experts.shape[1]] = experts
    return Rollouts(tokens=tokens, segment_ids=segment_ids, mask=mask, infer_logp=infer_logp,
                    truncated=~finished,
                    responses=[r[:-1] if f else r for r, f in zip(responses, finished)],
                    routed_experts=routed)
