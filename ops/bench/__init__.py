"""Benchmarks: one module per `expertmesh bench` subcommand, plus common.py (machine information, timing, JSON
reports, synthetic checkpoints)."""
