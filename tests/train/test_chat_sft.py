"""Chat SFT losses: the training loss (`train.step.loss_fn`, main and MTP heads) and the held-out
loss (`train.eval`) with a per-token `loss_mask` against explicit float64 loops over the
model's logits; a mask of all ones is today's loss; `python -m train` on chat data."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import SMALL_LOOP, TINY, small_run, synthetic_batch

from model.generate import main as generate_main
from model.interop.workdir_record import read_record
from model.tokenizers.text import load_tokenizer
from model.lm import join_variables
from train.__main__ import main as train_main
from train.data.chat_arith import chat_arith_records, jsonl_text
from train.eval import make_eval_step
from train.state import build_training, create_state
from train.step import loss_fn, target_counts

VOCAB = 64


@pytest.fixture(scope="module")
def setup():
    """(run, model, params, balance) of the small test model, MTP-1 in the loss."""
    run = small_run(vocab=VOCAB)
    assert run.trained_mtp_heads() == 1
    training = build_training(run)
    state = jax.jit(lambda: create_state(training.model, training.optimizer, 0))()
    return run, training.model, state.params, state.balance


def masked_batch(seed: int) -> dict:
    """[1, 2, 16]: two packed documents per row (3 metadata tokens each), a random loss mask."""
    batch = synthetic_batch(1, 2, 16, VOCAB, seed)
    rng = np.random.default_rng(seed + 100)
    return {**batch, "loss_mask": rng.random(batch["tokens"].shape) < 0.4}


def reference_loss(logits, tokens, segments, meta, trained, offset: int, mask_meta: bool):
    """(sum of -log p(target), count) in float64 over positions t whose target t + offset is in
    the same document, is not metadata when `mask_meta`, and is a `trained` token."""
    logits = np.asarray(logits, np.float64)
    total, count = 0.0, 0
    rows, length = tokens.shape
    for b in range(rows):
        for t in range(length - offset):
            target = t + offset
            if segments[b, t] == 0 or segments[b, target] != segments[b, t]:
                continue
            if (mask_meta and meta[b, target]) or not trained[b, target]:
                continue
            z = logits[b, t]
            top = max(z)
            log_sum = top + np.log(sum(np.exp(v - top) for v in z))
            total += log_sum - z[tokens[b, target]]
            count += 1
    return total, count


def model_logits(model, params, balance, micro):
    out = model.apply(join_variables(params, balance), micro["tokens"], micro["segment_ids"],
                      micro["positions"], compute_logits=True, num_mtp_heads=1)
    return np.asarray(out.logits), np.asarray(out.mtp_logits[0])


@pytest.mark.slow
@pytest.mark.parametrize("mask_meta", [False, True])
def test_training_loss_counts_only_masked_targets(setup, mask_meta):
    run, model, params, balance = setup
    batch = masked_batch(0)
    micro = {k: v[0] for k, v in batch.items()}
    counts = target_counts(run, batch, jnp.bool_(mask_meta))
    _, (parts, _) = jax.jit(lambda p, b, m: loss_fn(model, run, p, b, m, jnp.bool_(mask_meta),
                                                    counts, 1))(params, balance, micro)
    main, mtp = model_logits(model, params, balance, micro)
    fields = (micro["tokens"], micro["segment_ids"], micro["meta_mask"], micro["loss_mask"])
    lm_total, lm_count = reference_loss(main, *fields, 1, mask_meta)
    mtp_total, mtp_count = reference_loss(mtp, *fields, 2, mask_meta)
    assert [int(c) for c in counts] == [lm_count, mtp_count]
    assert 0 < lm_count < int(np.sum(micro["segment_ids"] > 0)) - 2  # the mask dropped some
    np.testing.assert_allclose(parts["loss/lm"], lm_total / lm_count, rtol=1e-5)
    weight = run.train.mtp_offset_weights[0]
    np.testing.assert_allclose(parts["loss/mtp"], weight * mtp_total / mtp_count, rtol=1e-5)


def test_a_mask_of_ones_is_the_unmasked_loss(setup):
    run, model, params, balance = setup
    batch = masked_batch(1)
    ones = {**batch, "loss_mask": np.ones_like(batch["loss_mask"])}
    unmasked = {k: v for k, v in batch.items() if k != "loss_mask"}

    def parts(b):
        counts = target_counts(run, b, jnp.bool_(False))
        micro = {k: v[0] for k, v in b.items()}
        _, (values, _) = loss_fn(model, run, params, balance, micro, jnp.bool_(False), counts, 1)
        return counts, values

    (counts_ones, with_ones), (counts_none, without) = parts(ones), parts(unmasked)
    np.testing.assert_array_equal(counts_ones, counts_none)
    for name in ("loss/lm", "loss/mtp"):
        np.testing.assert_array_equal(with_ones[name], without[name])
    micro = {k: v[0] for k, v in ones.items()}
    main, _ = model_logits(model, params, balance, micro)
    total, count = reference_loss(main, micro["tokens"], micro["segment_ids"], micro["meta_mask"],
                                  micro["loss_mask"], 1, False)
    np.testing.assert_allclose(with_ones["loss/lm"], total / count, rtol=1e-5)


def test_heldout_loss_counts_only_masked_targets(setup):
    run, model, params, balance = setup
    micro = {k: v[0] for k, v in masked_batch(2).items()}
    total, count = make_eval_step(model, run.train.loss_chunk_size)(params, balance, micro)
    main, _ = model_logits(model, params, balance, micro)
    want_total, want_count = reference_loss(main, micro["tokens"], micro["segment_ids"],
                                            micro["meta_mask"], micro["loss_mask"], 1, True)
    assert int(count) == want_count
    np.testing.assert_allclose(total, want_total, rtol=1e-5)


# ---- python -m train on chat data ------------------------------------------------------------


def run_train(capsys, workdir, *overrides) -> tuple[int, list[str]]:
    code = train_main(["--config", str(TINY), "--workdir", str(workdir), *SMALL_LOOP,
                       *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.slow
def test_train_on_chats_trains_on_assistant_turns(tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(jsonl_text(chat_arith_records(40)))
    code, err = run_train(capsys, tmp_path / "run", f"train.data.source={chats}",
                          "train.eval_every=3", "train.data.heldout_fraction=0.2")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3] and np.isfinite(rows[-1]["eval/loss"])
    # an answer of 1-3 digits and its closing token out of ~50 tokens per conversation
    assert all(0.02 < r["trained_fraction"] < 0.3 for r in rows), rows
    assert "chat template" in read_record(tmp_path / "run")["data"]["fingerprint"]
    # the workdir answers a question put in the same template
    assert generate_main(["--workdir", str(tmp_path / "run"), "--chat", "--prompt",
                          "What is 1 + 1?", "--max-new-tokens", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    text = load_tokenizer("default")
    prompt = [*text.encode("<|user|>\nWhat is 1 + 1?"), text.eos_id,
              *text.encode("\n<|assistant|>\n")]
    assert result["prompt_tokens"] == len(prompt) and len(result["token_ids"]) <= 2


@pytest.mark.parametrize("overrides, needle", [
    (["train.data.source=stdlib", "train.loss_mask=assistant"],
     "error: train.loss_mask: 'assistant' trains on the assistant turns of chat data"),
    (["train.data.source={chats}", "train.data.tokenizer=arith_chars", "model.vocab_size=32"],
     "error: tokenizer 'arith_chars' has no chat template"),
])
def test_chat_misconfigurations_stop_before_the_compile(tmp_path, capsys, overrides, needle):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(jsonl_text(chat_arith_records(3)))
    code, err = run_train(capsys, tmp_path / "run", *(o.format(chats=chats) for o in overrides))
    assert code == 2 and len(err) == 1 and err[0].startswith(needle), err
    assert not (tmp_path / "run" / "checkpoints").exists()
