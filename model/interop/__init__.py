"""Checkpoint formats: Hugging Face families over shared safetensors I/O, the stepjax model
directory and a training workdir's checkpoints."""
