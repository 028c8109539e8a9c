"""Training data: documents and their split, the corpus sources, the arithmetic task, chat
documents and their loss mask, packing and the grain pipeline."""
