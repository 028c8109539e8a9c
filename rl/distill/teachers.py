"""Distillation teachers: loading, routing each sampled row to its task's teacher, and scoring.

    teachers = load_teachers(task_teachers(rl.distill, run.task.tasks), tokenizer, vocab, mesh)
    scores = score_rows(teachers, drawn.tasks, tokens, segment_ids, rl.temperature)
    scores.logp, scores.teacher_id                 # [B, T] log pi_teacher(y_t), [B] (-1: none)

A teacher is any checkpoint `model.weights.load_model` reads, of any architecture family, but it
must read the student's token ids as the student does: its tokenizer's vocabulary (token -> id,
compared by fingerprint, not by name) must be the student's, and its `vocab_size` at least the
student's (a larger one, the same tokenizer rounded up further, is fine). Tasks naming the same
checkpoint and tokenizer share one loaded teacher. Teachers are frozen and are not part of the
RL state: a resumed run reloads them from the config.

Scoring (MOPD's "teacher pass", MiMo-V2-Flash 1.7): one full forward of the teacher over the
student's sampled rows of its tasks only, giving log pi_teacher of every sampled token at the
rollout temperature, the training path's `token_logprobs` (rl/models.py) with the teacher's
weights. It runs under the RL mesh, rows over the data-parallel axes (a teacher's rows are padded
with repeats to a power-of-two multiple of the data-parallel size, so few shapes compile) and
the teacher's params replicated on every device: the teachers here are small, and a large one
would take the model's sharding rules instead (`load_model(path, mesh)`). One jitted scorer per
teacher architecture, shared by the teachers of one architecture.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model.config import ConfigError, ModelConfig
from model.interop.workdir_record import describe_tokenizer, tokenizer_identity
from model.lm import CausalLM
from model.parallel.rules import replicated
from model.tokenizers.text import TextTokenizer
from model.weights import checkpoint_tokenizer, load_model
from rl.distill.config import TeacherConfig
from rl.models import token_logprobs
from rl.parallel import row_sharding, sharded_jit
from train.parallel.sharding import data_parallel_size


@dataclasses.dataclass
class Teacher:
    checkpoint: str
    config: ModelConfig
    variables: dict  # replicated over the mesh
    tokenizer: TextTokenizer
    tasks: tuple[str, ...]  # the tasks whose rows it scores


@dataclasses.dataclass
class TeacherScores:
    logp: np.ndarray  # float32 [B, T]: log pi_teacher(y_t | y_<t) at token t, 0 off its rows
    teacher_id: np.ndarray  # int32 [B]: index of each row's teacher, -1 for none
    hidden: np.ndarray | None  # float32 [B, T, D_max]: final normed hidden states (full_vocab)

    @property
    def rows(self) -> np.ndarray:
        return self.teacher_id >= 0


def load_teachers(assigned: dict[str, tuple[TeacherConfig, str]], tokenizer: TextTokenizer,
                  vocab_size: int, mesh: Mesh) -> list[Teacher]:
    """One `Teacher` per distinct (checkpoint, tokenizer) of `assigned` ({task: (teacher,
    the config field naming it)}, `rl.distill.config.task_teachers`), checked against the
    student's tokenizer and `vocab_size`; errors are ConfigErrors naming that field."""
    teachers: dict[tuple[str, str], Teacher] = {}
    for task, (config, where) in assigned.items():
        key = (config.checkpoint, config.tokenizer)
        if key not in teachers:
            teachers[key] = _load_teacher(config, where, task, tokenizer, vocab_size, mesh)
        else:
            teachers[key].tasks += (task,)
    return list(teachers.values())


def _load_teacher(config: TeacherConfig, where: str, task: str, student: TextTokenizer,
                  vocab_size: int, mesh: Mesh) -> Teacher:
    try:
        model, variables = load_model(config.checkpoint)
        tokenizer = checkpoint_tokenizer(Path(config.checkpoint), config.tokenizer)
    except ConfigError as err:
        raise err.within(where) from None
    except ValueError as err:  # load_model: not a checkpoint
        raise ConfigError("checkpoint", str(err)).within(where) from None
    if tokenizer.fingerprint() != student.fingerprint():
        raise ConfigError("tokenizer", f"task {task}: the teacher's tokenizer "
                          f"{describe_tokenizer(tokenizer_identity(tokenizer))} is not the "
                          f"student's {describe_tokenizer(tokenizer_identity(student))} "
                          "(rl.tokenizer): a teacher must read the student's token ids"
                          ).within(where)
    if model.vocab_size < vocab_size:
        raise ConfigError("checkpoint", f"task {task}: the teacher's vocab_size "
                          f"{model.vocab_size} is below the student's {vocab_size}; the "
                          "student's extra ids would have no teacher probability").within(where)
    return Teacher(config.checkpoint, model, jax.device_put(variables, replicated(mesh)),
                   tokenizer, (task,))


def teacher_scores(model: CausalLM, variables, tokens, segment_ids, temperature: float,
                   with_hidden: bool):
    """tokens, segment_ids [b, T] -> {"logp": [b, T]} (the training path's log-probs,
    rl/models.py, under the teacher's weights), plus "hidden" [b, T, D] float32, the final
    normed hidden states, if `with_hidden`."""
    out = {"logp": token_logprobs(model, variables, tokens, segment_ids, temperature)["logp"]}
    if with_hidden:
        out["hidden"] = model.apply(variables, tokens, segment_ids, compute_logits=False,
                                    num_mtp_heads=0).hidden.astype(jnp.float32)
    return out


@functools.cache
def _scorer(config: ModelConfig, temperature: float, with_hidden: bool, mesh: Mesh):
    """`teacher_scores` of one architecture, jitted under the mesh (rows over the data axes,
    params replicated)."""
    rows = row_sharding(mesh)
    return sharded_jit(functools.partial(teacher_scores, CausalLM(config),
                                         temperature=temperature, with_hidden=with_hidden),
                       (replicated(mesh), rows, rows), rows)


def padded_rows(rows: np.ndarray, ways: int) -> np.ndarray:
    """`rows` (int [n], n >= 1) repeated at the end up to `ways` * a power of two rows."""
    blocks = 1 << int(np.ceil(np.log2(-(-len(rows) // ways))))
    return np.concatenate([rows, np.full(blocks * ways - len(rows), rows[0])])


def score_rows(teachers: list[Teacher], tasks: np.ndarray, tokens: np.ndarray,
               segment_ids: np.ndarray, temperature: float, mesh: Mesh,
               with_hidden: bool = False) -> TeacherScores:
    """Each teacher scores the rows of its tasks (`tasks` str [B], each row's task) and nothing
    else: tokens, segment_ids int [B, T] -> TeacherScores."""
    batch, length = tokens.shape
    logp = np.zeros((batch, length), np.float32)
    teacher_id = np.full(batch, -1, np.int32)
    width = max(t.config.d_model for t in teachers)
    hidden = np.zeros((batch, length, width), np.float32) if with_hidden else None
    ways = data_parallel_size(mesh)
    for index, teacher in enumerate(teachers):
        rows = np.flatnonzero(np.isin(tasks, teacher.tasks))
        if not len(rows):
            continue
        padded = padded_rows(rows, ways)
        out = _scorer(teacher.config, temperature, with_hidden, mesh)(
            teacher.variables, tokens[padded], segment_ids[padded])
        logp[rows] = np.asarray(out["logp"])[:len(rows)]
        teacher_id[rows] = index
        if with_hidden:
            hidden[rows, :, :teacher.config.d_model] = np.asarray(out["hidden"])[:len(rows)]
    return TeacherScores(logp, teacher_id, hidden)
