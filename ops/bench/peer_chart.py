"""The chart of `expertmesh bench serve --peer`: per workload, tokens/s of expertmesh and of `transformers serve`
at each concurrency (bar: the median over rounds; whiskers: the range), and for streamed workloads the median time
to first token. `python -m expertmesh.ops.bench.peer_chart RESULT.json [OUT.png]` redraws it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLOURS = {"expertmesh": "#3182bd", "peer": "#e6550d"}
LABELS = {"expertmesh": "expertmesh", "peer": "transformers serve"}


def _panels(result: dict) -> list[tuple[str, str, str]]:
    """(workload, metric, y label) per panel: tokens/s for every workload, TTFT where it was measured."""
    panels = []
    for workload, levels in result["summary"].items():
        panels.append((workload, "tokens_per_s", "tokens/s (completion)"))
        if any(entry["expertmesh"]["ttft_p50_ms"]["median"] is not None for entry in levels.values()):
            panels.append((workload, "ttft_p50_ms", "time to first token, p50 (ms)"))
    return panels


def write_peer_chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(result)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (workload, metric, ylabel) in zip(axes[0], panels):
        levels = result["summary"][workload]
        concurrencies = sorted(levels, key=int)
        for i, server in enumerate(("expertmesh", "peer")):
            stats = [levels[c][server][metric] for c in concurrencies]
            med = [s["median"] or 0.0 for s in stats]
            low = [m - (s["min"] if s["min"] is not None else m) for m, s in zip(med, stats)]
            high = [(s["max"] if s["max"] is not None else m) - m for m, s in zip(med, stats)]
            xs = [k + (i - 0.5) * 0.38 for k in range(len(concurrencies))]
            ax.bar(xs, med, 0.38, yerr=[low, high], capsize=3, color=COLOURS[server], label=LABELS[server])
        for k, c in enumerate(concurrencies):
            key = "tokens_per_s" if metric == "tokens_per_s" else "ttft"
            ratio = levels[c]["ratio"][key]
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (k, 0), xytext=(0, -26), textcoords="offset points", ha="center",
                            fontsize=8)
        ax.set_xticks(range(len(concurrencies)), [f"{c} client{'s' if int(c) > 1 else ''}" for c in concurrencies])
        ax.set_ylabel(ylabel)
        ax.set_title(f"{workload}: {'tokens/s' if metric == 'tokens_per_s' else 'TTFT'}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"expertmesh vs transformers serve: {result.get('model')}, {result.get('max_tokens')} tokens, "
                 f"median of {result.get('rounds')} alternating rounds (ratio: expertmesh / peer)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    result_path = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else result_path.with_suffix(".png")
    print(write_peer_chart(json.loads(result_path.read_text()), out))
