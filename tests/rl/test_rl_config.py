"""Tests of `rl.config`: the RL sections validate on construction like the training ones, and
share the optimizer and loop fields (and their checks) with `train:`; a resumed run reads the
saved config as this version does."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.config import RLConfig, load_rl_config
from rl.task_config import TaskConfig, TaskMixConfig
from train.optim.config import OptimizerConfig

RL_ARITH = Path(__file__).resolve().parents[2] / "configs" / "rl_arith.yaml"


@pytest.mark.parametrize("make, message", [
    (lambda: RLConfig(top_p=0), "rl.top_p: must be in (0, 1], got 0"),
    (lambda: RLConfig(keep_checkpoints=0), "rl.keep_checkpoints: must be an integer >= 1"),
    (lambda: RLConfig(token_bounds=(1.5, 2.0)), "rl.token_bounds: need 0 < low <= 1 <= high"),
    (lambda: TaskConfig(ops="/"), "ops: must be a non-empty string of + - *"),
    (lambda: TaskMixConfig(heldout_fraction=1), "task.heldout_fraction: must be a number "
                                                "strictly between 0 and 1"),
    (lambda: OptimizerConfig(lr=0), "lr: must be a positive number, got 0"),
    (lambda: RLConfig(kl_estimator="k2"), "rl.kl_estimator: got 'k2', allowed values are "
                                          "['k3_importance', 'k3']"),
    (lambda: RLConfig(kl_coef=-0.1), "rl.kl_coef: must be a number >= 0, got -0.1"),
    (lambda: RLConfig(kimi_bounds=(1.2, 2.0)), "rl.kimi_bounds: need 0 < low <= 1 <= high"),
    (lambda: RLConfig(kimi_tau=-1), "rl.kimi_tau: must be a number >= 0, got -1"),
    (lambda: RLConfig(dapo_clip=(0.2,)), "rl.dapo_clip: expected two numbers"),
    (lambda: RLConfig(algorithm="drgrpo"), "rl.algorithm: got 'drgrpo'"),
    (lambda: RLConfig(loss_aggregation="sum"), "rl.loss_aggregation: got 'sum', allowed values "
                                               "are ['token_mean', 'sequence_mean', 'token_sum']"),
    (lambda: RLConfig(group_std="no"), "rl.group_std: must be true or false, got 'no'"),
    (lambda: RLConfig(dynamic_sampling=1), "rl.dynamic_sampling: must be true or false, got 1"),
    (lambda: RLConfig(max_draws=0), "rl.max_draws: must be an integer >= 1, got 0"),
    (lambda: RLConfig(max_new_tokens=8, overlong_buffer=9),
     "rl.overlong_buffer: must be an integer in [0, rl.max_new_tokens=8], got 9"),
    (lambda: RLConfig(overlong_buffer=-1), "rl.overlong_buffer: must be an integer in [0, "),
    (lambda: RLConfig(overlong_buffer=True), "rl.overlong_buffer: must be an integer in [0, "),
    (lambda: RLConfig(algorithm="dapo", samples_per_prompt=1),
     "rl.dynamic_sampling: needs rl.samples_per_prompt >= 2"),
    # one sample per prompt: every group advantage is exactly 0
    (lambda: RLConfig(advantages="group", samples_per_prompt=1),
     "rl.samples_per_prompt: rl.advantages=group: a group of 1 sample has advantage 0 and "
     "trains nothing; raise it or use rl.advantages=gae"),
    (lambda: RLConfig(algorithm="grpo", samples_per_prompt=1),
     "rl.samples_per_prompt: rl.algorithm=grpo uses group advantages: a group of 1 sample"),
    (lambda: RLConfig(prompts_per_iteration=2, samples_per_prompt=4),
     "rl.critic_minibatches: 8 rollouts per iteration (rl.prompts_per_iteration x "
     "rl.samples_per_prompt) cannot fill 12 minibatches"),
    (lambda: RLConfig(temperature=float("nan")), "rl.temperature: must be a finite number"),
    # RL samples its policy: a near-zero temperature is refused, not sampled greedily
    (lambda: RLConfig(temperature=1e-45), "rl.temperature: must be at least 0.01, got 1e-45: "
                                          "RL samples its policy"),
    (lambda: RLConfig(top_p=float("nan")), "rl.top_p: must be a finite number, got nan"),
    # the waiting batches are held in memory: at most one per iteration of the run
    (lambda: RLConfig(iterations=2, max_staleness=100_000, actor=OptimizerConfig(lr=1e-6)),
     "rl.max_staleness: 100000 exceeds rl.iterations=2: a batch cannot wait longer than the "
     "run lasts, and each waiting batch is held in memory; lower it (1 already trains every "
     "batch on the initial policy's rollouts)"),
])
def test_bad_value_raises_on_construction(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("override, message", [
    ("rl.actor.lr=-1", "rl.actor.lr: must be a positive number, got -1"),
    ("rl.critic.optimizer=sgd", "rl.critic.optimizer: got 'sgd'"),
    ("rl.actor.muon.steps=0", "rl.actor.muon.steps: must be an integer >= 1, got 0"),
    ("rl.log_every=0", "rl.log_every: must be an integer >= 1, got 0"),
    # the same check and message as train.data.heldout_fraction
    ("task.heldout_fraction=0", "task.heldout_fraction: must be a number strictly between 0 "
                                "and 1, got 0"),
    # a task written inline (rl_arith) names its fields task.x
    ("task.ops=/", "task.ops: must be a non-empty string of + - *, got '/'"),
    ("task.name=geometry", "task.name: got 'geometry', allowed values are ['arithmetic', "
                           "'multistep']"),
    # a warm-up counts updates: iterations x minibatches (rl_arith: 4 actor minibatches)
    ("rl.actor.warmup_steps=9 rl.iterations=2", "rl.actor.warmup_steps: 9 warm-up updates "
     "exceed the run's 8 (rl.iterations=2 x rl.actor_minibatches=4); set rl.actor.warmup_steps "
     "<= 8"),
    ("rl.critic.warmup_steps=3 rl.iterations=1 rl.critic_minibatches=2 rl.advantages=gae",
     "rl.critic.warmup_steps: 3 warm-up updates exceed the run's 2"),
])
def test_loaded_sections_name_the_dotted_field(override, message):
    with pytest.raises(ValueError) as info:
        load_rl_config(RL_ARITH, override.split())
    assert str(info.value).startswith(message), str(info.value)


def test_the_minibatches_of_an_unused_critic_and_single_samples_of_mopd_are_accepted():
    """Group advantages have no critic to split rollouts for; MOPD's teacher signal trains
    with one sample per prompt (only its outcome advantage is 0)."""
    assert RLConfig(advantages="group", prompts_per_iteration=2, samples_per_prompt=4,
                    actor_minibatches=2).critic_minibatches == 12
    assert RLConfig(algorithm="mopd", samples_per_prompt=1).samples_per_prompt == 1
    with pytest.raises(ValueError, match="^rl.actor_minibatches: 8 rollouts"):
        RLConfig(advantages="group", prompts_per_iteration=2, samples_per_prompt=4,
                 actor_minibatches=9)


def test_warmups_as_long_as_the_run_or_of_an_unused_critic_are_accepted():
    run = load_rl_config(RL_ARITH, ["rl.iterations=2", "rl.actor.warmup_steps=8",
                                    "rl.critic.warmup_steps=500"])  # advantages: group
    assert (run.rl.actor.warmup_steps, run.rl.critic.warmup_steps) == (8, 500)


def test_algorithm_presets_set_the_switches_left_unset():
    """grpo: DeepSeekMath's per-sequence mean and k3 KL at 0.04; dapo: dynamic sampling, an
    overlong buffer of a fifth of the budget, no KL; dr_grpo: no std division, the token-sum
    loss, no KL; kimi_k25: no std division, token mean, no KL; others: the report's KL 0.001,
    importance-weighted. An explicit switch wins."""
    resolved = lambda rl: (rl.divides_by_group_std, rl.aggregation,  # noqa: E731
                           rl.samples_dynamically, rl.overlong_buffer_tokens, rl.uses_critic,
                           rl.kl_weight, rl.kl_method)
    assert resolved(RLConfig()) == (True, "token_mean", False, 0, True, 0.001, "k3_importance")
    assert resolved(RLConfig(algorithm="grpo")) == (
        True, "sequence_mean", False, 0, False, 0.04, "k3")
    # DeepSeekMath 4.2: "the policy model only has a single update following each exploration
    # stage"; the report's MIS-PO 4 actor minibatches (5.2.3) for the others; explicit wins
    assert [RLConfig(algorithm=a).actor_minibatches for a in ("grpo", "mis_po", "dapo")] == [
        1, 4, 4]
    assert RLConfig(algorithm="grpo", actor_minibatches=4).actor_minibatches == 4
    assert resolved(RLConfig(algorithm="dapo", max_new_tokens=20)) == (
        True, "token_mean", True, 4, False, 0.0, "k3_importance")
    assert RLConfig(algorithm="dapo", max_new_tokens=3).overlong_buffer_tokens == 1
    assert resolved(RLConfig(algorithm="dr_grpo")) == (
        False, "token_sum", False, 0, False, 0.0, "k3_importance")
    assert resolved(RLConfig(algorithm="kimi_k25")) == (
        False, "token_mean", False, 0, False, 0.0, "k3_importance")
    assert resolved(RLConfig(algorithm="dapo", dynamic_sampling=False, overlong_buffer=0,
                             loss_aggregation="sequence_mean", group_std=False, kl_coef=0.5,
                             kl_estimator="k3")) == (
        False, "sequence_mean", False, 0, False, 0.5, "k3")
    assert resolved(RLConfig(advantages="group", dynamic_sampling=True, overlong_buffer=2,
                             loss_aggregation="token_sum", kl_coef=0)) == (
        True, "token_sum", True, 2, False, 0, "k3_importance")
    rl = RLConfig()
    assert (rl.ppo_clip, rl.grpo_clip, rl.dapo_clip) == ((0.2, 0.2), (0.2, 0.2), (0.2, 0.28))
    assert (rl.kimi_bounds, rl.kimi_tau) == ((0.5, 2.0), 0.1)


def test_switches_load_from_overrides_and_null_restores_the_preset():
    run = load_rl_config(RL_ARITH, ["rl.algorithm=dapo", "rl.dynamic_sampling=false",
                                    "rl.kl_estimator=k3", "rl.kl_coef=0.01"])
    assert (run.rl.samples_dynamically, run.rl.overlong_buffer_tokens) == (False, 1)
    assert (run.rl.kl_method, run.rl.kl_weight) == ("k3", 0.01)
    run = load_rl_config(RL_ARITH, ["rl.algorithm=dapo", "rl.dynamic_sampling=null",
                                    "rl.kl_coef=null"])
    assert run.rl.samples_dynamically and run.rl.kl_weight == 0


def test_rl_defaults_differ_from_training_where_the_report_says_so():
    rl = RLConfig()
    assert (rl.actor.lr, rl.actor.warmup_steps) == (2e-6, 20)  # report 5.2.3
    assert (rl.critic.lr, rl.critic.warmup_steps) == (5e-6, 50)
    assert rl.actor.schedule_settings() == {"lr": 2e-6, "warmup_steps": 20}  # then constant
    assert (rl.log_every, rl.checkpoint_every, rl.keep_checkpoints) == (1, 10, 2)


def test_resume_reads_the_saved_config_as_this_version_does(tmp_path):
    """A checkpoint saved before `rl.actor`/`rl.critic` had Adam and Muon fields resumes (they
    count at their defaults, what that version used); a real difference is still refused."""
    from rl.resume import resumed_config
    from train.loop import TrainingError

    run = load_rl_config(RL_ARITH, ["rl.iterations=7"])
    saved = run.to_dict()
    saved["rl"]["iterations"] = 3  # resumable: the new run may go on for longer
    for section in ("actor", "critic"):
        for key in ("adam_b1", "adam_b2", "adam_eps", "muon"):
            del saved["rl"][section][key]
    assert resumed_config(run, saved, tmp_path).rl.iterations == 7

    # Muon's iteration dtype only rounds the iteration: a run saved with float16 (the default
    # before 'auto') resumes, with this run's value.
    saved["rl"]["critic"]["muon"] = {"iteration_dtype": "float16"}
    assert resumed_config(run, saved, tmp_path).rl.critic.muon.iteration_dtype == "auto"

    saved["rl"]["actor"]["lr"] = run.rl.actor.lr * 2
    with pytest.raises(TrainingError, match=r"differs from the checkpoint's in rl\.actor\.lr;"):
        resumed_config(run, saved, tmp_path)


def test_an_init_from_policy_keeps_its_architecture_and_takes_the_runs_qat():
    """`model.qat.*` on the command line of an --init-from run: FP4 QAT (a training choice)
    over the checkpoint's model, whatever else a `model:` section says."""
    from model.config import ModelConfig

    checkpoint = ModelConfig(d_model=256, num_layers=2, layout="SF", num_dense_layers=1)
    run = load_rl_config(RL_ARITH, ["model.qat.expert_weights=mxfp4", "model.d_model=512"])
    policy = run.with_model(checkpoint, checkpoint=True).model
    assert policy == checkpoint.replace(qat=run.model.qat)
    assert policy.qat.expert_weights == "mxfp4" and policy.d_model == 256
    assert load_rl_config(RL_ARITH).with_model(checkpoint, checkpoint=True).model == checkpoint


def test_a_model_section_is_read_as_training_reads_it():
    """DeepSeek-V4 layers added to the tiny preset take attention sizes scaled to it
    (model.config.attention_config.host_shared_kv_sizes), in a run's `model:` section as in
    training's, not V4-Flash's 64 heads of 512."""
    from model.config import load_config, read_yaml
    from rl.config import rl_config_from_dict

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    section = {**read_yaml(tiny)["model"], "layout": "F+SSSC*2"}
    model = rl_config_from_dict({**read_yaml(RL_ARITH), "model": section}).model
    assert {name: getattr(model.shared_kv_attention, name) for name in (
        "num_heads", "head_dim", "rope_dims", "q_lora_rank", "o_groups", "o_lora_rank",
        "index_heads", "index_head_dim")} == {
        "num_heads": 4, "head_dim": 4 * 32, "rope_dims": 16, "q_lora_rank": 128 // 4,
        "o_groups": 4, "o_lora_rank": 128 // 4, "index_heads": 4, "index_head_dim": 32}
    assert model == load_config(tiny, ["layout=F+SSSC*2"])
    with pytest.raises(ValueError, match=r"^model: expected a mapping, got 5$"):
        rl_config_from_dict({**read_yaml(RL_ARITH), "model": 5})


def test_a_staleness_up_to_the_run_length_is_accepted():
    run = load_rl_config(RL_ARITH, ["rl.iterations=2", "rl.max_staleness=2",
                                    "rl.actor.warmup_steps=0"])
    assert run.rl.max_staleness == 2


def test_a_section_of_qat_switches_alone_is_no_model_of_its_own():
    """`model.qat.*` without a model: the switches wait for --init-from's model (they are not
    checked against Step 3.5's default architecture, which has no indexer), and a checkpoint
    without the part they quantize is refused by the field's name."""
    from model.config import ModelConfig, QATConfig

    run = load_rl_config(RL_ARITH, ["model.qat.indexer_qk=mxfp4"])
    assert run.model is None and run.qat == QATConfig(indexer_qk="mxfp4")
    checkpoint = ModelConfig(d_model=256, num_layers=2, layout="SF", num_dense_layers=1)
    with pytest.raises(ValueError, match=r"^model\.qat\.indexer_qk: 'mxfp4' applies to the CSA"):
        run.with_model(checkpoint, checkpoint=True)
    run = load_rl_config(RL_ARITH, ["model.qat.expert_weights=mxfp4"])
    assert run.with_model(checkpoint, checkpoint=True).model == checkpoint.replace(qat=run.qat)
    # --print-config without --init-from writes them, and the YAML reads back the same run
    from rl.config import rl_config_from_dict

    assert run.to_dict()["model"] == {"qat": {"expert_weights": "mxfp4", "indexer_qk": "none",
                                              "index_scores": "float32"}}
    assert rl_config_from_dict(run.to_dict()) == run


def test_a_resume_refuses_other_model_fields_by_name(tmp_path):
    """The policy's model is compared as the command gives it (training's comparison): its
    QAT switches always; its whole model: section without --init-from, where implementation
    switches may change as in training and are taken."""
    from model.config import ModelConfig
    from rl.resume import resumed_config
    from train.loop import TrainingError

    checkpoint = ModelConfig(d_model=256, num_layers=2, layout="SF", num_dense_layers=1)
    started = load_rl_config(RL_ARITH, ["model.qat.expert_weights=mxfp4"])
    saved = started.with_model(checkpoint, checkpoint=True).to_dict()
    qat_none = load_rl_config(RL_ARITH, ["model.qat.expert_weights=none"])
    for init_from in (True, False):
        with pytest.raises(TrainingError, match=r"differs from the checkpoint's in "
                                                r"model\.qat\.expert_weights; use another"):
            resumed_config(qat_none, saved, tmp_path, init_from=init_from)
    # the same switches, or none given: the saved model, switches included
    for again in (started, load_rl_config(RL_ARITH)):
        assert resumed_config(again, saved, tmp_path, init_from=True).model == \
            checkpoint.replace(qat=started.qat)

    section = {f"model.{k}={v}" for k, v in (("d_model", 256), ("num_layers", 2),
                                             ("layout", "SF"), ("num_dense_layers", 1))}
    own = load_rl_config(RL_ARITH, sorted(section))
    saved = own.to_dict()
    wider = load_rl_config(RL_ARITH, [*sorted(section - {"model.d_model=256"}),
                                      "model.d_model=512"])
    with pytest.raises(TrainingError, match=r"differs from the checkpoint's in model\.d_model;"):
        resumed_config(wider, saved, tmp_path)
    # with --init-from only the switches of a model: section apply, as when the run started
    assert resumed_config(wider, saved, tmp_path, init_from=True).model == own.model
    remat = load_rl_config(RL_ARITH, sorted(section) + ["model.remat_policy=full"])
    assert resumed_config(remat, saved, tmp_path).model.remat_policy == "full"
