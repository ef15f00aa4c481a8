"""`expertmesh plan-cluster`: does a model fit a cluster of a GPU type, and how many GPUs/nodes does it need?

From the checkpoint's config.json alone (a folder or a Hub repo id: only config, tokenizer and index are fetched),
so it answers before anyone pays for a cluster. The arithmetic is cluster/memory_plan.py.

--latency adds the decode latency model (cluster/cost_model.py, docs/concepts/cost-model.md): per MoE layer router
dense + plan + transport + expert + combine, and tokens/s, per transport and batch size. A model the latency table
knows (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, or their Hub repo ids) needs no checkpoint for it: only the latency
part is printed then.
"""

from __future__ import annotations

import argparse
import json
import sys

COMMAND = "plan-cluster"


def add_parser(sub) -> None:
    from ...cluster.memory_plan import DTYPE_BYTES, GPU_MEMORY_MIB, NODE_TYPES

    p = sub.add_parser(COMMAND, help="does a model fit: GPUs, nodes and memory per GPU for a GPU or node type")
    p.add_argument("--model", required=True, metavar="DIR|REPO", help="checkpoint folder or Hugging Face repo id")
    p.add_argument("--revision", help="with a repo id: branch, tag or commit")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="serving dtype")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--node-type", action="append", choices=sorted(NODE_TYPES),
                       help="cloud node type (repeat for several; default: every known one)")
    where.add_argument("--gpu-type", choices=sorted(GPU_MEMORY_MIB), help="a GPU type, with --gpus-per-node")
    p.add_argument("--gpus-per-node", type=int, default=8, help="with --gpu-type")
    p.add_argument("--gpu-memory-gb", type=float, help="override the GPU's memory (GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of each GPU to use")
    p.add_argument("--replicas", type=int, default=1, help="replicas of every expert")
    p.add_argument("--routers", type=int, default=1, help="router replicas placed at start (serve's "
                   "--router-replicas, or the minimum of --router-autoscale)")
    p.add_argument("--router-gpus", type=float, default=1.0, help="GPUs per router replica (serve's --router-gpus; "
                   "fractions pack onto whole GPUs kept for routers; 0: routers on the CPU)")
    p.add_argument("--router-node-type", choices=sorted(NODE_TYPES), help="routers on nodes of this type of their "
                   "own (as cluster/configs' g6e.xlarge / g2-standard-12); default: on the expert nodes' type")
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV cache per router (GiB)")
    p.add_argument("--json", action="store_true", help="print JSON")
    lat = p.add_argument_group("latency model (--latency)")
    lat.add_argument("--latency", action="store_true", help="also predict decode latency and tokens/s per transport "
                     "and batch (cluster/cost_model.py; a prediction on paper until measured on the GPUs)")
    lat.add_argument("--transport", action="append", choices=("refs", "grpc", "socket", "compiled", "rdt"),
                     help="with --latency: transport to predict (repeat; default: all)")
    lat.add_argument("--batch", action="append", type=int, help="with --latency: sequences decoding together "
                     "(repeat; default 1, 32, 256)")
    lat.add_argument("--context", type=int, default=1024, help="with --latency: cached tokens per sequence")
    lat.add_argument("--latency-overlap", choices=("auto", "on", "off"), default="auto", help="with --latency: "
                     "two micro-batches per step: auto lets the model decide per batch (router.overlap auto)")


def run(args: argparse.Namespace) -> int:
    from ...cluster.cost_profiles import known_model

    if args.latency and known_model(args.model) is not None:
        return _latency_only(args, known_model(args.model))
    return _fit(args)


def _fit(args: argparse.Namespace) -> int:
    from ...cluster.memory_plan import GIB, NODE_TYPES, model_memory, plan_fit
    from ...experts.checkpoint import CheckpointReader
    from ...experts.model_source import fetch_checkpoint

    folder = fetch_checkpoint(args.model, args.revision, tensors=lambda cfg, keys: ())
    cfg = CheckpointReader.config_only(folder)
    mem = model_memory(cfg, args.dtype)
    if args.gpu_type:
        targets = [(f"{args.gpus_per_node} x {args.gpu_type}", args.gpu_type, args.gpus_per_node)]
    else:
        names = args.node_type or sorted(NODE_TYPES)
        targets = [(name, *NODE_TYPES[name]) for name in names]
    router_node = (args.router_node_type, *NODE_TYPES[args.router_node_type]) if args.router_node_type else None
    rows = []
    for name, gpu, per_node in targets:
        try:
            fit = plan_fit(mem, gpu, per_node, args.replicas, args.routers, args.gpu_memory_utilization,
                           args.kv_cache_gb, args.gpu_memory_gb, router_gpus=args.router_gpus,
                           router_node=router_node)
            rows.append({"node_type": name, **fit.as_dict()})
        except ValueError as exc:
            rows.append({"node_type": name, "gpu_type": gpu, "error": str(exc)})
    disk = _disk(args, rows)
    summary = {"model": args.model, "family": cfg.family, "dtype": args.dtype, "replicas": args.replicas,
               "dense_gib": round(mem.dense_bytes / GIB, 2), "experts_gib": round(mem.expert_bytes / GIB, 2),
               "shard_mib": round(mem.shard_bytes / (1 << 20), 2), "moe_layers": mem.moe_layers,
               "experts": mem.experts, "kv_kib_per_token": round(mem.kv_bytes_per_token / 1024, 1), "fits": rows,
               "disk_bytes": disk}
    if mem.state_bytes_per_sequence:  # linear-attention layers: a fixed state per sequence, from the KV budget
        summary["state_bytes_per_sequence"] = mem.state_bytes_per_sequence
        summary["state_sequences_in_kv_budget"] = int(args.kv_cache_gb * GIB // mem.state_bytes_per_sequence)
    latency = None
    if args.latency:
        from ...cluster.cost_profiles import shape_from_config

        latency = _latency(args, shape_from_config(cfg, name=args.model), targets)
        summary["latency"] = latency
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    out = sys.stdout
    print(f"{args.model} ({cfg.family}) in {args.dtype}: {summary['dense_gib'] + summary['experts_gib']:.1f} GiB = "
          f"dense {summary['dense_gib']:.1f} GiB + experts {summary['experts_gib']:.1f} GiB ({mem.moe_layers} MoE "
          f"layers x {mem.experts} experts x {summary['shard_mib']:.1f} MiB); KV cache "
          f"{summary['kv_kib_per_token']:.0f} KiB/token"
          + (f" + linear-attention state {mem.state_bytes_per_sequence / (1 << 20):.1f} MiB/sequence "
             f"({summary['state_sequences_in_kv_budget']} sequences' states fill the {args.kv_cache_gb:g} GiB "
             "KV budget)" if mem.state_bytes_per_sequence else "")
          + f"; {args.replicas} replica(s) per expert, {args.routers} "
          f"router replica(s) x {args.router_gpus:g} GPU"
          f"{f' on {args.router_node_type}' if args.router_node_type else ''}", file=out)
    header = f"{'node type':<22}{'GPU':>12}{'GiB':>7}{'slots':>7}{'expert GPUs':>13}{'router GPUs':>13}" \
             f"{'nodes':>7}{'GiB/expert GPU':>16}{'router GiB':>12}  remap room"
    print(header, file=out)
    for row in rows:
        if "error" in row:
            print(f"{row['node_type']:<22}{row['gpu_type']:>12}  does not fit: {row['error']}", file=out)
            continue
        print(f"{row['node_type']:<22}{row['gpus_per_node']:>4} x {row['gpu_type']:<7}{row['gpu_memory_gib']:>7.1f}"
              f"{row['slots_per_gpu']:>7}{row['expert_gpus']:>13}{row['router_gpus']:>13}{row['nodes']:>7}"
              f"{row['expert_gib_per_gpu']:>16.1f}{row['router_gib']:>12.1f}  "
              f"{'yes' if row['transition_room'] else 'no'}"
              f"{'' if row['router_fits'] else '  (router does not fit its GPU share)'}", file=out)
        print(f"{'':<22}  {row['layout']}", file=out)
    _print_disk(disk, rows, out)
    if latency is not None:
        _print_latency(latency, out)
    return 0


def _latency_targets(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    from ...cluster.memory_plan import NODE_TYPES

    if args.gpu_type:
        return [(f"{args.gpus_per_node} x {args.gpu_type}", args.gpu_type, args.gpus_per_node)]
    if args.node_type:
        return [(name, *NODE_TYPES[name]) for name in args.node_type]
    return [("8 x H100", "H100", 8), ("8 x H200", "H200", 8)]  # the GPUs the latency model has profiles of


def _latency(args: argparse.Namespace, shape, targets: list[tuple[str, str, int]]) -> list[dict]:
    """Per target GPU type: the layout the model fits and, per batch, tokens/s per transport and the layer
    breakdown (us) of each transport."""
    from ...cluster.cost_model import Profile, StepShape, moe_layer_time, node_layout, predict_step
    from ...cluster.cost_profiles import GPUS, TRANSPORTS, gpu_transports

    transports = args.transport or list(TRANSPORTS)
    batches = args.batch or [1, 32, 256]
    overlap = {"auto": "auto", "on": True, "off": False}[args.latency_overlap]
    profiles = gpu_transports()
    out = []
    for name, gpu, per_node in targets:
        entry: dict = {"node_type": name, "gpu_type": gpu, "model": shape.name, "context": args.context,
                       "batches": []}
        if gpu not in GPUS:
            entry["error"] = f"no latency profile for {gpu} (known: {', '.join(sorted(GPUS))})"
            out.append(entry)
            continue
        for b in batches:
            layout, why = node_layout(shape, GPUS[gpu], per_node, b, args.context)
            row: dict = {"batch": b, "layout": why}
            if layout is not None:
                step = StepShape(b, b, args.context)
                row["transports"] = {}
                for t in transports:
                    profile = Profile(shape, GPUS[gpu], profiles[t], layout)
                    pred = predict_step(profile, step, overlap)
                    parts = moe_layer_time(profile, step)
                    row["transports"][t] = {"tokens_per_s": round(pred.tokens_per_s, 1), "overlap": pred.overlap,
                                            "step_ms": round(pred.step_s * 1000, 3),
                                            "layer_us": {k: round(v * 1e6, 1) for k, v in vars(parts).items()}}
            entry["batches"].append(row)
        out.append(entry)
    return out


def _latency_only(args: argparse.Namespace, shape) -> int:
    latency = _latency(args, shape, _latency_targets(args))
    if args.json:
        print(json.dumps({"model": args.model, "latency": latency}, indent=2))
        return 0
    _print_latency(latency, sys.stdout)
    return 0


def _print_latency(latency: list[dict], out) -> None:
    print("predicted decode (cluster/cost_model.py; on paper until measured): per MoE layer in us, router dense / "
          "plan / transport / expert / combine; * = two micro-batches", file=out)
    for entry in latency:
        head = f"{entry['node_type']} ({entry['gpu_type']}), {entry['model']}, context {entry['context']}"
        if "error" in entry:
            print(f"{head}: {entry['error']}", file=out)
            continue
        print(head, file=out)
        for row in entry["batches"]:
            if "transports" not in row:
                print(f"  batch {row['batch']:>4}: does not fit: {row['layout']}", file=out)
                continue
            for t, r in row["transports"].items():
                u = r["layer_us"]
                print(f"  batch {row['batch']:>4} {t:<9}{r['tokens_per_s']:>10.1f} tok/s{'*' if r['overlap'] else ' '}"
                      f"  {u['router_dense']:>7.1f} {u['plan']:>7.1f} {u['transport']:>7.1f} {u['expert']:>7.1f} "
                      f"{u['combine']:>6.1f}  ({row['layout']})", file=out)


def _disk(args: argparse.Namespace, rows: list[dict]) -> dict[str, int]:
    """Bytes each node's Hub cache needs (cluster/memory_plan.py:disk_per_node), from the checkpoint's headers (for a
    repo id: two small range requests per file); each fitting row gets its expert node's figure."""
    from ...cluster.memory_plan import disk_per_node, stored_bytes
    from ...experts.model_source import open_checkpoint

    stored = stored_bytes(open_checkpoint(args.model, args.revision))
    for row in rows:
        if "error" not in row:
            row["expert_node_disk_bytes"] = disk_per_node(stored, row["slots_per_gpu"], row["expert_gpus"],
                                                          row["gpus_per_node"], args.replicas)["expert_node"]
    return {"head": stored.metadata, "router_node": stored.metadata + stored.dense, "whole_checkpoint": stored.whole}


def _print_disk(disk: dict[str, int], rows: list[dict], out) -> None:
    experts = ", ".join(f"{row['node_type']} {_size(row['expert_node_disk_bytes'])}" for row in rows
                        if "expert_node_disk_bytes" in row)
    print(f"disk per node (Hub cache, as stored): head {_size(disk['head'])} (config, tokenizer, index, headers); "
          f"router node {_size(disk['router_node'])} (+ dense); expert node: {experts or '-'}; the whole checkpoint "
          f"{_size(disk['whole_checkpoint'])}", file=out)


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
