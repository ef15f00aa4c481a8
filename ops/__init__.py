"""The command line (one module per command in ops/commands/), benchmarks, drills, and the demo-model training
script."""
