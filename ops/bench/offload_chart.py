"""The chart of `expertmesh bench offload`: left, the eviction orders replayed on the recorded routing trace (shards
moved per decode call, on demand and with gate prefetch, at 50 % and 25 % residency, batch 16); right, the measured
decode throughput of each offloaded run against all-resident. `python -m expertmesh.ops.bench.offload_chart
RESULT.json [OUT.png]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_offload_chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    result_path = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else result_path.with_suffix(".png")
    print(write_offload_chart(json.loads(result_path.read_text()), out))
