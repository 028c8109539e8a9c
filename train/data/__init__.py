"""Training data: documents and their split, the corpus sources, the arithmetic task, packing
and the grain pipeline."""
