"""`GET /metrics` on the HTTP port: Prometheus text of the HTTP front's own counters and the router's stats. Pure
(no Ray, no HTTP server).

Ray's metrics endpoint (router_service/metrics.py) stays the cluster-wide source; this endpoint is for what load
generators and single-host setups expect on the API port (vLLM serves /metrics there): requests by path and status,
prompt and completion tokens the front returned, and the answering router replica's batcher and KV-cache gauges
(the Admin GetRouterStats reply), labelled by `replica`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

# RouterStats fields exported as gauges (name suffix, help); counters since start are named *_total.
ROUTER_FIELDS = {
    "live_kv_caches": ("expertmesh_router_live_kv_caches", "gauge", "sequences holding a KV cache"),
    "active_sequences": ("expertmesh_router_active_sequences", "gauge", "sequences in the running batch"),
    "waiting_requests": ("expertmesh_router_waiting_requests", "gauge", "requests waiting for a batch slot"),
    "kv_blocks_free": ("expertmesh_router_kv_blocks_free", "gauge", "paged KV-cache blocks free"),
    "kv_blocks_total": ("expertmesh_router_kv_blocks_total", "gauge", "paged KV-cache blocks in all"),
    "kv_blocks_cached": ("expertmesh_router_kv_blocks_cached", "gauge", "KV-cache blocks a prefix lookup can find"),
    "prefix_query_tokens": ("expertmesh_router_prefix_query_tokens_total", "counter",
                            "prompt tokens of admitted requests (prefix cache lookups)"),
    "prefix_hit_tokens": ("expertmesh_router_prefix_hit_tokens_total", "counter",
                          "prompt tokens served from the prefix cache"),
    "expert_shard_calls": ("expertmesh_router_expert_shard_calls_total", "counter",
                           "distinct (layer, expert) shards called per step, summed over steps (expert loads)"),
    "finished_requests": ("expertmesh_router_finished_requests_total", "counter", "generations finished"),
    "max_batch_seen": ("expertmesh_router_max_batch_seen", "gauge", "most sequences that shared one step"),
    "steps": ("expertmesh_router_steps_total", "counter", "forward steps run since start"),
    "preemptions": ("expertmesh_router_preemptions_total", "counter", "sequences preempted (KV cache full)"),
    "retried_calls": ("expertmesh_router_retried_calls_total", "counter", "expert calls re-sent elsewhere"),
    "degraded_slots": ("expertmesh_router_degraded_slots_total", "counter", "slots moved off a dead expert"),
    "shed_slots": ("expertmesh_router_shed_slots_total", "counter", "slots moved off an overloaded expert"),
    "cuda_graph_buckets": ("expertmesh_router_cuda_graph_buckets", "gauge",
                           "decode-step CUDA graph buckets captured (batch x history blocks)"),
    "cuda_graph_replays": ("expertmesh_router_cuda_graph_replays_total", "counter", "decode-step graph replays"),
    "cuda_graph_captures": ("expertmesh_router_cuda_graph_captures_total", "counter", "decode-step graph captures"),
    "cuda_graph_failed_buckets": ("expertmesh_router_cuda_graph_failed_buckets", "gauge",
                                  "decode-step buckets whose capture failed (they run eagerly)"),
}


@dataclass
class FrontCounters:
    """What the HTTP front counted since it started."""

    requests: Counter = field(default_factory=Counter)  # (path, status) -> requests
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served (usage.prompt_tokens_details.cached_tokens)

    def count_request(self, path: str, status: int) -> None:
        self.requests[(path, status)] += 1

    def count_usage(self, usage: dict) -> None:
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(front: FrontCounters, router: dict | None,
                    by_model: Mapping[str, dict | None] | None = None) -> str:
    """Prometheus exposition text (version 0.0.4). router: the RouterStats reply as a dict (proto field names), or
    None when no router answered (then `expertmesh_router_up 0`). by_model: instead of `router`, on a front over
    several meshes, each mesh's reply (or None) by its served model name; every router sample then carries a
    `model` label."""
    lines = ["# HELP expertmesh_http_requests_total HTTP requests the front answered, by path and status",
             "# TYPE expertmesh_http_requests_total counter"]
    for (path, status), count in sorted(front.requests.items()):
        lines.append(f'expertmesh_http_requests_total{{path="{_label(path)}",status="{status}"}} {count}')
    for name, value, what in (("prompt", front.prompt_tokens, "prompt"),
                              ("completion", front.completion_tokens, "generated"),
                              ("cached_prompt", front.cached_tokens, "prefix-cached prompt")):
        lines += [f"# HELP expertmesh_http_{name}_tokens_total {what} tokens in the front's responses",
                  f"# TYPE expertmesh_http_{name}_tokens_total counter",
                  f"expertmesh_http_{name}_tokens_total {value}"]
    # (label prefix, reply): one per mesh; the single mesh's samples keep the labels they always had
    routers = [("", router)] if by_model is None else [(f'model="{_label(m)}",', r) for m, r in by_model.items()]
    lines += ["# HELP expertmesh_router_up whether a router replica answered this scrape",
              "# TYPE expertmesh_router_up gauge"]
    for prefix, reply in routers:
        labels = f"{{{prefix.rstrip(',')}}}" if prefix else ""
        lines.append(f"expertmesh_router_up{labels} {0 if reply is None else 1}")
    answered = [(prefix, reply, _label(str(reply.get("replica", "")))) for prefix, reply in routers
                if reply is not None]
    if answered:
        for key, (name, kind, what) in ROUTER_FIELDS.items():
            lines += [f"# HELP {name} {what}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{{prefix}replica="{replica}"}} {float(reply.get(key, 0)):g}'
                      for prefix, reply, replica in answered]
        lines += ["# HELP expertmesh_router_stage_seconds_total seconds spent per serving stage since start",
                  "# TYPE expertmesh_router_stage_seconds_total counter"]
        for prefix, reply, replica in answered:
            for stage, seconds in sorted((reply.get("stage_seconds") or {}).items()):
                lines.append(f'expertmesh_router_stage_seconds_total{{{prefix}replica="{replica}",'
                             f'stage="{_label(stage)}"}} {float(seconds):.6f}')
    return "\n".join(lines) + "\n"
