"""The Flax modules of the network: norm, RoPE, attention, FFN, router, MoE, MTP head, block,
scanned layer stack, layer plan and parameter-layout conversion."""
