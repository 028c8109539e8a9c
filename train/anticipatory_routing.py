"""Anticipatory routing (DeepSeek-V4 report 4.2.3): on a detected loss spike, roll back a short
way and train for a while with routing indices computed by the parameters of `delta_steps`
(Δt) steps earlier, then return to standard training.

    train.anticipatory_routing.enabled=true train.anticipatory_routing.delta_steps=2

At step t of an anticipatory window the features are computed with the current parameters
θ_t, the experts of every learned-routing MoE layer with θ_{t-Δt}: a forward pass of the
backbone with θ_{t-Δt} (a copy kept on the devices for each of the last Δt steps) chooses
them, and the training forward replays that choice with the current router's weights
(model/layers/router.py, "Replayed routing"). The report fetches each batch Δt steps early and
routes it then, which needs no parameter copies; the indices are the same. Costs while active:
one more forward pass per step and Δt copies of the parameters; none otherwise.

What the report leaves open, and the choices made here:
- Δt (`delta_steps`, default 2) and the spike rule: a loss above `spike_factor` (1.5) times
  the median of the previous `spike_window` (20) finite losses; non-finite losses are the
  skipped steps of train/state.py, not spikes;
- the rollback goes to the latest checkpoint before the spiking step (`train.checkpoint_every`
  sets how far back); the checkpoints after it and the metrics rows after it are dropped, and
  the data stream resumes from the checkpoint's position, so the window re-trains the same
  batches. Without an earlier checkpoint the window starts at the next step, without rollback;
- the window covers the re-trained steps up to the spike and `active_steps` (100) after it;
  its first Δt steps route with the oldest parameters the window has (θ at its start), as
  nothing older is kept. No spike is looked for inside a window.

Every rollback is recorded in `WORKDIR/anticipatory_routing.json` ({"events": [{spike_step,
loss, median, rollback_to, active_until}]}); a resumed run continues a window it stopped in
(its routing history restarts from the resumed parameters, the one difference from an
uninterrupted run). Metrics: `anticipatory_routing/active` (0 or 1) every step, and while
active `anticipatory_routing/mismatch`, the share of (token, learned-routing layer) pairs
whose top-k under θ_t differs from the replayed choice of θ_{t-Δt}.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from model.config import Config, ConfigError, ModelConfig, check_bool, check_int
from model.interop.atomic_file import write_text_atomically
from model.lm import CausalLM, join_variables

EVENTS_FILE = "anticipatory_routing.json"


@dataclasses.dataclass(frozen=True)
class AnticipatoryRoutingConfig(Config):
    """`train.anticipatory_routing` (module docstring; the report gives none of the values)."""

    section = "train.anticipatory_routing"

    enabled: bool = False
    delta_steps: int = 2  # Δt: routing parameters this many steps old
    spike_factor: float = 1.5  # a spike: loss > spike_factor * median of the window
    spike_window: int = 20  # finite losses whose median is the baseline
    active_steps: int = 100  # steps with anticipatory routing after the spiking one

    def validate(self) -> None:
        check_bool("enabled", self.enabled)
        for name in ("delta_steps", "spike_window", "active_steps"):
            check_int(name, getattr(self, name), 1)
        if isinstance(self.spike_factor, bool) or not isinstance(self.spike_factor, (int, float)) \
                or not self.spike_factor > 1:
            raise ConfigError("spike_factor", f"must be a number > 1, got {self.spike_factor!r}")


def check_anticipatory_routing(model: ModelConfig, pipeline: int) -> None:
    """Anticipatory routing replays an expert choice: it needs learned-routing MoE layers and
    whole layers (`pipeline`: the mesh's pipeline axis, 1)."""
    if all(model.is_hash_layer(i) for i in model.moe_layer_indices()):
        raise ValueError("train.anticipatory_routing: the model has no MoE layer with learned "
                         "routing; set train.anticipatory_routing.enabled=false")
    if pipeline != 1:
        raise ValueError("train.anticipatory_routing: replayed routing needs whole layers; "
                         "use mesh.pipeline=1")


class SpikeDetector:
    """Loss spikes: a loss above `factor` times the median of the previous `window` finite
    losses (a full window needed)."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.losses = collections.deque(maxlen=window)

    def median(self) -> float:
        return float(np.median(self.losses))

    def is_spike(self, loss: float) -> bool:
        """Whether `loss` spikes; a loss that does not enters the window."""
        if not math.isfinite(loss):
            return False
        if len(self.losses) == self.losses.maxlen and loss > self.factor * self.median():
            return True
        self.losses.append(loss)
        return False

    def reset(self) -> None:
        self.losses.clear()


class RoutingHistory:
    """Copies of the (params, balance) of the last `delta_steps` steps of a window: the
    routing parameters of step t are those of step t - Δt, or the window's oldest."""

    def __init__(self, delta_steps: int):
        self.kept = collections.deque(maxlen=delta_steps)

    def routing_variables(self, variables):
        """The routing variables for the step whose own are `variables`; keeps a copy of
        those for the steps to come."""
        routing = self.kept[0] if self.kept else variables
        self.kept.append(jax.tree.map(jnp.copy, variables))  # drops the oldest when full
        return routing

    def clear(self) -> None:
        self.kept.clear()


def routes_function(model: CausalLM, batch_sharding):
    """-> jitted f(params, balance, batch) = the experts every MoE layer chooses for each
    micro-batch, [num_micro, micro, L_moe, T, k], laid out like the batch's arrays (rows
    second, `batch_sharding`)."""
    def routes(params, balance, batch):
        def one(micro):
            out = model.apply(join_variables(params, balance), micro["tokens"],
                              micro["segment_ids"], micro["positions"], compute_logits=False,
                              num_mtp_heads=0)
            return jnp.swapaxes(out.aux["moe"]["routed_experts"], 0, 1)

        return jax.lax.map(one, {k: batch[k] for k in ("tokens", "segment_ids", "positions")})

    return jax.jit(routes, out_shardings=batch_sharding)


class AnticipatoryRouting:
    """The switch of one run: spike detection, windows, routing history (module docstring)."""

    def __init__(self, config: AnticipatoryRoutingConfig, model: CausalLM, batch_sharding,
                 workdir: Path, write: bool):
        self.config, self.path, self.write = config, Path(workdir) / EVENTS_FILE, write
        self.detector = SpikeDetector(config.spike_factor, config.spike_window)
        self.history = RoutingHistory(config.delta_steps)
        self.routes = routes_function(model, batch_sharding)
        self.events = (json.loads(self.path.read_text())["events"] if self.path.is_file()
                       else [])

    def active(self, step: int) -> bool:
        return any(e["rollback_to"] <= step < e["active_until"] for e in self.events)

    def prepare(self, step: int, state, batch: dict) -> dict:
        """The batch of `step` with `routed_experts` of θ_{step-Δt} inside a window."""
        if not self.active(step):
            self.history.clear()
            return batch
        params, balance = self.history.routing_variables((state.params, state.balance))
        return {**batch, "routed_experts": self.routes(params, balance, batch)}

    def is_spike(self, step: int, loss: float) -> bool:
        return not self.active(step) and self.detector.is_spike(loss)

    def start_window(self, spike_step: int, loss: float, rollback_to: int) -> dict:
        """Records the rollback of a spike at `spike_step` to `rollback_to` -> the event."""
        event = {"spike_step": spike_step, "loss": loss, "median": self.detector.median(),
                 "rollback_to": rollback_to,
                 "active_until": spike_step + 1 + self.config.active_steps}
        self.events = [e for e in self.events if e["rollback_to"] < rollback_to] + [event]
        if self.write:
            write_text_atomically(self.path, json.dumps({"events": self.events}, indent=1))
        self.detector.reset()
        self.history.clear()
        return event

    def metrics(self, step: int) -> dict[str, float]:
        return {"anticipatory_routing/active": float(self.active(step))}
