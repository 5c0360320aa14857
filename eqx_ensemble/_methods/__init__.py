"""Ensemble methods built on the core and the loop: adversarial training,
weight averaging and soups, greedy selection, BatchNorm statistics."""
