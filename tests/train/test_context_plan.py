"""train/parallel/context_plan.py: what `mesh.context` adds to a device's memory per layer kind,
checked by hand on the tiny presets (no devices needed)."""

from train_helpers import TINY, TINY_V4

from train.config import load_run_config
from train.parallel.context_plan import context_layer_bytes, tokens_per_device


def test_full_and_sliding_window_layers_of_tiny_step35():
    # configs/tiny.yaml: float32, 2 KV heads of 32 (K and V), 4 full / 6 SWA query heads,
    # window 32; F layers -> balanced layout: T = 1024 on 8 shards is 16 chunks of 64 rows
    cfg = load_run_config(TINY).model
    terms = context_layer_bytes(cfg, seq_len=1024, rows=2, context=8)
    assert sorted(terms) == ["F", "S"]
    kv_token = 2 * (32 + 32) * 4 + 4  # K and V of one token, float32, and its segment id
    assert terms["F"]["gathered_kv"] == 2 * 1024 * kv_token
    assert terms["F"]["gathered_kv_grad"] == 2 * 1024 * 2 * 64 * 4
    # each of the device's 2 chunks gets the 31 rows before it, and 31 zero query rows
    assert terms["S"]["halo"] == 2 * 2 * 31 * kv_token
    assert terms["S"]["halo_queries"] == 2 * 2 * 31 * 6 * 64 * 4
    assert tokens_per_device(rows=2, seq_len=1024, context=8) == 256


def test_halos_do_not_grow_with_the_sequence_and_gathers_do():
    cfg = load_run_config(TINY).model
    short, long = (context_layer_bytes(cfg, seq_len=t, rows=1, context=8) for t in (4096, 65536))
    assert short["S"] == long["S"]
    assert long["F"]["gathered_kv"] == 16 * short["F"]["gathered_kv"]
    assert context_layer_bytes(cfg, seq_len=4096, rows=1, context=1) == {"F": {}, "S": {}}


def test_compressed_layers_of_tiny_deepseek_v4():
    # configs/tiny_deepseek_v4.yaml: entries of 64 channels, csa_rate 4 (indexer keys of 32),
    # hca_rate 32, window 32; no F layer -> contiguous: T = 2048 on 8 shards, chunks of 256
    cfg = load_run_config(TINY_V4).model
    terms = context_layer_bytes(cfg, seq_len=2048, rows=1, context=8)
    assert sorted(terms) == ["C", "H", "W"]
    assert terms["W"] == {"halo": 31 * (64 * 4 + 4)}
    hca = terms["H"]
    assert hca["compressor_halo"] == 31 * (64 * 8 + 12)  # m - 1 rows: kv, float32 gate, ints
    assert hca["compressor_gathered"] == 8 * (256 // 32) * (64 * 4 + 8)
    assert hca["compressor_selected"] == (2048 // 32) * (64 * 4 + 8)
    csa = terms["C"]
    assert csa["compressor_halo"] == 7 * (128 * 8 + 12)  # 2m - 1 rows of both series
    assert csa["indexer_selected"] == (2048 // 4) * (32 * 4 + 8)


def test_the_planner_counts_context_per_device():
    # configs/tiny.yaml: layout F+SSSF*2 (3 F, 6 S), MTP blocks of S layers; 2 rows of 1024
    # tokens on context=8: each device holds 2 x 128 tokens and per layer the terms above
    from model.parallel.rules import MESH_AXES
    from train.parallel.memory_plan import plan_memory

    run = load_run_config(TINY, ["train.batch_size=2", "train.seq_len=1024"])
    assert run.model.layout == "FSSSFSSSF" and run.model.mtp.attention_type == "S"
    sizes = dict(dict.fromkeys(MESH_AXES, 1), context=8)
    plan = plan_memory(run, sizes)
    assert plan["tokens_per_device"] == 256
    kv_token = 2 * (32 + 32) * 4 + 4
    halo_s = 2 * 2 * 31 * kv_token + 2 * 2 * 31 * 6 * 64 * 4
    window_layers = 6 + run.trained_mtp_heads()
    parts = plan["activation_parts_bytes"]
    assert parts["context_exchanged"] == 3 * 2 * 1024 * kv_token + window_layers * halo_s
    assert parts["context_working_set"] == 2 * 1024 * 2 * 64 * 4 + 4 * (1 << 22)
    assert parts["batch"] == 256 * 14  # the device's tokens of the step's batch
    one = plan_memory(run, dict.fromkeys(MESH_AXES, 1))
    assert "context_exchanged" not in one["activation_parts_bytes"]
    assert one["tokens_per_device"] == 2048
