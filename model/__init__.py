"""stepjax model package: config, Flax modules and model tools (summary, FLOPs)."""

from model.config import ModelConfig, load_config
from model.lm import CausalLM, LMOutput

__all__ = ["ModelConfig", "load_config", "CausalLM", "LMOutput"]
