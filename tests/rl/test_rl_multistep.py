"""The second embedded task (train/data/multistep.py) and its verifier (rl/rewards/verifiers.py):

- problems: prompt, answer, worked solution and key by hand, enumeration and argument checks;
- the verifier: worked line(s) then exactly the right final answer line earns 1; everything else
  (no worked line, whitespace, a wrong or non-canonical answer, malicious strings) earns 0 and
  nothing is ever evaluated; it differs from the arithmetic verifier on the same strings;
- the split: held-out problems disjoint from the training ones and the same as the SFT corpus
  `arith_multistep` holds out; the corpus' documents and fingerprint;
- the `arith_chars` tokenizer spells every document one token per character.
"""

import builtins

import numpy as np
import pytest

from model.tokenizers.text import load_tokenizer
from rl.rewards import (
    arithmetic_reward,
    final_answer,
    multistep_reward,
    multistep_rewards,
)
from train.data.arithmetic import arithmetic_problems, split_problems
from train.data.corpus import load_documents
from train.data.documents import heldout_score, split_documents
from train.data.fingerprint import data_fingerprint
from train.data.multistep import ChainProblem, multistep_documents, multistep_problems

# --------------------------------------------------------------------------------------------
# problems


@pytest.mark.parametrize("operands, ops, prompt, answer, solution", [
    ((12, 7, 5), "+-", "12+7-5=", 14, "19-5=14\n14"),
    ((0, 20, 20), "--", "0-20-20=", -40, "-20-20=-40\n-40"),
    ((3, 4, 9), "-+", "3-4+9=", 8, "-1+9=8\n8"),
    ((20, 20, 20), "++", "20+20+20=", 60, "40+20=60\n60"),
])
def test_chain_problem_prompt_answer_solution_key(operands, ops, prompt, answer, solution):
    p = ChainProblem(operands, ops)
    assert (p.prompt, p.answer, p.solution) == (prompt, answer, solution)
    assert p.key == "arith_multistep:" + prompt
    assert multistep_reward(p.solution, p.answer) == 1.0  # the reference earns full reward


def test_multistep_problems_count_content_and_order():
    problems = multistep_problems(max_operand=2, ops="+-")
    assert len(problems) == 3 ** 3 * 2 ** 2
    assert len({p.key for p in problems}) == len(problems)
    assert {p.ops for p in problems} == {"++", "+-", "-+", "--"}
    assert all(len(p.operands) == 3 and all(0 <= a <= 2 for a in p.operands) for p in problems)
    assert problems == multistep_problems(max_operand=2, ops="+-")
    assert len(multistep_problems(max_operand=1, ops="-")) == 8
    assert len(multistep_problems()) == 21 ** 3 * 4  # default: operands 0..20


@pytest.mark.parametrize("kwargs", [{"ops": "*"}, {"ops": ""}, {"ops": "+/"},
                                    {"max_operand": 0}, {"max_operand": 50}])
def test_multistep_problems_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        multistep_problems(**kwargs)


# --------------------------------------------------------------------------------------------
# the verifier

CORRECT = ["19-5=14\n14", "12+7=19\n19-5=14\n14", "anything at all\n14", "x\ny\n14"]
WRONG = ["19-5=14\n15", "19-5=14\n-14", "19-5=14\n014", "19-5=14\n+14", "19-5=14\n14.0",
         "19-5=14\n1e1"]
MALFORMED = ["14", "", "\n14", "19-5=14\n\n14", "19-5=14\n14\n", "19-5=14\n 14",
             "19-5=14\n14 ", "19-5=14\n\t14", "19-5=14\r\n14\r", "19-5=14 14", "19-5=14\n１４",
             "19-5=14\n14=", "19-5=14\n=14", "19-5=14\n-0"]
MALICIOUS = ["x\n__import__('os').system('echo pwned')", "x\n7*7", "x\n{{7*7}}",
             "x\neval('14')", "x\n14; import os", "x\nexec('y=14')", "x\n14\x00", "x\n14#"]


@pytest.mark.parametrize("response", CORRECT)
def test_worked_lines_then_the_right_answer_earn_one(response):
    assert final_answer(response) == 14
    assert multistep_reward(response, 14) == 1.0


@pytest.mark.parametrize("response", WRONG + MALFORMED + MALICIOUS)
def test_anything_else_earns_zero(response):
    assert multistep_reward(response, 14) == 0.0
    assert multistep_reward(response, 49) == 0.0  # 7*7 and {{7*7}} must not become 49


def test_malformed_final_lines_parse_to_nothing():
    for response in MALFORMED + MALICIOUS:
        assert final_answer(response) is None, repr(response)


def test_the_two_tasks_have_different_verifiers():
    """The arithmetic task wants the bare integer, the multi-step task the worked line first."""
    assert arithmetic_reward("14", 14) == 1.0 and multistep_reward("14", 14) == 0.0
    worked = "19-5=14\n14"
    assert arithmetic_reward(worked, 14) == 0.0 and multistep_reward(worked, 14) == 1.0


def test_no_response_is_ever_evaluated(monkeypatch):
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(args)
        raise AssertionError("model output was evaluated")

    # Malicious worked lines are never read beyond splitting on newlines: the right final
    # answer still earns the reward; malicious final lines earn nothing.
    responses = ["__import__('os').system('echo pwned')\n14", "eval('1')\n14", *MALICIOUS,
                 *MALFORMED]
    with monkeypatch.context() as patch:
        patch.setattr(builtins, "eval", forbidden)
        patch.setattr(builtins, "exec", forbidden)
        rewards = multistep_rewards(responses, [14] * len(responses))
    assert calls == []
    assert rewards.dtype == np.float32 and rewards.shape == (len(responses),)
    np.testing.assert_array_equal(rewards, [1.0, 1.0] + [0.0] * (len(responses) - 2))


def test_multistep_rewards_length_mismatch_raises():
    with pytest.raises(ValueError):
        multistep_rewards(["1\n2"], [2, 3])


# --------------------------------------------------------------------------------------------
# split, SFT corpus, tokenizer

def test_heldout_split_is_disjoint_from_training_and_by_hash():
    problems = multistep_problems()
    train, heldout = split_problems(problems, 0.05)
    assert train and heldout
    assert not {p.key for p in train} & {p.key for p in heldout}
    assert len(train) + len(heldout) == len(problems)
    assert all(heldout_score(p.key) < 0.05 for p in heldout)
    assert all(heldout_score(p.key) >= 0.05 for p in train)
    # the two tasks' problems never share a key (or a prompt)
    arithmetic = arithmetic_problems()
    assert not {p.key for p in problems} & {p.key for p in arithmetic}
    assert not {p.prompt for p in problems} & {p.prompt for p in arithmetic}


def test_sft_corpus_holds_out_exactly_rl_heldout_problems():
    docs = load_documents("arith_multistep")
    problems = multistep_problems()
    assert [d.key for d in docs] == [p.key for p in problems]
    assert docs == multistep_documents()
    assert docs[[p.key for p in problems].index("arith_multistep:12+7-5=")].text == \
        "12+7-5=19-5=14\n14"
    assert all(d.meta == {"type": "Math", "source": "arith_multistep"} for d in docs)
    train_docs, heldout_docs = split_documents(docs, 0.05)
    train_problems, heldout_problems = split_problems(problems, 0.05)
    assert [d.key for d in heldout_docs] == [p.key for p in heldout_problems]
    assert [d.key for d in train_docs] == [p.key for p in train_problems]
    fingerprint = data_fingerprint("arith_multistep")
    assert list(fingerprint) == ["arith_multistep"]
    assert fingerprint["arith_multistep"]["documents"] == len(problems)


def test_arith_chars_spells_every_document_one_token_per_character():
    tok = load_tokenizer("arith_chars")
    for doc in multistep_documents(max_operand=20)[::97]:
        ids = tok.encode(doc.text)
        assert len(ids) == len(doc.text) and tok.decode(ids) == doc.text
