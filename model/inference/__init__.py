"""Generation: KV caches, the `Decoder` (prefill, decode, MTP speculative decoding) and sampling."""
