"""Train/rollout log-probability mismatch on a small MoE, with and without Rollout Routing Replay.

    python -m benchmarks.routing_replay --workdir runs/sft_arith [--rows 256] [--seed 0]

The policy (a training workdir; `make rl` trains `runs/sft_arith`, 16 experts top-4 in four MoE
layers) samples one response to each of `--rows` arithmetic problems through RL's inference
path: KV-cache decoding in bfloat16 (`rl.inference_dtype`) at temperature 1, recording the log
probability of every sampled token (pi_infer) and the experts every token was routed to. The
training path (one full-sequence forward, as pi_old in an RL iteration) then scores the same
tokens in float32 (RL's default) and in bfloat16, routing on its own or replaying the rollout's
experts (`rl.routing_replay`). Per setting, over the response tokens:
- |log pi_train - log pi_infer|: mean, 99th percentile and largest;
- the share of tokens MIS-PO's token filter [0.5, 2] would drop and of trajectories its
  trajectory filter [0.996, 1.001] on the geometric-mean ratio would keep (report 5.2.1, eq. 2);
- routing: the share of (token, MoE layer) pairs, over every token the decoder fed, whose
  training-path experts differ from the rollout's (0 under replay by construction).
Results: benchmarks/results/routing_replay.json and a table on stdout.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, save
from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.layers.router import choices_differ
from model.lm import CausalLM
from model.tokenizers.text import load_tokenizer
from model.weights import load_model
from rl.rollout import collect_rollouts
from train.data.arithmetic import arithmetic_problems, sample_problems

MAX_NEW_TOKENS = 8  # "12+34=46" and the stop token fit


def sample_rollouts(config, variables, rows: int, seed: int):
    tokenizer = load_tokenizer("arith_chars")
    problems = sample_problems(arithmetic_problems(), rows, np.random.default_rng(seed))
    prompts = [tokenizer.encode(p.prompt).tolist() for p in problems]
    length = max(map(len, prompts)) + MAX_NEW_TOKENS
    decoder = Decoder(config.replace(compute_dtype="bfloat16"), variables, max_len=length)
    return collect_rollouts(decoder, prompts, length=length, max_new_tokens=MAX_NEW_TOKENS,
                            sampling=Sampling(1.0), stop_id=tokenizer.eos_id,
                            key=jax.random.key(seed), record_routing=True)


def training_path(config, dtype: str):
    """-> jitted f(variables, tokens, segments, routes [L, B, T, k] or None) = (log-prob of
    each token given the ones before [B, T] (0 at t = 0), the experts used [L, B, T, k])."""
    model = CausalLM(config.replace(compute_dtype=dtype))

    def score(variables, tokens, segments, routes):
        out = model.apply(variables, tokens, segments, num_mtp_heads=0, routed_experts=routes)
        log_probs = jax.nn.log_softmax(out.logits, axis=-1)
        logp = jnp.take_along_axis(log_probs[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.pad(logp, ((0, 0), (1, 0))), out.aux["moe"]["routed_experts"]

    return jax.jit(score)


def mismatch(logp, rollouts, used, recorded) -> dict[str, float]:
    mask = rollouts.mask > 0
    log_ratio = np.where(mask, np.asarray(logp, np.float64) - rollouts.infer_logp, 0.0)
    diff, ratio = np.abs(log_ratio[mask]), np.exp(log_ratio[mask])
    trajectory = np.exp(log_ratio.sum(1) / np.maximum(mask.sum(1), 1))
    fed = recorded[..., 0] >= 0  # [L, B, T]
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    differ = np.asarray(choices_differ(jnp.asarray(flat(np.asarray(used))),
                                       jnp.asarray(flat(recorded)))).reshape(fed.shape)
    return {"abs_logp_diff_mean": float(diff.mean()),
            "abs_logp_diff_p99": float(np.percentile(diff, 99)),
            "abs_logp_diff_max": float(diff.max()),
            "mis_token_drop": float(np.mean((ratio < 0.5) | (ratio > 2.0))),
            "mis_trajectory_keep": float(np.mean((trajectory >= 0.996) & (trajectory <= 1.001))),
            "routing_mismatch": float(differ[fed].mean())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="training workdir of the policy")
    parser.add_argument("--rows", type=int, default=256, help="rollouts (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    config, variables = load_model(args.workdir)
    rollouts = sample_rollouts(config, variables, args.rows, args.seed)
    recorded = np.swapaxes(rollouts.routed_experts, 0, 1)  # [L, B, T, k]
    tokens, segments = jnp.asarray(rollouts.tokens), jnp.asarray(rollouts.segment_ids)
    results = []
    for dtype in ("float32", "bfloat16"):
        score = training_path(config, dtype)
        for replay in (False, True):
            logp, used = score(variables, tokens, segments,
                               jnp.asarray(recorded) if replay else None)
            results.append({"train_dtype": dtype, "routing_replay": replay,
                            **mismatch(logp, rollouts, used, recorded)})
    tokens_scored = int(rollouts.mask.sum())
    headers = ["training path", "R3", "mean |dlogp|", "p99", "max", "MIS-PO tokens dropped",
               "MIS-PO trajectories kept", "routing differs"]
    print(f"{args.rows} rollouts, {tokens_scored} response tokens; inference path bfloat16")
    print(markdown_table(headers, [
        [r["train_dtype"], "on" if r["routing_replay"] else "off",
         f"{r['abs_logp_diff_mean']:.2e}", f"{r['abs_logp_diff_p99']:.2e}",
         f"{r['abs_logp_diff_max']:.2e}", f"{r['mis_token_drop']:.2%}",
         f"{r['mis_trajectory_keep']:.1%}", f"{r['routing_mismatch']:.2%}"] for r in results]))
    path = save("routing_replay", {"workdir": args.workdir, "rows": args.rows, "seed": args.seed,
                                   "response_tokens": tokens_scored, "inference_dtype": "bfloat16",
                                   "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
