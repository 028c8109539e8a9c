"""lm-evaluation-harness on stepjax models (model/inference/harness.py, `python -m train.lm_eval`),
offline, on the local tasks of tests/lm_eval_tasks (multiple choice, rolling log-likelihood,
greedy generation). The external reference is lm-eval's own Hugging Face backend (`HFLM`,
transformers' MiMoV2FlashForCausalLM in float32) on the same checkpoint: one random tiny
MiMo-V2-Flash model exported with `save_hf_checkpoint` and the shipped BPE, which both sides
load. Every sample's log-likelihood agrees to float32 noise and every generation is the same
text; scoring and generation run in several prefill chunks."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# lm-eval must never reach the network; `datasets` reads these when it is first imported.
os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_DATASETS_CACHE",
                      str(Path(tempfile.gettempdir()) / f"stepjax-test-hf-datasets-{os.getuid()}"))

from model.config import config_from_dict  # noqa: E402
from model.inference.decode import Decoder  # noqa: E402
from model.interop.hf import save_hf_checkpoint  # noqa: E402
from model.lm import abstract_variables  # noqa: E402
from model.tokenizers.text import load_tokenizer  # noqa: E402
from model.weights import load_model  # noqa: E402
from train.lm_eval import evaluate_tasks, main, task_manager, task_metrics  # noqa: E402

pytestmark = pytest.mark.lm_eval  # the `eval` extra (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = "tests/lm_eval_tasks"  # its YAMLs name their data relative to the repository
TASKS = ["stepjax_python_choice", "stepjax_python_rolling", "stepjax_python_generate"]
# Both backends see the same window; chunks of 16 make scoring and prefill take several passes.
MAX_LENGTH, BATCH, CHUNK = 64, 4, 16


@pytest.fixture(autouse=True)
def in_repository(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A random tiny MiMo-V2-Flash model (full + sliding window with sinks, a dense and an MoE
    layer) with the shipped BPE, as a Hugging Face directory transformers loads."""
    config = config_from_dict(dict(
        vocab_size=4096, d_model=32, num_layers=2, layout="FS", window=8, head_dim=16,
        num_kv_heads=1, v_head_dim=8, gate="none", qk_norm=False, value_scale=0.707,
        full_attention=dict(num_heads=2, rope_theta=1e4, partial_rotary_factor=0.5),
        swa_attention=dict(num_heads=2, num_kv_heads=2, rope_theta=1e4,
                           partial_rotary_factor=0.5, gate="sink"),
        num_dense_layers=1, dense_hidden=48,
        moe=dict(num_experts=4, top_k=2, expert_hidden=16, num_shared_experts=0,
                 num_ep_groups=1),
        mtp=dict(num_heads=0), tie_embeddings=False))
    rng = np.random.default_rng(0)
    variables = jax.tree.map(  # N(0, 0.1^2), N(0, 0.2^2) where stepjax starts at zero
        lambda leaf: jnp.asarray((0.1 if leaf.ndim > 1 else 0.2) * rng.standard_normal(
            leaf.shape), leaf.dtype), nn.meta.unbox(abstract_variables(config)))
    path = tmp_path_factory.mktemp("lm_eval") / "hf"
    save_hf_checkpoint(config, variables, path, tokenizer=load_tokenizer("default"),
                       progress=False)
    return path


def by_doc(samples: list[dict]) -> dict[int, list]:
    return {s["doc_id"]: s["resps"] for s in samples}


@pytest.mark.parity
@pytest.mark.slow
def test_every_sample_matches_lm_evals_hugging_face_backend(exported):
    from lm_eval.models.huggingface import HFLM

    from model.inference.harness import HarnessLM

    manager = task_manager(TASKS, TASKS_DIR)
    reference = HFLM(pretrained=str(exported), dtype="float32", batch_size=BATCH, device="cpu",
                     max_length=MAX_LENGTH)
    config, variables = load_model(exported)
    ours = HarnessLM(Decoder(config, variables, max_len=MAX_LENGTH, prefill_chunk=CHUNK),
                     load_tokenizer(str(exported)), batch_size=BATCH, progress=False)
    results = {}
    for name, lm in (("hf", reference), ("ours", ours)):
        results[name] = evaluate_tasks(lm, TASKS, manager, limit=None, num_fewshot=None,
                                       bootstrap_iters=0, log_samples=True)
    choice, rolling, generate = ({k: by_doc(r["samples"][task]) for k, r in results.items()}
                                 for task in TASKS)
    assert len(choice["ours"]) == 12 and len(rolling["ours"]) == 4 and len(generate["ours"]) == 6
    for doc, responses in choice["hf"].items():  # [[(log-likelihood, is greedy)] per choice]
        for (want, want_greedy), (got, got_greedy) in zip(
                (r[0] for r in responses), (r[0] for r in choice["ours"][doc]), strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-4) and got_greedy == want_greedy
    for doc, responses in rolling["hf"].items():  # whole snippets of 18-53 tokens, in one window
        assert rolling["ours"][doc][0][0] == pytest.approx(responses[0][0], rel=1e-5)
    assert generate["ours"] == generate["hf"]  # greedy: the same text, cut at the newline
    ours_metrics = task_metrics(results["ours"])
    assert ours_metrics == pytest.approx(task_metrics(results["hf"]), rel=1e-5)
    assert set(ours_metrics) == {
        "eval/stepjax_python_choice/acc", "eval/stepjax_python_generate/exact_match",
        "eval/stepjax_python_rolling/word_perplexity",
        "eval/stepjax_python_rolling/byte_perplexity",
        "eval/stepjax_python_rolling/bits_per_byte"}


@pytest.mark.parity
@pytest.mark.slow
def test_documents_longer_than_the_window_match_lm_evals_hugging_face_backend(exported):
    """A window of 32 tokens, shorter than two of the snippets (44 and 53 tokens): lm-eval cuts
    them into rolling windows of max_length + 1 tokens, all of which the cache of 32 positions
    scores."""
    from lm_eval.models.huggingface import HFLM

    from model.inference.harness import HarnessLM

    task, window = TASKS[1], 32
    manager = task_manager([task], TASKS_DIR)
    reference = HFLM(pretrained=str(exported), dtype="float32", batch_size=BATCH, device="cpu",
                     max_length=window)
    config, variables = load_model(exported)
    ours = HarnessLM(Decoder(config, variables, max_len=window, prefill_chunk=CHUNK),
                     load_tokenizer(str(exported)), batch_size=BATCH, progress=False)
    rolling = {name: by_doc(evaluate_tasks(lm, [task], manager, limit=None, num_fewshot=None,
                                           bootstrap_iters=0, log_samples=True)["samples"][task])
               for name, lm in (("hf", reference), ("ours", ours))}
    snippets = (REPO / TASKS_DIR / "python_rolling.jsonl").read_text().splitlines()
    assert max(len(ours.tok_encode(json.loads(line)["text"])) for line in snippets) > window + 1
    assert len(rolling["ours"]) == 4
    for doc, responses in rolling["hf"].items():
        assert rolling["ours"][doc][0][0] == pytest.approx(responses[0][0], rel=1e-5)


@pytest.mark.slow
def test_the_command_prints_lm_evals_results_and_writes_the_samples(exported, tmp_path,
                                                                     capsys):
    out_dir = tmp_path / "results"
    assert main(["--model", str(exported), "--tasks", ",".join(TASKS[:2]), "--include-path",
                 TASKS_DIR, "--limit", "3", "--num-fewshot", "1", "--batch-size", str(BATCH),
                 "--max-length", str(MAX_LENGTH), "--prefill-chunk", str(CHUNK), "--json",
                 "--output-path", str(out_dir), "--log-samples"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["results"]) == set(TASKS[:2])
    assert 0.0 <= printed["results"]["stepjax_python_choice"]["acc,none"] <= 1.0
    assert printed["results"]["stepjax_python_rolling"]["bits_per_byte,none"] > 0
    assert printed["n-shot"]["stepjax_python_choice"] == 1
    assert printed["n-samples"]["stepjax_python_choice"] == {"original": 12, "effective": 3}
    written = sorted(p.name.split("_")[0] for p in out_dir.rglob("*.json*"))
    assert written == ["results", "samples", "samples"], written


@pytest.mark.parametrize("argv, needle", [
    (["--tasks", TASKS[0], "--log-samples"], "--log-samples needs --output-path DIR"),
    (["--tasks", TASKS[0], "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--tasks", TASKS[0], "--include-path", "absent"], "--include-path: absent is not a dir"),
    (["--tasks", TASKS[0], "--include-path", TASKS_DIR, "--limit", "inf"],
     "argument --limit: must be a finite number, got 'inf'"),
])
def test_bad_input_is_one_line_before_any_model_work(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr("model.weights.load_model", pytest.fail)  # never reached
    try:
        code = main(["--model", "absent", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and needle in err, err
