"""Converting variables between the scanned and per-layer layouts: the documented path; the code
lives in `model.layers.params`."""

from model.layers.params import convert_layer_layout, stack_layers, unstack_layers

__all__ = ["convert_layer_layout", "stack_layers", "unstack_layers"]
