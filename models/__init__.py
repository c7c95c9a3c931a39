"""Shipped drafters and the registry of known target -> drafter pairs (registry.json).

Installed as the package data `mlx_infer.models` (pyproject maps this folder there); read by
mlx_infer.speculative.registry.
"""
