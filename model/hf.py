"""Hugging Face checkpoint import/export (`python -m model.hf import|export`): the documented path; the code lives in `model.interop.hf`."""

from model.interop.hf import load_hf_checkpoint, save_hf_checkpoint, main

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
