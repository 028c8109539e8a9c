"""Hugging Face checkpoints <-> stepjax variables, for every registered family.

    cfg, variables = load_hf_checkpoint("Step-3.5-Flash/")     # streams shard by shard
    save_hf_checkpoint(cfg, variables, "exported/", dtype="bfloat16")

config.json's `model_type` picks the family (`FAMILIES`, model/interop/families.py): its module
translates the config and names every tensor (model/interop/step3p5.py,
model/interop/deepseek_v4.py, model/interop/mimo_v2_flash.py); the checked, streamed reading is
model/interop/hf_stream.py, the safetensors reading and writing is shared
(model/interop/safetensors_io.py), and so is the dequantization of FP8 / MXFP4 releases
(model/interop/quantized.py). A family may give each tensor a second name (DeepSeek-V4's
release): an import uses the names the files hold.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model.config import DTYPES, ModelConfig
from model.interop import quantized
from model.interop.families import checkpoint_family, model_type_of
from model.interop.hf_stream import open_hf_checkpoint
from model.interop.io_errors import os_reason
from model.interop.model_dir import fresh_directory, variable_shardings
from model.interop.qat_json import qat_to_hf
from model.interop.safetensors_io import CheckpointFormatError, write_tensors
from model.interop.tensor_names import Entry, lookup
from model.lm import abstract_variables
from model.tokenizers.chat import write_tokenizer_files
from model.tokenizers.text import TextTokenizer


EXPORT_NAMES = ("transformers", "release")


# ---- import -------------------------------------------------------------------------------------


def load_hf_checkpoint(path: str | Path, mesh: jax.sharding.Mesh | None = None, *,
                       param_dtype: str | None = None,
                       progress: bool = True) -> tuple[ModelConfig, dict]:
    """(ModelConfig, variables) of a Hugging Face directory of a registered family.

    variables = {"params": ..., "balance": ...} as `nn.meta.unbox(init_variables(CausalLM(cfg),
    ...))`, in `param_dtype` (default the config's float32; the router bias stays float32), on
    one device or in the training shardings of `mesh`. Every tensor goes to its devices as it
    is read (`HFSource.pieces`, model/interop/hf_stream.py): a layer of a scanned (stacked)
    variable is written into its slot of a buffer that already lives in the variable's
    sharding, so host memory never holds more than one tensor beyond the open shard. A
    quantized release (FP8 block-wise, MXFP4 experts: `quantized.py`) is dequantized tensor by
    tensor as it streams, through float32 to `param_dtype`. DeepSeek-V4's own release layout
    (its tensor names and config keys) is read as well as transformers'
    (model/interop/deepseek_v4.py). The QAT switches an export recorded (`stepjax_qat`,
    model/interop/qat_json.py) are set again.
    """
    source = open_hf_checkpoint(path, param_dtype=param_dtype)
    shardings = variable_shardings(source.config, mesh)
    variables: dict = {}
    for entry, value in source.pieces(progress):
        leaf = lookup(source.abstract[entry.collection], entry.path)
        sharding = lookup(shardings[entry.collection], entry.path)
        if not entry.index:
            _insert(variables, entry, _place(value, sharding))
            continue
        stacked = lookup(variables.get(entry.collection, {}), entry.path)
        if stacked is None:
            stacked = jnp.zeros(leaf.shape, leaf.dtype, device=sharding)
        slice_sharding = _slice_sharding(sharding, len(entry.index))
        _insert(variables, entry, _write_slice(stacked, _place(value, slice_sharding),
                                               np.asarray(entry.index, np.int32)))
    return source.config, variables


def _place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _slice_sharding(sharding: jax.sharding.Sharding, depth: int) -> jax.sharding.Sharding:
    """Sharding of one slice of a stacked variable (a layer; an expert of a layer): the stacked
    spec without its first `depth` axes."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
            *sharding.spec[depth:]))
    return sharding


@functools.partial(jax.jit, donate_argnums=0)
def _write_slice(stacked: jax.Array, value: jax.Array, index: jax.Array) -> jax.Array:
    """stacked [n_1..n_k, ...] with the slice at leading positions `index` [k] replaced by
    value [...], in place (donated)."""
    depth = stacked.ndim - value.ndim
    start = [index[i] for i in range(depth)] + [0] * value.ndim
    return jax.lax.dynamic_update_slice(stacked, value.reshape((1,) * depth + value.shape), start)


def _insert(tree: dict, entry: Entry, value: Any) -> None:
    node = tree.setdefault(entry.collection, {})
    for part in entry.path[:-1]:
        node = node.setdefault(part, {})
    node[entry.path[-1]] = value


# ---- export -------------------------------------------------------------------------------------


def _check_variables(variables: dict, abstract: dict) -> None:
    """`variables` must have the config's structure and shapes (error names the first misfit)."""
    got = {jax.tree_util.keystr(p): a.shape
           for p, a in jax.tree_util.tree_flatten_with_path(variables)[0]}
    want = {jax.tree_util.keystr(p): a.shape
            for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    for key in sorted(set(got) | set(want)):
        if got.get(key) != want.get(key):
            raise CheckpointFormatError(f"variables{key}: shape {got.get(key)} but the config "
                                        f"expects {want.get(key)} (None = absent)")


def save_hf_checkpoint(config: ModelConfig, variables: dict, path: str | Path, *,
                       model_type: str | None = None, max_shard_bytes: int = 5 * 2**30,
                       dtype: str | None = None, names: str = "transformers",
                       expert_dtype: str | None = None, tokenizer: TextTokenizer | None = None,
                       progress: bool = True) -> None:
    """Writes `path/config.json` and the safetensors shards (`model.safetensors`, or
    `model-0000k-of-0000N.safetensors` + `model.safetensors.index.json`) of family
    `model_type` (default: `model_type_of(config)`), materialising one shard on the host at a
    time. `dtype`: tensor dtype in the files (default: each variable's); the `balance`
    collection (router biases, hash tables) and the tensors the family fixes (DeepSeek-V4's
    float32 norms and mHC, int64 tables; MiMo-V2-Flash's float32 router) keep their dtype, as
    the reference keeps them. `names`: "transformers" (what save_pretrained writes) or
    "release" (the family's own release names: DeepSeek-V4). `expert_dtype` "fp4": the routed
    experts in the MXFP4 layout of DeepSeek-V4's release (`quantized.mxfp4_pack`: the values
    FP4 QAT computes with), announced in config.json as the release does. `config.qat` goes
    into config.json (`qat_json.qat_to_hf`), so an import computes as this model does.
    `tokenizer`: written beside them (tokenizer.json and tokenizer_config.json,
    `write_tokenizer_files`), so the directory is a complete model.
    `path` must be new or empty; on failure nothing is left there.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: got {dtype!r}, allowed values are {list(DTYPES)}")
    model_type = model_type or model_type_of(config)
    family = checkpoint_family(model_type)
    if names not in EXPORT_NAMES:
        raise ValueError(f"names: got {names!r}, allowed values are {list(EXPORT_NAMES)}")
    if names == "release" and family.alternative_name is None:
        raise ValueError("names: 'release' is DeepSeek-V4's own layout; this model exports as "
                         f"{model_type}, whose release uses transformers' names")
    if expert_dtype not in (None, "fp4"):
        raise ValueError(f"expert_dtype: got {expert_dtype!r}, allowed values are [None, 'fp4']")
    if expert_dtype and family.expert_tensors is None:
        raise ValueError(f"expert_dtype: 'fp4' (MXFP4 experts) is DeepSeek-V4's release format; "
                         f"this model exports as {model_type}")
    hf_config = {**family.config_to_hf(config), **qat_to_hf(config)}
    abstract = nn.meta.unbox(abstract_variables(config))
    _check_variables(variables, abstract)
    entries = family.tensor_table(config, abstract)
    rename = family.alternative_name if names == "release" else (lambda name: name)

    def file_dtype(entry: Entry) -> np.dtype:
        if entry.dtype is not None:
            return np.dtype(entry.dtype)
        leaf = lookup(abstract[entry.collection], entry.path)
        return np.dtype(leaf.dtype if dtype is None or entry.collection == "balance" else dtype)

    def values(entry: Entry) -> np.ndarray:
        value = np.asarray(lookup(variables[entry.collection], entry.path)[entry.index])
        return entry.transform.to_hf(value)

    @functools.lru_cache(maxsize=1)  # a weight and its scale are written one after the other
    def packed(entry: Entry) -> tuple[np.ndarray, np.ndarray]:
        return quantized.mxfp4_pack(values(entry).astype(np.float32))

    outputs = []  # (name, bytes, materialise)
    for entry in entries:
        name = rename(entry.name)
        if expert_dtype and re.search(family.expert_tensors, entry.name):
            out, inputs = entry.hf_shape
            scale = f"{name.removesuffix('.weight')}.scale"
            outputs += [(name, out * inputs // 2, lambda e=entry: packed(e)[0]),
                        (scale, out * -(-inputs // 32), lambda e=entry: packed(e)[1])]
        else:
            kind = file_dtype(entry)
            outputs.append((name, math.prod(entry.shape) * kind.itemsize,
                            lambda e=entry, k=kind: np.ascontiguousarray(values(e).astype(k))))

    try:
        with fresh_directory(Path(path)) as staging:
            write_tensors(staging, [o[0] for o in outputs], [o[1] for o in outputs],
                          lambda i: outputs[i][2](), max_shard_bytes=max_shard_bytes,
                          progress=progress)
            hf_config["torch_dtype"] = dtype or config.param_dtype
            if expert_dtype:
                hf_config.update(quantized.MXFP4_EXPORT_KEYS)
            (staging / "config.json").write_text(json.dumps(hf_config, indent=1) + "\n")
            if tokenizer is not None:
                write_tokenizer_files(staging, tokenizer)
    except OSError as err:  # a full disk: the staging directory is gone, `path` untouched
        raise OSError(f"writing {path} failed ({os_reason(err)}); nothing was written there: "
                      "free disk space and re-run") from None
