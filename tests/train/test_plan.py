"""train.plan: per-device memory from abstract shapes, checked against hand-computed sizes."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import PIPELINABLE

from model.config import load_config
from model.layers.layer_plan import LayerKind
from train.config import load_run_config
from train.parallel.activation_plan import (
    activation_bytes,
    chunk_working_bytes,
    layer_bytes,
    scores_bytes,
)
from train.parallel.exchange_plan import exchange_bytes
from train.parallel.plan import PlanError, main, parse_mesh

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
STEP35 = str(ROOT / "configs" / "step35_flash.yaml")
TINY_V4 = str(ROOT / "configs" / "tiny_deepseek_v4.yaml")
V4_FLASH = str(ROOT / "configs" / "deepseek_v4_flash.yaml")
MIMO = str(ROOT / "configs" / "mimo_v2_flash.yaml")


def plan(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def step35_param_counts() -> tuple[int, int, int]:
    """Step 3.5 Flash parameters from the preset's numbers (report Table 6): 45 blocks of
    `F+SSSF*11`, 3 dense then MoE, embeddings, untied head, 3 MTP heads with own output layers.
    -> (decoder layers + final norm, embeddings + head, MTP heads)."""
    vocab, d, hd, kv, dense, experts, expert_hidden, shared = (
        128896, 4096, 128, 8, 11264, 288, 1280, 1280)

    def block(kind: str, moe: bool) -> int:
        heads = 64 if kind == "F" else 96
        n = 2 * d * heads * hd + 2 * d * kv * hd + d * heads  # q, o, k, v, head-wise gate
        n += 2 * hd + 2 * d  # q/k norms, two layer norms
        if moe:
            return n + d * experts + 3 * d * shared + experts * 3 * d * expert_hidden
        return n + 3 * d * dense

    layout = "F" + "SSSF" * 11
    layers = sum(block(kind, i >= 3) for i, kind in enumerate(layout)) + d  # + final norm
    mtp = 3 * (2 * d + 2 * d * d + block("S", False) + d + d * vocab)
    return layers, 2 * vocab * d, mtp


def test_step35_preset_counts_and_expert_sharding(capsys):
    start = time.monotonic()
    one = plan(capsys, "--config", STEP35, "--mesh", "data=1")
    eight = plan(capsys, "--config", STEP35, "--mesh", "data=1,expert=8")
    assert time.monotonic() - start < 60  # abstract shapes only: ~3 s on one CPU core
    layers, embeddings, mtp = step35_param_counts()
    count = layers + embeddings + mtp
    assert one["num_params"] == count == eight["num_params"]
    assert 194e9 < layers < 198e9  # report Table 6: ≈196B excluding embeddings and head
    assert 197e9 < layers + embeddings + mtp < 201e9  # ≈198B with MTP-3 (+ embeddings)
    # float32 routed experts: 42 MoE layers x 288 experts x 3 matrices of 4096 x 1280.
    routed = 42 * 288 * 3 * 4096 * 1280 * 4
    assert one["params_by_group_bytes"]["moe_routed"] == routed
    assert eight["params_by_group_bytes"]["moe_routed"] == routed // 8
    for group, size in one["params_by_group_bytes"].items():
        if group not in ("moe_routed", "router"):  # the router's expert axis shards too
            assert eight["params_by_group_bytes"][group] == size, group
    saved = one["per_device_bytes"]["params"] - eight["per_device_bytes"]["params"]
    router = 42 * 4096 * 288 * 4
    assert saved == routed * 7 // 8 + router * 7 // 8
    assert one["per_device_bytes"]["params"] == count * 4

    # The report's PP8 x EP8 (3.2): the [S F S S] x 10 segment in 8 uneven stages (2, 2, 1 x 6
    # repeats); its expert matrices split 64 ways (the `layers` axis does not divide by 8, so
    # `pipeline` takes the 4096-wide one), the 2 clamped MoE layers after it 8 ways, and, as
    # float32 master weights of a bfloat16 model under ZeRO-1, all of them over data=64 too.
    pp8 = plan(capsys, "--config", STEP35, "--mesh", "data=64,expert=8,pipeline=8")
    pipe = pp8["pipeline"]
    assert (pipe["segment_period"], pipe["segment_repeats"]) == (4, 10)
    assert pipe["chunk_repeats"] == [2, 2, 1, 1, 1, 1, 1, 1] and pipe["idle_slots"] == 6
    per_layer = routed // 42
    assert pp8["sharded_master"]
    assert pp8["params_by_group_bytes"]["moe_routed"] == (per_layer * 40 // (64 * 64)
                                                          + per_layer * 2 // (8 * 64))
    gpipe, interleaved = pipe["schedules"]  # 16 micro-batches; 2 virtual stages: 16 chunks
    assert gpipe["bubble_fraction"] == pytest.approx(7 / 23)
    assert interleaved["virtual_stages"] == 2
    assert interleaved["bubble_fraction"] == pytest.approx(7 / 39)
    assert interleaved["slots_per_device"] == gpipe["slots_per_device"] == 2
    # the step's bfloat16 copy holds the segment in the stage layout: 2 repeat slots per device
    # (of 4 layers: 4 x 288 / 8 experts of 3 matrices) besides the rest of the model
    assert pp8["per_device_bytes"]["compute_params"] > 2 * 4 * per_layer // 8 // 2


def test_mimo_v2_flash_counts_and_expert_sharding(capsys):
    """MiMo-V2-Flash from its report's numbers: 9 full layers (4 KV heads) and 39 SWA layers (8
    KV heads, 64 sink logits), all 64 query heads of 192 with 128-dim values; layer 0 dense
    (16384), 47 MoE layers of 256 experts of 2048; untied 152576-token embeddings and head;
    3 MTP blocks (eh_proj, an SWA block with the dense FFN, 3 norms) sharing the head."""
    d, vocab = 4096, 152576

    def attention(kv_heads: int, sink: bool) -> int:
        return d * 64 * 192 + d * kv_heads * (192 + 128) + 64 * 128 * d + 64 * sink + 2 * d

    layers = (9 * attention(4, False) + 39 * attention(8, True) + 3 * d * 16384
              + 47 * (d * 256 + 256 * 3 * d * 2048) + d)
    mtp = 3 * (2 * d * d + attention(8, True) + 3 * d * 16384 + 3 * d)
    one = plan(capsys, "--config", MIMO, "--mesh", "data=1")
    eight = plan(capsys, "--config", MIMO, "--mesh", "data=1,expert=8")
    assert one["num_params"] == eight["num_params"] == layers + 2 * vocab * d + mtp
    routed = 47 * 256 * 3 * d * 2048 * 4  # float32
    assert one["params_by_group_bytes"]["moe_routed"] == routed
    assert eight["params_by_group_bytes"]["moe_routed"] == routed // 8


def test_fsdp_halves_embed_sharded_matrices(capsys):
    one = plan(capsys, "--config", TINY, "--mesh", "data=1")
    two = plan(capsys, "--config", TINY, "--mesh", "data=1,fsdp=2")
    vocab_matrix = 4096 * 128 * 4  # [vocab, d_model] float32
    assert one["params_by_group_bytes"]["embeddings"] == vocab_matrix
    assert two["params_by_group_bytes"]["embeddings"] == vocab_matrix // 2
    assert two["params_by_group_bytes"]["lm_head"] == vocab_matrix // 2
    # Every tiny weight but the q/k norms ([head_dim]) has an `embed` (d_model = 128) axis and
    # halves; the norms of 9 layers + 3 MTP blocks stay replicated.
    qk_norms = (9 + 3) * 2 * 32 * 4
    assert two["per_device_bytes"]["params"] * 2 == one["per_device_bytes"]["params"] + qk_norms
    assert one["num_params"] == two["num_params"]
    assert two["devices"] == 2 and two["mesh"]["fsdp"] == 2


def test_zero1_shards_optimizer_state_over_data(capsys):
    z1 = plan(capsys, "--config", TINY, "--mesh", "data=2")
    plain = plan(capsys, "--config", TINY, "--mesh", "data=2", "mesh.zero1=false")
    assert z1["per_device_bytes"]["params"] == plain["per_device_bytes"]["params"]
    opt_z1 = z1["per_device_bytes"]["optimizer_state"]
    opt = plain["per_device_bytes"]["optimizer_state"]
    assert opt > 0
    # Moments and momenta halve; only scalar counters stay replicated.
    assert opt / 2 <= opt_z1 <= opt / 2 + 256


def test_gradients_like_params_and_accumulation(capsys):
    single = plan(capsys, "--config", TINY, "--mesh", "data=1,fsdp=2")
    assert single["per_device_bytes"]["gradients"] == single["per_device_bytes"]["params"]
    accumulated = plan(capsys, "--config", TINY, "--mesh", "data=1,fsdp=2",
                       "--batch-size", "8", "--micro-batch-size", "4")
    assert accumulated["accumulation_steps"] == 2
    assert accumulated["per_device_bytes"]["gradients"] == 2 * single["per_device_bytes"]["params"]


def test_activation_estimate_responds_to_batch_and_remat(capsys):
    base = plan(capsys, "--config", TINY, "--mesh", "data=1", "--seq-len", "128")
    assert base["tokens_per_device"] == 8 * 128
    split = plan(capsys, "--config", TINY, "--mesh", "data=2", "--seq-len", "128")
    assert split["tokens_per_device"] == 4 * 128
    assert split["per_device_bytes"]["activations"] < base["per_device_bytes"]["activations"]
    longer = plan(capsys, "--config", TINY, "--mesh", "data=1", "--seq-len", "256")
    assert longer["per_device_bytes"]["activations"] > base["per_device_bytes"]["activations"]
    by_policy = {p: plan(capsys, "--config", TINY, "--mesh", "data=1", f"model.remat_policy={p}")
                 ["per_device_bytes"]["activations"] for p in ("none", "dots", "full")}
    assert by_policy["full"] < by_policy["dots"] < by_policy["none"]
    # dots_with_kernels adds, per token and layer (float32, no tensor split), the attention
    # core's output and log-sum-exp (H * (4 * 32 + 4): 3 full layers of 4 heads, 6 SWA layers
    # of 6, and the trained MTP head's SWA block, rematerialised like a layer) and the 8 MoE
    # layers' routed gate/up and outputs (4 * top_k 4 * (2 * 64 + 128))
    kernels = plan(capsys, "--config", TINY, "--mesh", "data=1",
                   "model.remat_policy=dots_with_kernels")["per_device_bytes"]["activations"]
    per_token = (3 * 4 + 7 * 6) * (4 * 32 + 4) + 8 * 4 * 4 * (2 * 64 + 128)
    assert kernels - by_policy["dots"] == 8 * 256 * per_token
    parts = base["activation_parts_bytes"]
    assert sum(parts.values()) == base["per_device_bytes"]["activations"]
    # logits + gradient, float32, or a layer's working set, whichever is larger
    sets = base["working_sets_bytes"]
    assert sets["logits_chunk"] == 2 * 1024 * 4096 * 4
    assert parts["working_set"] == max(sets["layer"], sets["logits_chunk"])
    total = sum(base["per_device_bytes"][k] for k in ("params", "optimizer_state", "gradients",
                                                      "other_state", "activations"))
    assert base["per_device_bytes"]["total"] == total


def test_working_set_terms_by_hand():
    """tiny.yaml (float32, D=128, KV heads 2 of 32): attention scores while a layer runs, never
    saved; the expert-parallel exchange and receive buffer with mesh.expert=4."""
    cfg = load_config(TINY)
    swa, full = LayerKind("S", True, 0.0, 0.0, False), LayerKind("F", True, 0.0, 0.0, False)
    # float32 scores + probabilities: 6 SWA heads x 2 chunks of max(window 32, 128) keys;
    # 4 full heads x 5/8 of 1024 keys (4 causal blocks of 256 queries)
    assert scores_bytes(cfg, swa, 1024, 1) == 6 * 256 * 8
    assert scores_bytes(cfg, full, 1024, 1) == 4 * 640 * 8
    assert scores_bytes(cfg.replace(attention_impl="pallas"), full, 1024, 1) == 0
    # padded exchange: send and receive buffers of both exchanges, 4 peers x top-4 copies of D
    assert exchange_bytes(cfg, swa, 4) == 4 * 4 * 4 * 4 * 128
    assert exchange_bytes(cfg.replace(ep_collective="ragged"), swa, 4) == 4 * 4 * 4 * 128
    assert exchange_bytes(cfg, swa, 1) == exchange_bytes(cfg, LayerKind("F", False, 0, 0,
                                                                         False), 4) == 0
    # the saved O: the receive buffer's routed rows (in, out, gate/up/act of 64) grow 4x
    one, four = (layer_bytes(cfg, swa, 1024, 1, expert=e)[1] for e in (1, 4))
    assert four - one == 3 * 4 * 4 * (2 * 128 + 3 * 64)


def test_pipeline_reports_bubble_of_gpipe_and_interleaved(capsys):
    out = plan(capsys, "--config", TINY, "--mesh", "pipeline=2,data=1", *PIPELINABLE)
    stages, micro = 2, 4  # pipeline_microbatches 0 -> 2 x stages
    pipe = out["pipeline"]
    assert pipe["stages"] == stages and pipe["microbatches"] == micro
    assert pipe["bubble_fraction"] == pytest.approx((stages - 1) / (micro + stages - 1))
    assert pipe["layers_per_stage"] == 4 and pipe["chunk_repeats"] == [4, 4]
    # 8 repeats: 4 virtual stages keep GPipe's 4 slots per device (8 chunks of 1), 8 would not
    assert [(r["virtual_stages"], r["slots_per_device"]) for r in pipe["schedules"]] == [
        (1, 4), (4, 4)]
    assert pipe["schedules"][1]["bubble_fraction"] == pytest.approx(1 / (4 * micro + 1))
    assert main(["--config", TINY, "--mesh", "pipeline=2,data=1", *PIPELINABLE]) == 0
    assert "bubble 20.0%" in capsys.readouterr().out

    virtual = plan(capsys, "--config", TINY, "--mesh", "pipeline=2,data=1", *PIPELINABLE,
                   "model.pipeline_virtual_stages=2")["pipeline"]
    assert virtual["schedule"] == "interleaved" and virtual["chunk_repeats"] == [2] * 4
    assert virtual["bubble_fraction"] == pytest.approx(1 / (2 * micro + 1))
    assert [r["virtual_stages"] for r in virtual["schedules"] if r["configured"]] == [2]


def test_uneven_stages_pad_the_short_chunks(capsys):
    # 3 repeats (F+SSSF*2 splits its 8 SSSF layers into S x 3 runs) over 2 stages: 2 + 1
    pipe = plan(capsys, "--config", TINY, "--mesh", "pipeline=2,data=1")["pipeline"]
    assert pipe["segment_repeats"] == 3 and pipe["chunk_repeats"] == [2, 1]
    assert pipe["idle_slots"] == 1 and pipe["layers_per_stage"] == 2


def test_pipeline_shards_the_pipelined_segment(capsys):
    one = plan(capsys, "--config", TINY, "--mesh", "data=1", *PIPELINABLE)
    two = plan(capsys, "--config", TINY, "--mesh", "pipeline=2,data=1", *PIPELINABLE)
    # All decoder layers are in the one segment: every layer group halves.
    for group in ("attention", "moe_routed", "moe_shared"):
        assert two["params_by_group_bytes"][group] * 2 == one["params_by_group_bytes"][group]


def test_table_and_over_budget_warning(capsys):
    assert main(["--config", TINY, "--mesh", "data=2"]) == 0
    captured = capsys.readouterr()
    for row in ("params", "optimizer state", "gradients", "activations (estimate)", "total",
                "within budget"):
        assert row in captured.out
    assert "WARNING" not in captured.err
    assert main(["--config", TINY, "--mesh", "data=2", "--device-memory", "0.01"]) == 0
    captured = capsys.readouterr()
    assert "OVER BUDGET" in captured.out
    assert "WARNING: over budget" in captured.err
    assert main(["--config", TINY, "--mesh", "data=2", "--device-memory", "0.01", "--strict"]) == 1


def test_v4_layer_bytes_by_hand():
    """Per-token bytes of one W, one H and one C layer of tiny_deepseek_v4.yaml (float32, T=256,
    tensor=2), array by array from the model code: D=128, 4 heads of 64 (2 per device),
    q_lora 96, 2 output groups of 64, csa 4 / hca 32, indexer 4 heads of 32 and top-16, every
    layer MoE (16 experts top-4 of hidden 64, one shared of 64), 4 mHC streams, 20 Sinkhorn
    iterations."""
    cfg = load_config(TINY_V4)
    f = 4  # float32 bytes
    # attention: q_a_proj, q_b_proj (2 heads x 64), kv_proj, o_b_proj outputs
    attn_m = f * (96 + 2 * 64 + 64 + 128)
    # input / q_a / kv norms (x*rsqrt, weighted output); padded window keys, roped query,
    # un-roped output, o_a_proj output [2 groups, 64]
    attn_o = f * (2 * 128 + 2 * 96 + 2 * 64 + 64 + 2 * 64 + 2 * 64 + 2 * 64)
    # MoE: router logits, shared gate/up (64 over 2), shared out | router probabilities, 3
    # d-sized, 4 dispatched rows (in, out, gate/up/act of 32), shared activation
    moe_m = f * (16 + 2 * 32 + 128)
    moe_o = f * (16 + 3 * 128 + 4 * (2 * 128 + 3 * 32) + 32)
    # mHC, two sublayers: 24 mapping pre-activations | streams [4, 128], their normed copy,
    # collapsed input, sublayer output, Sinkhorn: per iteration two [4, 4] and four [4]
    hc_m = 2 * f * 24
    hc_o = 2 * f * (4 * 128 + 4 * 128 + 128 + 128 + 20 * (2 * 16 + 4 * 4))
    w_m, w_o = attn_m + moe_m + hc_m, attn_o + moe_o + hc_o

    def compressor(width, rate, overlapped):
        """kv/gate projections | float32 gathered values, softmax exp and weights per slot
        channel, 4 float32 arrays per entry; overlapped: the masked previous-block halves
        (values, logits: 4 bytes each, their bool masks)."""
        u = 2 * width if overlapped else width
        return 2 * f * u, 3 * f * u + 4 * f * width / rate + (10 * width if overlapped else 0)

    h_cm, h_co = compressor(64, 32, False)
    c_cm, c_co = compressor(64, 4, True)
    i_cm, i_co = compressor(32, 4, True)
    # indexer: queries [4 x 32] and head weights [4] | the same in float32, 7 arrays of [16]
    # (its chunks' scores are rematerialised: working set, below)
    index_m = f * (4 * 32 + 4)
    index_o = f * (4 * 32 + 4) + 7 * 4 * 16
    expected = {"W": (w_m, w_o), "H": (w_m + h_cm, w_o + h_co),
                "C": (w_m + c_cm + i_cm + index_m, w_o + c_co + i_co + index_o)}
    for kind, (matmul, other) in expected.items():
        got = layer_bytes(cfg, LayerKind(kind, True, 10.0, 10.0, False), 256, 2)
        assert got == pytest.approx((matmul, other)), kind
    # A query chunk of max(window 32, query_chunk 64) rows, differentiated: float32 logits +
    # probabilities of 2 heads over 128 window keys + 0 / 16 / 256/32 compressed entries, CSA's
    # 16 gathered [64] entries per query, forward and cotangent.
    for kind, entries in (("W", 0), ("C", 16), ("H", 8)):
        gathered = 16 * 64 * f if kind == "C" else 0
        core = 2 * 64 * (2 * (128 + entries) * (f + f) + gathered)
        # CSA's indexer chunk, recomputed: 64 queries x 256/4 entries, float32 scores + ReLU
        # mask per head (4) and the visibility mask, forward and cotangent
        indexer = 2 * 64 * 64 * (4 * 4 + 4 * 1 + 1) if kind == "C" else 0
        got = chunk_working_bytes(cfg, LayerKind(kind, True, 10.0, 10.0, False), 256, 2)
        assert got == max(core, indexer), kind


def test_v4_plans_and_mhc_streams_cost_memory(capsys):
    flash = plan(capsys, "--config", V4_FLASH, "--devices", "8", "--mesh",
                 "fsdp=2,expert=2,tensor=2")
    assert flash["devices"] == 8 and flash["remat_policy"] == "dots"
    parts = flash["activation_parts_bytes"]
    assert sum(parts.values()) == flash["per_device_bytes"]["activations"]
    assert all(v > 0 for v in parts.values())
    untensored = plan(capsys, "--config", V4_FLASH, "--devices", "8", "--mesh",
                      "fsdp=4,expert=2,tensor=1", "--batch-size", "16")
    assert untensored["tokens_per_device"] == flash["tokens_per_device"]
    # `heads` shard over tensor: query-sized arrays and scores halve
    assert untensored["working_sets_bytes"]["layer"] > flash["working_sets_bytes"]["layer"]
    sizes = {"pipeline": 1, "data": 1, "fsdp": 2, "expert": 2, "tensor": 2}

    def tiny_parts(hc_mult: int) -> dict:
        run = load_run_config(TINY_V4, [f"model.hyper_connections.hc_mult={hc_mult}"])
        return activation_bytes(run, sizes)["parts"]

    four, one = tiny_parts(4), tiny_parts(1)
    for part in ("layers_saved", "working_set", "embeddings_and_io"):
        assert four[part] > one[part], part
    assert four["mtp_heads"] == one["mtp_heads"]  # the MTP block takes one stream


@pytest.mark.parametrize("argv, needle", [
    (["--config", "configs/missing.yaml", "--mesh", "data=1"], "does not exist"),
    (["--config", TINY, "--mesh", "data=2", "--devices", "3"], "mesh"),
    (["--config", TINY, "--mesh", "data=-1"], "--devices"),
    (["--config", TINY, "--mesh", "data"], "axis=size"),
    (["--config", TINY, "--mesh", "pipeline=4,data=1"], "mesh.pipeline=4"),
    (["--config", TINY, "--mesh", "pipeline=2,data=1", "model.pipeline_virtual_stages=2",
      "model.pipeline_microbatches=1"], "model.pipeline_microbatches"),
    (["--config", TINY, "--mesh", "data=1", "train.bogus=1"], "train.bogus"),
    (["--config", TINY, "--mesh", "data=1", "--device-memory", "nan"],
     "argument --device-memory: must be a finite number, got 'nan'"),
])
def test_errors_are_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_devices_resolve_minus_one(capsys):
    out = plan(capsys, "--config", TINY, "--mesh", "data=-1,expert=2", "--devices", "8")
    assert out["mesh"]["data"] == 4 and out["devices"] == 8 and out["data_parallel_size"] == 8


def test_parse_mesh():
    assert parse_mesh("data=8, expert=8,pipeline=2") == {"data": 8, "expert": 8, "pipeline": 2}
    for bad in ("data=8,data=2", "data=x", "data=0", "gpu=2"):
        with pytest.raises(PlanError):
            parse_mesh(bad)


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "train.plan", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_json():
    result = _cli("--config", TINY, "--mesh", "data=2,fsdp=1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["devices"] == 2 and out["within_budget"] is True
    assert out["per_device_bytes"]["total"] <= out["budget_bytes"] == 80 * 2**30
    assert math.isclose(out["utilisation"], out["per_device_bytes"]["total"] / out["budget_bytes"])


def test_cli_bad_mesh():
    result = _cli("--config", TINY, "--mesh", "data=2,gpus=4")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: --mesh: unknown axis 'gpus'")
