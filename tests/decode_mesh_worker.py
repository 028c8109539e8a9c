"""The 8-device half of tests/model/test_generate_mesh.py, run as a subprocess (the device count
is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/decode_mesh_worker.py MODEL_DIR TOKENIZER PROMPT_FILE MESH [MESH ...]

Runs `python -m model.generate --json` (greedy, in this process) on MODEL_DIR once on one device
(`--prompt-file PROMPT_FILE`) and once per MESH (`--prompt` with the file's text, `--mesh MESH`:
the parameters loaded straight into that sharding), and prints
one JSON object: the device count, the single-device output and each mesh's, with where the
routed experts and the query heads of the first MoE layer were placed.
"""

import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
from flax.traverse_util import flatten_dict  # noqa: E402

from model.generate import main  # noqa: E402
from model.parallel.device_mesh import decode_mesh  # noqa: E402
from model.weights import load_model  # noqa: E402


def generate(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    assert code == 0, f"generate {args} exited {code}"
    return json.loads(out.getvalue())


def placement(model_dir: str, mesh_text: str) -> dict:
    """The sharding specs load_model gives the first routed-expert and query-projection
    variables on `mesh_text`."""
    _, variables = load_model(model_dir, decode_mesh(mesh_text))
    specs = {}
    for path, leaf in flatten_dict(variables["params"]).items():
        kind = ("experts" if path[-2:] == ("moe", "gate_proj") else
                "q_proj" if path[-3:] == ("self_attn", "q_proj", "kernel") else None)
        if kind and kind not in specs:
            specs[kind] = [None if s is None else str(s) for s in leaf.sharding.spec]
    return specs


def run(model_dir: str, tokenizer: str, prompt_file: str, *meshes: str) -> dict:
    """One device reads the prompt with --prompt-file, the meshes get it as --prompt."""
    common = ["--workdir", model_dir, "--tokenizer", tokenizer, "--max-new-tokens", "12",
              "--json"]
    prompt = Path(prompt_file).read_text()
    return {"devices": jax.device_count(),
            "single": generate(*common, "--prompt-file", prompt_file),
            "meshes": {mesh: generate(*common, "--prompt", prompt, "--mesh", mesh)
                       for mesh in meshes},
            "placement": {mesh: placement(model_dir, mesh) for mesh in meshes}}


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:])))
