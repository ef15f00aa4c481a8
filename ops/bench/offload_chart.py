"""The chart of `expertmesh bench offload`: left, the eviction orders replayed on the recorded routing trace (shards
moved per decode call, on demand and with gate prefetch, at 50 % and 25 % residency, batch 16); right, the measured
decode throughput of each offloaded run against all-resident; third, when the run has it, FIFO against expert-affinity
admission on the two-topic burst (demand loads and shard calls per request, p99 latency).
`python -m expertmesh.ops.bench.offload_chart RESULT.json [OUT.png]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_offload_chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    affinity = result.get("affinity")
    fig, axes = plt.subplots(1, 3 if affinity else 2, figsize=(19 if affinity else 13, 4.5))
    left, right = axes[0], axes[1]
    sim = (result.get("policy_simulation") or {}).get("rows", [])
    rows = [r for r in sim if r["batch"] == 16]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    groups = [(s, m) for s in (0.5, 0.25) for m in ("off", "gate")]
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        values = [next((r["shards_moved"] / r["calls"] for r in rows if r["policy"] == policy and r["share"] == s
                        and r["prefetch"] == m), 0.0) for s, m in groups]
        left.bar([g + i * width for g in range(len(groups))], values, width, label=policy)
    left.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                    [f"{s:.0%} {'on demand' if m == 'off' else 'gate prefetch'}" for s, m in groups])
    left.set_ylabel("shards moved per expert call")
    left.set_title("recorded trace (embedded model), batch 16")
    left.legend()
    runs = [r for r in result.get("runs", []) if r["residency"] < 1.0]
    labels = [f"{r['residency']:.0%} {r.get('eviction') or ''}\n{r['prefetch']}" for r in runs]
    right.bar(range(len(runs)), [r.get("decode_vs_resident", 0.0) for r in runs], color="#3182bd")
    right.axhline(0.8, color="#e6550d", linestyle="--", label="target at 50 % (0.8x)")
    right.axhline(0.6, color="#a63603", linestyle=":", label="target at 25 % (0.6x)")
    right.set_xticks(range(len(runs)), labels, fontsize=7)
    right.set_ylabel("decode tokens/s vs all-resident")
    right.set_title("measured (bench model, this machine)")
    right.legend(fontsize=8)
    if affinity:
        _affinity_panel(axes[2], affinity)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _affinity_panel(ax, affinity: dict) -> None:
    """Per round, FIFO and affinity side by side: demand loads and shard calls per request; p99 on a twin axis."""
    runs = affinity["runs"]
    labels = [f"{r['admission']}\nround {r['round']}" for r in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["demand_loads_per_request"] for r in runs], 0.4, label="demand loads / request")
    ax.bar([i + 0.2 for i in x], [r["shard_calls_per_request"] for r in runs], 0.4, label="shard calls / request")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("per request")
    twin = ax.twinx()
    twin.plot(list(x), [r["latency_p99_s"] for r in runs], "o", color="#e6550d", label="p99 latency (s)")
    twin.set_ylabel("p99 latency, s")
    twin.set_ylim(bottom=0)
    ax.set_title(f"FIFO vs affinity admission, {affinity['workload']['requests']} two-topic requests, "
                 f"{affinity.get('residency', 0):.0%} resident", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="upper right")


if __name__ == "__main__":
    result_path = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else result_path.with_suffix(".png")
    print(write_offload_chart(json.loads(result_path.read_text()), out))
