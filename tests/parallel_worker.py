"""Runs in a subprocess with 8 CPU devices (tests/test_parallel.py): measures a training step on
several meshes against the same step on one device, and expert-parallel dispatch against the
single-device dispatch. Prints one JSON object; the test asserts on it.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel_worker.py MESH...

MESH: comma-separated axis=size, e.g. `pipeline=2,data=4` (loss and gradients), where
`virtual=V` sets model.pipeline_virtual_stages; prefixed with `step:` to also run the whole train
step with the Muon update (slower to compile); the word `ep_skew` runs the skewed
expert-parallel dispatch check instead, `v4:MESH` the loss and gradients of a tiny DeepSeek-V4
model (W/C/H layers, mHC, hash routing; its two hash-routed W layers form the pipelined segment)
on MESH, `mimo:MESH` those of a tiny MiMo-V2-Flash model (per-type KV heads and head dims, sinks
on SWA layers only; four SWA layers in the pipelined segment).
"""

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from train_helpers import small_mimo_run, small_run, small_v4_run, synthetic_batch  # noqa: E402

from model.layers.moe import routed_experts  # noqa: E402
from model.ops.moe_dispatch import ExpertWeights
from model.ops.swiglu import SwiGLUClamp
from model.parallel.expert_parallel import expert_parallel_experts  # noqa: E402
from model.parallel.rules import named, replicated, use_mesh
from train import step as step_module  # noqa: E402
from train.config import MeshConfig  # noqa: E402
from train.parallel.sharding import batch_spec, make_mesh, state_specs
from train.state import abstract_state, build_training, create_state  # noqa: E402

# Layers: a dense S, then F x 2 with MoE (routed + shared expert): the F segment has 2 repeats,
# one per pipeline stage; the MTP head adds a dense S block outside the pipeline. That is both
# attention types, dense and MoE FFNs and a pipelined segment in two layer kinds; compile time
# grows with the kinds, and a third (S with MoE) would add no case the meshes shard differently.
# The whole-step comparison needs gradient elements well clear of adam_eps, around which Adam's
# first step turns round-off into O(lr) update differences: F+S*2 put an MTP q_norm gradient
# element at 4 eps (parameter error 1.6e-5 > TOLERANCE); S+F*2 stays below 3e-7.
RUN_OVERRIDES = (
    "model.num_layers=3", "model.layout=S+F*2", "model.swiglu_limits=0",
    "model.swiglu_limits_shared=0", "model.mtp.num_heads=1",
    "model.moe.num_ep_groups=2", "train.batch_size=16", "train.muon.iteration_dtype=float32",
    "train.warmup_steps=0",
)
BATCH = synthetic_batch(1, 16, 16, vocab=64, seed=3)
WATCHED = {  # params whose layout the test checks
    "embedding": ("embed_tokens", "embedding"),
    "expert_gate": ("layers", "segment_1", "block_0", "moe", "gate_proj"),
    "q_proj": ("layers", "segment_1", "block_0", "self_attn", "q_proj", "kernel"),
    "dense_up": ("layers", "segment_0", "block_0", "mlp", "up_proj", "kernel"),
}


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


@functools.lru_cache(maxsize=1)
def initial_state():
    """The same initial state for every mesh: created once, placed by device_put."""
    run = small_run(*RUN_OVERRIDES)
    training = build_training(run)
    return jax.jit(lambda: create_state(training.model, training.optimizer, run.train.seed))()


FAMILY_RUNS = {
    "v4": lambda *o: small_v4_run("model.layout=WWCH", "model.moe.hash_layers=2", *o),
    "mimo": small_mimo_run,
}


def parse_mesh(text: str) -> tuple[dict, tuple[str, ...]]:
    """'pipeline=2,data=4,virtual=2' -> ({mesh axis: size}, model overrides)."""
    sizes = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    virtual = sizes.pop("virtual", 1)
    return sizes, (f"model.pipeline_virtual_stages={virtual}",)


def family_loss_and_grads(family: str, mesh_sizes: dict, devices,
                          overrides: tuple = ()) -> tuple[float, list]:
    """Loss and gradients of a tiny DeepSeek-V4 or MiMo-V2-Flash model on a mesh of
    `mesh_sizes`."""
    run = FAMILY_RUNS[family]("train.batch_size=16", "train.seq_len=16",
                              "model.moe.num_ep_groups=2", *overrides)
    training = build_training(run)
    mesh = make_mesh(MeshConfig(**{"data": 1, **mesh_sizes}), devices)
    abstract = abstract_state(training, run.train.seed)
    shardings = named(mesh, state_specs(abstract, training.variable_axes, mesh, run))
    state = jax.jit(lambda: create_state(training.model, training.optimizer, run.train.seed))()

    def loss_and_grads(params, balance, batch):
        counts = step_module.target_counts(run, batch, False)
        micro = jax.tree.map(lambda x: x[0], batch)
        (loss, _), grads = jax.value_and_grad(step_module.loss_fn, argnums=2, has_aux=True)(
            training.model, run, params, balance, micro, False, counts, 1)
        return loss, grads

    with use_mesh(mesh):
        state = jax.device_put(state, shardings)
        batch = {k: jax.device_put(v, NamedSharding(mesh, batch_spec(mesh)))
                 for k, v in BATCH.items()}
        loss, grads = jax.jit(loss_and_grads)(state.params, state.balance, batch)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


def run_step(mesh_sizes: dict, devices, whole_step: bool = True, overrides: tuple = ()) -> dict:
    run = small_run(*RUN_OVERRIDES, *overrides)
    training = build_training(run)
    mesh = make_mesh(MeshConfig(**{"data": 1, **mesh_sizes}), devices)
    abstract = abstract_state(training, run.train.seed)
    shardings = named(mesh, state_specs(abstract, training.variable_axes, mesh, run))
    batch_sharding = NamedSharding(mesh, batch_spec(mesh))
    model = training.model

    def loss_and_grads(params, balance, batch):
        counts = step_module.target_counts(run, batch, False)
        micro = jax.tree.map(lambda x: x[0], batch)
        (loss, (parts, _)), grads = jax.value_and_grad(
            step_module.loss_fn, argnums=2, has_aux=True)(
            model, run, params, balance, micro, False, counts, 1)
        return loss, parts["loss/balance"], grads

    with use_mesh(mesh):
        state = jax.device_put(initial_state(), shardings)
        batch = {k: jax.device_put(v, batch_sharding) for k, v in BATCH.items()}
        loss, balance, grads = jax.jit(loss_and_grads)(state.params, state.balance, batch)
        layouts = {name: {"spec": [_entry(e) for e in _get(state.params, keys).sharding.spec],
                          "shape": list(_get(state.params, keys).shape),
                          "local_shape": list(_get(state.params, keys)
                                              .addressable_shards[0].data.shape)}
                   for name, keys in WATCHED.items()}
        momentum_spec = _muon_momentum_spec(state.opt_state, WATCHED["expert_gate"])
        result = {"loss": float(loss), "balance": float(balance),
                  "grads": [np.asarray(g) for g in jax.tree.leaves(grads)],
                  "layouts": layouts, "momentum_spec": momentum_spec}
        if whole_step:
            step = jax.jit(step_module.make_train_step(training, run),
                           in_shardings=(shardings, batch_sharding, None),
                           out_shardings=(shardings, replicated(mesh)))
            new_state, metrics = step(state, batch, np.bool_(False))
            result.update(step_loss=float(metrics["loss"]),
                          params=[np.asarray(p) for p in jax.tree.leaves(new_state.params)],
                          bubble=float(metrics.get("pipeline/bubble_fraction", 0.0)))
    return result


def _entry(entry):
    return list(entry) if isinstance(entry, tuple) else entry


def _muon_momentum_spec(opt_state, keys):
    """Spec of the Muon momentum of the param at `keys` (ZeRO-1 check)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        names = tuple(str(getattr(k, "key", getattr(k, "name", ""))) for k in path)
        if names[-len(keys):] == keys and "momentum" in names:
            return [_entry(e) for e in leaf.sharding.spec]
    raise KeyError(keys)


def relative_error(got: list, want: list) -> float:
    return max(float(np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-12))
               for g, w in zip(got, want))


def ep_skew() -> dict:
    """Dispatch where most routed copies go to the experts of one device (mesh data=2,
    expert=4): nothing may be dropped and outputs, statistics and gradients must match."""
    rng = np.random.default_rng(0)
    tokens, d_model, hidden, experts, top_k = 64, 8, 16, 8, 2
    x = jnp.asarray(rng.normal(size=(tokens, d_model)), jnp.float32)
    indices = rng.integers(0, experts, size=(tokens, top_k))
    indices[: tokens * 3 // 4] = (0, 1)  # 3/4 of all tokens pick experts 0 and 1 (device 0)
    indices = jnp.asarray(indices, jnp.int32)
    combine = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    weights = ExpertWeights(*(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in (
        (experts, d_model, hidden), (experts, d_model, hidden), (experts, hidden, d_model))))
    options = dict(clamp=SwiGLUClamp(0.0), impl="sorted", block_size=8)

    def reference(x, w):
        return routed_experts(x, indices, combine, w, **options)

    def parallel(x, w, chunk=0):
        return expert_parallel_experts(x, indices, combine, w, collective="padded", chunk=chunk,
                                       **options)

    def chunked(x, w):  # 8 tokens per device, at most 3 at a time: 4 exchanges of 2
        return parallel(x, w, chunk=3)

    def grads(fn):
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w)[0])), argnums=(0, 1))

    mesh = make_mesh(MeshConfig(data=2, expert=4))
    # References jitted too: eagerly, every op would be compiled on its own.
    want_y, want_stats = jax.jit(reference)(x, weights)
    want_grads = jax.tree.leaves(jax.jit(grads(reference))(x, weights))
    with use_mesh(mesh):
        y, stats = jax.jit(parallel)(x, weights)
        got_grads = jax.tree.leaves(jax.jit(grads(parallel))(x, weights))
        chunk_y, chunk_stats = jax.jit(chunked)(x, weights)
        chunk_grads = jax.tree.leaves(jax.jit(grads(chunked))(x, weights))
        ragged_hlo = jax.jit(lambda x, w: expert_parallel_experts(
            x, indices, combine, w, collective="ragged", **options)).lower(x, weights).as_text()
    return {
        "y_error": relative_error([np.asarray(y)], [np.asarray(want_y)]),
        "stats_error": relative_error([np.asarray(stats[k]) for k in sorted(stats)],
                                      [np.asarray(want_stats[k]) for k in sorted(stats)]),
        "grad_error": relative_error([np.asarray(g) for g in got_grads],
                                     [np.asarray(g) for g in want_grads]),
        "chunked_errors": [relative_error([np.asarray(chunk_y)], [np.asarray(want_y)]),
                           relative_error([np.asarray(chunk_stats[k]) for k in sorted(stats)],
                                          [np.asarray(want_stats[k]) for k in sorted(stats)]),
                           relative_error([np.asarray(g) for g in chunk_grads],
                                          [np.asarray(g) for g in want_grads])],
        "copies_computed": float(jnp.sum(stats["expert_tokens"])),
        "copies_routed": int(indices.size),
        "busiest_device_share": float(jnp.sum(stats["expert_tokens"][:2]) / indices.size),
        "ragged_all_to_all_in_hlo": "ragged_all_to_all" in ragged_hlo,
    }


def pallas_on_mesh() -> dict:
    """The Pallas kernels (interpret mode) under a mesh, where they run per shard: flash
    attention on (data=2, tensor=2, expert=2) against the XLA core on one device, and the
    grouped-matmul MoE inside the expert-parallel dispatch against the `sorted` path."""
    from model.ops.tables import ATTENTION
    from model.parallel.mesh import shard_attention_core
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(4, 32, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, 32, 2, 8)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[1, 2]], 4, 0).repeat(16, 1), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    options = dict(window=8, segment_ids=segments, sink=sink)
    want = jax.jit(lambda q, k, v: ATTENTION.resolve("xla")(q, k, v, **options))(q, k, v)
    mesh = make_mesh(MeshConfig(data=2, tensor=2, expert=2))
    with use_mesh(mesh):
        got = jax.jit(lambda q, k, v: shard_attention_core(ATTENTION.resolve("pallas"))(
            q, k, v, **options))(q, k, v)

    tokens, d_model, hidden, experts, top_k = 32, 8, 16, 8, 2
    x = jnp.asarray(rng.normal(size=(tokens, d_model)), jnp.float32)
    indices = jnp.asarray(rng.integers(0, experts, size=(tokens, top_k)), jnp.int32)
    combine = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    weights = ExpertWeights(*(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in (
        (experts, d_model, hidden), (experts, d_model, hidden), (experts, hidden, d_model))))
    no_clamp = SwiGLUClamp(0.0)
    want_y, _ = jax.jit(lambda x, w: routed_experts(x, indices, combine, w, clamp=no_clamp,
                                                    impl="sorted", block_size=8))(x, weights)
    with use_mesh(mesh):
        got_y, _ = jax.jit(lambda x, w: expert_parallel_experts(
            x, indices, combine, w, clamp=no_clamp, impl="pallas", block_size=8,
            collective="padded"))(x, weights)
    return {"attention_error": relative_error([np.asarray(got)], [np.asarray(want)]),
            "moe_error": relative_error([np.asarray(got_y)], [np.asarray(want_y)])}


def pipeline_schedules() -> dict:
    """`pipeline_forward` on a mesh (pipeline=2, data=4) against the repeats applied one after
    another on the whole batch, for uneven GPipe stages and virtual stages with and without an
    empty chunk: outputs, per-repeat aux (summed over micro-batches) and weight gradients.
    The repeats do not commute (tanh of a matmul plus a bias), so a chunk run out of order or
    twice, or a round that skips the queue, shows."""
    from model.parallel.pipeline import StagePlan, pipeline_forward
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(8, 4, 8)), jnp.float32)  # [B, T, D]
    positions = jnp.broadcast_to(jnp.arange(4), (8, 4))

    def repeat_fn(v, h, pos, *_):
        out = jnp.tanh(h @ v["w"]) + v["b"] + 0.01 * pos[..., None]
        return out, {"expert_tokens": jnp.sum(out, axis=(0, 1))}

    def sequential(variables):
        h, aux = x, []
        for r in range(variables["w"].shape[0]):
            h, a = repeat_fn(jax.tree.map(lambda t: t[r], variables), h, positions)
            aux.append(a["expert_tokens"])
        return h, jnp.stack(aux)

    mesh = make_mesh(MeshConfig(pipeline=2, data=4))
    errors = {}
    for repeats, virtual in ((3, 1), (4, 2), (3, 2)):
        variables = {"w": jnp.asarray(rng.normal(size=(repeats, 8, 8)) * 0.5, jnp.float32),
                     "b": jnp.asarray(rng.normal(size=(repeats, 8)), jnp.float32)}
        plan = StagePlan(2, virtual, repeats, 4)

        def piped(variables, plan=plan):
            h, aux = pipeline_forward(repeat_fn, variables, x, (positions, None, None), plan)
            return h, aux["expert_tokens"]

        def outputs_and_grads(fn):  # one program: (h, aux) and the gradient of a loss of both
            def loss(v):
                h, aux = fn(v)
                return jnp.sum(jnp.sin(h)) + jnp.sum(aux), (h, aux)
            return jax.jit(lambda v: jax.grad(loss, has_aux=True)(v))

        want = outputs_and_grads(sequential)(variables)
        with use_mesh(mesh):
            got = outputs_and_grads(piped)(variables)
        errors[f"R={repeats},V={virtual}"] = relative_error(
            [np.asarray(a) for a in jax.tree.leaves(got)],
            [np.asarray(a) for a in jax.tree.leaves(want)])
    return {"pipeline_schedule_errors": errors}


def main(args: list[str]) -> None:
    if args == ["ep_skew"]:
        print(json.dumps({**ep_skew(), **pallas_on_mesh(), **pipeline_schedules()}))
        return
    family = args[0].split(":")[0]
    if family in FAMILY_RUNS:
        want_loss, want_grads = family_loss_and_grads(family, {"data": 1}, jax.devices()[:1])
        results = {}
        for text in args:
            mesh = text.removeprefix(f"{family}:")
            sizes, overrides = parse_mesh(mesh)
            loss, grads = family_loss_and_grads(family, sizes, jax.devices(), overrides)
            results[mesh] = {"loss_error": abs(loss - want_loss) / abs(want_loss),
                             "grad_error": relative_error(grads, want_grads)}
        print(json.dumps(results))
        return
    reference = run_step({"data": 1}, jax.devices()[:1])
    results = {}
    for text in args:
        whole_step = text.startswith("step:")
        mesh = text.removeprefix("step:")
        sizes, overrides = parse_mesh(mesh)
        got = run_step(sizes, jax.devices(), whole_step, overrides)
        results[mesh] = {
            "loss_error": abs(got["loss"] - reference["loss"]) / abs(reference["loss"]),
            "balance_error": abs(got["balance"] - reference["balance"]) / reference["balance"],
            "grad_error": relative_error(got["grads"], reference["grads"]),
            "layouts": got["layouts"], "momentum_spec": got["momentum_spec"],
        }
        if whole_step:
            results[mesh].update(
                step_loss_error=abs(got["step_loss"] - reference["step_loss"])
                / reference["step_loss"],
                param_error=relative_error(got["params"], reference["params"]),
                bubble=got["bubble"])
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
