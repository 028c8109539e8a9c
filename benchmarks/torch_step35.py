"""The torch side of `benchmarks.vs_torch`: Hugging Face transformers' Step 3.5 text model
(`step3p5`, implemented in `transformers.models.step3p7`) on a published-layout checkpoint,
its fwd+bwd step and the per-module replays of the breakdown. torch and transformers are
imported here only (`pip install -e '.[parity]'`, which `make` installs)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

def torch_text_model(path: Path):
    """transformers' Step 3.5 text model + the checkpoint's `lm_head.weight`, float32. The
    published tensor names (`moe.*`, `share_expert.*`) are mapped onto transformers' module
    names (`mlp.gate`, `mlp.experts.gate_up_proj` = [gate; up] stacked on the output axis)."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    tensors = {name: t.float() for name, t in tensors.items()}
    lm_head = tensors.pop("lm_head.weight")
    state = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        match = re.match(r"layers\.(\d+)\.(moe|share_expert)\.(.*)", name)
        if not match:
            state[name] = t
            continue
        layer, module, rest = match.groups()
        prefix = f"layers.{layer}.mlp."
        if module == "share_expert":
            state[prefix + "shared_experts." + rest] = t
        elif rest == "gate.weight":
            state[prefix + "gate.weight"] = t
        elif rest == "router_bias":
            state[prefix + "gate.e_score_correction_bias"] = t
        elif rest == "down_proj.weight":
            state[prefix + "experts.down_proj"] = t
        elif rest == "gate_proj.weight":
            up = tensors[f"model.layers.{layer}.moe.up_proj.weight"]
            state[prefix + "experts.gate_up_proj"] = torch.cat([t, up], dim=1)
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    model = Step3p7TextModel(config).float()
    model.load_state_dict(state, strict=True)
    return model, lm_head.requires_grad_(True)


def torch_loss_and_grad(model, lm_head, tokens: np.ndarray, compile_it: bool):
    ids = torch.from_numpy(tokens).long()

    def loss_and_backward():
        logits = model(input_ids=ids, use_cache=False).last_hidden_state @ lm_head.T
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        return loss

    run = torch.compile(loss_and_backward) if compile_it else loss_and_backward

    def step():
        model.zero_grad(set_to_none=True)
        lm_head.grad = None
        return float(run().detach())

    return step


def torch_module_steps(model, lm_head, tokens: np.ndarray, modules: list[tuple[str, int | None]]
                       ) -> dict:
    """name -> (fwd+bwd closure, its input activation as numpy) for each (name, layer) of
    `modules`: layer i's `self_attn` for names starting with "attention", its `mlp` (dense FFN
    or MoE block) otherwise, the LM head + cross-entropy for layer None. Each module is replayed
    on the inputs it saw inside a full forward pass (captured with forward pre-hooks)."""
    captured = {}
    hooks = []
    for name, layer in modules:
        if layer is None:
            continue
        module = model.layers[layer].self_attn if name.startswith("attention") else (
            model.layers[layer].mlp)

        def capture(mod, args, kwargs, name=name):
            captured.setdefault(name, (mod, args, kwargs))

        hooks.append(module.register_forward_pre_hook(capture, with_kwargs=True))
    ids = torch.from_numpy(tokens).long()
    with torch.no_grad():
        final_hidden = model(input_ids=ids, use_cache=False).last_hidden_state
        captured["LM head + cross-entropy"] = (None, (final_hidden,), {})
    for hook in hooks:
        hook.remove()

    steps = {}
    for name, (module, args, kwargs) in captured.items():
        kwargs = dict(kwargs)
        x = (args[0] if args else kwargs.pop("hidden_states")).detach().clone()
        rest = args[1:]

        def step(module=module, x=x, rest=rest, kwargs=kwargs):
            x = x.requires_grad_(True)
            if module is None:
                lm_head.grad = None
                logits = x @ lm_head.T
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
                loss.backward()
                return
            module.zero_grad(set_to_none=True)
            out = module(x, *rest, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))

        steps[name] = (step, x.numpy())
    return steps
