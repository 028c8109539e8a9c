"""The pieces a family's tensor-name table is made of: how a stored tensor becomes a stepjax
variable (layout transforms), name rules, table entries and where a decoder layer's variables live.

A family module (e.g. model/interop/step3p5.py) lists `Rule`s and turns them into `Entry`s with
`entry`; import and export (model/interop/hf.py) only walk the entries.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from model.config import ModelConfig
from model.interop.safetensors_io import CheckpointFormatError
from model.layers.layer_plan import layer_kinds, plan_segments


@dataclasses.dataclass(frozen=True)
class Same:
    """Stored as-is: norm weights, embeddings, the router bias."""

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(shape)

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array


@dataclasses.dataclass(frozen=True)
class Linear:
    """torch Linear weight [out, in] <-> our kernel [*in, *out] contracting its first `inputs`
    dims: q_proj [H*D, d] <-> [d, H, D]; o_proj (inputs=2) [d, H*D] <-> [H, D, d]."""

    inputs: int = 1

    def hf_shape(self, shape: tuple) -> tuple:
        return (math.prod(shape[self.inputs:]), math.prod(shape[:self.inputs]))

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array.T.reshape(shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.reshape(math.prod(array.shape[:self.inputs]), -1).T


@dataclasses.dataclass(frozen=True)
class Experts:
    """Stacked expert weights [E, out, in] <-> our [E, in, out]."""

    def hf_shape(self, shape: tuple) -> tuple:
        return (shape[0], shape[2], shape[1])

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array.transpose(0, 2, 1)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class Offset:
    """A stepjax norm weight w, applied as (1 + w) (model/layers/norm.py) <-> a checkpoint
    weight applied as `weight * x` (DeepSeek-V4's and MiMo-V2-Flash's RMSNorm): weight = 1 + w,
    in float32."""

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(shape)

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        return array.astype(np.float32) - 1.0

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.astype(np.float32) + 1.0


@dataclasses.dataclass(frozen=True)
class GroupedLinear:
    """Per-group kernels [g, in, out] <-> torch's stacked group weights [g*out, in] (each
    group's [out, in] block in turn; DeepSeek-V4's grouped output projection `wo_a`)."""

    def hf_shape(self, shape: tuple) -> tuple:
        groups, inputs, outputs = shape
        return (groups * outputs, inputs)

    def to_ours(self, array: np.ndarray, shape: tuple) -> np.ndarray:
        groups, inputs, outputs = shape
        return array.reshape(groups, outputs, inputs).transpose(0, 2, 1)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        return array.transpose(0, 2, 1).reshape(-1, array.shape[1])


SAME, LINEAR, OFFSET = Same(), Linear(), Offset()


class Rule(NamedTuple):
    hf: str  # tensor name, relative to its layer prefix
    ours: str  # variable path inside `collection`, relative to the layer's subtree
    transform: Any
    collection: str = "params"
    dtype: str | None = None  # the tensor's dtype in the files whatever the variable's


class Entry(NamedTuple):
    """One checkpoint tensor and the variable (slice) it is."""

    name: str
    collection: str
    path: tuple[str, ...]  # inside the collection
    # Leading positions of the slice: () the whole variable, (r,) slot r along the stacked
    # `layers` axis of a scanned variable, (..., e) expert e of an expert-stacked one.
    index: tuple[int, ...]
    shape: tuple[int, ...]  # our shape of the slice
    transform: Any
    dtype: str | None = None  # fixed dtype in the files (None: the variable's or the export's)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.transform.hf_shape(self.shape)


def lookup(tree: Any, path: Sequence[str]) -> Any:
    """tree[path[0]][path[1]]..., or None where a key is absent."""
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def entry(name: str, rule: Rule, abstract: dict, prefix: tuple = (),
          index: tuple[int, ...] = ()) -> Entry | None:
    """Tensor `name` under `rule` for the variable at `prefix` (its slice at leading positions
    `index`, see `Entry.index`) of `abstract` (unboxed variables or their ShapeDtypeStructs);
    None when the model lacks the variable (g_proj without a head-wise gate, lm_head with tied
    embeddings, ...)."""
    path = (*prefix, *rule.ours.split("/"))
    leaf = lookup(abstract.get(rule.collection, {}), path)
    if leaf is None:
        return None
    shape = tuple(leaf.shape[len(index):])
    return Entry(name, rule.collection, path, tuple(index), shape, rule.transform, rule.dtype)


def layer_slots(cfg: ModelConfig) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Where decoder layer i lives: (subtree path, its `Entry.index` there: () or the slot
    along the stacked axis). Scanned layout as in model/layers/stack.py: layer
    start + r * period + j is slot r of `layers/segment_s/block_j`."""
    if not cfg.scan_layers:
        return [(("layers", f"layer_{i}"), ()) for i in range(cfg.num_layers)]
    slots: list = [None] * cfg.num_layers
    for s, seg in enumerate(plan_segments(layer_kinds(cfg))):
        for r in range(seg.repeats):
            for j in range(seg.period):
                slots[seg.start + r * seg.period + j] = (
                    ("layers", f"segment_{s}", f"block_{j}"), (r,))
    return slots


def layer_entries(cfg: ModelConfig, abstract: dict, block_rules: Sequence[Rule],
                  expert_rules: Sequence[Rule]) -> list[Entry]:
    """The tensors of every decoder layer in checkpoint order: `model.layers.{i}.<rule>` for
    `block_rules`, then on MoE layers routed expert e's slice `model.layers.{i}.<rule with
    {e}>` of the stacked expert variables for `expert_rules`. Rules whose variable a layer
    lacks drop out (the dense FFN of an MoE layer, a gate the config has not, ...)."""
    found = []
    for i, (prefix, index) in enumerate(layer_slots(cfg)):
        layer = f"model.layers.{i}"
        found += [entry(f"{layer}.{rule.hf}", rule, abstract, prefix, index)
                  for rule in block_rules]
        if cfg.is_moe_layer(i):
            found += [entry(f"{layer}.{rule.hf.format(e=e)}", rule, abstract, prefix,
                            (*index, e))
                      for e in range(cfg.moe.num_experts) for rule in expert_rules]
    return [e for e in found if e is not None]


def check_coverage(abstract: dict, entries: Sequence[Entry], family: str) -> None:
    """Every variable (every slice of a stacked one) must have a checkpoint name, or an
    import would leave it unset."""
    covered: dict[tuple, set] = {}
    for e in entries:
        covered.setdefault((e.collection, e.path), set()).add(e.index)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        keys = tuple(str(k.key) for k in path)
        slots = covered.get((keys[0], keys[1:]), set())
        depth = len(next(iter(slots), ()))
        every = set(itertools.product(*(range(n) for n in leaf.shape[:depth])))
        if slots != every:
            raise CheckpointFormatError(f"{'/'.join(keys)}: no {family} checkpoint tensor maps "
                                        "to this variable")
