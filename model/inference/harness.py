"""A stepjax model as lm-evaluation-harness sees one (`lm_eval.api.model.TemplateLM`), for
`python -m train.lm_eval` and the benchmark evaluations during training (`train.eval_tasks`).

    lm = HarnessLM(decoder, tokenizer, batch_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], ...)

- `loglikelihood` (lm-eval's TemplateLM splits each (context, continuation) into tokens, as its
  Hugging Face backend does): the sum of the continuation's log-probabilities and whether
  greedy decoding would produce it, from `model.inference.scoring.Scorer` (batched, KV cache);
  context and continuation longer than `max_length + 1` tokens lose tokens on the left.
- `loglikelihood_rolling`: a document's log-likelihood in disjoint windows of `max_length`
  tokens, each conditioned on as much preceding text as fits (lm-eval's own windowing), the
  first on the end-of-text token.
- `generate_until`: `Decoder.generate` on batches of requests with the same generation
  settings, greedy unless a task asks to sample (its temperature, top-k and top-p, the
  sampling key seeded by `seed`); the text is cut at the first stop sequence
  (the task's `until` and the end-of-text token); contexts keep their last `max_length -
  max_gen_toks` tokens.

`max_length` is the decoder's cache size. Requires the `eval` extra (`pip install
'stepjax[eval]'`: lm-eval).
"""

from __future__ import annotations

import jax
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.inference.scoring import Scorer
from model.tokenizers.text import TextTokenizer


class HarnessLM(TemplateLM):
    def __init__(self, decoder: Decoder, tokenizer: TextTokenizer, *, batch_size: int = 8,
                 max_gen_toks: int = 256, seed: int = 0, progress: bool = True):
        super().__init__()
        self.decoder, self.tokenizer = decoder, tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.scorer = Scorer(decoder, batch_size)
        self.key, self.progress = jax.random.key(seed), progress

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self.decoder.spec.max_len

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                   ) -> list[int]:
        return self.tokenizer.encode(string).tolist()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False
                              ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids)."""
        sequences = [(context + continuation)[-(self.max_length + 1):]
                     for _, context, continuation in requests]
        scored = self.scorer.score(sequences, progress=self.progress and not disable_tqdm)
        results = []
        for (request, _, continuation), (logprobs, greedy) in zip(requests, scored):
            n = len(continuation)
            result = (float(logprobs[-n:].sum()), bool(greedy[-n:].all()))
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(utils.make_disjoint_window,
                                             utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id])
        batches = Collator([request.args for request in requests],
                           sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
                           group_by="gen_kwargs", group_fn=lambda args: args[1])
        results = []
        bar = tqdm(total=len(requests), desc="generate", leave=False,
                   disable=disable_tqdm or not self.progress)
        for batch in batches.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*batch)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            for context, text in zip(contexts, self._generate(contexts, kwargs)):
                text = postprocess_generated_text(text, until, None)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                results.append(text)
            bar.update(len(batch))
        bar.close()
        return batches.get_original(results)

    def _generate(self, contexts, kwargs: dict) -> list[str]:
        """Continuations of `contexts` (text), padded to a full batch so that one compiled
        step serves every batch."""
        new_tokens = kwargs["max_gen_toks"]
        room = self.max_length - new_tokens
        if room < 1:
            raise ValueError(f"max_gen_toks: {new_tokens} new tokens leave no room for a context "
                             f"in the cache of {self.max_length} positions (--max-length)")
        prompts = [self.tok_encode(c)[-room:] or [self.eot_token_id] for c in contexts]
        padding = [[self.eot_token_id]] * (self.batch_size - len(prompts))
        sampling = Sampling()  # greedy; `generate` validates a task's settings
        if kwargs["do_sample"]:
            sampling = Sampling(float(kwargs["temperature"]), int(kwargs.get("top_k") or 0),
                                float(kwargs.get("top_p") or 1.0))
        self.key, key = jax.random.split(self.key)
        out = self.decoder.generate(prompts + padding, new_tokens, sampling=sampling, key=key,
                                    stop_ids=(self.eot_token_id,))
        return [self.tokenizer.decode(ids, skip_special_tokens=False)
                for ids in out.tokens[:len(prompts)]]
