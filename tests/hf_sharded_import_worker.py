"""The 8-device half of tests/model/test_load_model.py's sharded-import test, run as a
subprocess (the device count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/hf_sharded_import_worker.py HF_DIR OUT_DIR

Imports the Hugging Face directory HF_DIR without a mesh (the reference) and onto a
data=1 x fsdp=2 x expert=2 x tensor=2 mesh, saves the sharded variables as a model directory in
OUT_DIR and restores that onto the mesh. Every variable of both must equal the reference exactly;
a difference raises naming the variable and the values. Prints one JSON object (what was
compared, how the experts were placed); the test asserts on it.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model.interop.hf import load_hf_checkpoint  # noqa: E402
from model.weights import load_model, save_model_dir  # noqa: E402
from train.config import MeshConfig  # noqa: E402
from train.parallel.sharding import make_mesh  # noqa: E402

EXPERT_KEYS = ("params", "layers", "segment_1", "block_0", "moe", "gate_proj")


def compare(what: str, expected: dict, got: dict) -> int:
    """Raises AssertionError naming the first variable of `got` that differs from `expected` in
    tree structure, shape, dtype or any value; returns the number of variables compared."""
    if jax.tree.structure(got) != jax.tree.structure(expected):
        raise AssertionError(f"{what}: tree structure {jax.tree.structure(got)} != "
                             f"{jax.tree.structure(expected)}")
    count = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                            jax.tree.leaves(got)):
        name = f"{what} {jax.tree_util.keystr(path)}"
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise AssertionError(f"{name}: {b.shape} {b.dtype}, expected {a.shape} {a.dtype}")
        a, b = np.asarray(a), np.asarray(b)  # gathers b's shards
        if not np.array_equal(a, b):
            where = np.argwhere(a != b)
            raise AssertionError(f"{name}: {len(where)} of {a.size} elements differ, first at "
                                 f"{tuple(where[0])}: {b[tuple(where[0])]!r}, expected "
                                 f"{a[tuple(where[0])]!r}")
        count += 1
    return count


def not_named(variables: dict) -> list[str]:
    """Variables not placed with a NamedSharding (the training shardings are all named)."""
    return [jax.tree_util.keystr(path)
            for path, a in jax.tree_util.tree_flatten_with_path(variables)[0]
            if not isinstance(a.sharding, jax.sharding.NamedSharding)]


def main(hf_dir: str, out_dir: str) -> dict:
    reference = load_hf_checkpoint(hf_dir, progress=False)[1]
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
    config, variables = load_hf_checkpoint(hf_dir, mesh, progress=False)
    imported = compare("sharded import", reference, variables)
    save_model_dir(config, variables, Path(out_dir))
    restored = load_model(out_dir, mesh)[1]
    reloaded = compare("model directory restored onto the mesh", reference, restored)
    experts = variables
    for key in EXPERT_KEYS:
        experts = experts[key]
    return {
        "devices": jax.device_count(),
        "compared": {"import": imported, "restored": reloaded},
        "not_named": {"import": not_named(variables), "restored": not_named(restored)},
        "expert_shape": list(experts.shape),
        "expert_spec": [None if s is None else str(s) for s in experts.sharding.spec],
        "expert_shard_shapes": sorted({tuple(s.data.shape) for s in experts.addressable_shards}),
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
