"""`expertmesh drill`: a failover drill under load (kill actors / a node / a router / the controller), with a report.

The server a drill starts takes the configuration tree like `expertmesh serve` (the same flags and --config FILE);
the drill's own defaults differ in one place: two replicas per expert.
"""

from __future__ import annotations

import argparse
import json
import os

from .mesh_flags import DRILLED_SERVER_GROUPS, add_mesh_flags, mesh_config_from_args

# ops/drill/config.py KILL_MODES, restated so that `--help` imports nothing heavy (a unit test checks they agree)
KILL_CHOICES = ("actor", "fraction", "node", "router", "controller", "chaos", "none")


def add_parser(sub) -> None:
    p = sub.add_parser("drill", help="failover drill under load: kill actors/nodes/router/controller, report")
    p.add_argument("--kill", choices=KILL_CHOICES, default="actor",
                   help="what to kill each tick: chaos = a node, the controller and a share of the actors together; "
                        "none = a soak (load and resource sampling only)")
    p.add_argument("--every", type=float, default=10.0, help="seconds between kills")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the fault phase")
    p.add_argument("--baseline", type=float, default=15.0, help="seconds of fault-free load first")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent greedy Generate streams")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--nodes", type=int, default=2,
                   help="worker nodes of the self-started cluster (--kill node or chaos)")
    p.add_argument("--node-cpus", type=int, default=2, help="CPUs of each worker node (--kill node or chaos)")
    p.add_argument("--node-gpus", type=int, default=0,
                   help="GPUs each worker node declares (--kill node; none needed: expert actors then go only to the "
                        "workers, and with --cpus-per-actor taking every CPU the cluster has no spare capacity)")
    p.add_argument("--fraction", type=float, default=0.25, help="share of expert actors per tick (fraction, chaos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=30.0,
                   help="after the schedule, keep the load on until every kill recovered, at most this many seconds")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds the self-started server may take to become ready (many actors on few cores: more)")
    p.add_argument("--sample-every", type=float, default=5.0,
                   help="seconds between samples of resident memory, descriptors, KV blocks and live actors")
    p.add_argument("--target", metavar="HOST:PORT", help="attach to a running server instead of starting one")
    p.add_argument("--address", help="with --target: its Ray cluster (needed to kill router/controller)")
    p.add_argument("--admin-token", default=os.environ.get("EXPERTMESH_ADMIN_TOKEN"),
                   help="admin token: sent with Admin KillReplica when attached with --target and no --address; a "
                        "self-started server gets it (default: $EXPERTMESH_ADMIN_TOKEN)")
    p.add_argument("--out", metavar="DIR", default="drill_out", help="report folder (default: drill_out)")
    p.add_argument("--json", action="store_true", help="print only the JSON report")
    # The self-started server's settings (ignored with --target).
    # --mesh-id: the drilled mesh (with --target, the running server's id; a self-started server serves under it).
    add_mesh_flags(p, DRILLED_SERVER_GROUPS, extra=("mesh.id",))


def config_from_args(args: argparse.Namespace):
    """The DrillConfig the parsed flags describe (not yet validated)."""
    from ..drill import DrillConfig
    from ..drill.config import default_drill_mesh

    return DrillConfig(kill=args.kill, every=args.every, duration=args.duration, baseline=args.baseline,
                       concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed,
                       fraction=args.fraction, sample_every=args.sample_every,
                       ready_timeout=args.ready_timeout, settle=args.settle, nodes=args.nodes,
                       node_cpus=args.node_cpus,
                       node_gpus=args.node_gpus, target=args.target, address=args.address,
                       out=args.out, admin_token=args.admin_token,
                       mesh=mesh_config_from_args(args, default_drill_mesh()))


def run(args: argparse.Namespace) -> int:
    from ..drill import run_drill

    result = run_drill(config_from_args(args), verbose=not args.json)
    summary = result.pop("summary")
    print(json.dumps(result, indent=2) if args.json else f"{summary}\nreport: {result['files']['markdown']}")
    return 0
