"""Distillation teachers (rl/distill/teachers.py, rl/distill/full_vocab.py, model/weights.py) on
tiny random models: the student (the tiny RL architecture, vocab 32), teacher A of the same
architecture with other weights, and teacher B of the MiMo-V2-Flash family (sink attention,
per-type head geometry, no shared expert) with d_model 48 and a larger vocabulary (40):

- scoring equals each teacher's own full forward (`CausalLM.apply` logits, a float64 numpy
  log-softmax at the rollout temperature), row by row;
- routing: rows of task A are scored by teacher A only, rows of B by B, rows of a task without
  a teacher by none (teacher id -1, log-prob 0); tasks naming one checkpoint share a teacher;
- the final hidden states kept for the full-vocabulary signal, and the KL that the actor step
  forms from them chunk by chunk, equal KL(student || teacher) of the two full forwards;
- refusals, one line naming the field and the task: a teacher tokenizer with another vocabulary
  (both tokenizers named), a smaller vocab_size, a path that is no checkpoint; the same
  vocabulary under another name (a copied tokenizer.json) is accepted.
"""

import functools
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_rl_model import tiny_model_config
from train_helpers import REPO

from model.config import ConfigError
from model.interop.model_dir import save_model_dir
from model.lm import CausalLM, init_variables
from model.tokenizers.text import SHIPPED, load_tokenizer
from rl.config import RLMeshConfig
from rl.distill.config import TeacherConfig
from rl.distill.full_vocab import head_params, teacher_log_probs_fn
from rl.distill.teachers import load_teachers, padded_rows, score_rows
from rl.models import token_logprobs
from rl.parallel import rl_mesh
from rl.rollout import layout_rows
from train.config import load_run_config

TEMPERATURE = 0.7
MIMO_TEACHER = ["model.num_layers=2", "model.layout=FS", "model.d_model=48",
                "model.vocab_size=40", "model.window=4", "model.moe.num_experts=4",
                "model.moe.top_k=2", "model.moe.expert_hidden=16", "model.dense_hidden=32",
                "model.moe.num_ep_groups=2"]


def random_variables(cfg, seed):
    return nn.meta.unbox(jax.jit(lambda k: init_variables(CausalLM(cfg), k))(
        jax.random.key(seed)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (config, variables, model directory)} of the student and the two teachers."""
    root = tmp_path_factory.mktemp("teachers")
    student = tiny_model_config()
    mimo = load_run_config(REPO / "configs" / "tiny_mimo.yaml", MIMO_TEACHER).model
    out = {}
    for name, cfg, seed in (("student", student, 0), ("a", student, 1), ("b", mimo, 2)):
        variables = random_variables(cfg, seed)
        save_model_dir(cfg, variables, root / name)
        out[name] = (cfg, variables, root / name)
    return out


@pytest.fixture(scope="module")
def mesh():
    return rl_mesh(RLMeshConfig(), jax.devices()[:1])


def rows():
    """Five rows (prompt; response; padding) of tasks add, add, sub, sub, mul."""
    prompts = [[3, 4, 5], [6], [7, 8], [9, 10, 11, 12], [13]]
    responses = [[14, 2], [5, 6, 7], [1], [15, 16], [4, 4, 4]]
    tokens, segments, mask = layout_rows(prompts, responses, 8)
    return tokens, segments, mask, np.array(["add", "add", "sub", "sub", "mul"])


def assigned(a_dir, b_dir, tokenizer="arith_chars"):
    return {"add": (TeacherConfig(str(a_dir), tokenizer), "task.tasks.add.teacher"),
            "sub": (TeacherConfig(str(b_dir), tokenizer), "task.tasks.sub.teacher")}


@functools.cache
def _forward(cfg):
    return jax.jit(lambda variables, tokens: CausalLM(cfg).apply(variables, tokens))


def full_log_softmax(cfg, variables, tokens, segments):
    """float64 [T, V] log-softmax of the plain forward's logits / TEMPERATURE over one row (its
    zero padding after the row, which causal attention keeps out of the row's positions)."""
    logits = np.asarray(_forward(cfg)(variables, tokens[None]).logits[0], np.float64)
    logits = logits / TEMPERATURE
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))


@pytest.mark.slow
def test_each_row_is_scored_by_its_tasks_teacher_as_its_own_forward(models, mesh):
    tokens, segments, mask, tasks = rows()
    student_tokenizer = load_tokenizer("arith_chars")
    teachers = load_teachers(assigned(models["a"][2], models["b"][2]), student_tokenizer, 32,
                             mesh)
    assert [t.tasks for t in teachers] == [("add",), ("sub",)]
    scores = score_rows(teachers, tasks, tokens, segments, TEMPERATURE, mesh, with_hidden=True)
    np.testing.assert_array_equal(scores.teacher_id, [0, 0, 1, 1, -1])
    for b, task in enumerate(tasks):
        if task == "mul":  # no teacher: nothing scored
            assert (scores.logp[b] == 0).all() and (scores.hidden[b] == 0).all()
            continue
        cfg, variables, _ = models["a" if task == "add" else "b"]
        reference = full_log_softmax(cfg, variables, tokens[b], segments[b])
        n = int(segments[b].sum())
        expected = [reference[t - 1, tokens[b, t]] for t in range(1, n)]
        np.testing.assert_allclose(scores.logp[b, 1:n], expected, atol=2e-5)
        hidden = np.asarray(_forward(cfg)(variables, tokens[b][None]).hidden[0])
        np.testing.assert_allclose(scores.hidden[b, :n, :cfg.d_model], hidden[:n], atol=2e-5)
        assert (scores.hidden[b, :, cfg.d_model:] == 0).all()
    # The other teacher would have given other log-probs: the routing is not vacuous.
    other = full_log_softmax(*models["b"][:2], tokens[0], segments[0])
    assert abs(other[0, tokens[0, 1]] - scores.logp[0, 1]) > 1e-3


def test_tasks_naming_one_checkpoint_share_a_teacher(models, mesh):
    tokens, segments, _, tasks = rows()
    shared = assigned(models["a"][2], models["a"][2])
    teachers = load_teachers(shared, load_tokenizer("arith_chars"), 32, mesh)
    assert len(teachers) == 1 and teachers[0].tasks == ("add", "sub")
    scores = score_rows(teachers, tasks, tokens, segments, TEMPERATURE, mesh)
    np.testing.assert_array_equal(scores.teacher_id, [0, 0, 0, 0, -1])


def test_padded_rows_reach_a_power_of_two_multiple_of_the_data_ways():
    np.testing.assert_array_equal(padded_rows(np.array([4, 7, 9]), 1), [4, 7, 9, 4])
    np.testing.assert_array_equal(padded_rows(np.array([4, 7, 9]), 2), [4, 7, 9, 4])
    assert len(padded_rows(np.arange(5), 2)) == 8 and len(padded_rows(np.arange(8), 8)) == 8


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1024, 3])
def test_full_vocab_kl_from_kept_hidden_states_equals_the_two_full_forwards(models, mesh,
                                                                            chunk):
    tokens, segments, _, tasks = rows()
    teachers = load_teachers(assigned(models["a"][2], models["b"][2]),
                             load_tokenizer("arith_chars"), 32, mesh)
    scores = score_rows(teachers, tasks, tokens, segments, TEMPERATURE, mesh, with_hidden=True)
    cfg, variables, _ = models["student"]
    configs = tuple(t.config for t in teachers)
    heads = tuple(head_params(t.config, t.variables) for t in teachers)

    @jax.jit
    def kl(variables, heads, hidden, teacher_id):
        fn = teacher_log_probs_fn(configs, heads, cfg.vocab_size, TEMPERATURE)
        return token_logprobs(CausalLM(cfg), variables, jnp.asarray(tokens),
                              jnp.asarray(segments), TEMPERATURE, chunk_size=chunk,
                              teacher=(fn, hidden, teacher_id))["reverse_kl"]

    got = np.asarray(kl(variables, heads, scores.hidden, scores.teacher_id))
    for b, task in enumerate(tasks[:4]):
        student = full_log_softmax(cfg, variables, tokens[b], segments[b])
        teacher = full_log_softmax(*models["a" if task == "add" else "b"][:2], tokens[b],
                                   segments[b])[:, :cfg.vocab_size]
        n = int(segments[b].sum())
        want = [(np.exp(student[t - 1]) * (student[t - 1] - teacher[t - 1])).sum()
                for t in range(1, n)]
        np.testing.assert_allclose(got[b, 1:n], want, atol=2e-5)
        assert min(want) > 1e-3  # random models disagree: the comparison is not vacuous


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(models, mesh):
    student = load_tokenizer("arith_chars")
    with pytest.raises(ConfigError) as info:
        load_teachers(assigned(models["a"][2], models["b"][2], tokenizer="default"), student, 32,
                      mesh)
    message = str(info.value)
    assert message.startswith("task.tasks.add.teacher.tokenizer: task add: the teacher's "
                              "tokenizer 'default' (sha256 "), message
    assert "is not the student's 'arith_chars' (sha256 " in message and "\n" not in message


def test_the_same_vocabulary_under_another_name_is_accepted(models, mesh, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(models["a"][2], teacher)
    shutil.copy(SHIPPED["arith_chars"], teacher / "tokenizer.json")  # found by the checkpoint
    [loaded] = load_teachers({"add": (TeacherConfig(str(teacher)), "rl.distill.teacher")},
                             load_tokenizer("arith_chars"), 32, mesh)
    assert loaded.tokenizer.name != "arith_chars" and loaded.tasks == ("add",)


@pytest.mark.slow
def test_a_smaller_teacher_vocabulary_or_no_checkpoint_is_refused(models, mesh, tmp_path):
    small = tiny_model_config("model.vocab_size=24")  # >= the tokenizer's 18 ids, < 32
    save_model_dir(small, random_variables(small, 4), tmp_path / "small")
    student = load_tokenizer("arith_chars")
    with pytest.raises(ConfigError, match=r"^task\.tasks\.sub\.teacher\.checkpoint: task sub: "
                                          r"the teacher's vocab_size 24 is below the student's "
                                          "32"):
        load_teachers(assigned(models["a"][2], tmp_path / "small"), student, 32, mesh)
    with pytest.raises(ConfigError, match=r"^task\.tasks\.add\.teacher\.checkpoint: .*absent "
                                          "does not exist"):
        load_teachers(assigned(tmp_path / "absent", models["b"][2]), student, 32, mesh)
    with pytest.raises(ConfigError, match=r"^task\.tasks\.add\.teacher\.tokenizer: .* holds no "
                                          "tokenizer.json"):
        load_teachers(assigned(models["a"][2], models["b"][2], tokenizer=""), student, 32, mesh)
