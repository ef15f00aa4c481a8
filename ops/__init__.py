"""The command line (one module per command in ops/commands/), benchmarks (ops/bench/), drills (ops/drill/), the
demo model's trainer and corpus (ops/train/) and monitoring assets (ops/monitoring/: alert rules, dashboard)."""
