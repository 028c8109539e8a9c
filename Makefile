# Set-up and entry points. Every target creates .venv and installs the package on first use,
# so `make test` and `make train` work from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stepjax-installed

.PHONY: test train rl rl-compare rl-toggle mopd sweep bench bench-torch gpu-check clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,parity]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q --durations=15

# Tiny Step 3.5 Flash on the embedded stdlib corpus; re-running resumes from the last checkpoint.
TRAIN_DIR ?= runs/tiny
train: $(STAMP)
	$(PY) -m train --config configs/tiny.yaml --workdir $(TRAIN_DIR) $(ARGS)

# RL run (docs/post_training.md, "Reinforcement learning"): SFT warm start on the arithmetic task,
# then MIS-PO; ARGS go to `python -m rl` (e.g. ARGS="rl.algorithm=ppo" RL_DIR=runs/ppo_arith).
SFT_DIR ?= runs/sft_arith
RL_DIR ?= runs/rl_arith
rl: $(STAMP)
	$(PY) -m train --config configs/sft_arith.yaml --workdir $(SFT_DIR)
	$(PY) -m rl --config configs/rl_arith.yaml --workdir $(RL_DIR) --init-from $(SFT_DIR) $(ARGS)

# RL algorithms side by side on one SFT warm start (docs/post_training.md): one run
# per algorithm in COMPARE_DIR/<algorithm>, then `python -m rl.compare` (table, JSON, plot).
# Re-running resumes unfinished runs; ARGS go to every `python -m rl`.
RL_ALGORITHMS ?= mis_po ppo grpo dapo dr_grpo kimi_k25
COMPARE_DIR ?= runs/rl_compare
rl-compare: $(STAMP)
	$(PY) -m train --config configs/sft_arith.yaml --workdir $(SFT_DIR)
	for algorithm in $(RL_ALGORITHMS); do \
		$(PY) -m rl --config configs/rl_arith.yaml --workdir $(COMPARE_DIR)/$$algorithm \
			--init-from $(SFT_DIR) rl.algorithm=$$algorithm $(ARGS) || exit 1; done
	$(PY) -m rl.compare $(foreach a,$(RL_ALGORITHMS),$(a)=$(COMPARE_DIR)/$(a)) \
		--json $(COMPARE_DIR)/compare.json --plot $(COMPARE_DIR)/compare.png

# Kimi K2.5's Toggle (docs/post_training.md, "Toggle"): an SFT warm start on the multi-step task,
# then the same RL run with and without Toggle, compared by `python -m rl.compare` (response
# length against accuracy). Re-running resumes unfinished runs; ARGS go to both `python -m rl`.
TOGGLE_SFT_DIR ?= runs/sft_multistep
TOGGLE_DIR ?= runs/rl_toggle
rl-toggle: $(STAMP)
	$(PY) -m train --config configs/sft_arith.yaml --workdir $(TOGGLE_SFT_DIR) \
		train.data.source=arith_multistep
	$(PY) -m rl --config configs/rl_toggle_multistep.yaml --workdir $(TOGGLE_DIR)/toggle \
		--init-from $(TOGGLE_SFT_DIR) $(ARGS)
	$(PY) -m rl --config configs/rl_toggle_multistep.yaml --workdir $(TOGGLE_DIR)/baseline \
		--init-from $(TOGGLE_SFT_DIR) rl.toggle.enabled=false $(ARGS)
	$(PY) -m rl.compare toggle=$(TOGGLE_DIR)/toggle baseline=$(TOGGLE_DIR)/baseline \
		--json $(TOGGLE_DIR)/compare.json --plot $(TOGGLE_DIR)/compare.png

# Multi-teacher on-policy distillation (docs/post_training.md, "On-policy distillation"): from one
# SFT base, an addition and a subtraction teacher (RL on one op each), then a student distilled
# from both by MOPD and a mixed-task RL student for the same iterations, compared by `python -m
# rl.compare`. ARGS go to the two students' runs (e.g. ARGS="rl.distill.signal=full_vocab").
MOPD_DIR ?= runs/mopd
MOPD_TEACHERS = task.tasks.add.teacher.checkpoint=$(MOPD_DIR)/teacher_add \
	task.tasks.sub.teacher.checkpoint=$(MOPD_DIR)/teacher_sub
MOPD_METRICS = eval/accuracy/add eval/accuracy/sub distill/kl/add distill/kl/sub \
	response_length/add response_length/sub
mopd: $(STAMP)
	$(PY) -m train --config configs/sft_arith.yaml --workdir $(SFT_DIR)
	for op in add sub; do \
		$(PY) -m rl --config configs/rl_teacher_$$op.yaml --workdir $(MOPD_DIR)/teacher_$$op \
			--init-from $(SFT_DIR) || exit 1; done
	$(PY) -m rl --config configs/rl_mopd_arith.yaml --workdir $(MOPD_DIR)/student \
		--init-from $(SFT_DIR) $(MOPD_TEACHERS) $(ARGS)
	$(PY) -m rl --config configs/rl_mixed_arith.yaml --workdir $(MOPD_DIR)/mixed_rl \
		--init-from $(SFT_DIR) $(MOPD_TEACHERS) $(ARGS)
	$(PY) -m rl.compare teacher_add=$(MOPD_DIR)/teacher_add teacher_sub=$(MOPD_DIR)/teacher_sub \
		mopd=$(MOPD_DIR)/student mixed_rl=$(MOPD_DIR)/mixed_rl \
		$(foreach m,$(MOPD_METRICS),--metric $(m)) \
		--json $(MOPD_DIR)/compare.json --plot $(MOPD_DIR)/compare.png

# Ablation sweep (docs/experiments.md):
# SWEEP=layout|gate|optimizer|balance|deepseek_v4|families; re-running skips
# finished runs and resumes unfinished ones. ARGS override every run, e.g.
# ARGS="train.seed=1" SWEEP_DIR=runs/sweep_layout_seed1.
SWEEP ?= layout
SWEEP_DIR ?= runs/sweep_$(SWEEP)
sweep: $(STAMP)
	$(PY) -m train.sweep --sweep configs/sweeps/$(SWEEP).yaml --workdir $(SWEEP_DIR) $(ARGS)

# The decode benchmark needs a tiny model with all three MTP heads trained (re-running resumes).
DECODE_DIR ?= runs/tiny_mtp3
bench: $(STAMP)
	$(PY) -m benchmarks.attention_scaling
	$(PY) -m benchmarks.compressed_attention_scaling
	$(PY) -m benchmarks.moe_dispatch
	$(PY) -m benchmarks.compile_time
	$(PY) -m benchmarks.layout_flops
	$(PY) -m benchmarks.long_context
	$(PY) -m benchmarks.data_pipeline
	$(PY) -m benchmarks.data_shards
	$(PY) -m benchmarks.train_step
	$(PY) -m train --config configs/tiny.yaml --workdir $(DECODE_DIR) train.steps=480 \
		"train.mtp_offset_weights=[1.0, 1.0, 1.0]"
	$(PY) -m benchmarks.decode --workdir $(DECODE_DIR)

# stepjax against transformers' torch implementation on the same checkpoint (docs/performance.md).
bench-torch: $(STAMP)
	$(PY) -m benchmarks.vs_torch $(ARGS)

# Accelerator check (docs/kernels.md, "make gpu-check"): every kernel against XLA, kernel and
# train-step timings, MFU, decode speed -> GPU_OUT/gpu_report.json and .md. Runs the Python it is
# given (default: .venv's if there is one, else $(PYTHON)) and installs nothing: accelerator
# images bring their own JAX. Without an accelerator it is a short dry run. ARGS go to the suite,
# e.g. ARGS="--train-override model.remat_policy=none".
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_OUT ?= benchmarks/results
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu.suite --out $(GPU_OUT) $(ARGS)

clean-venv:
	rm -rf $(VENV)
