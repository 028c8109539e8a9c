"""Group-limited routing (DeepSeek-V3's, as MiMo-V2-Flash's release configures it):
`moe.num_groups` contiguous expert groups, a group scores the sum of its two highest biased
scores, and the top-k is taken within the best `moe.topk_groups` groups. Against a float64
numpy loop written here (nothing from `model/`) and a hand-worked case."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from moe_references import assert_routes_equal, np_sigmoid, np_softmax, routes_of

from model.config import MoEConfig
from model.layers.router import limit_to_groups, route


def np_scores(logits, activation):
    if activation == "sigmoid":
        return np_sigmoid(logits)
    if activation == "softmax":
        return np_softmax(logits)
    return np.sqrt(np.log1p(np.exp(logits)))  # sqrt_softplus


def np_group_route(logits, bias, top_k, num_groups, topk_groups, activation, scale):
    """Per token: group score = sum of the (up to) two largest biased scores of its experts;
    the best `topk_groups` groups stay; top-k of the biased scores among their experts; combine
    weights = the unbiased scores of the chosen, renormalised, times `scale`."""
    logits = np.asarray(logits, np.float64)
    scores = np_scores(logits, activation)
    selection = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    num_experts = logits.shape[1]
    size = num_experts // num_groups
    routes, kept_groups = [], []
    for n in range(logits.shape[0]):
        group_score = []
        for g in range(num_groups):
            members = sorted((selection[n, e] for e in range(g * size, (g + 1) * size)),
                             reverse=True)
            group_score.append(sum(members[:2]))
        kept = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        candidates = [e for e in range(num_experts) if e // size in kept]
        chosen = sorted(candidates, key=lambda e: -selection[n, e])[:top_k]
        weights = np.array([scores[n, e] for e in chosen])
        weights = weights / weights.sum()
        routes.append({e: w * scale for e, w in zip(chosen, weights)})
        kept_groups.append(set(kept))
    return routes, kept_groups


CASES = [  # (experts, groups, kept groups, top_k, activation, with bias)
    (16, 4, 2, 4, "sigmoid", True),
    (16, 8, 3, 4, "sigmoid", True),  # groups of 2: the group score is the sum of both
    (8, 8, 4, 3, "sigmoid", True),  # groups of 1: the group score is the expert's own
    (12, 6, 2, 3, "sigmoid", True),
    (12, 3, 1, 2, "softmax", False),
    (16, 4, 2, 5, "sqrt_softplus", True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_route_with_groups_matches_numpy_loop(case):
    experts, groups, kept, top_k, activation, with_bias = case
    rng = np.random.default_rng(experts * groups + top_k)
    logits = rng.normal(size=(64, experts)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=experts).astype(np.float32) if with_bias else None
    cfg = MoEConfig(num_experts=experts, top_k=top_k, router_activation=activation,
                    routed_scaling_factor=2.5, num_ep_groups=1, num_groups=groups,
                    topk_groups=kept)
    routing = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), cfg)
    expected, _ = np_group_route(logits, bias, top_k, groups, kept, activation, 2.5)
    assert_routes_equal(routes_of(routing.indices, routing.weights), expected)
    # Control: the group limit changes some tokens' experts, so the check above can fail
    # (except with groups of one expert, where the best top_k <= kept groups hold the top-k).
    unlimited, _ = np_group_route(logits, bias, top_k, groups, groups, activation, 2.5)
    assert any(set(a) != set(b) for a, b in zip(expected, unlimited)) == (experts > groups)


@pytest.mark.parametrize("experts,groups,kept", [(16, 4, 2), (16, 8, 3), (8, 8, 1)])
def test_limit_to_groups_masks_exactly_the_other_groups(experts, groups, kept):
    """Experts of the kept groups keep their selection score, all others become -inf."""
    rng = np.random.default_rng(experts + groups)
    selection = rng.normal(size=(32, experts)).astype(np.float32)
    got = np.asarray(limit_to_groups(jnp.asarray(selection), groups, kept))
    _, kept_groups = np_group_route(np.zeros_like(selection), selection, experts // groups * kept,
                                    groups, kept, "sigmoid", 1.0)
    # np_group_route's selection is sigmoid(0) + bias: the same order as `selection` itself.
    size = experts // groups
    for n in range(len(selection)):
        for e in range(experts):
            if e // size in kept_groups[n]:
                assert got[n, e] == selection[n, e]
            else:
                assert got[n, e] == -np.inf


def test_group_score_is_the_sum_of_the_two_best():
    """Hand-worked: scores group 0 = (0.9, 0.1), group 1 = (0.6, 0.55); one group kept, top-1.
    By the best expert group 0 would win; by the sum of the top two (1.0 < 1.15) group 1 does,
    so expert 2 is chosen, with weight 1 (renormalised) * the scaling factor. A bias of +0.2 on
    expert 1 lifts group 0 to 1.2: expert 0 is chosen, with its unbiased score renormalised."""
    scores = np.array([[0.9, 0.1, 0.6, 0.55]])
    logits = jnp.asarray(np.log(scores / (1 - scores)), jnp.float32)  # sigmoid^-1
    cfg = MoEConfig(num_experts=4, top_k=1, routed_scaling_factor=3.0, num_ep_groups=1,
                    num_groups=2, topk_groups=1)
    routing = route(logits, jnp.zeros(4), cfg)
    assert routes_of(routing.indices, routing.weights)[0] == pytest.approx({2: 3.0})
    routing = route(logits, jnp.array([0.0, 0.2, 0.0, 0.0]), cfg)
    assert routes_of(routing.indices, routing.weights)[0] == pytest.approx({0: 3.0})
    # No limit: expert 0 (the best score) whatever the groups.
    unlimited = MoEConfig(num_experts=4, top_k=1, routed_scaling_factor=3.0, num_ep_groups=1)
    routing = route(logits, jnp.zeros(4), unlimited)
    assert routes_of(routing.indices, routing.weights)[0] == pytest.approx({0: 3.0})
