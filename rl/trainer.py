"""One RL run's machinery (report 5.2): `RLTrainer` builds the models, optimizers, decoder,
tasks and mesh layouts once; `iteration()` does rollouts -> rewards -> advantages -> one epoch
of actor and critic updates; `evaluate()` the held-out accuracy. `rl.loop.run_rl` drives it.

Each iteration draws P training problems (deterministically from the seed and the iteration),
samples N responses for each with the inference path (its own dtype: pi_infer), recomputes
pi_old with the training path, scores the responses with each task's reward (rl/tasks.py; the
prompts are split between the tasks by weight, rl/task_mix.py), bootstraps truncated
ones with the critic (eq. 3), forms advantages (GAE, or group-normalised rewards for GRPO; with
teachers, plus the on-policy distillation term, rl/distill/) and runs one epoch of actor and
critic minibatch updates. Everything runs under `rl.mesh` with training's layouts
(rl/parallel.py). With `rl.toggle`, the rewards pass through Kimi K2.5's Toggle
(rl/objectives/toggle.py) on budgets estimated at the start (rl/budget.py). With
`rl.routing_replay` the training forwards route as the rollouts did (rl/routing_replay.py);
with `rl.max_staleness` an iteration trains on a batch drawn k iterations earlier
(rl/staleness.py), weighted by truncated importance sampling (rl/objectives/truncated_is.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.interop.workdir import Checkpointer, restore_target
from model.lm import CausalLM, abstract_variables, init_variables, join_variables
from model.parallel.rules import param_axes, replicated
from model.tokenizers.text import load_tokenizer
from model.weights import load_model
from rl.budget import BudgetTable, budget_table, toggled_rewards
from rl.config import RLRunConfig
from rl.distill.distillation import Distillation
from rl.draw import Draw, score_draw
from rl.dynamic_sampling import sample_batch
from rl.evaluate import heldout_scores
from rl.models import ValueModel, critic_variables_from_policy, shift_right, token_logprobs
from rl.objectives import losses
from rl.objectives.advantages import bootstrapped_rewards, gae, terminal_rewards
from rl.objectives.kl import kl_estimate
from rl.objectives.overlong import overlong_penalty
from rl.objectives.truncated_is import tis_weights
from rl.parallel import (
    check_rows_fit,
    place_variables,
    rl_mesh,
    rl_state_shardings,
    row_sharding,
    sharded_jit,
    variables_sharding,
)
from rl.resume import resumed_config
from rl.rollout import Rollouts, collect_rollouts
from rl.routing_replay import replay_metrics
from rl.staleness import RolloutBuffer
from rl.task_mix import sample_mix
from rl.tasks import build_tasks
from rl.update import make_actor_step, make_critic_step, minibatches
from train.init_from import source_tokenizer_mismatch
from train.loop import TrainingError
from train.optim.optimizer import build_optimizer
from train.optim.schedules import learning_rate_schedule
from train.state import TrainState, state_from_variables


class RLState(flax.struct.PyTreeNode):
    actor: TrainState
    critic: TrainState | None  # None for GRPO
    reference: Any  # params of the initial policy (KL anchor), {} when rl.kl_coef == 0
    iteration: jax.Array  # int32 []: iterations completed


class StaleRLState(RLState):
    """`RLState` of a run with `rl.max_staleness` (an on-policy run keeps the plain layout, so
    its checkpoints stay those of earlier versions)."""

    buffer: dict  # the waiting batches (rl/staleness.py)


class RLTrainer:
    """The pieces of one RL run; `run_rl()` is the entry point (it prepares and locks the
    workdir first)."""

    def __init__(self, run: RLRunConfig, workdir: Path, init_from: str | None = None,
                 devices: list | None = None):
        self.workdir = Path(workdir)
        self.mesh = rl_mesh(run.rl.mesh, devices)  # this command's: a resume may change it
        self.checkpoints = Checkpointer(self.workdir / "checkpoints", run.rl.keep_checkpoints)
        self.resume_step = self.checkpoints.latest_step()
        self.initial_variables = None
        self.budgets: BudgetTable | None = None  # Toggle's, set by initial_state()
        if self.resume_step is not None:
            run = resumed_config(run, self.checkpoints.read_config(self.resume_step),
                                 self.workdir, init_from=bool(init_from))
        elif init_from:  # float32 masters, whatever the checkpoint stores (a bfloat16 import)
            config, self.initial_variables = load_model(init_from, self.mesh, param_dtype="float32")
            run = run.with_model(config, checkpoint=True)
        elif run.model is None:
            raise TrainingError("no policy to start from: pass --init-from (a training workdir, "
                                "model directory or HF checkpoint) or give a model: section")
        self.run, rl = run, run.rl
        check_rows_fit(rl, self.mesh)
        self.tokenizer = load_tokenizer(rl.tokenizer)
        # A policy trained with another tokenizer reads the prompts as noise: reward 0 throughout.
        mismatch = init_from and self.resume_step is None and source_tokenizer_mismatch(
            Path(init_from), self.tokenizer)
        if mismatch:
            raise TrainingError(f"--init-from: {mismatch}; set rl.tokenizer to the workdir's "
                                "tokenizer or start from a policy trained with this one")
        if self.tokenizer.get_vocab_size() > run.model.vocab_size:
            raise TrainingError(f"tokenizer {rl.tokenizer!r} has {self.tokenizer.get_vocab_size()} "
                                f"tokens but the model's vocab_size is {run.model.vocab_size}")
        if rl.routing_replay and not run.model.moe_layer_indices():
            raise TrainingError("rl.routing_replay: the policy has no MoE layers, so there is "
                                "no routing to replay; set rl.routing_replay=false")
        self.tasks = build_tasks(run.task)
        self.batches = RolloutBuffer(self.tasks, rl.max_staleness, rl.iterations)
        self.distillation = Distillation.of_run(run, self.tokenizer, self.mesh)
        self.prompt_ids = {p.prompt: self.tokenizer.encode(p.prompt).tolist()
                           for task in self.tasks for p in task.train + task.heldout}
        self.row_length = max(map(len, self.prompt_ids.values())) + rl.max_new_tokens

        self.actor = CausalLM(run.model)
        self.critic = ValueModel(run.model) if rl.uses_critic else None
        boxed = abstract_variables(run.model)
        # Only the main head is trained: the MTP heads are frozen (no loss reaches them).
        self.actor_optimizer = build_optimizer(
            param_axes(boxed), learning_rate=learning_rate_schedule(**rl.actor.schedule_settings()),
            trained_mtp_heads=0, **rl.actor.optimizer_settings())
        critic_boxed = None
        if self.critic is not None:
            critic_boxed = jax.eval_shape(lambda: init_variables(self.critic, jax.random.key(0)))
            self.critic_optimizer = build_optimizer(
                param_axes(critic_boxed),
                learning_rate=learning_rate_schedule(**rl.critic.schedule_settings()),
                **rl.critic.optimizer_settings())
        self.decoder = Decoder(run.model.replace(compute_dtype=rl.inference_dtype),
                               nn.meta.unbox(boxed), max_len=self.row_length)
        self.abstract_state = jax.eval_shape(lambda: self._fresh_state(self._random_variables()))
        shardings = self.state_sharding = rl_state_shardings(
            self.abstract_state, boxed, critic_boxed, self.mesh, run.model, rl.mesh.zero1)
        rows, metrics = row_sharding(self.mesh), replicated(self.mesh)
        self._score = sharded_jit(lambda variables, tokens, segments, routes: token_logprobs(
            self.actor, variables, tokens, segments, rl.temperature, routed_experts=routes),
            (variables_sharding(shardings.actor), rows, rows, rows), rows)
        self.teacher_heads = self.distillation.heads if self.distillation else ()
        self._actor_step = sharded_jit(
            make_actor_step(self.actor, self.actor_optimizer, rl,
                            self.distillation.head_configs if self.distillation else ()),
            (shardings.actor, rows, replicated(self.mesh)), (shardings.actor, metrics), (0,))
        if self.critic is not None:
            self._values = sharded_jit(self.critic.apply,
                                       (variables_sharding(shardings.critic), rows, rows), rows)
            self._critic_step = sharded_jit(make_critic_step(self.critic, self.critic_optimizer),
                                            (shardings.critic, rows), (shardings.critic, metrics),
                                            (0,))

    # ---- state ----------------------------------------------------------------------------

    def _fresh_state(self, variables: dict) -> RLState:
        rl = self.run.rl
        actor = state_from_variables(variables, self.actor_optimizer, jax.random.key(rl.seed))
        critic = None
        if self.critic is not None:
            critic_init = nn.meta.unbox(init_variables(self.critic, jax.random.key(rl.seed)))
            critic_vars = critic_variables_from_policy(variables, critic_init)
            critic = state_from_variables(critic_vars, self.critic_optimizer,
                                          jax.random.key(rl.seed + 1))
        common = dict(actor=actor, critic=critic, reference=variables["params"] if rl.kl_weight
                      else {}, iteration=jnp.zeros((), jnp.int32))
        if not rl.max_staleness:
            return RLState(**common)
        routes = (len(self.run.model.moe_layer_indices()), self.run.model.moe.top_k)
        return StaleRLState(**common, buffer=RolloutBuffer.empty(
            rl.max_staleness, rl.batch_size, self.row_length,
            routes if rl.routing_replay else None))

    def initial_state(self) -> RLState:
        """A fresh state created in its shardings, or the latest checkpoint restored into them
        (whatever mesh saved it). With `rl.toggle`, also sets `budgets`: estimated with the
        fresh policy and saved, or read back on resume (rl/budget.py)."""
        if self.resume_step is not None:
            state, _ = self.checkpoints.restore(
                self.resume_step, restore_target(self.abstract_state, self.state_sharding))
        else:
            variables = place_variables(self.initial_variables or self._random_variables(),
                                        self.state_sharding.actor)
            state = jax.jit(self._fresh_state, out_shardings=self.state_sharding)(variables)
        rl = self.run.rl
        if rl.toggle.enabled:
            self.budgets = budget_table(self.workdir, self.resume_step is not None, rl,
                                        self.tasks, lambda rows, key: self.sample(state, rows, key))
        if rl.max_staleness and self.resume_step is None:  # the initial policy's batches
            state = state.replace(buffer=self.batches.fill(
                state.buffer, lambda batch: self._draw_batch(state, batch)[0]))
        return state

    def _random_variables(self) -> dict:
        return nn.meta.unbox(init_variables(self.actor, jax.random.key(self.run.rl.seed)))

    def save(self, state: RLState) -> None:
        iteration = int(state.iteration)
        self.checkpoints.save(iteration, state, {"iteration": iteration}, self.run.to_dict())

    # ---- one iteration ----------------------------------------------------------------------

    def draw(self, state: RLState, iteration: int, draw: int = 0) -> Draw:
        """P problems x N samples, sampled and scored -> a `Draw` (rl/draw.py): rollouts,
        rewards float32 [P * N] and each row's task. The samples of a
        problem are adjacent rows; the P problems are split between the tasks by weight. Draw 0
        is an iteration's first; each `draw` takes other problems and sampling keys,
        deterministically."""
        rl = self.run.rl
        rng = np.random.default_rng([rl.seed, iteration] + ([draw] if draw else []))
        rows = [row for row in sample_mix(self.tasks, rl.prompts_per_iteration, rng)
                for _ in range(rl.samples_per_prompt)]
        key = jax.random.fold_in(jax.random.key(rl.seed), iteration)
        if draw:
            key = jax.random.fold_in(key, draw)
        return self.sample(state, rows, key)

    def sample(self, state: RLState, rows: list, key: jax.Array) -> Draw:
        """rows [B] of (task, problem) -> one response each from the actor at the rollout
        temperature, scored (`Draw`)."""
        rl = self.run.rl
        rollouts = collect_rollouts(
            self.decoder.with_variables(_variables(state.actor)),
            [self.prompt_ids[p.prompt] for _, p in rows], length=self.row_length,
            max_new_tokens=rl.max_new_tokens, sampling=Sampling(rl.temperature, top_p=rl.top_p),
            stop_id=self.tokenizer.eos_id, key=key, record_routing=rl.routing_replay)
        return score_draw(rollouts, rows, [self.tokenizer.decode(r) for r in rollouts.responses])

    def _draw_batch(self, state: RLState, iteration: int) -> tuple[Draw, dict]:
        """The batch of `iteration` sampled by `state`'s policy -> (draw, sampling metrics);
        with dynamic sampling it takes several draws (rl/dynamic_sampling.py)."""
        rl, started = self.run.rl, time.perf_counter()
        drawn, metrics = sample_batch(
            lambda draw: self.draw(state, iteration, draw),
            groups=rl.prompts_per_iteration, group_size=rl.samples_per_prompt,
            dynamic=rl.samples_dynamically, max_draws=rl.max_draws)
        seconds = time.perf_counter() - started
        tokens = metrics.get("sampling/tokens_drawn", drawn.rollouts.response_lengths.sum())
        return drawn, {**metrics, "rollout_seconds": seconds,
                       "rollout_tokens_per_sec": float(tokens) / max(seconds, 1e-9)}

    def iteration(self, state: RLState, iteration: int) -> tuple[RLState, dict]:
        """Rollouts -> rewards -> advantages -> one epoch of updates. -> (state, metrics).
        `rewards` are the verifier's, `scored` the trained-on ones (`training_rewards`)."""
        rl = self.run.rl
        started = time.perf_counter()
        buffer, drawn, drawn_at, sampling = self.batches.next(
            getattr(state, "buffer", {}), iteration, lambda batch: self._draw_batch(state, batch))
        if rl.max_staleness:
            state = state.replace(buffer=buffer)
        scored, toggle_metrics = self.training_rewards(drawn, iteration)
        rollouts = drawn.rollouts
        tokens, segments = jnp.asarray(rollouts.tokens), jnp.asarray(rollouts.segment_ids)
        mask, infer_logp = jnp.asarray(rollouts.mask), jnp.asarray(rollouts.infer_logp)
        routes = (None if rollouts.routed_experts is None
                  else jnp.asarray(rollouts.routed_experts))

        # pi_old by the training path; the reference policy scored on the same routes, so
        # with routing replay the KL measures how the weights moved, not routing noise
        old = self._score(_variables(state.actor), tokens, segments, routes)
        ref_logp = (self._score({**_variables(state.actor), "params": state.reference}, tokens,
                                segments, routes)["logp"] if rl.kl_weight else old["logp"])
        advantages, returns, values = self._advantages(state, rollouts, scored)
        distilled, distill_metrics = {}, {}
        if self.distillation is not None:  # the teacher term (rl/distill/)
            advantages, distilled, distill_metrics = self.distillation.apply(
                drawn, old["logp"], advantages)
        select = (losses.high_entropy_mask(old["entropy"], mask, rl.entropy_top_frac)
                  if rl.entropy_top_frac < 1 else mask)
        off_policy = {"staleness": float(iteration - drawn_at)}
        if rl.uses_tis:
            weights, tis = tis_weights(old["logp"], infer_logp, mask, rl.tis_cap)
            select = select * weights
            off_policy.update(tis)
        if routes is not None:
            distilled = {**distilled, "routed_experts": routes}
            off_policy.update({f"replay/{k}": v for k, v in
                               replay_metrics(old["replay_mismatch"], routes, mask).items()})
        batch = jax.tree.map(np.asarray, {
            "tokens": tokens, "segment_ids": segments, "mask": mask, "old_logp": old["logp"],
            "infer_logp": infer_logp, "advantages": advantages, "ref_logp": ref_logp,
            "select": select, **distilled})
        state, update_metrics = self._update(state, batch, returns, iteration)

        _, _, filters = losses.mis_filters(old["logp"], infer_logp, mask, rl.token_bounds,
                                           rl.traj_bounds)
        lengths = rollouts.response_lengths
        per_rollout_confidence = (jnp.sum(old["routing_confidence"] * mask, axis=1)
                                  / jnp.maximum(jnp.sum(mask, axis=1), 1.0))
        metrics = {
            **drawn.metrics([task.name for task in self.tasks]),
            "truncation_rate": float(rollouts.truncated.mean()),
            "response_length": float(lengths.mean()),
            "entropy": float(losses.masked_mean(old["entropy"], mask)),
            "routing_confidence": float(per_rollout_confidence.mean()),
            "routing_confidence_hist": np.asarray(per_rollout_confidence),  # TensorBoard only
            **({"kl": float(kl_estimate(rl.kl_method, old["logp"], old["logp"], ref_logp,
                                        mask))} if rl.kl_weight else {}),  # needs a reference
            **{k: float(v) for k, v in {**filters, **off_policy}.items()}, **sampling,
            **update_metrics, **distill_metrics,
            "advantage_rms": float(jnp.sqrt(losses.masked_mean(advantages ** 2, mask))),
            "iteration_seconds": time.perf_counter() - started,
        }
        if rl.overlong_buffer_tokens:
            metrics["overlong_penalty"] = float(np.mean(
                overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer_tokens)))
        metrics.update(toggle_metrics)
        if values is not None:
            metrics["value_mean"] = float(losses.masked_mean(values, mask))
        return state, metrics

    def training_rewards(self, drawn: Draw, iteration: int) -> tuple[np.ndarray, dict]:
        """A draw's rewards as trained on -> (float32 [B], Toggle's metrics or {}): the task's,
        through Toggle (eq. 2) when `rl.toggle` is on, then plus DAPO's overlong penalty. In that
        order because eq. 2 gates the outcome reward: multiplied after the penalty, an over-budget
        response would also shed its (negative) length penalty and out-score a shorter one."""
        rl = self.run.rl
        rewards, metrics = drawn.rewards, {}
        if rl.toggle.enabled:
            rewards, metrics = toggled_rewards(drawn, self.budgets, rl, iteration)
        return rewards + overlong_penalty(drawn.rollouts.response_lengths, rl.max_new_tokens,
                                          rl.overlong_buffer_tokens), metrics

    def _advantages(self, state: RLState, rollouts: Rollouts, rewards: np.ndarray):
        """-> (advantages [B, T], critic targets [B, T] or None, V(s_t) [B, T] or None).
        With a critic: eq. 3's bootstrapped rewards and GAE; without (GRPO, or
        rl.advantages=group): group-normalised rewards."""
        rl = self.run.rl
        mask = jnp.asarray(rollouts.mask)
        if self.critic is None:
            group = losses.group_advantages(jnp.asarray(rewards), rl.samples_per_prompt,
                                            scale=rl.divides_by_group_std)
            return group[:, None] * mask, None, None
        after = self._values(_variables(state.critic), jnp.asarray(rollouts.tokens),
                             jnp.asarray(rollouts.segment_ids))
        values = shift_right(after) * mask
        last = rollouts.tokens.shape[1] - 1 - np.argmax(rollouts.mask[:, ::-1], axis=1)
        final_values = after[jnp.arange(len(last)), jnp.asarray(last)]  # V(s_T)
        scored = jnp.asarray(rewards)
        if rl.truncation_bootstrap:
            scored = bootstrapped_rewards(scored, jnp.asarray(rollouts.truncated), final_values)
        advantages, returns = gae(terminal_rewards(scored, mask), values, mask, rl.gamma, rl.lam)
        return advantages, returns, values

    def _update(self, state: RLState, batch: dict, returns, iteration: int
                ) -> tuple[RLState, dict]:
        """One epoch: `rl.actor_minibatches` actor and `rl.critic_minibatches` critic updates."""
        rl = self.run.rl
        shuffle = np.random.default_rng([rl.seed, iteration, 1])
        actor, actor_metrics = state.actor, []
        for mb in minibatches(batch, rl.actor_minibatches, shuffle):
            actor, m = self._actor_step(actor, mb, self.teacher_heads)
            actor_metrics.append(m)
        critic, critic_metrics = state.critic, []
        if self.critic is not None:
            critic_batch = {k: batch[k] for k in ("tokens", "segment_ids", "mask")}
            critic_batch["returns"] = np.asarray(returns)
            for mb in minibatches(critic_batch, rl.critic_minibatches, shuffle):
                critic, m = self._critic_step(critic, mb)
                critic_metrics.append(m)
        state = state.replace(actor=actor, critic=critic, iteration=state.iteration + 1)
        return state, {**_mean_metrics(actor_metrics, "actor/"),
                       **_mean_metrics(critic_metrics, "critic/")}

    def evaluate(self, state: RLState) -> dict[str, float]:
        """Held-out exact-match accuracy, pooled and per task: greedy and sampled (the rollout
        temperature)."""
        rl = self.run.rl
        decoder = self.decoder.with_variables(_variables(state.actor))
        common = dict(prompt_ids=self.prompt_ids, tokenizer=self.tokenizer,
                      max_new_tokens=rl.max_new_tokens, batch_size=rl.batch_size)
        return {
            **heldout_scores(decoder, self.tasks, rl.eval_prompts, Sampling(), "eval/accuracy",
                             **common),
            **heldout_scores(decoder, self.tasks, rl.eval_prompts,
                             Sampling(rl.temperature, top_p=rl.top_p), "eval/sample_accuracy",
                             key=jax.random.key(rl.seed), **common),
        }


def _variables(state: TrainState) -> dict:
    return join_variables(state.params, state.balance)


def _mean_metrics(records: list[dict], prefix: str) -> dict[str, float]:
    if not records:
        return {}
    return {prefix + k: float(np.mean([float(r[k]) for r in records])) for k in records[0]}
