"""The chart of `expertmesh bench fleet`: availability, where the slots went, restore times and GPU-hours per strategy
and spare count, at each failure scale. `python -m expertmesh.ops.bench.fleet_chart RESULT.json [OUT.png]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _label(run: dict) -> str:
    c = run["config"]
    spares = f"+{c['spare_gpus']}" if c["spare_gpus"] else ""
    return f"{c['strategy']}{spares}\n{run['failure_scale']:g}x"


def write_fleet_chart(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [_label(r) for r in runs]
    x = list(range(len(runs)))
    colours = {"none": "#bdbdbd", "restart": "#6baed6", "replan": "#31a354"}
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(14, 9))

    lost = [1 - r["availability"] for r in runs]
    a.bar(x, lost, color=[colours[r["config"]["strategy"]] for r in runs])
    a.set_yscale("log")
    a.set_ylabel("1 - availability (slots not served by their expert)")
    a.set_title("unavailability (lower is better)")
    a.set_xticks(x, labels, fontsize=7)

    width = 0.27
    for i, key in enumerate(("degraded", "rerouted", "shed")):
        b.bar([v + (i - 1) * width for v in x], [max(r["fraction"][key], 1e-12) for r in runs], width, label=key)
    b.set_yscale("log")
    b.set_ylim(bottom=1e-10)
    b.set_ylabel("fraction of routed slots")
    b.set_title("where slots went: degraded, rerouted, shed")
    b.set_xticks(x, labels, fontsize=7)
    b.legend(fontsize=8)

    samples = [r.get("restore_samples_s") or [float("nan")] for r in runs]
    c.boxplot(samples, positions=x, widths=0.6, showfliers=True)
    c.set_yscale("log")
    c.set_ylabel("seconds from fault to its replicas serving again")
    c.set_title("restore time per fault")
    c.set_xticks(x, labels, fontsize=7)

    d.bar([v - 0.2 for v in x], [r["gpu_hours"]["lost"] for r in runs], 0.4, label="lost (down or dead actor)")
    d.bar([v + 0.2 for v in x], [r["gpu_hours"]["idle"] for r in runs], 0.4, label="idle (spares, awaiting rejoin)")
    d.set_ylabel("GPU-hours")
    d.set_title(f"GPU-hours over {result['params']['days']:g} days on {result['params']['gpus']} GPUs")
    d.set_xticks(x, labels, fontsize=7)
    d.legend(fontsize=8)

    fig.suptitle("expertmesh fleet simulator: DeepSeek-V3-sized, published failure rates (Llama 3, Table 5) and 10x")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    src = Path(sys.argv[1])
    write_fleet_chart(json.loads(src.read_text()), sys.argv[2] if len(sys.argv) > 2 else src.with_suffix(".png"))
