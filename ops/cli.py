"""`expertmesh` command line: serve, front, status, generate, score, bench, plan, plan-cluster, drill (ops/commands/).

Errors in what the user passed (a setting out of range, a bad checkpoint, a gRPC error from the server) print one
line naming the field or the file and key, and exit with status 2; they never print a traceback.

Import weight: this module and every command's `add_parser` import no torch, Ray or gRPC (the configuration tree is
pure), so `expertmesh --help` and a refused configuration answer in a fraction of a second; each command imports
its heavy modules inside `run`, after its configuration was checked (tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

import argparse
import sys

from ..experts.errors import CheckpointError
from .commands import bench, drill, front, generate, plan, plan_cluster, score, serve, status

COMMANDS = {getattr(module, "COMMAND", module.__name__.rsplit(".", 1)[-1]): module
            for module in (serve, front, status, generate, score, bench, plan, plan_cluster, drill)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertmesh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except (CheckpointError, ValueError) as exc:  # ConfigError and RequestError are ValueErrors naming the field
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # A gRPC error from the server: grpc is only loaded by the commands that talk to one, so it is looked up
        # here rather than imported (importing it would cost every command, --help included, ~0.3 s).
        grpc = sys.modules.get("grpc")
        if grpc is not None and isinstance(exc, grpc.RpcError):
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
