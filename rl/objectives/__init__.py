"""RL objectives: MIS-PO and baseline policy losses, KL and entropy masks, advantages."""
