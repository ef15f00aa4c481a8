"""One module per `expertmesh` command, each with `add_parser(sub)` and `run(args) -> int` (ops/cli.py wires them)."""
