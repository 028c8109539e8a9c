"""A training run that starts from existing weights: `python -m train --init-from SRC`
(`train.init_from`), the way to fine-tune and to continue a finished run with a new schedule.

SRC is anything `model.weights.load_model` reads: a `python -m train` or `python -m rl` workdir
(its latest checkpoint, or the step `DIR/checkpoints/<step>` names), a stepjax model directory
or a Hugging Face checkpoint. The run takes SRC's params and router biases only; its optimizer
state, step counter, data order and learning-rate schedule start fresh. Before anything is
compiled:

- the run's model must have SRC's parameters, shape for shape: a model that differs is refused
  naming every model field in which it differs (a run YAML without a `model:` section takes
  SRC's model, train/config.py). Fields that keep every shape (RoPE, windows, kernels, dtypes,
  ...) may differ: they are listed in a note;
- SRC's tokenizer (a workdir's record, a directory's tokenizer.json) must be the run's.

A workdir that already holds checkpoints resumes from them and never reads SRC again; since
`train.init_from` is part of the run config saved with every checkpoint, resuming with another
`--init-from`, or with one into a workdir of a run that started otherwise, is refused as any
other config change is (train/config.py, `resume_changes`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax

from model.config import ModelConfig, config_to_dict
from model.interop.workdir import split_checkpoint_step
from model.interop.workdir_record import describe_tokenizer, tokenizer_identity, tokenizer_mismatch
from model.lm import abstract_variables, join_variables, split_variables
from model.tokenizers.text import TextTokenizer, load_tokenizer
from model.weights import load_model_config
from train.resume_fields import RESUMABLE_CHANGES, flatten


class InitFromError(ValueError):
    """SRC cannot start this run; the message is one line naming SRC and the problem."""


@dataclasses.dataclass(frozen=True)
class FieldChange:
    field: str  # dotted, below `model.`
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"model.{self.field} ({self.before} -> {self.after})"


def model_changes(before: ModelConfig, after: ModelConfig) -> tuple[list[FieldChange],
                                                                    list[FieldChange]]:
    """The model fields in which `after` differs from `before`, as (those that change a
    parameter's shape or the set of parameters, those that keep every shape). A field is in the
    first list when it is not known to keep shapes and the two models' parameter shapes differ
    (traced, nothing allocated); implementation switches are in neither."""
    old, new = flatten(config_to_dict(before)), flatten(config_to_dict(after))
    changed = [FieldChange(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and f"model.{k}" not in RESUMABLE_CHANGES]
    if variable_shapes(before) == variable_shapes(after):
        return [], changed
    suspects = [c for c in changed if not keeps_shapes(c.field)]
    kept = [c for c in changed if keeps_shapes(c.field)]
    return (suspects, kept) if suspects else (changed, [])


def keeps_shapes(field: str) -> bool:
    """Model fields (dotted, below `model.`) that never change a parameter's shape."""
    return "rope" in field or field.split(".")[-1] in ("window", "param_dtype")


def variable_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(abstract_variables(config)))[0]
    return {jax.tree_util.keystr(path): leaf.shape for path, leaf in leaves}


def source_model(source: str) -> ModelConfig:
    """The model of `source`, from its config files (InitFromError if it has none)."""
    try:
        return load_model_config(source)
    except (ValueError, OSError, RuntimeError) as err:  # missing, corrupt, unknown family
        raise InitFromError(f"train.init_from: {err}") from None


def source_model_values(source: str) -> dict:
    """The model fields of `source` (a run YAML without a `model:` section takes them)."""
    return config_to_dict(source_model(source))


def check_init_source(source: str, model: ModelConfig, tokenizer: TextTokenizer) -> str | None:
    """Raises InitFromError unless run model `model` and `tokenizer` can start from the weights
    of `source` (config files only: no weights are read). Returns a note naming the model
    fields that differ but keep every shape, or None."""
    changed, kept = model_changes(source_model(source), model)
    if changed:
        raise InitFromError(
            f"train.init_from: this run's model does not have the parameters of {source}; "
            f"fields ({source} -> this run): {', '.join(map(str, changed))}; drop the run "
            f"YAML's model: section to take {source}'s model, or set those fields to its values")
    mismatch = source_tokenizer_mismatch(Path(source), tokenizer)
    if mismatch:
        raise InitFromError(f"train.init_from: {mismatch}; set train.data.tokenizer to it")
    if kept:
        return (f"note: starting from {source} with model.* changes that keep every parameter "
                f"shape: {', '.join(map(str, kept))}")
    return None


def source_tokenizer_mismatch(source: Path, tokenizer: TextTokenizer) -> str | None:
    """None when `tokenizer` is the one `source` was trained with or holds (or it names none),
    else one clause naming both."""
    workdir, _ = split_checkpoint_step(source)
    if (workdir / "checkpoints").is_dir():
        return tokenizer_mismatch(workdir, tokenizer)
    if not (workdir / "tokenizer.json").is_file():
        return None
    theirs = load_tokenizer(str(workdir))
    if theirs.fingerprint() == tokenizer.fingerprint():
        return None
    return (f"tokenizer {describe_tokenizer(tokenizer_identity(tokenizer))} is not the one "
            f"{source} holds, {describe_tokenizer(tokenizer_identity(theirs))}")


def fitted_variables(variables: dict, target: tuple[Any, Any]) -> dict:
    """`variables` {"params", "balance"?} in the dtypes of `target` (the run's (params,
    balance) ShapeDtypeStructs); InitFromError when their tree or a shape differs (recipe
    stages and `train.init_from` check the model before anything is read: the last guard)."""
    got = split_variables(variables)
    if jax.tree.structure(got) != jax.tree.structure(target) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(target))):
        raise InitFromError("the starting weights do not fit this run's model (a different "
                            "shape or set of parameters); only shape-preserving model changes "
                            "can continue from them")
    params, balance = jax.tree.map(lambda v, t: v if v.dtype == t.dtype else v.astype(t.dtype),
                                   got, target)
    return join_variables(params, balance)
