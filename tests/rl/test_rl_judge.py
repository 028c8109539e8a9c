"""The generative pairwise judge (rl/rewards/judge.py) on a tiny random model with the shipped
BPE tokenizer (it spells the default template; " A" and " B" are single tokens):

- its confidences equal an independent computation: the template written out here, a full
  `CausalLM.apply` forward pass per prompt (no padding, no batching) and a float64 softmax over
  the two choice tokens' logits, in both presentation orders;
- its rewards are `bradley_terry_reward` of both orders pooled in logit space with the length
  penalty, computed here in float64 from those confidences and the lengths in judge tokens;
- Bradley-Terry by hand for pooled orders with a length penalty;
- templates missing a placeholder (or with a foreign one) are refused by name, as are a
  tokenizer that cannot spell the template and choices that are not one token;
- loading: a stepjax model directory with a named tokenizer gives the same confidences; no
  tokenizer to be found is one line; a task with `reward: judge` is built with it.
"""

import functools
import math

import flax.linen as nn
import jax
import numpy as np
import pytest
from tiny_rl_model import tiny_model_config
from train_helpers import REPO

from model.config import ConfigError
from model.interop.model_dir import save_model_dir
from model.lm import CausalLM, init_variables
from model.tokenizers.text import load_tokenizer
from rl.config import load_rl_config
from rl.rewards import bradley_terry_reward
from rl.rewards.judge import PairwiseJudge
from rl.rewards.template import template_error
from rl.task_config import JudgeConfig
from rl.tasks import build_tasks
from train.data.arithmetic import Problem
from train.data.multistep import ChainProblem

PROBLEMS = [Problem(37, "+", 58), Problem(12, "-", 40), ChainProblem((12, 7, 5), "+-"),
            Problem(3, "+", 4), ChainProblem((0, 20, 20), "--")]
RESPONSES = ["95", "-28 and a much longer answer than the reference", "19-5=14\n14", "8",
             "garbage {response_a} }{"]


@pytest.fixture(scope="module")
def judge_model():
    cfg = tiny_model_config("model.vocab_size=4096")
    variables = nn.meta.unbox(jax.jit(lambda k: init_variables(CausalLM(cfg), k))(
        jax.random.key(7)))
    # A random output head gives confidences all near 0.5; a larger one spreads them, so the
    # comparison below is not trivially met.
    variables["params"]["lm_head"] = jax.tree.map(lambda w: w * 30.0,
                                                  variables["params"]["lm_head"])
    return cfg, variables, load_tokenizer("default")


REFERENCE_LENGTH = 96


@functools.cache
def _forward(cfg):
    return jax.jit(lambda variables, tokens: CausalLM(cfg).apply(variables, tokens).logits)


def reference_confidence(cfg, variables, tokenizer, question, response_a, response_b):
    """P(choice A) of one prompt: the default template written out, the plain forward pass
    (all logits; the prompt zero-padded to one length for one compile, which causal attention
    keeps out of the prompt's positions), a float64 softmax over the logits of " A" and " B"
    at the prompt's last position."""
    text = (f"Question: {question}\nResponse A: {response_a}\nResponse B: {response_b}\n"
            "Which response is better? Answer A or B:")
    ids = tokenizer.encode(text)
    tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
    tokens[0, :len(ids)] = ids
    logits = np.asarray(_forward(cfg)(variables, tokens)[0, len(ids) - 1], np.float64)
    a, b = (int(tokenizer.encode(choice)[0]) for choice in (" A", " B"))
    return math.exp(logits[a]) / (math.exp(logits[a]) + math.exp(logits[b]))


@pytest.mark.slow
def test_confidences_equal_full_forward_softmax_over_the_two_choices(judge_model):
    cfg, variables, tokenizer = judge_model
    judge = PairwiseJudge(cfg, variables, tokenizer, batch_size=3)  # 10 prompts: 3 + 3 + 3 + 1
    questions = [p.prompt for p in PROBLEMS]
    references = [p.solution for p in PROBLEMS]
    got = judge.confidences(questions, RESPONSES, references)
    assert got.shape == (len(PROBLEMS), 2)
    for i, (q, r, ref) in enumerate(zip(questions, RESPONSES, references)):
        as_a = reference_confidence(cfg, variables, tokenizer, q, r, ref)
        as_b = 1.0 - reference_confidence(cfg, variables, tokenizer, q, ref, r)
        np.testing.assert_allclose(got[i], [as_a, as_b], atol=2e-5)
    assert np.ptp(got) > 0.1, got  # the confidences really differ

    # rewards: both orders pooled in logit space, minus the length penalty (judge tokens)
    penalised = PairwiseJudge(cfg, variables, tokenizer, batch_size=3, length_penalty=0.5)
    rewards = penalised.score(PROBLEMS, RESPONSES)
    assert rewards.dtype == np.float32 and rewards.shape == (len(PROBLEMS),)
    for i, (problem, response) in enumerate(zip(PROBLEMS, RESPONSES)):
        logit = lambda p: math.log(p / (1.0 - p))  # noqa: E731
        strength = (logit(got[i, 0]) + logit(got[i, 1])) / 2
        excess = max(0.0, len(tokenizer.encode(response))
                     / len(tokenizer.encode(problem.solution)) - 1.0)
        expected = 1.0 / (1.0 + math.exp(-(strength - 0.5 * excess)))
        np.testing.assert_allclose(rewards[i], expected, atol=2e-5)
    assert len(tokenizer.encode(RESPONSES[1])) > 2 * len(tokenizer.encode("-28"))  # penalised


def test_bradley_terry_pools_both_orders_and_penalises_length_by_hand():
    # logit(0.8) = ln 4, logit(0.6) = ln 1.5: strength = ln(sqrt(6)) = 0.8958797...;
    # 30 tokens against a 20-token reference: excess 0.5, penalty 0.5 -> 0.25 logits.
    got = bradley_terry_reward([[0.8, 0.6], [0.8, 0.6]], length=[30, 20],
                               reference_length=[20, 20], length_penalty=0.5)
    sqrt6 = math.sqrt(6.0)
    np.testing.assert_allclose(got, [1.0 / (1.0 + math.exp(0.25) / sqrt6),
                                     sqrt6 / (1.0 + sqrt6)], rtol=1e-12)
    np.testing.assert_allclose(got, [0.6560814, 0.7101021], atol=1e-7)


@pytest.mark.parametrize("template, problem", [
    ("{question} {response_a}", "missing placeholder {response_b}"),
    ("{question}", "missing placeholder {response_a}, {response_b}"),
    ("{question}{response_a}{response_b}{verdict}", "unknown placeholder {verdict}"),
    ("{question.__class__}{response_a}{response_b}", "unknown placeholder {question.__class__}"),
    ("{question!r}{response_a}{response_b}", "unknown placeholder {question!r}"),
    ("{question}{response_a}{response_b} {", "malformed braces"),
])
def test_bad_templates_are_refused_by_name(judge_model, template, problem):
    assert template_error(template).startswith(problem)
    with pytest.raises(ValueError) as info:
        JudgeConfig(template=template)
    assert str(info.value).startswith(f"template: {problem}")
    cfg, variables, tokenizer = judge_model
    with pytest.raises(ConfigError, match=f"^template: {problem[:12]}"):
        PairwiseJudge(cfg, variables, tokenizer, template=template)
    assert template_error("{{literal}} {question}{response_a}{response_b}") is None


def test_unspellable_template_and_multi_token_choices_are_refused(judge_model):
    cfg, variables, tokenizer = judge_model
    with pytest.raises(ConfigError, match=r"^template: the judge's tokenizer 'arith_chars' "
                                          r"cannot spell 'Question: '"):
        PairwiseJudge(cfg, variables, load_tokenizer("arith_chars"))
    with pytest.raises(ConfigError, match=r"^choices: ' A wins' is not one token"):
        PairwiseJudge(cfg, variables, tokenizer, choices=(" A wins", " B"))


@pytest.mark.slow
def test_judge_from_a_model_directory_and_as_a_task_reward(judge_model, tmp_path):
    cfg, variables, tokenizer = judge_model
    save_model_dir(cfg, variables, tmp_path / "judge")
    loaded = PairwiseJudge.from_checkpoint(tmp_path / "judge", "default", batch_size=2)
    in_memory = PairwiseJudge(cfg, variables, tokenizer, batch_size=2)
    args = ([p.prompt for p in PROBLEMS[:2]], RESPONSES[:2], [p.solution for p in PROBLEMS[:2]])
    np.testing.assert_allclose(loaded.confidences(*args), in_memory.confidences(*args),
                               atol=1e-6)
    with pytest.raises(ConfigError, match="^tokenizer: .* holds no tokenizer.json"):
        PairwiseJudge.from_checkpoint(tmp_path / "judge")

    judged = f"task.tasks.multistep.judge.checkpoint={tmp_path / 'judge'}"
    run = load_rl_config(REPO / "configs" / "rl_arith_mix.yaml", [
        "task.tasks.multistep.reward=judge", judged, "task.tasks.multistep.judge.tokenizer=default",
        "task.tasks.multistep.max_operand=3"])
    arithmetic, multistep = build_tasks(run.task)
    assert isinstance(multistep.reward, PairwiseJudge)
    assert arithmetic.reward is arithmetic.verifier
    rewards = multistep.reward.score(multistep.train[:3], ["1+2=3\n3", "3", "x"])
    assert rewards.shape == (3,) and ((rewards > 0) & (rewards < 1)).all()
    missing = load_rl_config(REPO / "configs" / "rl_arith_mix.yaml", [
        "task.tasks.multistep.reward=judge", f"{judged}_absent"])
    with pytest.raises(ConfigError, match=r"^task\.tasks\.multistep\.judge\.checkpoint: .* "
                                          "does not exist"):
        build_tasks(missing.task)
