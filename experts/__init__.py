"""Checkpoints, model math (pure torch, no Ray), the in-process reference model and the expert actor."""
