"""Tensor parallelism: how a model definition's weights are split over N ranks (Megatron style)."""
