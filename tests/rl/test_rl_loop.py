"""RL plumbing on a small random model: inference-path log-probs, rollout layout, the training
path's log-probs/entropy/values, minibatches, the loop (metrics, resume, algorithms) and the
`python -m rl` command line."""

import dataclasses
import functools
import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_workdir_source import check_rl_workdir_is_a_model_source
from train_helpers import REPO

import rl.trainer as rl_trainer
import rl.tasks as rl_tasks
from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.lm import CausalLM, init_variables
from rl.__main__ import main as rl_main
from rl.config import load_rl_config, rl_config_from_dict
from rl.loop import run_rl
from rl.models import ValueModel, critic_variables_from_policy, token_logprobs
from rl.objectives import kl as K
from rl.objectives import losses
from rl.rollout import collect_rollouts, layout_rows
from rl.update import actor_loss, minibatches
from train.config import load_run_config
from train.telemetry.metrics import read_metrics

# Two layers (SWA dense + full MoE) and one MTP head: every code path of the RL plumbing at the
# smallest compile time (XLA compilation dominates these tests).
RL_TEST_MODEL = [
    "model.num_layers=2", "model.layout=SF", "model.d_model=32", "model.window=4",
    "model.head_dim=8", "model.dense_hidden=32", "model.moe.num_experts=4", "model.moe.top_k=2",
    "model.moe.expert_hidden=16", "model.moe.shared_hidden=16", "model.moe.num_ep_groups=2",
    "model.mtp.num_heads=1",
]


def small_model_dict() -> dict:
    run = load_run_config(REPO / "configs" / "sft_arith.yaml", RL_TEST_MODEL)
    return run.to_dict()["model"]


def small_run(**rl_overrides):
    rl = {"iterations": 2, "prompts_per_iteration": 2, "samples_per_prompt": 2,
          "max_new_tokens": 3, "actor_minibatches": 2, "critic_minibatches": 2,
          "eval_prompts": 4, "eval_every": 0, "checkpoint_every": 1, "progress": False,
          "actor": {"lr": 1e-3, "warmup_steps": 0}, "critic": {"lr": 1e-3, "warmup_steps": 0},
          **rl_overrides}
    return rl_config_from_dict({"model": small_model_dict(), "rl": rl,
                                "task": {"max_operand": 9}})


@pytest.fixture(scope="module")
def policy():
    cfg = rl_config_from_dict({"model": small_model_dict()}).model
    init = jax.jit(lambda key: init_variables(CausalLM(cfg), key))
    return cfg, nn.meta.unbox(init(jax.random.key(3)))


REFERENCE_LENGTH = 16


@functools.cache
def _forward(cfg):
    return jax.jit(lambda variables, tokens: jax.nn.log_softmax(
        CausalLM(cfg).apply(variables, tokens).logits, axis=-1))


def full_forward_logprobs(cfg, variables, row):
    """Reference: log-softmax of the plain forward pass's logits over one row [T] -> [T, V].
    The row is zero-padded to one length (one compile); causal attention keeps the padding
    out of the row's own positions."""
    padded = np.zeros((1, REFERENCE_LENGTH), np.int32)
    padded[0, :len(row)] = row
    return np.asarray(_forward(cfg)(variables, jnp.asarray(padded))[0, :len(row)])


@pytest.mark.slow
def test_decoder_records_logprobs_of_sampled_tokens(policy):
    cfg, variables = policy
    decoder = Decoder(cfg, variables, max_len=16)
    prompts = [[3, 4, 5, 6], [7, 8]]
    out = decoder.generate(prompts, 5, sampling=Sampling(temperature=1.0),
                           key=jax.random.key(1))
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
        row = prompt + tokens
        reference = full_forward_logprobs(cfg, variables, row)
        expected = [reference[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)]
        np.testing.assert_allclose(logprobs, expected, atol=2e-5)


@pytest.mark.slow
def test_speculative_generation_has_no_logprobs(policy):
    cfg, variables = policy
    decoder = Decoder(cfg, variables, max_len=16, draft=1)
    assert decoder.generate([[3, 4]], 3, speculative=True).logprobs is None


@pytest.mark.slow
def test_rollout_layout_mask_and_truncation(policy):
    cfg, variables = policy
    decoder = Decoder(cfg, variables, max_len=12)
    prompts = [[3, 4, 5], [6, 7]]
    tokens_of = decoder.generate(prompts, 4, sampling=Sampling(1.0), key=jax.random.key(5))
    stop = tokens_of.tokens[0][0]  # make the first row stop at once
    rollouts = collect_rollouts(decoder, prompts, length=10, max_new_tokens=4,
                                sampling=Sampling(1.0), stop_id=stop, key=jax.random.key(5))
    assert rollouts.tokens.shape == (2, 10)
    assert rollouts.responses[0] == [] and not rollouts.truncated[0]
    np.testing.assert_array_equal(rollouts.mask[0], [0, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    assert rollouts.tokens[0, 3] == stop
    generated = len(rollouts.responses[1]) + (not rollouts.truncated[1])
    assert rollouts.mask[1].sum() == generated
    assert rollouts.truncated[1] == (generated == 4 and stop not in rollouts.responses[1])
    np.testing.assert_array_equal(rollouts.segment_ids[1, :2 + generated], 1)
    assert (rollouts.infer_logp[rollouts.mask == 0] == 0).all()
    assert (rollouts.infer_logp[rollouts.mask == 1] < 0).all()


def test_layout_rows_rejects_rows_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        layout_rows([[1, 2, 3]], [[4, 5]], 4)


@pytest.mark.slow
def test_token_logprobs_and_entropy_match_the_full_forward(policy):
    cfg, variables = policy
    tokens, segments, _ = layout_rows([[3, 4, 5], [6]], [[7, 8], [9, 10, 11]], 7)
    reference = [full_forward_logprobs(cfg, variables, row[:s.sum()])
                 for row, s in zip(tokens, segments)]
    for chunk in (1024, 3):  # chunking the vocabulary projection changes nothing
        out = jax.jit(lambda v, t, s: token_logprobs(CausalLM(cfg), v, t, s, chunk_size=chunk))(
            variables, jnp.asarray(tokens), jnp.asarray(segments))
        for b, ref in enumerate(reference):
            n = len(ref)
            expected = [ref[t - 1, tokens[b, t]] for t in range(1, n)]
            np.testing.assert_allclose(out["logp"][b, 1:n], expected, atol=2e-5)
            probs = np.exp(ref[:n - 1].astype(np.float64))
            entropy = -(probs * np.log(probs)).sum(-1)
            np.testing.assert_allclose(out["entropy"][b, 1:n], entropy, atol=2e-5)
            assert out["logp"][b, 0] == 0
        confidence = np.asarray(out["routing_confidence"])
        assert ((confidence[:, 1:] > 0) & (confidence[:, 1:] <= 1 + 1e-6)).all()


@pytest.mark.slow
def test_critic_starts_from_the_policy_backbone_with_zero_values(policy):
    cfg, variables = policy
    critic = ValueModel(cfg)
    init = nn.meta.unbox(jax.jit(lambda key: init_variables(critic, key))(jax.random.key(0)))
    critic_vars = critic_variables_from_policy(variables, init)
    for name, value in critic_vars["params"]["backbone"].items():
        assert jax.tree.all(jax.tree.map(np.array_equal, value, variables["params"][name]))
    assert not any(k.startswith("mtp_") for k in critic_vars["params"]["backbone"])
    values = jax.jit(critic.apply)(critic_vars, jnp.ones((2, 6), jnp.int32))
    assert values.shape == (2, 6) and float(jnp.abs(values).max()) == 0.0


def test_minibatches_cover_every_row_once_and_pad_with_masked_rows():
    rows = 10
    batch = {"id": np.arange(rows), "mask": np.ones((rows, 3), np.float32)}
    parts = minibatches(batch, 4, np.random.default_rng(0))
    assert [len(p["id"]) for p in parts] == [3, 3, 3, 3]
    real = np.concatenate([p["id"][p["mask"].sum(1) > 0] for p in parts])
    assert sorted(real.tolist()) == list(range(rows))
    assert sum(int((p["mask"].sum(1) == 0).sum()) for p in parts) == 2


def is_fraction_of(value: float, count: int) -> bool:
    """value is k / count for an integer 0 <= k <= count."""
    return 0 <= value <= 1 and abs(value * count - round(value * count)) < 1e-5


def check_iteration_metrics(r: dict, rows: int, max_new_tokens: int, vocab: int) -> None:
    """The per-iteration metrics of `rows` rollouts are in range and agree with each other."""
    # Exact-match rewards are 0 or 1: the mean reward is the fraction answered exactly.
    assert r["reward"] == r["accuracy"] and is_fraction_of(r["accuracy"], rows), r
    assert is_fraction_of(r["truncation_rate"], rows), r
    # Truncated rollouts generated max_new_tokens; the others at most that, the stop included.
    assert max_new_tokens * r["truncation_rate"] <= r["response_length"] <= max_new_tokens, r
    for key in ("token_keep_frac", "token_filter_frac", "traj_keep_frac"):
        assert 0 <= r[key] <= 1, (key, r)
    assert r["token_keep_frac"] <= r["token_filter_frac"], r  # kept tokens passed both filters
    assert 0 <= r["entropy"] <= np.log(vocab) + 1e-4, r
    # `kl` only with a KL term (a reference policy kept)
    assert 0 < r["routing_confidence"] <= 1 + 1e-6 and r.get("kl", 0.0) >= 0, r
    assert r["actor/grad_norm"] >= 0 and r["advantage_rms"] >= 0, r


@pytest.mark.slow
def test_loop_metrics_resume_and_cli_on_a_finished_run(tmp_path, capsys):
    """Two iterations from random weights (bfloat16 inference) with Rollout Routing Replay and
    rollouts one iteration stale (the second iteration trains on the batch the initial policy
    drew for it, with truncated importance sampling), the same run interrupted after one
    iteration and resumed (the waiting batch comes back from the checkpoint), and the command
    line on the finished workdir."""
    run = small_run(routing_replay=True, max_staleness=1)
    straight = run_rl(run, tmp_path / "straight")
    assert (straight.first_iteration, straight.last_iteration) == (0, 2)
    records = read_metrics(straight.workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    rl, vocab = run.rl, run.model.vocab_size
    rows = rl.prompts_per_iteration * rl.samples_per_prompt  # rollouts per iteration
    for r in records[1:]:
        check_iteration_metrics(r, rows, rl.max_new_tokens, vocab)
        assert np.isfinite([r["actor/loss"], r["critic/grad_norm"]]).all(), r
        assert r["critic/loss"] >= 0, r  # a squared error
    for r in (records[0], records[2]):  # held-out accuracy of eval_prompts problems
        for key in ("eval/accuracy", "eval/sample_accuracy"):
            assert is_fraction_of(r[key], rl.eval_prompts), (key, r)
    # The first iteration's pi_old is the reference policy itself: KL exactly 0. The value
    # head starts at zero (test_critic_starts_from_the_policy_backbone_with_zero_values).
    assert records[1]["kl"] == 0.0 and records[1]["value_mean"] == 0.0
    # bfloat16 inference against float32 training: pi_infer really differs from pi_old
    # (float32 decoding matches the training path to ~1e-6, see the decoder test above), even
    # with the rollout's routes replayed.
    assert records[1]["mismatch/abs_log_ratio_mean"] > 1e-4
    assert [r["staleness"] for r in records[1:]] == [0, 1]
    for r in records[1:]:
        assert 0 < r["tis/mean_weight"] <= rl.tis_cap and 0 <= r["tis/truncation_rate"] <= 1, r
        for key in ("replay/topk_mismatch", "replay/token_mismatch",
                    "actor/replay_topk_mismatch"):
            assert 0 <= r[key] <= 1, (key, r)
        assert r["replay/topk_mismatch"] <= r["replay/token_mismatch"], r

    first = run_rl(run, tmp_path / "resumed", stop_after=1)
    assert first.interrupted and first.last_iteration == 1
    second = run_rl(run, tmp_path / "resumed")
    assert (second.first_iteration, second.last_iteration) == (1, 2)
    assert second.accuracy_before == pytest.approx(records[0]["eval/accuracy"])
    resumed = read_metrics(second.workdir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in ("reward", "actor/loss", "critic/loss", "eval/accuracy", "tis/mean_weight",
                "replay/topk_mismatch"):
        assert resumed[-1][key] == pytest.approx(records[-1][key], rel=1e-5), key

    config = tmp_path / "rl.yaml"
    config.write_text(json.dumps(run.to_dict()))  # JSON is YAML
    capsys.readouterr()
    assert rl_main(["--config", str(config), "--workdir", str(straight.workdir)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    saved = sorted(p.name for p in (straight.workdir / "checkpoints").iterdir())
    assert rl_main(["--config", str(config), "--workdir", str(straight.workdir),
                    "rl.iterations=3", "rl.algorithm=ppo"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "rl.algorithm" in error
    assert sorted(p.name for p in (straight.workdir / "checkpoints").iterdir()) == saved
    check_rl_workdir_is_a_model_source(straight.workdir, small_run().model, tmp_path, capsys)


@pytest.mark.slow
def test_group_advantages_train_without_a_critic(tmp_path, monkeypatch):
    """Group-normalised rewards drive the actor with no value model. A random policy answers
    nothing right, so every reward and every group advantage would be 0 (and the actor gradient
    only the KL term's, ~1e-5 in the run above); here the rewards are 1, 0 for each prompt's
    two samples, which group normalisation turns into +1 / -1 on every response token."""
    def one_right_one_wrong(texts, answers):
        return np.tile(np.float32([1.0, 0.0]), len(texts) // 2)

    problems, _ = rl_tasks.KINDS["arithmetic"]
    monkeypatch.setitem(rl_tasks.KINDS, "arithmetic", (problems, one_right_one_wrong))
    run = small_run(iterations=1, advantages="group", entropy_top_frac=0.5)
    summary = run_rl(run, tmp_path / "group")
    record = [r for r in read_metrics(summary.workdir / "metrics.jsonl") if r["step"] == 1][0]
    rows = run.rl.prompts_per_iteration * run.rl.samples_per_prompt
    check_iteration_metrics(record, rows, run.rl.max_new_tokens, run.model.vocab_size)
    assert record["reward"] == record["accuracy"] == 0.5
    # (1 - 0.5) / (std 0.5 + eps 1e-6) on every response token
    assert record["advantage_rms"] == pytest.approx(1.0, abs=1e-5)
    assert record["actor/grad_norm"] > 0.1 and np.isfinite(record["actor/loss"]), record
    assert not [k for k in record if k.startswith("critic/") or k == "value_mean"], record


@pytest.mark.slow
def test_dynamic_sampling_and_overlong_shaping_in_the_loop(tmp_path, monkeypatch):
    """Dr. GRPO with DAPO's two batch-side switches on. Draw 0 has one group of differing
    rewards, draw 1 another: the batch takes both draws. One-token responses (max_new_tokens=1)
    with L_cache = L_max = 1 all get the overlong penalty -1, which changes no group's spread;
    unnormalised advantages are then +-0.5 on every response token."""
    rewards_of_draw = {0: [1, 1, 0, 1], 1: [0, 0, 1, 0]}  # groups of 2 samples
    drawn = rl_trainer.RLTrainer.draw

    def draw(self, state, iteration, draw=0):
        rewards = np.float32(rewards_of_draw[draw])
        return dataclasses.replace(drawn(self, state, iteration, draw), rewards=rewards,
                                   correct=rewards == 1)

    monkeypatch.setattr(rl_trainer.RLTrainer, "draw", draw)
    run = small_run(iterations=1, algorithm="dr_grpo", dynamic_sampling=True, overlong_buffer=1,
                    max_new_tokens=1)
    summary = run_rl(run, tmp_path / "dapo")
    record = [r for r in read_metrics(summary.workdir / "metrics.jsonl") if r["step"] == 1][0]
    check_iteration_metrics(record, 4, 1, run.model.vocab_size)
    assert (record["sampling/draws"], record["sampling/groups_drawn"]) == (2, 4)
    assert (record["sampling/varied_frac"], record["sampling/batch_varied_frac"]) == (0.5, 1.0)
    assert record["sampling/drawn_reward"] == 0.5 and record["reward"] == 0.5
    assert record["response_length"] == 1 and record["overlong_penalty"] == -1
    assert record["advantage_rms"] == pytest.approx(0.5, abs=1e-6)
    assert record["actor/grad_norm"] > 0 and np.isfinite(record["actor/loss"]), record


@pytest.mark.parametrize("algorithm", ["mis_po", "ppo", "grpo", "gspo", "dapo", "dr_grpo",
                                       "kimi_k25"])
def test_actor_loss_dispatches_to_the_algorithm_and_adds_kl(algorithm):
    """Each algorithm's loss with its preset clip and aggregation, plus an explicit KL term
    aggregated like the loss (tests/rl/test_rl_paper_objectives.py checks the defaults against
    the papers' equations)."""
    rng = np.random.default_rng(0)
    shape = (3, 5)
    mb = {k: jnp.asarray(rng.normal(scale=0.1, size=shape) - 1.0, jnp.float32)
          for k in ("old_logp", "infer_logp", "ref_logp")}
    mb["advantages"] = jnp.asarray(rng.normal(size=shape), jnp.float32)
    mb["mask"] = jnp.asarray(rng.integers(0, 2, shape), jnp.float32)
    mb["select"] = mb["mask"]
    logp = mb["old_logp"] + 0.05
    aggregation = {"grpo": "sequence_mean", "dr_grpo": "token_sum"}.get(algorithm, "token_mean")
    common = {"aggregation": aggregation, "max_length": 3}  # max_new_tokens = 3
    expected = {
        "mis_po": lambda: losses.mis_po_loss(logp, mb["old_logp"], mb["infer_logp"],
                                             mb["advantages"], mb["mask"], **common)[0],
        "ppo": lambda: losses.ppo_clip_loss(logp, mb["old_logp"], mb["advantages"],
                                            mb["mask"], 0.2, 0.2, **common)[0],
        # DeepSeekMath: symmetric clip, per-sequence mean
        "grpo": lambda: losses.ppo_clip_loss(logp, mb["old_logp"], mb["advantages"],
                                             mb["mask"], 0.2, 0.2, **common)[0],
        "gspo": lambda: losses.gspo_loss(logp, mb["old_logp"], mb["infer_logp"],
                                         mb["advantages"], mb["mask"], 1e-4, **common)[0],
        "dapo": lambda: losses.ppo_clip_loss(logp, mb["old_logp"], mb["advantages"],
                                             mb["mask"], 0.2, 0.28, **common)[0],
        # Dr. GRPO: symmetric clip, token sum over L_max (max_new_tokens = 3) x responses
        "dr_grpo": lambda: losses.ppo_clip_loss(logp, mb["old_logp"], mb["advantages"],
                                                mb["mask"], 0.2, 0.2, **common)[0],
        "kimi_k25": lambda: losses.kimi_k25_loss(logp, mb["infer_logp"], mb["advantages"],
                                                 mb["mask"], (0.5, 2.0), 0.1, **common)[0],
    }[algorithm]()
    for estimator in ("k3_importance", "k3"):
        run = small_run(algorithm=algorithm, kl_coef=0.5, kl_estimator=estimator).rl
        loss, stats = actor_loss(run, logp, mb)
        terms = K.kl_terms(estimator, logp, mb["old_logp"], mb["ref_logp"], mb["mask"])
        kl = losses.aggregate(terms, mb["mask"], **common)
        np.testing.assert_allclose(loss, expected + 0.5 * kl, rtol=1e-6)
        assert float(stats["kl"]) == pytest.approx(float(K.kl_estimate(
            estimator, logp, mb["old_logp"], mb["ref_logp"], mb["mask"])))


def test_shipped_rl_config_loads_with_report_defaults():
    run = load_rl_config(REPO / "configs" / "rl_arith.yaml")
    assert run.model is None and run.rl.algorithm == "mis_po"
    assert run.rl.token_bounds == (0.5, 2.0) and run.rl.traj_bounds == (0.996, 1.001)
    assert run.rl.temperature == 1.0 and run.rl.top_p == 1.0 and run.rl.kl_weight == 0.001
    assert (run.rl.actor_minibatches, run.rl.critic_minibatches) == (4, 12)
    with pytest.raises(ValueError, match="rl.token_bounds"):
        load_rl_config(REPO / "configs" / "rl_arith.yaml", ["rl.token_bounds=[1.5, 2.0]"])
    with pytest.raises(ValueError, match="prefix the key"):
        load_rl_config(REPO / "configs" / "rl_arith.yaml", ["algorithm=ppo"])


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "rl", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


@pytest.mark.slow
def test_cli_help_and_one_line_errors(tmp_path):
    assert "MIS-PO" in run_cli("--help").stdout
    bad = run_cli("--config", "configs/rl_arith.yaml", "--workdir", str(tmp_path / "x"),
                  "rl.algorithm=reinforce")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "rl.algorithm" in bad.stderr
    missing = run_cli("--config", "configs/rl_arith.yaml", "--workdir", str(tmp_path / "y"))
    assert missing.returncode == 2 and "--init-from" in missing.stderr
    assert missing.stderr.count("\n") == 1
    nowhere = run_cli("--config", "configs/rl_arith.yaml", "--workdir", str(tmp_path / "z"),
                      "--init-from", str(tmp_path / "absent"))
    assert nowhere.returncode == 2 and "does not exist" in nowhere.stderr
