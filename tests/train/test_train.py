"""Tests of the training loop (`train.loop`, `train.step`, `python -m train`, `python -m
train.eval`): resume exactness, gradient accumulation, non-finite skipping, loss-free balancing,
signals, and the one-line errors of bad inputs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import SMALL_MODEL, TINY, small_run, synthetic_batch

import train.step as step_module
from model.config import load_config
from model.interop.workdir import Checkpointer
from model.interop.workdir_lock import LOCK_FILE
from model.layers.params import unstack_layers
from model.layers.router import expert_load, route
from model.lm import abstract_variables
from train.__main__ import main as train_main
from train.balance import update_router_bias
from train.eval import main as eval_main
from train.init_from import InitFromError, fitted_variables
from train.loop import Trainer, TrainingError, meta_loss_masked, train
from train.state import abstract_state, build_training, create_state
from train.step import make_train_step

VOCAB = 4096  # the shipped tokenizer's size: loop tests read the real stdlib corpus
STEPS = 6  # every loop test shares it, so their step functions compile once (persistent cache)


def loop_run(*overrides):
    return small_run(f"train.steps={STEPS}", "train.log_every=1", "train.checkpoint_every=2",
                     *overrides, vocab=VOCAB)


def restore_params(workdir: Path, step: int, run):
    checkpoints = Checkpointer(workdir / "checkpoints", keep=100)
    try:
        state, _ = checkpoints.restore(step, abstract_state(build_training(run), run.train.seed))
    finally:
        checkpoints.close()
    return state


def files_digest(directory: Path) -> dict[str, str]:
    """Digest of every saved file (the lock file names its latest holder, so it is left out)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A workdir holding a 2-step run of `loop_run()` (checkpoint and held-out eval at step 2)."""
    workdir = tmp_path_factory.mktemp("trained")
    summary = train(loop_run("train.eval_every=2", "train.eval_batches=1"), workdir, stop_after=2)
    assert summary.interrupted and summary.last_step == 2
    return workdir


# ---- resume ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    run = loop_run("train.checkpoint_every=4")  # the stop at step 3 is off the save grid
    straight = train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", stop_after=3)
    second = train(run, tmp_path / "resumed")
    assert (first.interrupted, first.last_step, second.first_step) == (True, 3, 3)
    assert len(straight.losses) == STEPS
    assert first.losses + second.losses == straight.losses  # exactly, not approximately
    a = restore_params(tmp_path / "straight", STEPS, run)
    b = restore_params(tmp_path / "resumed", STEPS, run)
    chex.assert_trees_all_equal(a, b)
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, monkeypatch):
    original = Trainer.next_batch

    def next_batch(self, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the run is mid-way
        return original(self, step)

    monkeypatch.setattr(Trainer, "next_batch", next_batch)
    handler = signal.getsignal(signal.SIGTERM)
    summary = train(loop_run(), tmp_path)
    assert summary.interrupted and summary.last_step == 4
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=100)
    assert checkpoints.all_steps() == [2, 4]
    checkpoints.close()
    assert signal.getsignal(signal.SIGTERM) is handler  # the loop's handler is gone again


# ---- the step ----------------------------------------------------------------------------------


def _one_step(run, batch):
    training = build_training(run)
    state = jax.jit(lambda: create_state(training.model, training.optimizer, run.train.seed))()
    return jax.jit(make_train_step(training, run))(state, batch, jnp.bool_(False))


@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch():
    # The balance loss is a per-micro-batch statistic (eq. 1 is not linear in the batch), so it
    # is off here; no warm-up so the first update is not scaled to zero; a float32 Muon
    # iteration, since float16 rounding turns summation-order noise into ~10% of an update.
    common = ("train.balance_loss_coef=0", "train.warmup_steps=0",
              "train.muon.iteration_dtype=float32")
    batch = synthetic_batch(2, 2, 16, 64)
    full_batch = {k: v.reshape(1, 4, 16) for k, v in batch.items()}
    full_state, full = _one_step(small_run(*common), full_batch)
    acc_state, acc = _one_step(small_run(*common, "train.micro_batch_size=2"), batch)
    for name in ("loss", "loss/lm", "loss/mtp", "grad_norm"):
        np.testing.assert_allclose(acc[name], full[name], rtol=2e-5, err_msg=name)
    chex.assert_trees_all_close(acc_state.params, full_state.params, atol=1e-5)
    # The bias moves by the sign of the mean load.
    chex.assert_trees_all_equal(acc_state.balance, full_state.balance)


def _poison_loss(monkeypatch):
    """Makes the loss (and with it every gradient) NaN on micro-batches flagged `poison`."""
    original = step_module.loss_fn

    def loss_fn(model, run, params, balance, micro, *rest):
        loss, aux = original(model, run, params, balance, micro, *rest)
        poisoned = jnp.any(micro["poison"]) if "poison" in micro else False
        return loss * jnp.where(poisoned, jnp.nan, 1.0), aux

    monkeypatch.setattr(step_module, "loss_fn", loss_fn)


@pytest.mark.slow
def test_non_finite_step_is_skipped_and_counted(monkeypatch):
    _poison_loss(monkeypatch)
    run = small_run("train.warmup_steps=0")
    training = build_training(run)
    step_fn = jax.jit(make_train_step(training, run))
    state = jax.jit(lambda: create_state(training.model, training.optimizer, 0))()
    batch = synthetic_batch(1, 4, 16, 64)
    bad = {**batch, "poison": np.ones((1, 4, 16), bool)}
    good = {**batch, "poison": np.zeros((1, 4, 16), bool)}

    skipped, metrics = step_fn(state, bad, jnp.bool_(False))
    assert not np.isfinite(metrics["loss"])
    counters = (skipped.skipped, skipped.consecutive_skips, metrics["skipped"])
    assert [int(c) for c in counters] == [1, 1, 1]
    for name in ("params", "opt_state", "balance"):
        chex.assert_trees_all_equal(getattr(skipped, name), getattr(state, name))
    assert int(skipped.step) == 1  # the batch is consumed all the same

    # A skip leaves no trace: the next good step is exactly the first step of a fresh run
    # (same learning-rate count, momentum, bias).
    stepped, metrics = step_fn(skipped, good, jnp.bool_(False))
    fresh, _ = step_fn(state, good, jnp.bool_(False))
    assert np.isfinite(metrics["loss"])
    assert (int(stepped.skipped), int(stepped.consecutive_skips)) == (1, 0)
    chex.assert_trees_all_equal(stepped.params, fresh.params)
    head = lambda s: s.params["lm_head"]["kernel"]  # noqa: E731
    assert not np.array_equal(head(stepped), head(state))


@pytest.mark.slow
def test_consecutive_skips_stop_the_run_with_good_checkpoints(tmp_path, monkeypatch):
    _poison_loss(monkeypatch)
    original = Trainer.next_batch

    def next_batch(self, step):
        batch, tokens = original(self, step)
        return {**batch, "poison": np.full(batch["tokens"].shape, step >= 2)}, tokens

    monkeypatch.setattr(Trainer, "next_batch", next_batch)
    run = loop_run("train.max_consecutive_skips=3")
    with pytest.raises(TrainingError, match="3 consecutive steps had a non-finite .* the "
                                            "checkpoint of step 4 is intact"):
        train(run, tmp_path)
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=100)
    steps = checkpoints.all_steps()
    checkpoints.close()
    # Skips at steps 3, 4 and 5: the run stopped at the third, never saving its state; step 4
    # was saved while skipping, within the limit.
    assert steps == [2, 4]
    good = restore_params(tmp_path, 2, run)
    for later in steps:  # a checkpoint taken while skipping holds the last good params
        state = restore_params(tmp_path, later, run)
        chex.assert_trees_all_equal(state.params, good.params)
        chex.assert_tree_all_finite(state.params)


# ---- loss-free balancing and the meta-token switch --------------------------------------------


@pytest.mark.parametrize("scan", [True, False])
def test_loss_free_bias_balances_a_skewed_router(scan):
    """Each MoE layer gets a router skewed towards different experts; the bias updates (u=0.01)
    must even out every layer's load, which also checks that loads reach the right layers."""
    cfg = load_config(TINY, [o.removeprefix("model.") for o in SMALL_MODEL] +
                      [f"scan_layers={str(scan).lower()}", "moe.num_experts=8", "moe.top_k=2"])
    shapes = abstract_variables(cfg)
    balance = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           nn.meta.unbox(shapes["balance"]))  # the bias starts at zero
    moe_layers = cfg.moe_layer_indices()
    rng = np.random.default_rng(0)
    skews = [np.linspace(2.0, 0.0, 8)[rng.permutation(8)] for _ in moe_layers]
    logits = [jnp.asarray(rng.normal(size=(512, 8)) * 0.5 + s, jnp.float32) for s in skews]

    def layer_bias(balance):
        layers = balance["layers"]
        per_layer = unstack_layers(layers, cfg) if cfg.scan_layers else layers
        return [per_layer[f"layer_{i}"]["moe"]["router_bias"] for i in moe_layers]

    def loads(balance):
        return jnp.stack([expert_load(route(x, b, cfg.moe).indices, 8)
                          for x, b in zip(logits, layer_bias(balance))])

    def imbalance(balance):
        load = loads(balance)
        return np.asarray(jnp.max(load, axis=-1) / jnp.mean(load, axis=-1))

    update = jax.jit(lambda b: update_router_bias(b, loads(b), cfg, rate=0.01))
    before = imbalance(balance)
    for _ in range(200):
        balance = update(balance)
    after = imbalance(balance)
    assert np.all(before > 2.0)
    assert np.all(after < 1.25), after


def test_meta_loss_switch_threshold():
    assert not meta_loss_masked(-1, 10**12)  # never
    assert meta_loss_masked(0, 0)  # from the start
    assert not meta_loss_masked(1000, 999) and meta_loss_masked(1000, 1000)


# ---- command lines and bad inputs --------------------------------------------------------------


def _cli(capsys, main, *args) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _small_args(workdir, *extra):
    return ["--config", str(TINY), "--workdir", str(workdir), *SMALL_MODEL,
            f"model.vocab_size={VOCAB}", "train.seq_len=16", "train.batch_size=4",
            "train.warmup_steps=2", f"train.steps={STEPS}", "train.progress=false",
            "train.peak_flops=1e9", "train.log_every=1", "train.checkpoint_every=2", *extra]


def test_help_exits_zero(capsys):
    for main in (train_main, eval_main):
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0
        assert "--workdir" in capsys.readouterr().out


def _one_line_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("content, needle", [
    (None, "does not exist"),
    ("", "no non-empty documents"),
    ('{"text": 1}\n', "data.jsonl:1"),
    ('{"text": "ok"\n', "malformed JSON"),
])
def test_bad_data_is_a_one_line_error(tmp_path, capsys, content, needle):
    source = tmp_path / "data.jsonl"
    if content is not None:
        source.write_text(content)
    code, _, err = _cli(capsys, train_main, *_small_args(tmp_path / "run",
                                                         f"train.data.source={source}"))
    _one_line_error(code, err, needle)


def test_vocabulary_too_small_for_the_tokenizer(tmp_path, capsys):
    code, _, err = _cli(capsys, train_main, *_small_args(tmp_path / "run"),
                        "model.vocab_size=1000")
    _one_line_error(code, err, "4096 tokens", "model.vocab_size=1000")


def test_unwritable_workdir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = _cli(capsys, train_main, *_small_args(blocker / "run"))
    _one_line_error(code, err, "not writable")


def test_bad_override_and_unknown_key(tmp_path, capsys):
    for bad, needle in (("train.optimizer=sgd", "train.optimizer"),
                        ("train.stepz=3", "train.stepz"), ("steps=3", "prefix the key")):
        with pytest.raises(SystemExit) as exit_info:
            train_main(_small_args(tmp_path / "run", bad))
        _one_line_error(exit_info.value.code, capsys.readouterr().err, needle)


@pytest.fixture
def trained_copy(trained, tmp_path) -> Path:
    """A private copy of the `trained` workdir, for tests that run the CLI on it."""
    workdir = tmp_path / "copy"
    shutil.copytree(trained, workdir)
    return workdir


@pytest.mark.slow
def test_resume_with_an_incompatible_config_is_refused(trained_copy, capsys):
    workdir = trained_copy
    before = files_digest(workdir)
    code, _, err = _cli(capsys, train_main, *_small_args(workdir, "model.d_model=48",
                                                         "train.lr=1e-2"))
    _one_line_error(code, err, "model.d_model", "train.lr")
    assert files_digest(workdir) == before


def test_corrupt_checkpoint_is_a_one_line_error_and_nothing_is_overwritten(trained_copy, capsys):
    workdir = trained_copy
    state_files = [p for p in (workdir / "checkpoints" / "2" / "state").rglob("*") if p.is_file()]
    victim = max(state_files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    before = files_digest(workdir)
    code, _, err = _cli(capsys, train_main, *_small_args(workdir))
    _one_line_error(code, err, "unreadable", str(workdir / "checkpoints" / "2"))
    assert files_digest(workdir) == before


def test_eval_reports_loss_and_perplexity(trained, capsys):
    code, out, _ = _cli(capsys, eval_main, "--workdir", str(trained), "--batches", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["step"] == 2 and result["split"] == "heldout" and result["batches"] == 2
    assert 0 < result["loss"] < 2 * math.log(VOCAB)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


def test_finished_run_has_nothing_to_do(trained_copy, capsys):
    workdir = trained_copy
    before = files_digest(workdir)
    code, out, _ = _cli(capsys, train_main, *_small_args(workdir, "train.steps=2"))
    assert code == 0 and "nothing to do" in out and "train.steps=2" in out
    assert files_digest(workdir) == before


def test_eval_without_checkpoint_is_a_one_line_error(tmp_path, capsys):
    code, _, err = _cli(capsys, eval_main, "--workdir", str(tmp_path))
    _one_line_error(code, err, "no checkpoint")


def test_metrics_lines_have_the_promised_fields(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "eval/loss" not in records[0]
    assert records[1]["eval/perplexity"] == pytest.approx(math.exp(records[1]["eval/loss"]))
    for record in records:  # tokens_per_sec and mfu: tests/train/test_throughput.py
        assert {"loss", "tokens_seen", "lr", "grad_norm", "moe/routing_confidence",
                "moe/act_rms_max_over_median", "update_rms/muon"} <= set(record)


def test_starting_weights_must_fit_the_model():
    """A stage's (or `train.init_from`'s) starting variables are checked against the run's state
    before training: a missing or extra collection, parameter or a changed shape is refused;
    other dtypes are cast to the run's."""
    params = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    bias = {"b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    fitted = fitted_variables({"params": {"w": jnp.ones((2, 3), jnp.bfloat16)}}, (params, {}))
    assert fitted["params"]["w"].dtype == jnp.float32 and "balance" not in fitted  # none: empty
    for bad in ({"params": {"w": jnp.zeros((2, 4))}},
                {"params": {"w": jnp.zeros((2, 3)), "v": jnp.zeros(1)}},
                {"params": {"w": jnp.zeros((2, 3))}, "balance": {"b": jnp.zeros(3)}}):
        with pytest.raises(InitFromError, match="do not fit this run's model"):
            fitted_variables(bad, (params, {}))
    fitted_variables({"params": {"w": jnp.zeros((2, 3))}, "balance": {"b": jnp.zeros(3)}},
                     (params, bias))
    with pytest.raises(InitFromError, match="do not fit this run's model"):
        fitted_variables({"params": {"w": jnp.zeros((2, 3))}}, (params, bias))
