"""Groups the layer list into scannable segments so compile time does not grow with depth.

A layer's *kind* is everything that changes its parameter shapes or static behaviour:
(attention type, MoE or dense, routed clamp, shared clamp, hash-routed). Consecutive layers are split
greedily into segments `(start, period, repeats)`: the `period` kinds starting at `start` repeat
`repeats` times. Step 3.5 Flash (F SSS F ...; 3 dense layers) becomes
[F-dense], [S-dense]x2, [S F S S]-MoE x10, ... and each segment is one `nn.scan`.
"""

from typing import NamedTuple

from model.config import ModelConfig

MAX_PERIOD = 8


class LayerKind(NamedTuple):
    attention_type: str
    is_moe: bool
    limit: float
    shared_limit: float
    is_hash: bool


class Segment(NamedTuple):
    start: int
    period: int
    repeats: int

    @property
    def layers(self) -> range:
        return range(self.start, self.start + self.period * self.repeats)


def layer_kinds(cfg: ModelConfig) -> list[LayerKind]:
    return [
        LayerKind(cfg.attention_type(i), cfg.is_moe_layer(i), cfg.swiglu_limits[i],
                  cfg.swiglu_limits_shared[i], cfg.is_hash_layer(i))
        for i in range(cfg.num_layers)
    ]


def plan_segments(kinds: list) -> list[Segment]:
    """Greedy cover of `kinds` by runs of a repeated unit (longest coverage, then shortest unit)."""
    segments, start = [], 0
    while start < len(kinds):
        best = Segment(start, 1, 1)
        for period in range(1, MAX_PERIOD + 1):
            unit = kinds[start:start + period]
            if len(unit) < period:
                break
            repeats = 1
            while kinds[start + repeats * period:start + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats > 1 and period * repeats > best.period * best.repeats:
                best = Segment(start, period, repeats)
        segments.append(best)
        start += best.period * best.repeats
    return segments
