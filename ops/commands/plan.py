"""`expertmesh plan`: plan a shard placement offline from a load file (ops/plan_cli.py does the work)."""

from __future__ import annotations

import argparse
import json
import sys


def _gpu_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--failed-gpus must be comma-separated GPU indices, got {text!r}") from exc


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan a shard placement offline from a load file (writes JSON)")
    p.add_argument("--load", required=True, metavar="LOAD.json",
                   help='{"load": [[per expert] per MoE layer]} or the nested list alone')
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--slots-per-gpu", type=int, required=True, help="shards per GPU per MoE layer")
    p.add_argument("--nodes", type=int, default=1, help="nodes the GPUs split evenly over")
    p.add_argument("--current", metavar="PLACEMENT.json", help="placement now serving: move few shards")
    p.add_argument("--out", metavar="PLACEMENT.json", help="write the placement here (default: stdout)")
    p.add_argument("--extra-replicas", type=int, default=None,
                   help="replicas per layer beyond one per expert (default: fill every slot)")
    p.add_argument("--failed-gpus", type=_gpu_ids, default=[], metavar="G,G", help="GPUs to leave empty")
    p.add_argument("--balance-slack", type=float, default=0.0,
                   help="with --current: peak may exceed greedy's by this fraction to save moves")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from ..plan_cli import format_summary, run_plan

    placement, summary = run_plan(args.load, args.gpus, args.slots_per_gpu, args.nodes, args.current, args.out,
                                  args.extra_replicas, args.failed_gpus, args.balance_slack)
    if not args.out:
        sys.stdout.write(placement.dumps())
    report = json.dumps(summary) if args.json else format_summary(summary)
    print(report, file=sys.stdout if args.out else sys.stderr)
    return 0
