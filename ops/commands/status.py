"""`expertmesh status`: cluster state from a running server (replicas, nodes, GPUs, breakers, load, epoch, events)."""

from __future__ import annotations

import argparse
import json

from .client_flags import add_client_flags


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="cluster state: replicas, nodes, GPUs, breakers, load, epoch, events")
    add_client_flags(p)
    p.add_argument("--model-name", dest="status_model", metavar="NAME",
                   help="on a front serving several models (`expertmesh front --mesh-id a --mesh-id b`): the mesh "
                        "serving this model (sent as x-expertmesh-model metadata)")


def run(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from ...protos import admin_pb2, admin_pb2_grpc
    from ...router_service.model_routes import MODEL_METADATA
    from .. import client

    chan = client.channel(args.target, args.tls_ca)
    metadata = client.auth_metadata(args.client_token)
    if args.status_model:
        metadata += ((MODEL_METADATA, args.status_model),)
    state = admin_pb2_grpc.AdminStub(chan).GetClusterState(
        admin_pb2.ClusterStateRequest(), metadata=metadata, timeout=args.timeout or 30)
    if args.json:
        out = MessageToDict(state, preserving_proto_field_name=True)
        # The load snapshots travel as JSON strings; print them as objects.
        out["load"] = json.loads(out.pop("load_json", "null"))
        out.get("router", {})["load"] = json.loads(out.get("router", {}).pop("load_json", "null"))
        out["control"] = json.loads(out.pop("control_json", "[]"))
        print(json.dumps(out))
        return 0
    for line in status_lines(state):
        print(line)
    return 0


def status_lines(state) -> list[str]:
    """The text report of an admin_pb2.ClusterState."""
    from ..bench.serve_profile import status_profile_line
    from ..load_report import control_lines, load_lines

    r = state.router
    lines = [
        f"model {state.model}   table epoch {state.epoch}   controller {'up' if state.controller_alive else 'DOWN'}"
        f"   no-replica policy {state.no_replica_policy}",
        f"router {r.replica}: {r.active_sequences} active, {r.waiting_requests} waiting, {r.live_kv_caches} KV "
        f"caches, {r.steps} steps, largest batch {r.max_batch_seen}, {r.retried_calls} retried calls, "
        f"{r.degraded_slots} degraded slots, {r.shed_slots} shed slots",
        f"router compute: {r.dtype or '?'} on {r.device or '?'}, {r.threads} threads; KV cache "
        f"{r.kv_blocks_free}/{r.kv_blocks_total} blocks free, {r.preemptions} preemptions",
        prefix_cache_line(r),
        expert_loads_line(r),
        cuda_graphs_line(r),
    ]
    if prefetch_line(r) is not None:
        lines.append(prefetch_line(r))
    profile = status_profile_line(dict(r.stage_seconds), r.steps)
    if profile is not None:
        lines.append(profile)
    lines += load_lines(json.loads(state.load_json) if state.load_json else None)
    lines += control_lines(json.loads(state.control_json) if state.control_json else [], state.requested_gpus)
    if state.placement_claims:
        lines.append(f"placements starting: {state.placement_claims} planned actors not yet in Ray's free table "
                     "(counted as used by the controller's plans)")
    lines.append(f"{'actor':<16}{'node':<14}{'gpu':<6}{'device':<8}{'dtype':<10}{'state':<10}{'gen':>4}  "
                 f"{'breaker':<10}{'calls':>8}{'tokens':>10}")
    for rep in state.replicas:
        alive = "drained" if rep.drained else "restoring" if rep.restoring else "up" if rep.alive else "DOWN"
        lines.append(f"{rep.actor:<16}{rep.node_id[:12]:<14}{','.join(rep.gpu_ids) or '-':<6}{rep.device or '-':<8}"
                     f"{rep.dtype or '-':<10}{alive:<10}{rep.generation:>4}  {rep.breaker:<10}{rep.calls:>8}"
                     f"{rep.tokens:>10}{load_note(rep)}{tier_note(rep)}")
    for event in state.events[-10:]:
        lines.append(f"event {event.time:.1f} {event.kind:<15} {event.actor} {event.detail_json}")
    return lines


def prefix_cache_line(r) -> str:
    """The router's prefix cache (README: Prefix caching): hit rate over admitted prompt tokens, blocks cached."""
    rate = f"{100 * r.prefix_hit_tokens / r.prefix_query_tokens:.1f}%" if r.prefix_query_tokens else "-"
    return (f"prefix cache: {rate} of prompt tokens served from cache ({r.prefix_hit_tokens} of "
            f"{r.prefix_query_tokens}), {r.kv_blocks_cached} blocks cached")


def prefetch_line(r) -> str | None:
    """The router's offload prefetch and its governor's verdict (README: Offload); None when prefetch is off."""
    return f"prefetch: {r.prefetch}" if r.prefetch else None


def cuda_graphs_line(r) -> str:
    """The router's decode-step CUDA graphs (README: CUDA graphs): on or off (and why), buckets, replays."""
    state = r.cuda_graphs or "off"
    if not state.startswith("on"):
        return f"CUDA graphs: {state}"
    failed = f", {r.cuda_graph_failed_buckets} buckets failed to capture (eager; see the router's log)" \
        if r.cuda_graph_failed_buckets else ""
    return (f"CUDA graphs: {state}: {r.cuda_graph_buckets} buckets captured, {r.cuda_graph_replays} replays"
            f"{failed}")


def expert_loads_line(r) -> str:
    """Expert loads (README: Offload, expert-affinity admission): distinct shards called per step and per finished
    request, since start."""
    per_step = f"{r.expert_shard_calls / r.steps:.1f}" if r.steps else "-"
    per_request = f"{r.expert_shard_calls / r.finished_requests:.1f}" if r.finished_requests else "-"
    return (f"expert loads: {per_step} shards per step, {per_request} per finished request "
            f"({r.expert_shard_calls} shard calls, {r.finished_requests} requests)")


def tier_note(rep) -> str:
    """'  tiers 1.2/2.0 GiB, 93% hits, 0.4 s stall' for an actor with a memory budget (README: Offload)."""
    if not rep.tiers_json:
        return ""
    t = json.loads(rep.tiers_json)
    asked = t["hits"] + t["misses"]
    hits = f"{100 * t['hits'] / asked:.0f}% hits" if asked else "no calls"
    return (f"  tiers {t['resident_bytes'] / 2**30:.2f}/{t['budget_bytes'] / 2**30:.2f} GiB "
            f"({t['resident_shards']}/{t['hosted_shards']} shards, {t['tier']}), {hits}, "
            f"{t['bytes_moved'] / 2**30:.2f} GiB moved, {t['stall_s']:.2f} s stall, "
            f"prefetch {t['prefetch_useful']}/{t['prefetch_issued']} useful")


def load_note(rep) -> str:
    """'  loading 3.2/10.5 GiB' while an actor reads its weights, its load error if the last load failed."""
    if rep.load_error:
        return f"  load failed: {rep.load_error}"
    if rep.load_total_bytes and rep.load_bytes < rep.load_total_bytes:
        return f"  loading {rep.load_bytes / 2**30:.1f}/{rep.load_total_bytes / 2**30:.1f} GiB"
    return ""
