"""The layer plan (`model.layers.layer_plan`): every layer of the shipped presets and of random
kind sequences covered once and in order by the scan segments, the Step 3.5 motif, and a segment
count that does not grow with depth.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model import load_config
from model.config import expand_layout
from model.layers.layer_plan import layer_kinds, plan_segments

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def assert_valid_plan(kinds, segments):
    """Segments tile 0..L-1 in order exactly once, and each is truly periodic."""
    covered = []
    for seg in segments:
        assert seg.period >= 1 and seg.repeats >= 1
        assert seg.start == len(covered)
        for r in range(seg.repeats):
            for j in range(seg.period):
                assert kinds[seg.start + r * seg.period + j] == kinds[seg.start + j]
        covered.extend(seg.layers)
    assert covered == list(range(len(kinds)))


@pytest.mark.parametrize("preset", ["tiny.yaml", "step35_flash.yaml", "ablation/30b_a3b_S1F1.yaml",
                                    "ablation/30b_a3b_FFFF.yaml", "ablation/100b_a10b_gate.yaml"])
def test_plan_covers_every_layer_once_in_order(preset):
    cfg = load_config(REPO / "configs" / preset)
    kinds = layer_kinds(cfg)
    assert len(kinds) == cfg.num_layers
    for i, kind in enumerate(kinds):
        assert kind.attention_type == cfg.layout[i]
        assert kind.is_moe == cfg.is_moe_layer(i)
        assert kind.limit == cfg.swiglu_limits[i]
        assert kind.shared_limit == cfg.swiglu_limits_shared[i]
    assert_valid_plan(kinds, plan_segments(kinds))


def test_plan_on_random_kind_sequences():
    rng = np.random.default_rng(4)
    for _ in range(300):
        alphabet = rng.integers(1, 4)
        length = int(rng.integers(1, 40))
        if rng.random() < 0.5:  # periodic with noise
            unit = list(rng.integers(0, alphabet, size=int(rng.integers(1, 6))))
            kinds = (unit * 40)[:length]
            for i in rng.integers(0, length, size=int(rng.integers(0, 3))):
                kinds[i] = alphabet
        else:
            kinds = list(rng.integers(0, alphabet, size=length))
        assert_valid_plan(kinds, plan_segments(kinds))


def test_step35_plan_has_few_segments_and_the_40_layer_motif():
    cfg = load_config(REPO / "configs" / "step35_flash.yaml")  # config only: never initialised
    kinds = layer_kinds(cfg)
    segments = plan_segments(kinds)
    assert_valid_plan(kinds, segments)
    assert len(segments) <= 6
    motif = [seg for seg in segments if seg.period * seg.repeats == 40]
    assert len(motif) == 1
    seg = motif[0]
    assert (seg.start, seg.period, seg.repeats) == (3, 4, 10)
    assert "".join(kinds[seg.start + j].attention_type for j in range(seg.period)) == "SFSS"
    assert all(kinds[i].is_moe for i in seg.layers)
    # the clamped last two layers and the three dense layers are outside the motif
    assert set(seg.layers) == set(range(3, 43))


@pytest.mark.parametrize("dense, clamp_last", [(1, False), (1, True), (3, True)])
def test_number_of_segments_does_not_grow_with_depth(dense, clamp_last):
    counts = {}
    for k in range(2, 12):
        layers = 1 + 4 * k
        limits = [0.0] * layers
        if clamp_last:
            limits[-2:] = [7.0, 7.0]
        cfg = load_config(TINY, overrides=[
            f"num_layers={layers}", f"layout=F+SSSF*{k}", f"num_dense_layers={dense}",
            f"swiglu_limits={limits}", f"swiglu_limits_shared={limits}"])
        assert cfg.layout == expand_layout(f"F+SSSF*{k}")
        segments = plan_segments(layer_kinds(cfg))
        assert_valid_plan(layer_kinds(cfg), segments)
        counts[k] = len(segments)
    # compile time follows the number of distinct scan bodies: bounded, not growing with k
    assert max(counts.values()) <= 7, counts
    assert all(counts[k] <= counts[k - 1] for k in range(3, 12)), counts
