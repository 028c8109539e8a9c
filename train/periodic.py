"""What a training run measures besides its training loss, at `train.eval_every` and
`train.sample_every` (train/loop.py logs and prints what this returns):

- the held-out loss and perplexity over the first `train.eval_batches` batches of the held-out
  split (the same batches every time), each device evaluating its share of the rows;
- `train.eval_tasks`: lm-evaluation-harness tasks on their first `limit` samples through
  `model.inference.harness.HarnessLM`, as `python -m train.lm_eval` runs them, logged as
  `eval/<task>/<metric>` (the `eval` extra; the tasks are found before the first step);
- `train.samples`: greedy generations from the configured prompts or from the start of the
  first held-out rows, logged as `samples/<i>` (prompt and continuation) and printed.

Decoding uses the state's weights as they lie on the mesh, like RL's rollouts; it runs on one
process, with whole layers and sequences (no `pipeline` or `context` axis) and batches that
split over the data-parallel devices (all checked before the first step).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.inference.decode import Decoder
from model.lm import CausalLM, join_variables
from model.tokenizers.text import TextTokenizer
from train.config import RunConfig
from train.data.pipeline import make_dataset
from train.data.sources import TrainingData
from train.eval import evaluate, limited, make_eval_step
from train.lm_eval import evaluate_tasks, harness_available, task_manager, task_metrics
from train.parallel.sharding import batch_spec, data_parallel_size
from train.periodic_config import decoder_length


class PeriodicEvals:
    def __init__(self, run: RunConfig, model: CausalLM, tokenizer: TextTokenizer,
                 data: TrainingData, mesh: Mesh):
        self.run, self.model, self.tokenizer, self.data, self.mesh = run, model, tokenizer, data, mesh
        cfg = run.train
        self._eval_step = self._decoder = self._harness = self._tasks = None
        if cfg.eval_tasks.tasks or cfg.sample_every:
            check_decodable(run, mesh)
        if cfg.eval_tasks.tasks:
            harness_available()
            self._tasks = task_manager(cfg.eval_tasks.tasks, cfg.eval_tasks.include_path or None)
        self.prompts = self._sample_prompts() if cfg.sample_every else []

    def run_at(self, state, step: int, *, held_out: bool, samples: bool
               ) -> tuple[dict, list[str]]:
        """(metrics to log, lines to print) of the evaluations due at `step`."""
        record, lines = {}, []
        if held_out:
            record.update(self.held_out(state))
            lines.append(f"step {step}: held-out loss {record['eval/loss']:.4f}")
            if self._tasks is not None:
                scores = self.benchmarks(state)
                record.update(scores)
                lines.append(f"step {step}: " + ", ".join(
                    f"{name.removeprefix('eval/')} {value:.4g}" for name, value in scores.items()))
        if samples:
            for i, (prompt, text) in enumerate(self.generations(state)):
                record[f"samples/{i}"] = prompt + text
                lines.append(f"step {step} sample {i}: {prompt!r} -> {text!r}")
        return record, lines

    def held_out(self, state) -> dict[str, float]:
        cfg = self.run.train
        if self._eval_step is None:
            self._eval_step = make_eval_step(self.model, cfg.loss_chunk_size)
        data = self._heldout_batches()
        # Every process reads the same held-out rows; each device evaluates its share of them.
        rows = NamedSharding(self.mesh, P(*batch_spec(self.mesh)[1:]))
        shard = lambda batch: {k: jax.make_array_from_callback(  # noqa: E731
            v.shape, rows, lambda index, v=v: v[index]) for k, v in batch.items()}
        result = evaluate(self._eval_step, state.params, state.balance,
                          map(shard, limited(data, cfg.eval_batches)))
        return {"eval/loss": result["loss"], "eval/perplexity": result["perplexity"]}

    def benchmarks(self, state) -> dict[str, float]:
        cfg = self.run.train.eval_tasks
        decoder = self.decoder(state)  # holding the current weights
        if self._harness is None:
            from model.inference.harness import HarnessLM

            self._harness = HarnessLM(decoder, self.tokenizer, batch_size=cfg.batch_size,
                                      max_gen_toks=cfg.max_gen_toks, seed=self.run.train.seed,
                                      progress=False)
        results = evaluate_tasks(self._harness, cfg.tasks, self._tasks, limit=cfg.limit,
                                 num_fewshot=None if cfg.num_fewshot < 0 else cfg.num_fewshot,
                                 bootstrap_iters=0, keep_global_seeds=True)
        return task_metrics(results)

    def generations(self, state) -> list[tuple[str, str]]:
        """(prompt, greedy continuation) of every sample prompt."""
        cfg = self.run.train.samples
        ways = data_parallel_size(self.mesh)
        padding = [[self.tokenizer.eos_id]] * (-len(self.prompts) % ways)
        out = self.decoder(state).generate(self.prompts + padding, cfg.max_new_tokens,
                                           stop_ids=(self.tokenizer.eos_id,))
        return [(self.tokenizer.decode(prompt), self.tokenizer.decode(tokens))
                for prompt, tokens in zip(self.prompts, out.tokens)]

    def decoder(self, state) -> Decoder:
        """The decoder (built once; compiled steps kept), holding the state's weights."""
        variables = join_variables(state.params, state.balance)
        if self._decoder is None:
            cfg = self.run.train
            self._decoder = Decoder(self.run.model, variables, max_len=decoder_length(cfg))
        self._decoder.variables = variables
        return self._decoder

    def _sample_prompts(self) -> list[list[int]]:
        cfg, train = self.run.train.samples, self.run.train
        room = decoder_length(train) - cfg.max_new_tokens
        if cfg.prompts:
            return [self.tokenizer.encode(p).tolist()[-room:] for p in cfg.prompts]
        batches = limited(self._heldout_batches(), math.ceil(cfg.count / train.micro_batch()))
        rows = [row for batch in batches for row in batch["tokens"]]
        return [row[:cfg.prompt_tokens].tolist() for row in rows[:cfg.count]]

    def _heldout_batches(self):
        """The held-out split from its start in micro-batches: the same rows every time."""
        cfg = self.run.train
        return make_dataset(cfg.data, self.tokenizer, seq_len=cfg.seq_len,
                            batch_size=cfg.micro_batch(), split="heldout", seed=cfg.seed,
                            data=self.data, loss_mask=cfg.loss_mask)


def check_decodable(run: RunConfig, mesh: Mesh) -> None:
    """ValueError (one line) unless the run's evaluations can decode (module docstring)."""
    fields = "train.eval_tasks and train.sample_every"
    if jax.process_count() > 1:
        raise ValueError(f"{fields} decode on one process; evaluate the checkpoints with "
                         "python -m train.lm_eval instead")
    for axis, whole in (("pipeline", "layers"), ("context", "sequences")):  # as KV caches need
        if getattr(run.mesh, axis) != 1:
            raise ValueError(f"{fields} decode whole {whole}: use mesh.{axis}=1")
    ways = data_parallel_size(mesh)
    if run.train.eval_tasks.tasks and run.train.eval_tasks.batch_size % ways:
        raise ValueError(f"train.eval_tasks.batch_size: {run.train.eval_tasks.batch_size} rows "
                         f"do not split over the {ways} data-parallel devices")
