"""Generation with KV caches: chunked prefill, one-token decode steps, MTP speculative decoding.

    decoder = Decoder(cfg, variables, max_len=1024, draft=3)
    out = decoder.generate([[5, 9, 2], [7]], max_new_tokens=64, sampling=Sampling(0.8, top_p=0.95),
                           speculative=True, key=jax.random.key(0))
    out.tokens          # generated ids per prompt (stop token included if one was produced)
    out.mean_accepted   # tokens committed per main-model forward pass (speculative)
    out.logprobs        # log-probability of each generated token under the sampling
                        # distribution (plain decoding; RL records it as pi_infer)
    out.routed_experts  # with record_routing=True: the experts every MoE layer routed each
                        # processed token to (RL replays them: Rollout Routing Replay)

Caches (model/inference/kv_cache.py) hold max_len positions on full layers and a W + draft ring on
SWA layers; DeepSeek-V4's W / C / H layers (model/inference/compressed_cache.py) a W + draft ring of
shared entries, and on C / H layers the compressed entries with a short tail of per-token
compressor projections (C layers also the lightning indexer's keys). Prompts of different lengths share a batch: each row has its own positions, padding has
position -1, and finished rows are frozen (their tokens get position -1).

Speculative decoding (report 2.1-2.2): after the main model has seen the sequence up to
position n-1 and token x_n is known, the MTP heads are chained at position n-1: head h reads
the previous depth's hidden state and x_{n-1+h} (a draft when beyond x_n) and proposes
x_{n+h}. One verify pass over [x_n, d_1 .. d_D] scores all drafts; `model.inference.speculative`
decides how many are kept. The MTP heads then run on the verified chunk, which extends their caches
with the committed tokens and proposes the next drafts. Keys an MTP head computed from a draft
that was later rejected stay in its cache (at most D - 1 per head); they change only which
tokens are proposed, never which are committed.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from model.config import ModelConfig
from model.config.model_config import INT32_MAX
from model.inference.cache_memory import free_memory
from model.inference.kv_cache import KVCacheSpec
from model.inference.sampling import Sampling, sample, sample_with_logprob, token_probs
from model.inference.speculative import accept_drafts
from model.lm import CausalLM


class Generation(NamedTuple):
    tokens: list[list[int]]  # generated ids per prompt
    forward_passes: int  # main-model decode/verify passes after prefill
    mean_accepted: float  # tokens committed per row and pass (1.0 without speculation)
    prefill_seconds: float
    decode_seconds: float  # wall time of the passes after the first (which includes compiling)
    decode_tokens: int  # tokens committed by those passes
    # per prompt, log-probability of each generated token under the sampling distribution it
    # was drawn from (plain decoding); None with speculative decoding
    logprobs: list[list[float]] | None = None
    # per prompt (`generate(record_routing=True)`, plain decoding, a model with MoE layers):
    # int32 [L_moe, P + G - 1, k], the experts each MoE layer sent the prompt's P tokens and
    # the first G - 1 of the G generated ones to (the last generated token is never fed back)
    routed_experts: list[np.ndarray] | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def required_length(prompt_lengths: Sequence[int], max_new_tokens: int, draft: int) -> int:
    """Cache length that holds the longest prompt, its new tokens and a verify chunk."""
    return max(prompt_lengths) + max_new_tokens + draft


class Decoder:
    """Jitted prefill / decode / speculative steps for one model and cache size.

    `variables`: {"params": ..., "balance": ...} as `CausalLM.init` makes them (unboxed);
    `max_len`: cache positions per row; `draft`: MTP drafts per step (0 = no speculation);
    `kv_fp8`: keys and values cached in FP8 but their RoPE channels (`KVCacheSpec.fp8`)."""

    def __init__(self, config: ModelConfig, variables: dict, *, max_len: int, draft: int = 0,
                 prefill_chunk: int = 256, kv_fp8: bool = False):
        if not 0 <= draft <= config.mtp.num_heads:
            raise ValueError(f"draft: {draft} speculative tokens need as many MTP heads; the "
                             f"model has mtp.num_heads={config.mtp.num_heads}")
        if max_len + draft > INT32_MAX:
            raise ValueError(f"a cache of {max_len} positions: positions are int32, so at most "
                             f"{INT32_MAX}; generate fewer new tokens")
        self.config, self.variables = config, variables
        self.spec = KVCacheSpec(max_len, draft, kv_fp8)
        self._fitting_batches: set[int] = set()
        self.model = CausalLM(config, self.spec)
        self.prefill_chunk = max(1, min(prefill_chunk, max_len))
        self._init = jax.jit(self._init_cache, static_argnums=1)
        self._prefill = jax.jit(self._prefill_step, donate_argnums=1)
        self._draft = jax.jit(self._draft_step, static_argnums=8, donate_argnums=1)
        self._decode = jax.jit(self._decode_step, static_argnums=5, donate_argnums=1)
        self._speculate = jax.jit(self._speculative_step, static_argnums=7, donate_argnums=1)
        self._sample = jax.jit(lambda key, logits, sampling: sample_with_logprob(
            key, token_probs(logits, sampling)), static_argnums=2)

    def with_variables(self, variables: dict) -> "Decoder":
        """The same decoder (and compiled steps) for other weights of the same shapes, e.g. a
        policy after an RL update: nothing is traced or compiled again."""
        other = copy.copy(self)
        other.variables = variables
        return other

    def init_cache(self, batch: int):
        """Empty caches for `batch` rows: the `cache` collection of the decoding model. Refused
        (ValueError) before anything is allocated when they would not fit in free memory."""
        if batch not in self._fitting_batches:
            shapes = jax.eval_shape(self._init, self.variables, batch)
            need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))
            free = free_memory()
            if need > free:
                raise ValueError(f"the KV caches of {batch} row(s) x {self.spec.max_len} "
                                 f"positions need {need / 2**30:.2f} GiB, more than the "
                                 f"{free / 2**30:.2f} GiB of free memory; generate fewer new "
                                 "tokens (or fewer rows at once)")
            self._fitting_batches.add(batch)
        return self._init(self.variables, batch)

    # ---- pure steps (jitted above) ------------------------------------------------------------

    def _apply(self, variables, cache, method, *args):
        out, mutated = self.model.apply({**variables, "cache": cache}, *args, method=method,
                                        mutable=["cache"])
        return out, mutated["cache"]

    def _logits(self, variables, normed, head: int = 0):
        return self.model.apply(variables, normed, head, method=CausalLM.project)

    def _init_cache(self, variables, batch: int):
        """Empty caches of every layer (and of the MTP heads used for drafting)."""
        tokens = jnp.zeros((batch, 1), jnp.int32)
        padding = jnp.full((batch, 1), -1, jnp.int32)
        (_, h, _), cache = self._apply(variables, {}, CausalLM.decode_chunk, tokens, padding)
        for head in range(1, self.spec.draft + 1):
            (_, h), cache = self._apply(variables, cache, CausalLM.mtp_chunk, head, h, tokens,
                                        padding)
        return cache

    def _prefill_step(self, variables, cache, tokens, positions, last_index):
        """tokens/positions [B, C]; last_index [B]: chunk index whose logits to return.
        -> (cache, logits [B, V], pre-norm hidden [B, C, D], routed experts [L_moe, B, C, k]
        or None)."""
        (normed, h, routed), cache = self._apply(variables, cache, CausalLM.decode_chunk, tokens,
                                                 positions)
        rows = jnp.arange(tokens.shape[0])
        return cache, self._logits(variables, normed[rows, last_index]), h, routed

    def _draft_step(self, variables, cache, h_prev, positions, known_tokens, known, last, key,
                    sampling):
        """Chains the MTP heads over a chunk whose backbone hidden states are h_prev [B, T, D]
        (positions [B, T], -1 = skip). known_tokens [B, T + D]: entry j is the token at
        position (chunk start + 1 + j), valid for j < known [B]; last [B]: chunk index to draft
        from. -> (cache, drafts [B, D] for positions after last + 1, their probs [B, D, V])."""
        rows, length = jnp.arange(h_prev.shape[0]), h_prev.shape[1]
        tokens, draft_probs = known_tokens, []
        for head, head_key in enumerate(jax.random.split(key, self.spec.draft), start=1):
            (normed, h_prev), cache = self._apply(
                variables, cache, CausalLM.mtp_chunk, head, h_prev,
                tokens[:, head - 1:head - 1 + length], positions)
            probs = token_probs(self._logits(variables, normed[rows, last], head), sampling)
            target = last + head
            drafted = jnp.where(target >= known, sample(head_key, probs), tokens[rows, target])
            tokens = tokens.at[rows, target].set(drafted)
            draft_probs.append(probs)
        drafts = tokens[rows[:, None], last[:, None] + 1 + jnp.arange(self.spec.draft)]
        return cache, drafts, jnp.stack(draft_probs, axis=1)

    def _decode_step(self, variables, cache, token, position, key, sampling):
        """token/position [B] (position -1 = frozen row) -> (cache, next token [B], its
        log-probability [B], the experts `token` was routed to [L_moe, B, k] or None)."""
        (normed, _, routed), cache = self._apply(variables, cache, CausalLM.decode_chunk,
                                                 token[:, None], position[:, None])
        probs = token_probs(self._logits(variables, normed[:, 0]), sampling)
        return (cache, *sample_with_logprob(key, probs),
                None if routed is None else routed[:, :, 0])

    def _speculative_step(self, variables, cache, token, position, drafts, draft_probs, key,
                          sampling):
        """Verify [token, drafts] at positions position.. (-1 = frozen row), accept, re-draft.
        -> (cache, accepted [B], committed [B, D+1], next drafts [B, D], their probs)."""
        draft = self.spec.draft
        offsets = jnp.arange(draft + 1)
        positions = jnp.where(position[:, None] >= 0, position[:, None] + offsets, -1)
        chunk = jnp.concatenate([token[:, None], drafts], axis=1)
        (normed, h, _), cache = self._apply(variables, cache, CausalLM.decode_chunk, chunk,
                                            positions)
        target_probs = token_probs(self._logits(variables, normed), sampling)
        accept_key, draft_key = jax.random.split(key)
        accepted, committed = accept_drafts(accept_key, target_probs, draft_probs, drafts)
        kept = jnp.where(offsets <= accepted[:, None], positions, -1)
        known_tokens = jnp.concatenate([committed, jnp.zeros_like(drafts)], axis=1)
        cache, drafts, draft_probs = self._draft_step(variables, cache, h, kept, known_tokens,
                                                      accepted + 1, accepted, draft_key, sampling)
        return cache, accepted, committed, drafts, draft_probs

    # ---- the generation loop ------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampling: Sampling = Sampling(), speculative: bool = False,
                 key: jax.Array | None = None, stop_ids: Sequence[int] = (),
                 progress: bool = False, record_routing: bool = False,
                 on_tokens: Callable[[list[list[int]]], None] | None = None) -> Generation:
        """Continues every prompt (a non-empty list of token ids) by up to `max_new_tokens`,
        stopping a row early at any of `stop_ids`. `record_routing`: also return the experts
        every token was routed to (`Generation.routed_experts`; plain decoding only).
        `on_tokens`: called as tokens are committed (streaming), with each row's new tokens:
        once after the prompt, then after every main-model pass."""
        sampling.validate()
        if record_routing and speculative:
            raise ValueError("record_routing: recording the routed experts needs plain decoding "
                             "(speculative=False)")
        lengths = self._check_prompts(prompts, max_new_tokens, speculative)
        key = jax.random.key(0) if key is None else key
        batch, draft = len(prompts), self.spec.draft if speculative else 0
        started = time.perf_counter()
        cache = self.init_cache(batch)
        key, first_key, draft_key = jax.random.split(key, 3)
        cache, last_logits, hidden, padded, positions, prefill_routes = self._prefill_prompts(
            cache, prompts, lengths)
        step_routes = []
        first, first_logprob = self._sample(first_key, last_logits, sampling)
        if draft:
            cache, drafts, draft_probs = self._draft_prompts(cache, hidden, padded, positions,
                                                             lengths, first, draft_key, sampling)
        first = np.asarray(first)
        prefill_seconds = time.perf_counter() - started

        outputs = [[int(t)] for t in first]
        if on_tokens is not None:
            on_tokens([list(row) for row in outputs])
        logprobs = None if draft else [[float(p)] for p in np.asarray(first_logprob)]
        done = np.array([t in stop_ids for t in first]) | (max_new_tokens <= 1)
        current, position = first.astype(np.int32), lengths.astype(np.int32)
        passes = row_passes = row_tokens = timed_tokens = 0
        timer = None
        bar = tqdm(total=batch * max_new_tokens, initial=batch, desc="decode", unit="tok",
                   disable=not progress, leave=False)
        while not done.all():
            key, step_key = jax.random.split(key)
            frozen_position = np.where(done, -1, position).astype(np.int32)
            if draft:
                cache, accepted, committed, drafts, draft_probs = self._speculate(
                    self.variables, cache, current, frozen_position, drafts, draft_probs,
                    step_key, sampling)
                accepted, committed = np.asarray(accepted), np.asarray(committed)
                new = [committed[b, :accepted[b] + 1] for b in range(batch)]
            else:
                cache, token, token_logprob, routed = self._decode(
                    self.variables, cache, current, frozen_position, step_key, sampling)
                if record_routing and routed is not None:
                    step_routes.append(routed)
                new = [[t] for t in np.asarray(token)]
                new_logprobs = np.asarray(token_logprob)
            passes += 1
            step_tokens = 0
            committed_now = [[] for _ in range(batch)]
            for b in np.flatnonzero(~done):
                row_passes += 1
                row_tokens += len(new[b])
                room = max_new_tokens - len(outputs[b])
                taken = [int(t) for t in new[b][:room]]
                stops = [i for i, t in enumerate(taken) if t in stop_ids]
                if stops:
                    taken = taken[:stops[0] + 1]
                outputs[b].extend(taken)
                committed_now[b] = taken
                if logprobs is not None and taken:
                    logprobs[b].append(float(new_logprobs[b]))
                step_tokens += len(taken)
                position[b] += len(new[b])
                current[b] = new[b][-1]
                done[b] = bool(stops) or len(outputs[b]) >= max_new_tokens
            bar.update(step_tokens)
            if on_tokens is not None:
                on_tokens(committed_now)
            if timer is None:
                timer = time.perf_counter()  # the first pass compiled the step
            else:
                timed_tokens += step_tokens
        bar.close()
        decode_seconds = time.perf_counter() - timer if timer is not None else 0.0
        routed_experts = None
        if record_routing and prefill_routes is not None:
            routed_experts = _routes_per_row(prefill_routes, step_routes, lengths, outputs)
        return Generation(outputs, passes, row_tokens / row_passes if row_passes else 0.0,
                          prefill_seconds, decode_seconds, timed_tokens, logprobs,
                          routed_experts)

    def _check_prompts(self, prompts, max_new_tokens: int, speculative: bool) -> np.ndarray:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
        if speculative and self.spec.draft == 0:
            raise ValueError("speculative decoding needs a Decoder built with draft >= 1")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one prompt and no empty prompt")
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prompts[{i}]: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab})")
        lengths = np.array([len(p) for p in prompts])
        need = required_length(lengths, max_new_tokens, self.spec.draft)
        if need > self.spec.max_len:
            raise ValueError(f"max_len: the longest prompt ({lengths.max()}) + max_new_tokens "
                             f"({max_new_tokens}) + draft ({self.spec.draft}) needs {need} cache "
                             f"positions, the Decoder has {self.spec.max_len}")
        return lengths

    def _prefill_prompts(self, cache, prompts, lengths):
        """Runs the prompts through the backbone in chunks of `prefill_chunk` tokens.
        -> (cache, logits at each prompt's last token [B, V], per-chunk hidden states,
        padded prompts [B, P], positions [B, P] with -1 on padding, the routed experts
        [L_moe, B, P, k] or None without MoE layers)."""
        chunk = self.prefill_chunk
        width = -(-int(lengths.max()) // chunk) * chunk
        padded = np.zeros((len(prompts), width), np.int32)
        for b, prompt in enumerate(prompts):
            padded[b, :len(prompt)] = prompt
        index = np.arange(width)
        positions = np.where(index < lengths[:, None], index, -1).astype(np.int32)
        last_logits, hidden, routes = None, [], []
        for start in range(0, width, chunk):
            last_index = np.clip(lengths - 1 - start, 0, chunk - 1)
            cache, logits, h, routed = self._prefill(
                self.variables, cache, padded[:, start:start + chunk],
                positions[:, start:start + chunk], last_index)
            routes.append(routed)
            ends_here = ((lengths - 1) // chunk == start // chunk)[:, None]
            last_logits = logits if last_logits is None else jnp.where(ends_here, logits,
                                                                       last_logits)
            hidden.append(h)
        routed = None if routes[0] is None else jnp.concatenate(routes, axis=2)
        return cache, last_logits, hidden, padded, positions, routed

    def _draft_prompts(self, cache, hidden, padded, positions, lengths, first, key, sampling):
        """Fills the MTP caches over the prompt and drafts the tokens after `first`, the token
        sampled at position len(prompt)."""
        chunk, draft, batch = self.prefill_chunk, self.spec.draft, len(lengths)
        sequence = np.zeros((batch, padded.shape[1] + chunk + draft), np.int32)
        sequence[:, :padded.shape[1]] = padded
        sequence[np.arange(batch), lengths] = np.asarray(first)
        drafts = draft_probs = None
        for c, h in enumerate(hidden):
            start = c * chunk
            known_tokens = sequence[:, start + 1:start + 1 + chunk + draft]
            last = np.clip(lengths - 1 - start, 0, chunk - 1)
            key, chunk_key = jax.random.split(key)
            cache, d, q = self._draft(self.variables, cache, h, positions[:, start:start + chunk],
                                      known_tokens, lengths - start, last, chunk_key, sampling)
            ends_here = ((lengths - 1) // chunk == c)
            drafts = d if drafts is None else jnp.where(ends_here[:, None], d, drafts)
            draft_probs = q if draft_probs is None else jnp.where(ends_here[:, None, None], q,
                                                                  draft_probs)
        return cache, drafts, draft_probs


def _routes_per_row(prefill, steps, lengths, outputs) -> list[np.ndarray]:
    """The prefill's routes [L_moe, B, P_max, k] and each decode step's [L_moe, B, k] -> per row
    [L_moe, P_b + G_b - 1, k]: its prompt's P_b tokens, then the generated tokens it fed back
    (row b feeds its i-th generated token at step i, and stops before feeding its last)."""
    prefill = np.asarray(prefill)
    layers, _, _, k = prefill.shape
    fed = (np.asarray(jnp.stack(steps, axis=2)) if steps
           else np.zeros((layers, len(outputs), 0, k), np.int32))
    return [np.concatenate([prefill[:, b, :length], fed[:, b, :len(out) - 1]], axis=1)
            for b, (length, out) in enumerate(zip(lengths, outputs))]
