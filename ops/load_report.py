"""Text rendering of a load snapshot (cluster/load_stats.py) for `expertmesh status`."""

from __future__ import annotations


def load_lines(snap: dict | None, max_experts_shown: int = 16) -> list[str]:
    if not snap:
        return ["load: no traffic reported yet"]
    h, c = snap["health"], snap["counts"]
    routers = snap.get("routers", 1)
    lines = [
        f"load over the last {snap['covered_s']:.0f}s (window {snap['window_s']:.0f}s, {routers} router"
        f"{'s' if routers != 1 else ''}): max/mean imbalance {h['imbalance']:.2f} (worst layer), "
        f"GPU imbalance {h['gpu_imbalance']:.2f}, active-parameter density {h['active_param_density']:.3f}, "
        f"{c['rerouted']} rerouted, {c['degraded']} degraded",
        f"{'layer':<7}{'tokens':>8}{'imbalance':>11}{'std':>9}{'entropy':>9}{'(norm)':>8}{'switch':>8}"
        f"{'coverage':>10}  slots per expert",
    ]
    for i, layer in enumerate(snap["layers"]):
        shard = c["shard_load"][i]
        shown = " ".join(f"{v:.0f}" for v in shard[:max_experts_shown])
        if len(shard) > max_experts_shown:
            shown += f" ... (+{len(shard) - max_experts_shown})"
        lines.append(
            f"{layer:<7}{c['tokens'][i]:>8.0f}{h['imbalance_per_layer'][i]:>11.2f}{h['load_std'][i]:>9.1f}"
            f"{h['routing_entropy'][i]:>9.3f}{h['routing_entropy_norm'][i]:>8.2f}{h['switch_rate'][i]:>8.2f}"
            f"{h['expert_coverage'][i]:>10.2f}  {shown}"
        )
    return lines


def control_lines(log: list[dict], requested_gpus: int = 0, shown: int = 5) -> list[str]:
    """The elastic controller's latest steps: GPU imbalance (worst layer) before and after each decision."""
    if not log:
        return ["elastic: off (or no control step yet)"]
    lines = [f"elastic: last {min(shown, len(log))} of {len(log)} control steps"
             + (f", asking Ray's autoscaler for {requested_gpus} GPUs" if requested_gpus else "")]
    for entry in log[-shown:]:
        before = entry.get("imbalance_before")
        after = entry.get("imbalance_after")
        text = f"  {entry['reason']:<22}"
        if before:
            text += f" GPU imbalance {max(before):.2f}"
        if after:
            text += f" -> {max(after):.2f} (planned)"
        if entry.get("replicas_after"):
            text += f", replicas {entry['replicas_before']} -> {entry['replicas_after']}"
        remap = entry.get("remap")
        if remap:
            text += (f", epoch {remap.get('epoch')}: +{len(remap.get('added', []))} "
                     f"-{len(remap.get('retired', []))} actors" if remap.get("ok") else ", remap FAILED")
        lines.append(text)
    return lines
