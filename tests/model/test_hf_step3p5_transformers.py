"""What transformers (5.24) makes of stepjax's Step 3.5 export (docs/inference.md, "Step 3.5
Flash in transformers"): `model_type: step3p5` is the text half of its Step 3.7 vision-language
model (`Step3p7TextConfig`), with no causal-LM class of its own, so `AutoModelForCausalLM`
refuses it; `Step3p7ForConditionalGeneration` with the export's config as its `text_config`
loads the export's tensors through transformers' own `step3p7` renaming (no tensor unexpected,
only the vision tower missing) and gives our logits. A random stepjax model (norm offsets and
router biases drawn too, so no mapping hides behind a zero) with every Step 3.5 feature of the
test-size preset: head-wise gate, QK norm, llama3-scaled RoPE on full layers, different head
counts per layer type, sliding window shorter than the sequence, SwiGLU clamps, a shared
expert, MTP heads (transformers skips them)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_step3p5_checkpoint import CFG

from model.interop.hf import save_hf_checkpoint
from model.lm import CausalLM, abstract_variables

pytestmark = pytest.mark.parity
TINY_VISION = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14}  # built by the class, never used for text


def random_variables(seed: int = 0) -> dict:
    """N(0, 0.2^2) weights, N(0, 0.3^2) norm offsets and router biases."""
    rng = np.random.default_rng(seed)

    def drawn(path, leaf):
        names = {str(getattr(p, "key", "")) for p in path}
        scale = 0.3 if "router_bias" in names or any(n.endswith("norm") for n in names) else 0.2
        return jnp.asarray(rng.standard_normal(leaf.shape) * scale, leaf.dtype)

    return jax.tree_util.tree_map_with_path(drawn, nn.meta.unbox(abstract_variables(CFG)))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    variables = random_variables()
    path = tmp_path_factory.mktemp("step3p5") / "hf"
    save_hf_checkpoint(CFG, variables, path, dtype="float32", progress=False)
    return path, variables


def test_auto_model_for_causal_lm_refuses_step3p5(export):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(export[0])
    assert type(config).__name__ == "Step3p7TextConfig" and config.model_type == "step3p5"
    with pytest.raises(ValueError, match="Unrecognized configuration class .*Step3p7TextConfig"):
        AutoModelForCausalLM.from_pretrained(export[0])


def test_the_export_loads_as_the_text_model_of_step3p7_with_our_logits(export):
    import torch
    from transformers import AutoConfig, Step3p7Config, Step3p7ForConditionalGeneration
    from transformers.utils import logging

    path, variables = export
    logging.set_verbosity_error()  # the vision tower's missing tensors, listed one by one
    config = Step3p7Config(text_config=AutoConfig.from_pretrained(path).to_dict(),
                           vision_config=TINY_VISION)
    model, info = Step3p7ForConditionalGeneration.from_pretrained(
        path, config=config, dtype=torch.float32, output_loading_info=True)
    assert info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    missing = {key for key in info["missing_keys"]
               if not key.startswith(("model.vision_model.", "model.multi_modal_projector."))}
    assert missing == set()

    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 24))
    with torch.no_grad():
        theirs = model.eval()(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda v, x: CausalLM(CFG).apply(v, x).logits)(
        variables, jnp.asarray(ids, jnp.int32)))
    error = np.max(np.abs(theirs - ours)) / np.max(np.abs(ours))
    assert error < 1e-5, error
