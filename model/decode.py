"""Decoding with KV caches and MTP speculative decoding: the documented path; the code lives in
`model.inference.decode`."""

from model.inference.decode import Decoder, Generation, required_length

__all__ = ["Decoder", "Generation", "required_length"]
