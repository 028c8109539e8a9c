"""Sampling settings (temperature, top-k, top-p): the documented path; the code lives in
`model.inference.sampling`."""

from model.inference.sampling import Sampling

__all__ = ["Sampling"]
