"""Command line, benchmarks and the demo-model training script."""
