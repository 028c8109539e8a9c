"""Rewards (rl/rewards/verifiers.py, rl/rewards/bradley_terry.py), the arithmetic task
(train/data/arithmetic.py) and its shipped tokenizer.

- `parse_integer` / `arithmetic_reward(s)`: only a canonical ASCII decimal integer earns reward;
  malformed and adversarial responses earn 0.0 and are never evaluated;
- `bradley_terry_reward`: logit pooling of GenRM judgements, length penalty, rejection;
- `Problem`, `arithmetic_problems`, `split_problems`: prompts/answers/keys, argument checks,
  and a split consistent with the SFT corpus (`train.data.corpus`), so SFT never trains on RL's
  held-out problems;
- the shipped `arith_chars` tokenizer: one token per character, round trip, eos id, and the
  asset equal to what `model.tokenizers.arith_chars.char_tokenizer` builds (not stale).
"""

import builtins
import math

import numpy as np
import pytest
import tokenizers

from model.tokenizers.arith_chars import CHARACTERS, char_tokenizer
from model.tokenizers.text import SHIPPED, load_tokenizer
from rl.rewards import arithmetic_reward, arithmetic_rewards, bradley_terry_reward, parse_integer
from train.data.arithmetic import Problem, arithmetic_problems, split_problems
from train.data.corpus import load_documents
from train.data.documents import heldout_score, split_documents

# --------------------------------------------------------------------------------------------
# arithmetic verifier

MALFORMED = ["", " ", "9 5", "95.0", "+95", "095", "1e2", "0x5F", "٩٥", "(95)",
             "95 96", "95=", "=95", "95.", "9_5", "95-", "--95", "- 95", "１２"]
ADVERSARIAL = ["__import__('os').system('echo pwned')", "95; import os", "{{7*7}}",
               "eval('95')", "95\x00", "\x0095", "94+1", "exec('x=95')", "95#", "95\u200b"]


@pytest.mark.parametrize("response, answer", [("95", 95), ("-28", -28), (" 95\n", 95),
                                              ("\t-28  ", -28), ("0", 0)])
def test_arithmetic_reward_correct(response, answer):
    assert arithmetic_reward(response, answer) == 1.0
    assert parse_integer(response) == answer


def test_arithmetic_reward_wrong_answer():
    assert arithmetic_reward("94", 95) == 0.0
    assert arithmetic_reward("28", -28) == 0.0
    assert arithmetic_reward("-95", 95) == 0.0


@pytest.mark.parametrize("response", MALFORMED)
def test_malformed_responses_earn_zero(response):
    assert parse_integer(response) is None
    assert arithmetic_reward(response, 95) == 0.0


def test_minus_zero_and_overlong_integers_earn_zero():
    assert parse_integer("-0") is None
    assert arithmetic_reward("-0", 0) == 0.0
    nineteen = "1234567890123456789"  # 19 digits: beyond the 18-digit grammar
    assert parse_integer(nineteen) is None
    assert arithmetic_reward(nineteen, int(nineteen)) == 0.0
    eighteen = "123456789012345678"  # 18 digits: still canonical
    assert arithmetic_reward(eighteen, int(eighteen)) == 1.0
    assert arithmetic_reward("-" + eighteen, -int(eighteen)) == 1.0


@pytest.mark.parametrize("response", ADVERSARIAL)
def test_adversarial_responses_earn_zero(response):
    assert parse_integer(response) is None
    assert arithmetic_reward(response, 95) == 0.0
    assert arithmetic_reward(response, 49) == 0.0  # {{7*7}} must not become 49


def test_no_response_is_ever_evaluated(monkeypatch):
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(args)
        raise AssertionError("model output was evaluated")

    responses = [*ADVERSARIAL, *MALFORMED, "95", " -28 "]
    answers = [95] * (len(ADVERSARIAL) + len(MALFORMED)) + [95, -28]
    with monkeypatch.context() as patch:  # only around the verifier (numpy imports use exec)
        patch.setattr(builtins, "eval", forbidden)
        patch.setattr(builtins, "exec", forbidden)
        rewards = arithmetic_rewards(responses, answers)
    assert calls == []
    assert rewards.dtype == np.float32 and rewards.shape == (len(responses),)
    np.testing.assert_array_equal(rewards, [0.0] * (len(responses) - 2) + [1.0, 1.0])


def test_arithmetic_rewards_length_mismatch_raises():
    with pytest.raises(ValueError):
        arithmetic_rewards(["95", "3"], [95])
    with pytest.raises(ValueError):
        arithmetic_rewards(["95"], [95, 3])


# --------------------------------------------------------------------------------------------
# Bradley-Terry GenRM reward

def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _logit(p):
    return math.log(p / (1.0 - p))


def test_bradley_terry_single_judgement_is_identity():
    np.testing.assert_allclose(bradley_terry_reward([0.5]), [0.5], rtol=1e-12)
    np.testing.assert_allclose(bradley_terry_reward([0.7, 0.1, 0.95]), [0.7, 0.1, 0.95],
                               rtol=1e-9)
    # K = 1 judgement per response ([N, 1]): sigmoid(logit p) = p
    np.testing.assert_allclose(bradley_terry_reward([[0.7], [0.3]]), [0.7, 0.3], rtol=1e-9)


def test_bradley_terry_pools_judgements_in_logit_space():
    # logit(0.8) = ln 4, logit(0.2) = -ln 4: mean 0 -> 0.5
    np.testing.assert_allclose(bradley_terry_reward([[0.8, 0.2]]), [0.5], rtol=1e-9)
    # [0.9, 0.6]: mean of ln 9 and ln 1.5 = ln(sqrt(13.5)) -> sqrt(13.5) / (1 + sqrt(13.5))
    expected = math.sqrt(13.5) / (1 + math.sqrt(13.5))
    np.testing.assert_allclose(bradley_terry_reward([[0.9, 0.6]]), [expected], rtol=1e-9)


def test_bradley_terry_length_penalty():
    # Twice the reference length: relative excess 1, penalty 1.0 -> sigmoid(logit(0.7) - 1).
    got = bradley_terry_reward([0.7, 0.7, 0.7], length=[200, 50, 100],
                               reference_length=[100, 100, 100], length_penalty=1.0)
    expected = [_sigmoid(_logit(0.7) - 1.0), 0.7, 0.7]  # shorter / equal: not penalised
    np.testing.assert_allclose(got, expected, rtol=1e-9)
    # excess 0.5 with penalty 2.0 -> one logit as well
    got = bradley_terry_reward([0.6], length=[150], reference_length=[100], length_penalty=2.0)
    np.testing.assert_allclose(got, [_sigmoid(_logit(0.6) - 1.0)], rtol=1e-9)


def test_bradley_terry_rejected_get_zero():
    got = bradley_terry_reward([0.9, 0.9, 0.4], rejected=[False, True, True])
    np.testing.assert_allclose(got, [0.9, 0.0, 0.0], rtol=1e-9)
    assert got[1] == 0.0 and got[2] == 0.0


def test_bradley_terry_length_penalty_needs_lengths():
    with pytest.raises(ValueError):
        bradley_terry_reward([0.7], length_penalty=1.0)
    with pytest.raises(ValueError):
        bradley_terry_reward([0.7], length=[10], length_penalty=1.0)
    with pytest.raises(ValueError):
        bradley_terry_reward([0.7], reference_length=[10], length_penalty=1.0)


# --------------------------------------------------------------------------------------------
# the arithmetic task

def test_problem_prompt_answer_key():
    p = Problem(37, "+", 58)
    assert (p.prompt, p.answer, p.key) == ("37+58=", 95, "arith:37+58=")
    q = Problem(12, "-", 40)
    assert (q.prompt, q.answer, q.key) == ("12-40=", -28, "arith:12-40=")
    r = Problem(7, "*", 9)
    assert (r.prompt, r.answer) == ("7*9=", 63)


def test_arithmetic_problems_count_and_content():
    problems = arithmetic_problems(max_operand=3, ops="+-")
    assert len(problems) == 32  # 2 ops * 4 * 4 operand pairs
    assert len({p.key for p in problems}) == 32
    assert {p.op for p in problems} == {"+", "-"}
    assert all(0 <= p.a <= 3 and 0 <= p.b <= 3 for p in problems)
    assert problems == arithmetic_problems(max_operand=3, ops="+-")  # deterministic order
    assert len(arithmetic_problems(max_operand=1, ops="*")) == 4


@pytest.mark.parametrize("kwargs", [{"ops": "/"}, {"ops": ""}, {"ops": "+/"}, {"ops": "x"},
                                    {"max_operand": 0}, {"max_operand": -5}])
def test_arithmetic_problems_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        arithmetic_problems(**kwargs)


def test_split_problems_uses_heldout_score():
    problems = arithmetic_problems(max_operand=9, ops="+-*")
    for fraction in (0.05, 0.3):
        train, heldout = split_problems(problems, fraction)
        assert all(heldout_score(p.key) < fraction for p in heldout)
        assert all(heldout_score(p.key) >= fraction for p in train)
        assert len(train) + len(heldout) == len(problems)
        assert {p.key for p in train} | {p.key for p in heldout} == {p.key for p in problems}
        assert heldout, "the fraction should hold out some of these 300 problems"
        # order preserved within each side
        assert train == [p for p in problems if p in set(train)]
        assert heldout == [p for p in problems if p in set(heldout)]


def test_sft_corpus_holds_out_exactly_rl_heldout_problems():
    docs = load_documents("arith")
    problems = arithmetic_problems()
    assert [d.key for d in docs] == [p.key for p in problems]
    assert all(d.text == p.prompt + str(p.answer) for d, p in zip(docs, problems))
    assert docs[[p.key for p in problems].index("arith:37+58=")].text == "37+58=95"
    train_docs, heldout_docs = split_documents(docs, 0.05)
    train_problems, heldout_problems = split_problems(problems, 0.05)
    assert [d.key for d in heldout_docs] == [p.key for p in heldout_problems]
    assert [d.key for d in train_docs] == [p.key for p in train_problems]
    assert not {d.key for d in train_docs} & {p.key for p in heldout_problems}


# --------------------------------------------------------------------------------------------
# the shipped character tokenizer

def test_arith_chars_tokenizer_one_token_per_character():
    tok = load_tokenizer("arith_chars")
    ids = [tok.encode(c) for c in CHARACTERS]
    assert all(len(i) == 1 for i in ids)
    assert len({int(i[0]) for i in ids}) == len(CHARACTERS)
    assert CHARACTERS == "0123456789+-*=\n"  # appended only: earlier ids never change
    assert [int(tok.encode(c)[0]) for c in "0=\n"] == [3, 16, 17]
    text = "37+58=95"
    encoded = tok.encode(text)
    assert len(encoded) == len(text)
    assert tok.decode(encoded) == text
    assert tok.eos_id == 0


def test_shipped_arith_chars_asset_is_not_stale():
    shipped = tokenizers.Tokenizer.from_file(str(SHIPPED["arith_chars"]))
    assert shipped.to_str() == char_tokenizer().to_str()
