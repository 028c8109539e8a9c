"""Pallas kernels for the model's `attention_impl=pallas` / `moe_impl=pallas` switches.

Importing this package registers its kernels with `model.attention_ops` / `model.moe_dispatch`.
No kernels are provided yet: they are delivered by the Pallas-kernels issue.
"""
