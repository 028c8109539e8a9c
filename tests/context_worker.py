"""Runs in a subprocess with 8 CPU devices (tests/train/test_context_parallel.py): the loss and
gradients of a tiny model with its sequences split over `context` against the same on one
device, and the context layout's exchanges against numpy. Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/context_worker.py FAMILY MESH...

FAMILY: `s35` (Step 3.5: S and F layers, MoE, MTP), `mimo` (MiMo-V2-Flash: sinks, per-type
heads) or `v4` (DeepSeek-V4: W/C/H layers, mHC, hash routing, the MTP layer block); MESH:
comma-separated axis=size, e.g. `pipeline=2,context=2,expert=2`, and optionally
`layout=contiguous|balanced` (model.context_layout). `v4dense` is `v4` with CSA attending
densely (the indexer warm-up's KL over every entry). The word `exchanges` adds the layout
checks (tests/context_exchanges.py).

The batch packs three documents per row with boundaries at odd places (so documents cross the
shard boundaries) and padding at the end; T = 64 (32 for `v4`), so `context=8` gives chunks
shorter than the window (several permute hops) and `context=4` chunks that hold a window.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from parallel_worker import relative_error  # noqa: E402
from train_helpers import small_mimo_run, small_run, small_v4_run  # noqa: E402

from model.parallel.rules import named, use_mesh  # noqa: E402
from train import step as step_module  # noqa: E402
from train.config import MeshConfig  # noqa: E402
from train.parallel.sharding import batch_spec, check_batch_fits, make_mesh, state_specs  # noqa: E402
from train.state import abstract_state, build_training, create_state  # noqa: E402

ROWS = 4  # pipeline=2 x expert=2 needs 2 micro-batches of 2 rows
FAMILIES = {  # run builder, sequence length
    "s35": (lambda *o: small_run("model.num_layers=3", "model.layout=S+F*2",
                                 "model.swiglu_limits=0", "model.swiglu_limits_shared=0",
                                 "model.mtp.num_heads=1", *o), 64),
    "mimo": (small_mimo_run, 64),
    "v4": (lambda *o: small_v4_run("model.layout=WWCH", "model.moe.hash_layers=2", *o), 32),
    # CSA attending to every visible entry, the indexer learning the dense distribution
    "v4dense": (lambda *o: small_v4_run("model.layout=WCHC",
                                        "model.shared_kv_attention.csa_attention=dense", *o), 32),
}


def packed_batch(length: int, vocab: int = 64, seed: int = 0) -> dict:
    """[1, ROWS, length]: three documents per row cut at random places, two padding tokens
    (segment 0) at the end, the first 2 tokens of each document meta."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((ROWS, length), np.int32)
    positions = np.zeros((ROWS, length), np.int32)
    for row in range(ROWS):
        cuts = sorted(rng.choice(np.arange(3, length - 5), 2, replace=False))
        bounds = [0, *cuts, length - 2]
        for doc in range(3):
            segments[row, bounds[doc]:bounds[doc + 1]] = doc + 1
            positions[row, bounds[doc]:bounds[doc + 1]] = np.arange(bounds[doc + 1] - bounds[doc])
    return {"tokens": rng.integers(0, vocab, (1, ROWS, length)).astype(np.int32),
            "segment_ids": segments[None], "positions": positions[None],
            "meta_mask": (positions < 2)[None]}


def loss_and_grads(family: str, sizes: dict, devices, layout: str = "auto"):
    build, length = FAMILIES[family]
    run = build(f"train.batch_size={ROWS}", f"train.seq_len={length}",
                "model.pipeline_microbatches=2", "model.moe.num_ep_groups=2",  # G = mesh.expert
                f"model.context_layout={layout}")
    training = build_training(run)
    mesh = make_mesh(MeshConfig(**{"data": 1, **sizes}), devices)
    check_batch_fits(run, mesh)
    shardings = named(mesh, state_specs(abstract_state(training, run.train.seed),
                                        training.variable_axes, mesh, run))

    def loss_grads(params, balance, batch):
        counts = step_module.target_counts(run, batch, False)
        micro = jax.tree.map(lambda x: x[0], batch)
        (loss, _), grads = jax.value_and_grad(step_module.loss_fn, argnums=2, has_aux=True)(
            training.model, run, params, balance, micro, False, counts, 1)
        return loss, grads

    with use_mesh(mesh):  # the state initialised under the mesh, as the trainer does
        state = jax.jit(lambda: create_state(training.model, training.optimizer,
                                             run.train.seed), out_shardings=shardings)()
        batch = {k: jax.device_put(v, NamedSharding(mesh, batch_spec(mesh)))
                 for k, v in packed_batch(length).items()}
        loss, grads = jax.jit(loss_grads)(state.params, state.balance, batch)
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    return float(loss), {jax.tree_util.keystr(path): np.asarray(g) for path, g in leaves}


def main(args: list[str]) -> None:
    family, meshes = args[0], [a for a in args[1:] if a != "exchanges"]
    results = {}
    if "exchanges" in args:
        from context_exchanges import check_attention_cores, check_exchanges
        results["exchanges"] = check_exchanges()
        results["cores"] = check_attention_cores()
    want_loss, want = loss_and_grads(family, {}, jax.devices()[:1])
    attention = [k for k in want if "self_attn" in k]  # what the exchanges feed
    for text in meshes:
        sizes = dict(item.split("=") for item in text.split(","))
        layout = sizes.pop("layout", "auto")
        loss, got = loss_and_grads(family, {k: int(v) for k, v in sizes.items()}, jax.devices(),
                                   layout)
        results[text] = {"loss_error": abs(loss - want_loss) / abs(want_loss),
                         "grad_error": relative_error(list(got.values()), list(want.values())),
                         "attention_grad_error": relative_error([got[k] for k in attention],
                                                                [want[k] for k in attention])}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
