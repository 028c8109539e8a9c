"""Tests of `train.config`: every section validates on construction, naming the field by its
place in the run YAML; checks that span sections belong to `RunConfig`. Pure Python."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from model.config import load_config
from model.parallel.rules import MESH_AXES
from train import checkpoint
from train.checkpoint import changed_since_checkpoint
from train.config import MeshConfig, RunConfig, TrainConfig, load_run_config, resume_changes
from train.optim.config import MuonConfig

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(lr=-1), "train.lr: must be a positive number, got -1"),
    (lambda: TrainConfig(log_every=0), "train.log_every: must be an integer >= 1, got 0"),
    (lambda: dataclasses.replace(TrainConfig(), schedule="linear"), "train.schedule: got 'linear'"),
    (lambda: MeshConfig(expert=0), "mesh.expert: must be a positive integer or -1, got 0"),
    (lambda: MeshConfig(data=-1, fsdp=-1), "mesh: at most one axis may be -1"),
    (lambda: MuonConfig(steps=0), "steps: must be an integer >= 1, got 0"),
])
def test_bad_value_raises_on_construction(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1", "train.lr: must be a positive number, got -1"),
    ("train.muon.steps=0", "train.muon.steps: must be an integer >= 1, got 0"),
    ("train.muon.finish_steps=2", "train.muon.finish_steps: finish_steps=2 needs an "
                                  "orthogonalizer with a finishing polynomial "
                                  "(hybrid_newton_schulz)"),
    ("train.muon.orthogonalizer=hybrid_newton_schulz train.muon.steps=1",
     "train.muon.finish_steps: finish_steps=2 must lie in [0, steps=1]"),
    ("train.trainable=indexer train.router_bias_rate=0",
     "train.trainable: 'indexer' needs a C layer in model.layout"),
    ("train.trainable=indexer", "train.router_bias_rate: must be 0 under train.trainable=indexer"),
    # the warm-up and the stages must cover the run: no decay cut short, no silent hold
    ("train.schedule=stages train.lr_stages=[[10,0.001,linear],[20,0.0,cosine]]",
     "train.lr_stages: train.warmup_steps=24 + the stages' 10 + 20 = 54 steps, but "
     "train.steps=240; make them add up"),
    ("train.schedule=stages train.lr_stages=[[300,0.001,linear]]",
     "train.lr_stages: train.warmup_steps=24 + the stages' 300 = 324 steps, but train.steps=240"),
    ("train.schedule=constant train.mtp_loss_weight_at_decay=0.1",
     "train.mtp_loss_weight_at_decay: the learning rate never decays"),
    ("train.data.heldout_fraction=1.0", "train.data.heldout_fraction: must be a number strictly"),
    ("train.xla_cache_dir=3", "train.xla_cache_dir: must be a directory path"),
    ("mesh.zero1=maybe", "mesh.zero1: must be true or false"),
    ("train.seq_len=1", "train.seq_len: must be an integer >= 2, got 1"),
    ("train.seq_len=100000000000", "train.seq_len: 8 x 100000000000 tokens per micro-batch x "
                                   "model.moe.top_k=4 = 3,200,000,000,000 routed slots exceed "
                                   "int32 indexing (2,147,483,647)"),
    # sections of the model named by their place in the run YAML
    ("model.moe.top_k=0", "model.moe.top_k: must be an integer >= 1, got 0"),
    ("model.qat.indexer_qk=int4", "model.qat.indexer_qk: got 'int4', allowed values are"),
    ("model.mtp.num_heads=-1", "model.mtp.num_heads: must be an integer >= 0, got -1"),
    # a QAT switch on a part the model lacks changes nothing: refused
    ("model.qat.indexer_qk=mxfp4", "model.qat.indexer_qk: 'mxfp4' applies to the CSA lightning "
                                   "indexer, but the layout has no CSA ('C') layer; leave it "
                                   "'none'"),
    ("model.qat.index_scores=bfloat16", "model.qat.index_scores: 'bfloat16' applies to the CSA "
                                        "lightning indexer"),
    ("model.num_dense_layers=9 model.qat.expert_weights=mxfp4",
     "model.qat.expert_weights: 'mxfp4' applies to the routed experts, but the model has none"),
    ("train.min_lr=0.01", "train.min_lr: the cosine decays from train.lr=0.003 down to min_lr"),
    ("train.micro_batch_size=3", "train.micro_batch_size: must divide train.batch_size=8 (a "
                                 "step accumulates batch_size / micro_batch_size micro-batches), "
                                 "got 3"),
    ("train.batch_warmup=[[10,6]] train.micro_batch_size=4",
     "train.batch_warmup[0]: batch size 6 is not a multiple of train.micro_batch_size=4"),
    # one range check, one message, whatever side the value is off
    ("train.data.heldout_fraction=0", "train.data.heldout_fraction: must be a number strictly "
                                      "between 0 and 1, got 0"),
    ("train.data.heldout_fraction=1.5", "train.data.heldout_fraction: must be a number strictly "
                                        "between 0 and 1, got 1.5"),
])
def test_loaded_sections_name_the_dotted_field(override, message):
    with pytest.raises(ValueError) as info:
        load_run_config(TINY, override.split())
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("schedule", [
    [], ["train.schedule=constant"],
    ["train.schedule=stages", "train.lr_stages=[[5, 0.001, linear]]"],
])
def test_warmup_longer_than_the_run_is_refused_under_every_schedule(schedule):
    with pytest.raises(ValueError) as info:
        load_run_config(TINY, ["train.steps=10", "train.warmup_steps=11", *schedule])
    assert str(info.value) == ("train.warmup_steps: 11 warm-up steps exceed train.steps=10; set "
                               "train.warmup_steps <= 10 (or raise train.steps)")


def test_warmup_up_to_the_run_length_or_none_is_accepted():
    assert load_run_config(TINY, ["train.steps=10", "train.warmup_steps=10"]).train.steps == 10
    assert TrainConfig(steps=1, warmup_steps=0).warmup_steps == 0
    with pytest.raises(ValueError, match=r"^train.warmup_steps: 50 warm-up steps exceed "):
        TrainConfig(steps=10)  # the default warm-up is checked too


@pytest.mark.parametrize("text", ["", "train: {steps: 3}\n", "model:\ntrain: {steps: 3}\n",
                                  "mesh: {data: 1}\n"])
def test_a_config_without_a_model_is_refused_by_both_loaders(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    for load in (load_run_config, load_config):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"config file {str(path)!r} defines no model"), message
        # the presets are the repository's configs/*.yaml that define a model
        assert message.endswith("start from a preset that has one: "
                                "configs/deepseek_v4_flash.yaml, configs/gpu_1b.yaml, "
                                "configs/gpu_1b_deepseek_v4.yaml, configs/gpu_1b_mimo.yaml, "
                                "configs/mimo_v2_flash.yaml, "
                                "configs/sft_arith.yaml, configs/sft_chat_arith.yaml, "
                                "configs/step35_flash.yaml, "
                                "configs/tiny.yaml, configs/tiny_deepseek_v4.yaml, "
                                "configs/tiny_mimo.yaml"), message


@pytest.mark.parametrize("path, message", [
    ("configs/recipes/tiny_staged.yaml", "is a staged recipe (stages:), not a run YAML: "
     "`python -m train --recipe configs/recipes/tiny_staged.yaml` takes it; here give a run "
     "YAML or model preset such as its base, configs/tiny.yaml"),
    ("configs/sweeps/balance.yaml", "is a sweep (runs:), not a run YAML: `python -m train.sweep "
     "--sweep configs/sweeps/balance.yaml` takes it"),
    ("configs/rl_arith.yaml", "is an RL run config (rl:), not a run YAML: `python -m rl --config "
     "configs/rl_arith.yaml` takes it; here give a run YAML or model preset such as "
     "configs/tiny.yaml"),
])
def test_other_kinds_of_yaml_are_named_with_what_takes_them(path, message, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError) as info:
        load_run_config(path)
    assert str(info.value).startswith(f"config file {path!r} {message}"), str(info.value)


def test_presets_with_top_level_model_fields_still_load():
    flash = REPO / "configs" / "step35_flash.yaml"
    assert load_run_config(flash).model == load_config(flash)
    assert load_run_config(flash).model.num_layers == 45


def test_a_directory_is_not_a_config_file():
    for load in (load_run_config, load_config):
        with pytest.raises(ValueError, match=r"'.*configs' is a directory; expected a YAML file"):
            load(REPO / "configs")


def test_min_lr_above_lr_is_accepted_where_no_cosine_uses_it():
    stages = ["train.schedule=stages", "train.lr_stages=[[216, 1.0e-4, linear]]"]
    assert load_run_config(TINY, ["train.min_lr=0.01", *stages]).train.min_lr == 0.01


def test_mtp_weights_are_checked_against_the_model_by_the_run():
    model = load_config(TINY, ["mtp.num_heads=1"])
    train = TrainConfig(mtp_offset_weights=(1.0, 0.5))  # valid on its own
    with pytest.raises(ValueError, match=r"^train.mtp_offset_weights: 2 weights but the model "
                                         r"has model.mtp.num_heads=1"):
        RunConfig(model=model, train=train)
    assert RunConfig(model=load_config(TINY, ["mtp.num_heads=2"]), train=train).train == train


def test_a_field_added_since_a_checkpoint_counts_at_its_default():
    """A checkpoint written before train.loss_mask existed resumes (its run trained on text,
    which `auto` trains on entirely); a changed value is still refused by name."""
    run = load_run_config(REPO / "configs" / "sft_arith.yaml")
    saved = run.to_dict()
    del saved["train"]["loss_mask"]
    assert resume_changes(saved, run) == []
    assert resume_changes(saved, load_run_config(REPO / "configs" / "sft_arith.yaml",
                                                 ["train.loss_mask=all"])) == ["train.loss_mask"]
    assert resume_changes(saved, load_run_config(REPO / "configs" / "sft_arith.yaml",
                                                 ["train.steps=700"])) == []


def test_a_finished_stage_or_sweep_run_is_compared_as_a_resume_is(monkeypatch):
    """Recipes and sweeps check a finished workdir's checkpoint as a resume would: a field
    added since it was saved (train.init_from) counts at its default, a changed one is named."""
    saved = load_run_config(TINY).to_dict()
    del saved["train"]["init_from"]
    monkeypatch.setattr(checkpoint, "latest_run_config", lambda workdir: (3, saved))
    assert changed_since_checkpoint(Path("finished"), load_run_config(TINY)) == []
    assert changed_since_checkpoint(Path("finished"), load_run_config(TINY, ["train.lr=0.5"])) \
        == ["train.lr"]


@pytest.mark.parametrize("override", [*(f"mesh.{axis}=2" for axis in MESH_AXES),
                                      "mesh.zero1=false"])
def test_a_resume_may_change_every_mesh_axis(override):
    """A checkpoint restores into any mesh (docs/parallelism.md), context parallelism's too."""
    assert resume_changes(load_run_config(TINY).to_dict(), load_run_config(TINY, [override])) == []


def test_muon_settings_follow_the_orthogonalizer_unless_given():
    """`steps` / `update_rms` left unset take the orthogonalizer's defaults (DeepSeek-V4 report
    eq. 28 and 4.2.2 for the hybrid: 10 at 0.18; Step 3.5 report 4.1.1: 6 at 0.2; Keller
    Jordan's 5), also through the defaults of a section two configs deep; a given value wins."""
    assert (MuonConfig().steps, MuonConfig().update_rms) == (6, 0.2)
    assert MuonConfig(orthogonalizer="newton_schulz").steps == 5
    for overrides, expected in ((["train.muon.orthogonalizer=hybrid_newton_schulz"], (10, 0.18)),
                                (["train.muon.update_rms=0.3",
                                  "train.muon.orthogonalizer=hybrid_newton_schulz"], (10, 0.3))):
        muon = load_run_config(TINY, overrides).train.muon
        assert (muon.steps, muon.update_rms) == expected
    from rl.config import load_rl_config  # rl -> actor -> muon
    rl = load_rl_config(REPO / "configs" / "rl_arith.yaml",
                        ["rl.actor.muon.orthogonalizer=hybrid_newton_schulz"]).rl
    assert (rl.actor.muon.steps, rl.critic.muon.steps) == (10, 6)


def _family_settings(train) -> dict:
    """The optimizer and balance settings a family's presets share."""
    muon = train.muon
    return {"optimizer": train.optimizer, "muon": (muon.orthogonalizer, muon.steps,
                                                   muon.finish_steps, muon.update_rms),
            "adam": (train.adam_b1, train.adam_b2, train.adam_eps, train.weight_decay),
            "balance": (train.balance_loss_coef, train.sequence_balance_coef,
                        train.router_bias_rate)}


@pytest.mark.parametrize("family, presets, expected", [
    # DeepSeek-V4 (report 2.4 / 4.2.2): Muon with the hybrid Newton-Schulz (10 iterations, the
    # last 2 finishing by default), update RMS 0.18, AdamW eps 1e-20, sequence-wise loss 1e-4.
    ("deepseek_v4", ("tiny_deepseek_v4", "gpu_1b_deepseek_v4"),
     {"optimizer": "muon", "muon": ("hybrid_newton_schulz", 10, None, 0.18),
      "adam": (0.9, 0.95, 1e-20, 0.1), "balance": (0.0, 1e-4, 1e-3)}),
    # MiMo (its pre-training hyper-parameters): sequence auxiliary loss 1e-5; the presets keep
    # stepjax's Muon (the recipes train with the report's AdamW).
    ("mimo", ("tiny_mimo", "gpu_1b_mimo"),
     {"optimizer": "muon", "muon": ("polar_express", 6, None, 0.2),
      "adam": (0.9, 0.95, 1e-8, 0.1), "balance": (0.0, 1e-5, 1e-3)}),
])
def test_family_presets_train_with_their_reports_optimizer_and_losses(family, presets, expected):
    """Every preset of a family, the ~1B ones included, trains with its family's settings;
    neither V4 nor MiMo has Step 3.5's EP-group loss."""
    for preset in presets:
        assert _family_settings(load_run_config(REPO / "configs" / f"{preset}.yaml").train) \
            == expected, preset
